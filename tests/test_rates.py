"""Time hints from this machine's measured speed (kvdemo/rates.py), kept across restarts in the cache folder,
and the content key the converted model is cached under (kvdemo/models.py)."""

import json

import pytest
import torch

from kvdemo import rates
from kvdemo.models import content_key


class _Model:
    name, device, dtype = "m", torch.device("cpu"), torch.float32


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDEMO_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVDEMO_RATES_FILE", raising=False)  # the cache folder's file (conftest points elsewhere)
    return tmp_path


def test_hints_say_first_guess_then_follow_this_machines_runs(cache):
    lm = _Model()
    first = rates.hint(lm, "needle", 1000, "this grid")
    assert "a first guess, not yet measured here" in first
    assert rates.rate(lm, "needle").source == "guess"
    rates.record(lm, "needle", 1000, 10.0)
    rates.record(lm, "needle", 1000, 30.0)
    assert rates.rate(lm, "needle").s_per_token == pytest.approx(0.02)
    assert rates.hint(lm, "needle", 500, "this grid") == (
        "About 10 s for this grid (from this machine's last 2 runs: 50 tokens/s)."
    )
    stored = json.loads((cache / rates.RATES_FILE).read_text())  # what a restarted server reads
    (key,) = stored
    assert key == rates.machine_key(lm) and "| cpu | m | float32" in key
    assert stored[key]["needle"] == [pytest.approx(0.01), pytest.approx(0.03)]


def test_only_the_last_runs_count_and_other_tasks_and_models_are_apart(cache):
    lm, other = _Model(), _Model()
    other.name = "bigger"
    for seconds in (100, 100, 1, 1, 1, 1, 1):
        rates.record(lm, "ppl", 100, seconds)
    assert rates.measured(lm, "ppl") == [0.01] * rates.KEEP
    assert rates.measured(lm, "drift") == [] and rates.measured(other, "ppl") == []


def test_a_probe_scales_the_first_guess_of_tasks_of_its_kind(cache):
    lm = _Model()
    assert rates.needs_probe(lm, "needle") and rates.needs_probe(lm, "drift")
    rates.record(lm, "probe:prefill", 256, 0.256)  # 1 ms a token read
    assert not rates.needs_probe(lm, "needle") and rates.needs_probe(lm, "drift")
    r = rates.rate(lm, "needle")
    assert r.source == "probe" and r.s_per_token == pytest.approx(0.001 * rates.PROBE_MARGIN)
    assert "quick probe of this machine" in rates.hint(lm, "needle", 1000, "this grid")


def test_a_broken_rates_file_counts_as_empty(cache):
    (cache / rates.RATES_FILE).write_text("{not json")
    lm = _Model()
    assert rates.rate(lm, "drift").source == "guess"
    rates.record(lm, "drift", 10, 1.0)
    assert rates.rate(lm, "drift").source == "measured"


def test_the_converted_model_is_keyed_by_content_not_by_path(tmp_path):
    data = bytes(range(256)) * 20_000  # ~5 MB: first and last MiB differ from the middle
    a, b = tmp_path / "one" / "m.gguf", tmp_path / "two" / "copy.gguf"
    for path in (a, b):
        path.parent.mkdir()
        path.write_bytes(data)
    assert content_key(a) == content_key(b)  # two checkouts, one converted model
    changed = tmp_path / "three.gguf"
    changed.write_bytes(data[:-1] + b"\x00")
    assert content_key(changed) != content_key(a)
    a.write_bytes(data + b"more")  # the same path, new content (size and mtime change): a new key
    assert content_key(a) != content_key(b)
