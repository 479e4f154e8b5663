"""kvdemo.layout: the one storage-layout rule, checked against the cache that follows it."""

import pytest
import torch

from kvdemo.cache import QuantizedKVCache
from kvdemo.layout import Layout, Regions, bytes_per_token
from kvdemo.precision import parse_precision


def test_int4_s4_at_130_keys_has_a_quantized_block():
    """The drift page once called this case "nothing quantized" (130 <= residual 128 + sinks 4): it is not."""
    r = Layout("int4:s4").regions([129, 1])  # a 129-token prompt, then one decode step
    assert r == Regions(tokens=130, sinks=4, quantized=128)
    assert r.has_codes and r.coded == 124 and r.residual == 2
    one_call = Layout("int4:s4").regions(130)
    assert one_call.coded == 124
    assert not Layout("int4:s4").regions(127).has_codes  # below the residual: all exact


def test_flush_rule_and_views():
    lay = Layout("int4:g32:r64:s2")
    r = lay.regions(63)
    assert (r.sinks, r.quantized, r.residual) == (2, 0, 61)
    r = lay.after_append(r, 1)  # the residual reaches 64: both whole blocks are quantized
    assert (r.quantized, r.residual, r.coded) == (64, 0, 62)
    assert lay.flushes(r, 70) == [63]  # T = 128 is the next time T - Q >= 64
    past = Layout.view(r, 10)  # positions [0, 10) of it: 2 sinks, 8 read from codes
    assert (past.sinks, past.quantized, past.residual) == (2, 10, 0)
    assert Layout.view(r, 1) == Regions(1, 1, 0)
    assert Layout.holds_exactly(r, 64, 65) and not Layout.holds_exactly(r, 63, 64)
    assert Layout("full").regions([500, 1]) == Regions(501, 0, 0)


@pytest.mark.parametrize("spec", ["int4", "int4:s4", "int2:g16:r32:s3", "k8v4:ktoken", "fp8:g64:r128", "full"])
@pytest.mark.parametrize("updates", [[1] * 300, [129, 1], [300, 7, 1, 1], [64] * 5])
def test_the_cache_follows_the_layout(spec, updates):
    cache = QuantizedKVCache(spec, num_layers=1)
    lay, r = Layout(spec), Regions(0, 0, 0)
    g = torch.Generator().manual_seed(0)
    for n in updates:
        flushes = lay.flushes(r, n)
        before = cache.layers[0].quant_len
        cache.update(torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g), 0)
        r = lay.after_append(r, n)
        assert cache.layers[0].regions == r
        assert (r.quantized > before) == (bool(flushes) if n == 1 else r.quantized > before)
    packed = cache.layers[0].packed()
    assert packed.regions == r
    assert packed.keys.residual.shape[-2] == r.residual and packed.keys.sinks.shape[-2] == r.sinks


def test_one_bytes_per_token_formula():
    assert bytes_per_token(80, 8, 128, "full") == 327_680  # Llama-3.1-70B at 16 bits
    assert bytes_per_token(30, 3, 64, "int4") == 30 * 3 * 64 * (4.25 + 4.5) / 8  # values: group min(128, 64)
    assert bytes_per_token(30, 3, 64, "full", full_bits=32) == 2 * bytes_per_token(30, 3, 64, "full")
    spec = parse_precision("k8v4")
    assert bytes_per_token(30, 3, 64, spec) == 30 * 3 * 64 * (8.25 + 4.5) / 8
