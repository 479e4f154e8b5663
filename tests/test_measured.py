"""Long prompts and many sequences, measured (kvdemo.measured): bounded prefill memory, measured headroom."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdemo.figures.memory import headroom_batch_speed_figure, headroom_measured_figure
from kvdemo.measured import fullest_length, load_scale_model, measure_headroom, prefill_rows
from kvdemo.results.measured import BatchSpeed, HeadroomRow, MeasuredHeadroom

ROOT = Path(__file__).resolve().parent.parent


def test_prefill_workspace_does_not_grow_with_the_past():
    """Chunked prefill over packed storage: what a prefill adds beyond its cache stays flat from 4k to 12k
    tokens (each row in a fresh process, peak resident memory with a fixed glibc mmap threshold)."""
    seen = []
    rows = prefill_rows([4096, 12288], ["int4"], on_progress=seen.append)
    small, big = rows
    assert big.cache_bytes > 2.5 * small.cache_bytes  # the cache grows with the prompt...
    # ...the workspace does not: a whole-past fp32 copy of one layer's keys and values at 12k is 12 MiB
    assert abs(big.workspace_bytes - small.workspace_bytes) < 4 * 2**20
    assert all("MALLOC_MMAP_THRESHOLD_=131072" in r.peak_measured_by for r in rows)  # see kvdemo.measured
    for r in rows:
        assert r.peak_bytes == r.weights_bytes + r.cache_bytes + r.workspace_bytes
    assert [(p.done, p.total, p.row) for p in seen] == [(4096, 16384, small), (16384, 16384, big)]  # tokens


def test_fullest_length_is_where_the_residual_window_is_fullest():
    assert fullest_length("int4", 4096, 2, 2, 64, 32) == 4095  # 3968 coded + 127 exact beats 4096 coded
    assert fullest_length("full", 4096, 2, 2, 64, 32) == 4096


def test_measured_headroom_is_within_five_percent_of_the_formula():
    lm = load_scale_model("random")
    out = measure_headroom(lm, ["full", "int8", "int4"], 1024, 60 * 10**6, batch_sizes=(1, 2), decode_steps=2)
    assert (out.model, out.context, out.budget_bytes) == (lm.name, 1024, 60 * 10**6)
    for r in out.results:
        assert r.measured_max_sequences > 5
        assert abs(r.measured_vs_formula - 1) <= 0.05, r
        assert [s.batch for s in r.tokens_per_s] == [1, 2] and all(s.tokens_per_s > 0 for s in r.tokens_per_s)
    by = {r.precision: r.measured_max_sequences for r in out.results}
    assert by["full"] < by["int8"] < by["int4"]
    assert MeasuredHeadroom.from_json(out.to_json()) == out


def test_headroom_measure_cli(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "kvdemo",
        "headroom",
        "--measure",
        "--budget-gb",
        "0.05",
        "--context",
        "512",
        "--precision",
        "full,int4",
        "--batch-sizes",
        "1",
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True)
    data = json.loads(out.stdout)
    assert set(data["measured_max_sequences"]) == {"full", "int4"} and set(data["max_sequences"]) == {"full", "int4"}
    bad = subprocess.run(cmd[:5] + ["--context", "512"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "--budget-gb" in bad.stderr
    with pytest.raises(ValueError, match="at least 2"):
        from argparse import Namespace

        from kvdemo.cli.scale import run_cli

        run_cli(Namespace(tokens="1", precision="int4", model="random", mode="chunked", device="cpu", out=""))


def test_measured_headroom_figures():
    speeds = [BatchSpeed(1, 100.0, 0.1), BatchSpeed(2, 180.0, 0.1)]
    rows = [
        HeadroomRow(p, 512, 20_000_000, 1000, 100, 100, m, f, round(m / f, 4), 2000, speeds)
        for p, m, f in (("full", 10, 11), ("int4", 30, 33))
    ]
    report = MeasuredHeadroom("m", "float32", 20_000_000, 512, rows)
    bars = headroom_measured_figure(report)
    assert [t.name for t in bars.data] == ["measured (real caches)", "formula"]
    assert list(bars.data[0].y) == [10, 30] and list(bars.data[1].y) == [11, 33]
    assert "Sequences of 512 tokens in 0.02 GB" in bars.layout.title.text.replace("<br>", " ")
    speed = headroom_batch_speed_figure(report)
    assert [t.name for t in speed.data] == ["full", "int4"] and list(speed.data[1].x) == [1, 2]
