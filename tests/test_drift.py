"""Attention-score drift: metrics on known distributions, the capture hook against a dense softmax,
and (marked `model`) drift on the embedded model at a small size, its figures and its CLI."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdemo import attention, drift
from kvdemo.cache import QuantizedKVCache
from kvdemo.cli import drift as drift_cli
from kvdemo.figures.drift import (
    drift_js_heatmap_figure,
    drift_layer_figure,
    drift_logit_kl_figure,
    drift_position_figure,
)
from kvdemo.progress import Cancelled
from kvdemo.quant import reference_attention
from kvdemo.results.drift import DriftReport, PrecisionDrift, table_rows, unquantized

ROOT = Path(__file__).resolve().parent.parent
LN2 = math.log(2.0)


# --- metrics --------------------------------------------------------------------------------------


def test_kl_of_identical_is_zero_and_known_value():
    p = torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.5, 0.0]])
    assert torch.allclose(drift.kl_divergence(p, p), torch.zeros(2, dtype=torch.float64), atol=1e-15)
    a, b = torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.75])
    want = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert float(drift.kl_divergence(a, b)) == pytest.approx(want, rel=1e-12)
    assert float(drift.kl_divergence(b, a)) != pytest.approx(want, rel=1e-3)  # KL is not symmetric


def test_kl_where_q_is_zero_is_large_but_finite():
    kl = drift.kl_divergence(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0]))
    assert torch.isfinite(kl) and float(kl) > 10


def test_js_known_values():
    p = torch.tensor([1.0, 0.0, 0.0])
    q = torch.tensor([0.0, 0.0, 1.0])
    assert float(drift.js_divergence(p, q)) == pytest.approx(LN2, rel=1e-12)  # disjoint supports: ln 2
    assert float(drift.js_divergence(p, p)) == 0.0
    a, b = torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.75])
    m = (a + b) / 2
    want = 0.5 * float(drift.kl_divergence(a, m)) + 0.5 * float(drift.kl_divergence(b, m))
    assert float(drift.js_divergence(a, b)) == pytest.approx(want, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 50))
def test_js_symmetric_bounded_and_sums_its_terms(seed, n):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(3, n, generator=g) * 3, -1)
    q = torch.softmax(torch.randn(3, n, generator=g) * 3, -1)
    js = drift.js_divergence(p, q)
    assert torch.allclose(js, drift.js_divergence(q, p), rtol=1e-12, atol=0)
    assert bool((js >= 0).all()) and bool((js <= LN2 + 1e-12).all())
    terms = drift.js_terms(p, q)
    assert bool((terms >= 0).all())
    assert torch.allclose(terms.sum(-1), js, rtol=1e-12, atol=0)
    assert bool((drift.kl_divergence(p, q) >= js).all())  # JS <= (KL(p||q) + KL(q||p)) / 4 <= max KL


def test_topk_overlap_of_permutations():
    p = torch.arange(1.0, 21.0)  # strictly increasing: top-10 is positions 10..19
    assert float(drift.topk_overlap(p, p, 10)) == 1.0
    assert float(drift.topk_overlap(p, p.flip(-1), 10)) == 0.0  # reversed ranking: disjoint top-10
    shifted = p.roll(5)  # top-10 of shifted: positions 15..19 and 0..4 -> 5 shared with p's
    assert float(drift.topk_overlap(p, shifted, 10)) == pytest.approx(0.5)
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(0))
    assert float(drift.topk_overlap(p[perm], p[perm], 10)) == 1.0
    assert float(drift.topk_overlap(p[:3], p[:3].flip(-1), 10)) == 1.0  # k clipped to the length


def test_cosine_similarity():
    a = torch.tensor([[1.0, 2.0, 3.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    b = torch.tensor([[2.0, 4.0, 6.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert drift.cosine_similarity(a, b).tolist() == pytest.approx([1.0, 0.0, 1.0])
    assert float(drift.cosine_similarity(a[0], -a[0])) == pytest.approx(-1.0)


def test_logit_kl_is_shift_invariant_and_positive():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(drift.logit_kl(logits, logits + 7.0), torch.zeros(2, dtype=torch.float64), atol=1e-12)
    other = logits.clone()
    other[:, 0] += 2.0
    direct = drift.kl_divergence(torch.softmax(logits.double(), -1), torch.softmax(other.double(), -1))
    assert torch.allclose(drift.logit_kl(logits, other), direct, rtol=1e-9)
    assert bool((direct > 0).all())


def test_position_edges_and_profile():
    assert drift.position_edges(1000, 4, 896) == [0, 4, 301, 598, 896, 1000]
    edges = drift.position_edges(300, 4, 0)  # nothing quantized: the last 128 keys are "recent"
    assert edges[0] == 0 and edges[1] == 4 and edges[4] == 300 - 128 and edges[-1] == 300
    assert drift.position_edges(3, 4, 0) == [0, 3, 3, 3, 3, 3]
    prof = drift.profile_edges(1000, 4, bins=8)
    assert prof[:2] == [0, 4] and prof[-1] == 1000 and len(prof) == 10 and prof == sorted(set(prof))


# --- the capture hook against a dense softmax over the dequantized cache --------------------------


@pytest.mark.parametrize("precision", ["int4", "k8v4:ktoken", "full"])
def test_capture_matches_dense_softmax(precision):
    g = torch.Generator().manual_seed(0)
    b, hkv, hq, d, t = 1, 2, 6, 64, 300
    cache = QuantizedKVCache(precision, num_layers=1)
    layer = cache.layers[0]
    layer.update(torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g))
    k1, v1 = torch.randn(b, hkv, 1, d, generator=g), torch.randn(b, hkv, 1, d, generator=g)
    view, _ = layer.update(k1, v1)
    query = torch.randn(b, hq, 1, d, generator=g) * 2
    scaling = d**-0.5
    with drift.AttentionCapture(cache) as rec:
        out = attention.attend(query, view, scaling)  # [B, Hq, 1, D]
        step = rec.take(t, torch.zeros(5))
    assert not attention.observers  # the observer is removed on exit
    assert step.probs.shape == (1, hq, t + 1) and step.outputs.shape == (1, hq, d)
    past_k, past_v = view.packed().dequantized()  # [B, Hkv, t, D]
    keys = torch.cat([past_k, k1], -2).repeat_interleave(hq // hkv, dim=1)  # [B, Hq, t+1, D]
    values = torch.cat([past_v, v1], -2).repeat_interleave(hq // hkv, dim=1)
    dense = torch.softmax((query @ keys.transpose(-1, -2)) * scaling, -1)  # [B, Hq, 1, t+1]
    torch.testing.assert_close(step.probs, dense[:, :, 0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(step.outputs, (dense @ values)[:, :, 0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(step.outputs, out[:, :, 0].float())
    assert step.quant_len == (256 if precision != "full" else 0)


def test_past_probabilities_rows_sum_to_one_and_match_past_attention():
    g = torch.Generator().manual_seed(3)
    cache = QuantizedKVCache("int2", num_layers=1)
    layer = cache.layers[0]
    layer.update(torch.randn(1, 3, 260, 64, generator=g), torch.randn(1, 3, 260, 64, generator=g))
    packed = layer.packed()
    query = torch.randn(1, 9, 2, 64, generator=g)
    probs = reference_attention.past_probabilities(query, packed, 0.125)  # [1, 9, 2, 260]
    assert probs.shape == (1, 9, 2, 260)
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 9, 2))
    out, lse = reference_attention.past_attention(query, packed, 0.125)
    _, past_v = packed.dequantized()
    torch.testing.assert_close(probs @ past_v.repeat_interleave(3, dim=1), out, rtol=1e-4, atol=1e-5)
    half = reference_attention.past_probabilities(query, packed, 0.125, lse=lse + math.log(2.0))
    torch.testing.assert_close(half.sum(-1), torch.full((1, 9, 2), 0.5))


def test_capture_without_kvdemo_attention_says_why():
    cache = QuantizedKVCache("int8", num_layers=2)
    with drift.AttentionCapture(cache) as rec, pytest.raises(RuntimeError, match="kvdemo"):
        rec.take(0, torch.zeros(3))


# --- on the embedded model --------------------------------------------------------------------------

DOC_TOKENS = 300
NEW_TOKENS = 2


@pytest.fixture(scope="module")
def prompt(lm):
    text, n = drift.document_text(lm, DOC_TOKENS)
    assert n == DOC_TOKENS
    return drift.document_prompt(lm, text)


@pytest.fixture(scope="module")
def ref(lm, prompt):
    return drift.capture_reference(lm, prompt, NEW_TOKENS)


@pytest.fixture(scope="module")
def out(lm, prompt, ref):
    return drift.run_drift(lm, prompt, ["int8", "int2"], new_tokens=NEW_TOKENS, reference=ref)


@pytest.mark.model
def test_reference_capture_shapes(lm, prompt, ref):
    assert len(ref.steps) == NEW_TOKENS == len(ref.tokens)
    hq = lm.config.num_attention_heads
    for i, step in enumerate(ref.steps):
        assert step.position == len(prompt) - 1 + i
        assert step.probs.shape == (lm.num_layers, hq, step.position + 1)
        assert step.outputs.shape == (lm.num_layers, hq, lm.head_dim)
        torch.testing.assert_close(step.probs.sum(-1), torch.ones(lm.num_layers, hq), atol=1e-4, rtol=0)
        assert step.quant_len == 0
        assert int(torch.argmax(step.logits)) == ref.tokens[i]


@pytest.mark.model
def test_full_vs_full_has_no_drift(lm, prompt, ref):
    res = drift.measure_drift(lm, prompt, "full", ref)
    assert res.mean_js < 1e-9 and res.mean_kl < 1e-9
    assert res.topk_overlap == 1.0 and res.output_cosine > 1 - 1e-9
    assert max(res.logit_kl) < 1e-9 and res.top1_agreement == 1.0


@pytest.mark.model
def test_int2_drifts_more_than_int8(lm, out):
    assert out.new_tokens == NEW_TOKENS and out.prompt_tokens > DOC_TOKENS
    i8, i2 = out.result("int8"), out.result("int2")
    assert i2.mean_js > 10 * i8.mean_js > 0
    assert i2.mean_kl > i8.mean_kl > 0
    assert i2.topk_overlap < i8.topk_overlap <= 1.0
    assert i2.output_cosine < i8.output_cosine <= 1.0 + 1e-12
    assert sum(i2.logit_kl) > sum(i8.logit_kl)
    for r in (i8, i2):
        assert len(r.per_layer) == lm.num_layers and len(r.logit_kl) == NEW_TOKENS
        assert len(r.per_layer[0]["js_per_head"]) == lm.config.num_attention_heads
        assert [b["bin"] for b in r.by_position] == list(drift.POSITION_BINS)
        assert sum(b["js"] for b in r.by_position) == pytest.approx(r.mean_js, rel=1e-6)
        assert sum(b["js"] for b in r.position_profile) == pytest.approx(r.mean_js, rel=1e-6)
        assert sum(b["mass_full"] for b in r.by_position) == pytest.approx(1.0, abs=1e-4)
        assert r.by_position[-1]["start"] == 256  # int8/int2 at 351 keys: 256 quantized, the rest residual
        assert json.loads(json.dumps(r.to_json())) == r.to_json()
    again = DriftReport.from_json(json.loads(json.dumps(out.to_json())))
    assert again.to_json() == out.to_json() and again.result("int2").mean_js == i2.mean_js


@pytest.mark.model
def test_figures_build(out):
    heat = drift_js_heatmap_figure(out.results[1])
    assert len(heat.data[0].z) == len(out.results[1].per_layer)
    for fig in (
        drift_position_figure(out),
        drift_logit_kl_figure(out),
        drift_layer_figure(out),
    ):
        assert len(fig.data) == len(out.results)
    assert drift_cli.format_text(dataclasses.replace(out, tokens=DOC_TOKENS)).count("\n") > 4


@pytest.mark.model
def test_cli_json(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The harbour town wakes early. Fishermen mend nets while gulls argue over scraps.\n\n" * 20)
    cmd = [sys.executable, "-m", "kvdemo", "drift", "--precision", "int4", "--tokens", "100"]
    cmd += ["--new-tokens", "2", "--document", str(doc), "--json"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert set(got) >= {"model", "tokens", "results"} and got["tokens"] <= 100
    (r,) = got["results"]
    assert r["precision"] == "int4"
    assert set(r) >= {"mean_js", "mean_kl", "topk_overlap", "output_cosine", "per_layer", "by_position", "logit_kl"}
    assert len(r["logit_kl"]) == 2


def test_cli_rejects_bad_input(tmp_path, capsys):
    from kvdemo.cli import main

    assert main(["drift", "--precision", "int5", "--tokens", "100"]) == 2
    assert "unknown precision" in capsys.readouterr().err
    assert main(["drift", "--tokens", "100", "--document", str(tmp_path / "missing.txt")]) == 2
    assert "document not found" in capsys.readouterr().err


@pytest.mark.model
def test_reference_from_another_prompt_is_refused(lm, prompt, ref):
    with pytest.raises(ValueError, match="different prompt"):
        drift.run_drift(lm, prompt[1:], ["int8"], new_tokens=NEW_TOKENS, reference=ref)


@pytest.mark.model
def test_int4_s4_at_130_keys_is_not_called_unquantized(lm):
    """The drift page's "nothing was quantized" note: a 129-token prompt + 1 query step is 130 keys. int4:s4
    has read 124 of them from codes (block [4, 128)); int4 at 100 keys has read none."""
    prompt = list(range(1000, 1129))  # 129 token ids
    out = drift.run_drift(lm, prompt, ["int4:s4"], new_tokens=1)
    assert out.results[0].coded_keys == 124
    assert unquantized(out) == []
    short = drift.run_drift(lm, prompt[:99], ["int4"], new_tokens=1)
    assert short.results[0].coded_keys == 0 and unquantized(short) == ["int4"]


@pytest.mark.model
def test_progress_counts_tokens_of_work_and_a_stop_keeps_the_finished_precisions(lm):
    """Units: (prompt + queries) per run, the reference first; each finished precision in `Progress.row`;
    `should_stop` once a precision finished raises `Cancelled` carrying it."""
    prompt = list(range(1000, 1100))  # 100 token ids
    seen = []

    def finished():
        return [p.row for p in seen if p.row is not None]

    with pytest.raises(Cancelled) as stopped:
        drift.run_drift(lm, prompt, ["int4", "int8"], 2, on_progress=seen.append, should_stop=lambda: bool(finished()))
    assert [(p.done, p.what, p.row is not None) for p in seen] == [
        (0, "full precision (the reference)", False),
        (102, "full precision (the reference)", False),
        (102, "int4", False),
        (204, "int4", True),
    ]
    assert {(p.total, p.unit) for p in seen} == {(306, "tokens")} and drift.work_tokens(100, 2, 2) == 306
    assert drift.planned_work_tokens(100 - drift.QUESTION_TOKENS, 2, 2) == 306  # the page's hint, before the prompt
    (kept,) = stopped.value.partial
    assert isinstance(kept, PrecisionDrift) and kept.precision == "int4" and [kept] == finished()


# --- shipped report --------------------------------------------------------------------------------------


def test_shipped_report_round_trips_and_draws():
    """assets/reports/drift.json reads as a DriftReport, writes back the same JSON in the same key order, and its
    figures and table take the typed report."""
    data = json.loads((ROOT / "assets" / "reports" / "drift.json").read_text())
    report = DriftReport.from_json(data)
    assert report.to_json() == data and list(report.to_json()) == list(data)
    assert [list(r.to_json()) for r in report.results] == [list(r) for r in data["results"]]
    assert [r["precision"] for r in table_rows(report)] == [r["precision"] for r in data["results"]]
    assert unquantized(report) == []
    for fig in (drift_layer_figure(report), drift_logit_kl_figure(report), drift_position_figure(report)):
        assert [t.name for t in fig.data] == [r["precision"] for r in data["results"]]
    heat = drift_js_heatmap_figure(report.result("int2"))
    assert [list(z) for z in heat.data[0].z] == [row["js_per_head"] for row in data["results"][3]["per_layer"]]
    assert data["results"][3]["precision"] == "int2"
    with pytest.raises(KeyError, match="it has int8"):
        report.result("nvfp4")
    text = drift_cli.format_text(report)
    assert f"document: {data['tokens']} tokens" in text and "int2" in text
