"""bench/scalar_floor.py: the per-block oracle key code (the floor docs/methods-passkey.md's "Is the key code the limit?" rests on)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import scalar_floor as sf  # noqa: E402

from kvdemo import cache as kv_cache  # noqa: E402
from kvdemo.codebooks import normal_float  # noqa: E402
from kvdemo.quant import reference as ref  # noqa: E402


def test_block_lloyd_keeps_ends_and_few_values_exact():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 128, generator=g, dtype=torch.float64)
    x[0] = torch.tensor([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0, 4.0, 7.0]).repeat(16)  # 8 distinct values: no error
    keep = torch.ones_like(x, dtype=torch.bool)
    keep[1, 5] = False
    x[1, 5] = 50.0  # held exact, and outside the levels' range
    out = sf.block_lloyd(x, keep)
    assert torch.equal(out[0], x[0])
    assert out[1, 5] == 50.0 and out[1].max() == 50.0
    for r in range(6):  # the kept min and max are stored exactly
        kept = x[r][keep[r]]
        assert kept.min() in out[r] and kept.max() in out[r]
        assert len(out[r][keep[r]].unique()) <= sf.LEVELS


def test_oracle_beats_fixed_codebook_on_every_block_shape():
    """Its own levels per block: never worse than nuq3:o1's one codebook over the same blocks and outliers."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 256, 64, generator=g) * torch.rand(64, generator=g).add(0.1)
    k[..., 3] = torch.distributions.StudentT(2.0).sample((1, 2, 256))  # a heavy-tailed channel
    nuq = ref.dequantize(ref.quantize(k, "nuq3", "channel", 128, levels=normal_float(3), outliers=1.0))
    oracle = sf.oracle_keys(k)
    assert (oracle - k).square().mean() < (nuq - k).square().mean()
    picked = ref._mask(k, ref.outlier_picks(k, "channel", 128, 1))
    assert torch.equal(oracle[picked], k[picked])  # nuq3:o1's outliers are held exact here too


def test_gaussian_reference_orders_the_codes():
    """On Gaussian channels: int4 < the Gaussian 3-bit distortion-rate bound < oracle 3-bit <= nuq3:o1 < int3."""
    out = sf.gaussian_rows()
    mse = {r["keys"]: r["relative_mse"] for r in out["rows"]}
    assert mse["int4"] < out["distortion_rate_3_bits"] < mse["oracle"] <= mse["nuq3:o1"] < mse["int3"]


def test_oracle_only_replaces_the_carriers_keys(monkeypatch):
    seen = []
    monkeypatch.setattr(kv_cache, "quantize", lambda x, fmt, axis, group, **m: seen.append((fmt, axis, x.clone())))
    k = torch.randn(1, 1, 128, 64)
    with sf.oracle_in_carrier():
        kv_cache.quantize(k, "int8", "channel", 128)
        kv_cache.quantize(k, "int8", "token", 64)
        kv_cache.quantize(k, "int4", "channel", 128)
    assert torch.equal(seen[0][2], sf.oracle_keys(k)) and not torch.equal(seen[0][2], k)
    assert torch.equal(seen[1][2], k) and torch.equal(seen[2][2], k)
    assert kv_cache.quantize is not None and kv_cache.quantize.__name__ == "<lambda>"  # restored on exit


@pytest.mark.model
def test_keys_alone_ppl_rows(lm):
    """The patched perplexity run on a short text: the carrier's keys are 3-bit oracle codes, far from int8's
    (int8 keys alone cost a logit KL of about 2e-5 at 4k tokens; 3-bit keys about 2e-2)."""
    rows = sf.ppl_rows(lm, tokens=384, prefix=128, precisions=(sf.CARRIER,))
    assert [r["precision"] for r in rows] == ["full", sf.CARRIER]
    assert rows[1]["keys"] == "oracle 3-bit keys" and rows[1]["logit_kl"] > 1e-3


@pytest.mark.model
def test_passkey_rows_run_the_oracle_in_the_carrier(lm, monkeypatch):
    """One short cell, one seed: nuq2:o1's keys and the oracle's run beside full precision, with the bar."""
    monkeypatch.setattr(sf, "PASSKEY_LENGTHS", (384,))
    monkeypatch.setattr(sf, "PASSKEY_DEPTHS", (50.0,))
    levels = []
    real = sf.oracle_keys
    monkeypatch.setattr(sf, "oracle_keys", lambda k, group, **kw: levels.append(kw) or real(k, group, **kw))
    out = sf.passkey_rows(lm, repeats=1)
    assert [s["precision"] for s in out["summary"]] == ["full", "knuq2v8:o1", sf.CARRIER]
    assert {r["precision"] for r in out["rows"]} == {"full", "knuq2v8:o1", sf.CARRIER} and len(out["rows"]) == 3
    assert levels and all(kw == {"levels": 4} for kw in levels)  # the carrier's keys went through 2-bit oracle codes
    assert out["summary"][2]["keys"] == "oracle 2-bit keys" and "verdict" in out["summary"][2]["bar"]
