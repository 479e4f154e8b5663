"""Cache sizes on one basis (kvdemo.sizes): live bytes in the model's dtype with their 16-bit equivalent,
checked against real caches; which reference models fit a memory size."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvdemo import sizes
from kvdemo.cache import QuantizedKVCache

LAYERS, HEADS, DIM = 2, 3, 64
SPECS = ["full", "int8", "int4", "int2", "fp8", "k8v4", "int4:g32:r32:s4", "int4:s4", "int4:ktoken:g64"]


def _lm(dtype=torch.float32):
    return SimpleNamespace(num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, dtype=dtype, device=torch.device("cpu"))


def _cache(spec: str, updates: list[int], dtype=torch.float32) -> QuantizedKVCache:
    cache = QuantizedKVCache(spec, num_layers=LAYERS)
    for n in updates:
        for layer in range(LAYERS):
            cache.update(torch.randn(1, HEADS, n, DIM, dtype=dtype), torch.randn(1, HEADS, n, DIM, dtype=dtype), layer)
    return cache


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("updates", [[5], [128], [200], [300, 1, 1, 1], [64] * 7, [1] * 260, [1113]])
def test_a_chat_answers_cache_size_from_its_total_matches_the_breakdown(spec, updates):
    """`of_cache` (what a chat caption has: total bytes and tokens) gives the breakdown's 16-bit equivalent."""
    cache = _cache(spec, updates)
    nb = cache.nbytes()
    want = sizes.from_nbytes(nb, torch.float32)
    got = sizes.of_cache(_lm(), spec, nb["total"], sum(updates))
    assert got.live == want.live == nb["total"]
    assert got.at16 == pytest.approx(want.at16, abs=0.5)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("tokens", [5, 127, 128, 200, 1113])
def test_one_prefill_estimate_matches_a_live_cache(spec, tokens):
    want = sizes.from_nbytes(_cache(spec, [tokens]).nbytes(), torch.float32)
    got = sizes.prefilled(_lm(), spec, tokens)
    assert got.live == pytest.approx(want.live) and got.at16 == pytest.approx(want.at16)


def test_sizes_name_the_dtype_and_the_16_bit_equivalent_and_ratios_are_against_16_bit():
    lm = _lm()
    full, int4 = sizes.per_token(lm, "full"), sizes.per_token(lm, "int4")
    assert full.live == 2 * full.at16 == LAYERS * HEADS * DIM * 2 * 4  # float32 K and V
    assert int4.live == int4.at16  # codes and 16-bit scales: the same in any model dtype
    assert int4.times_smaller(full) == pytest.approx(full.at16 / int4.at16)  # not live over live (twice that)
    assert int4.times_smaller(full) == sizes.per_token(_lm(torch.bfloat16), "int4").times_smaller(
        sizes.per_token(_lm(torch.bfloat16), "full")
    )  # the same ratio whatever dtype the model runs in
    assert sizes.CacheSize(51_281_920, 25_640_960, "float32").text() == "48.9 MiB live (float32) = 24.5 MiB at 16 bits"
    assert sizes.CacheSize(2**20, 2**20, "bfloat16").text() == "1.0 MiB live (bfloat16)"
    assert sizes.CacheSize(2**20, 2**20, "float32").text() == "1.0 MiB live (the same at 16 bits)"  # all coded
    half = sizes.per_token(_lm(torch.bfloat16), "full")
    assert half.live == half.at16 and "also the 16-bit sizes" in sizes.basis_note(
        SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cpu"))
    )


def test_models_that_fit_grow_with_memory_and_lower_precision():
    small, big = sizes.models_that_fit(8 * 10**9), sizes.models_that_fit(200 * 10**9)
    assert [r["model"] for r in small] == [r["model"] for r in big]
    for s, b in zip(small, big, strict=True):
        assert s["full"] <= s["int8"] <= s["int4"] <= s["int2"]  # fewer bits: a longer context fits
        assert all(s[p] <= b[p] for p in sizes.FIT_PRECISIONS)
    assert small[-1]["full"] == 0 and big[0]["full"] > 0  # 405B never fits 8 GB; 135M fits 200 GB
    assert all("/" in r["load as"] for r in big)  # a Hugging Face id to paste into the sidebar
    memory = sizes.machine_memory("cpu")
    assert memory["kind"] == "RAM" and 0 < memory["available"] <= memory["total"]
    text = sizes.stronger_model_text(SimpleNamespace(device=torch.device("cpu")), memory)
    assert "Hugging Face id" in text and "Local folder" in text and all(f"{p}:" in text for p in sizes.FIT_PRECISIONS)


def test_homes_range_is_computed_from_the_16_bit_ratios():
    lm = _lm()
    r = sizes.ratios(lm)
    full = sizes.per_token(lm, "full").at16
    assert r == {p: pytest.approx(full / sizes.per_token(lm, p).at16) for p in ("int8", "int4", "int2")}
    assert (
        sizes.range_text(lm) == f"{r['int8']:.1f}x (int8), {r['int4']:.1f}x (int4) or {r['int2']:.1f}x (int2) smaller"
    )
    assert 1 < r["int8"] < r["int4"] < r["int2"] < 8


def test_the_perplexity_tables_ratio_is_on_the_16_bit_basis_and_says_why_it_is_below_the_sidebars():
    """The shipped ppl report's ratio is a 16-bit cache over the cache at 16 bits (`ppl.run_ppl`), at most the
    per-token ratio of the quantized region the sidebar shows; the page's note says which tokens it counts."""
    import json
    from pathlib import Path

    from kvdemo.layout import bytes_per_token
    from kvdemo.results.ppl import PplReport, size_note

    report = PplReport.from_json(json.loads((Path(__file__).parent.parent / "assets/reports/ppl.json").read_text()))
    lm = SimpleNamespace(num_layers=30, kv_heads=3, head_dim=64, dtype=torch.float32, device=torch.device("cpu"))
    for row in report.results:
        per_token = sizes.per_token(lm, row.precision)
        full = sizes.per_token(lm, "full")
        assert row.ratio_vs_fp16 <= per_token.times_smaller(full) + 1e-3, row.precision
        assert bytes_per_token(30, 3, 64, "full", 16) == full.at16
    note = size_note(report)
    assert f"{report.results[0].stored_tokens:,} stored tokens" in note and "16-bit basis" in note
