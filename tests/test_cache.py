"""QuantizedKVCache without a model: regions, byte accounting, attention over packed blocks."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvdemo.attention import attend
from kvdemo.cache import QuantizedKVCache, QuantizedLayer
from kvdemo.layout import Layout
from kvdemo.precision import parse_precision
from kvdemo.quant import reference, reference_attention

B, H, HQ, D = 1, 3, 9, 64


def _fill(spec, tokens, step=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = QuantizedKVCache(spec, num_layers=1)
    k, v = torch.randn(B, H, tokens, D, generator=g), torch.randn(B, H, tokens, D, generator=g)
    if step is None:
        cache.update(k, v, 0)
    else:
        for i in range(0, tokens, step):
            cache.update(k[:, :, i : i + step], v[:, :, i : i + step], 0)
    return cache, k, v


@pytest.mark.parametrize("spec", ["int8", "int4:s4", "int2", "k8v4", "fp8", "int4:g32:r64", "int4:ktoken:s2"])
@pytest.mark.parametrize("tokens", [1, 3, 127, 128, 300, 1024])
def test_regions_and_bytes_match_the_formula(spec, tokens):
    s = parse_precision(spec)
    cache, _, _ = _fill(s, tokens)
    layer = cache.layers[0]
    g = s.group_size
    regions = Layout(s).regions(tokens)  # the rule (tests/test_layout.py checks it by hand)
    assert layer.regions == regions
    quantized, sinks, residual = regions.quantized, regions.sinks, regions.residual
    fp_bytes = 4  # float32 test tensors
    kb, vb = s.key_bits, s.value_bits
    meta = lambda fmt: 2 if fmt.startswith("fp8") else 4  # noqa: E731 (bytes of metadata per group)
    key_groups = quantized // g * D if s.key_axis == "channel" else quantized * (D // s.key_group(D))
    value_groups = quantized * (D // s.value_group(D))
    expected = {
        "codes": B * H * quantized * D * (kb + vb) // 8,
        "scales": B * H * (key_groups * meta(s.key_format) + value_groups * meta(s.value_format)),
        "residual": 2 * B * H * residual * D * fp_bytes,
        "sinks": 2 * B * H * sinks * D * fp_bytes,
    }
    nb = cache.nbytes()
    for kind, want in expected.items():
        assert nb[kind] == want, kind
    # and the bits-per-element formula agrees with the measured bytes within 1% on the quantized part
    if quantized:
        bits = s.bits_per_element(D)["mean"]
        formula = 2 * B * H * quantized * D * bits / 8
        assert abs((nb["codes"] + nb["scales"]) - formula) / formula < 0.01
    assert nb["allocated"] >= nb["total"]


@pytest.mark.parametrize("spec", ["int4", "int2", "k8v4", "full"])
def test_allocated_memory_stays_close_to_live_bytes(spec):
    """What the cache holds (capacity included) after a long prefill and while decoding: within 10% of its
    live bytes once it is large, so the measured saving is the saving a GPU would see."""
    cache, _, _ = _fill(spec, 4096)
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(300):  # decoding: one token at a time, flushes every 128 tokens
        k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
        cache.update(k, v, 0)
        nb = cache.nbytes()
        assert nb["allocated"] >= nb["total"]
        worst = max(worst, nb["allocated"] / nb["total"])
    assert worst < 1.10, worst


@pytest.mark.parametrize("spec", ["int4", "int2:s4", "int4:ktoken", "k8v4", "fp8", "int4:g32:r64:s3", "full"])
@pytest.mark.parametrize("step", [1, 100, 2048, 5000])
def test_reserved_buffers_never_regrow_while_a_prompt_is_appended(spec, step):
    """`reserve(T)` sizes codes / metadata (and a full cache's residual) for T tokens: chunked appends of
    those T tokens write in place (no buffer is replaced, so none is copied), and hold no more than that."""
    tokens = 5000
    cache = QuantizedKVCache(spec, num_layers=1)
    cache.reserve(tokens)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(B, H, tokens, D, generator=g), torch.randn(B, H, tokens, D, generator=g)
    parts = [layer.keys, layer.values]
    buffers = [b for p in parts for b in ((p.codes, p.scale, p.zero) if cache.spec.is_quantized else (p.residual,))]
    first = {}
    for i in range(0, tokens, step):
        cache.update(k[:, :, i : i + step], v[:, :, i : i + step], 0)
        for n, buf in enumerate(buffers):
            if buf.data is not None:
                assert first.setdefault(n, buf.data.data_ptr()) == buf.data.data_ptr(), f"buffer {n} regrew"
    assert first, "nothing was stored"
    live = sum(b.live_bytes() for b in buffers)
    assert sum(b.allocated_bytes() for b in buffers) <= live * 1.05 + 4096  # reserved, not over-sized
    one, _, _ = _fill(spec, tokens, seed=2)
    ka, va = one.layers[0].packed().dequantized()
    kb, vb = layer.packed().dequantized()
    assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("spec", ["int4", "int8:s4", "fp8", "int4:g32:r64:s3"])
def test_incremental_appends_store_the_same_as_one_prefill(spec):
    one, _, _ = _fill(spec, 400)
    many, _, _ = _fill(spec, 400, step=7)
    a, b = one.layers[0].packed(), many.layers[0].packed()
    assert a.quant_len == b.quant_len and one.nbytes()["total"] == many.nbytes()["total"]
    ka, va = a.dequantized()
    kb, vb = b.dequantized()
    assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_full_precision_stores_exact_tensors():
    cache, k, v = _fill("full", 260, step=13)
    pk, pv = cache.layers[0].packed().dequantized()
    assert torch.equal(pk, k) and torch.equal(pv, v)


def test_sinks_and_residual_are_exact_and_sinks_excluded_from_block_stats():
    cache, k, v = _fill("int2:s4", 300)
    k2 = k.clone()
    k2[:, :, :4] *= 1000  # huge sinks: must not stretch block 0's range
    cache2 = QuantizedKVCache("int2:s4", 1)
    cache2.update(k2, v, 0)
    p1, p2 = cache.layers[0].packed(), cache2.layers[0].packed()
    assert torch.equal(p2.keys.sinks, k2[:, :, :4])
    assert torch.equal(p1.keys.quantized.scale, p2.keys.quantized.scale)  # sinks never entered the statistics
    assert torch.equal(p2.keys.residual, k2[:, :, 256:])


@pytest.mark.parametrize(
    "spec",
    [
        *("full", "int8", "int4:s4", "int2", "k8v4", "fp8", "fp8-e5m2", "int4:ktoken", "int4:g32:r64"),
        *("int2:g16:r32:s8", "knuq4vnuq2:o1", "kfp8vnvfp4", "knvfp4v8:s2"),
    ],
)
@pytest.mark.parametrize("n_queries", [1, 5])
def test_blocked_attention_equals_attention_over_dequantized_cache(spec, n_queries):
    cache, _, _ = _fill(spec, 333)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, HQ, n_queries, D, generator=g)
    kn, vn = torch.randn(B, H, n_queries, D, generator=g), torch.randn(B, H, n_queries, D, generator=g)
    view, _ = cache.update(kn, vn, 0)
    out = attend(q, view, D**-0.5)
    pk, pv = view.packed().dequantized()
    keys, values = torch.cat([pk, kn], -2), torch.cat([pv, vn], -2)
    mask = torch.ones(n_queries, keys.shape[-2], dtype=torch.bool).tril(diagonal=keys.shape[-2] - n_queries)
    ref = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=D**-0.5, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_long_query_block_over_a_past_uses_the_stored_cache():
    """A follow-up turn (many new tokens over a stored past) sees the same past as decoding does."""
    cache, _, _ = _fill("int4", 300)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, HQ, 40, D, generator=g)
    kn, vn = torch.randn(B, H, 40, D, generator=g), torch.randn(B, H, 40, D, generator=g)
    view, _ = cache.update(kn, vn, 0)
    out = attend(q, view, D**-0.5)  # > DECODE_MAX_QUERIES: dequantize-once path
    pk, pv = view.packed().dequantized()
    keys, values = torch.cat([pk, kn], -2), torch.cat([pv, vn], -2)
    mask = torch.ones(40, 340, dtype=torch.bool).tril(diagonal=300)
    ref = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=D**-0.5, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_quantized_attention_error_grows_as_bits_shrink():
    errs = []
    for spec in ("int8", "int4", "int2"):
        cache, k, v = _fill(spec, 1024)
        q = torch.randn(B, HQ, 1, D, generator=torch.Generator().manual_seed(5))
        kn, vn = k[:, :, -1:], v[:, :, -1:]
        view, _ = cache.update(kn, vn, 0)
        exact = F.scaled_dot_product_attention(
            q, torch.cat([k, kn], -2), torch.cat([v, vn], -2), scale=D**-0.5, enable_gqa=True
        )
        errs.append(float((attend(q, view, D**-0.5) - exact).norm() / exact.norm()))
    assert errs[0] < errs[1] < errs[2], errs
    assert errs[0] < 0.02 and math.isfinite(errs[2])


@pytest.mark.parametrize("spec", ["int8:g16:r16:s2", "int4:g32:r32", "k8v4:ktoken:g16:r16", "fp8:g16:r16", "full"])
@pytest.mark.parametrize("n_queries", [1, 3])
def test_masked_decode_equals_sdpa_over_the_dequantized_cache(spec, n_queries):
    """The masked path (padding, sliding windows) against an independent oracle: SDPA over the dequantized
    past + the exact new tokens, same mask. A left-padded batch of 2: row 1's first 13 positions are padding."""
    b, t, pad = 2, 70, 13
    g = torch.Generator().manual_seed(7)
    layer = QuantizedLayer(parse_precision(spec))
    layer.update(torch.randn(b, H, t, D, generator=g), torch.randn(b, H, t, D, generator=g))
    q = torch.randn(b, HQ, n_queries, D, generator=g)
    kn, vn = torch.randn(b, H, n_queries, D, generator=g), torch.randn(b, H, n_queries, D, generator=g)
    view, _ = layer.update(kn, vn)
    length = t + n_queries
    causal = torch.ones(n_queries, length, dtype=torch.bool).tril(diagonal=t)
    mask = causal.expand(b, 1, n_queries, length).clone()  # [B, 1, n, T + n]
    mask[1, :, :, :pad] = False  # left padding
    mask[0, :, :, 5:9] = False  # and a hole, as a sliding window or a dropped span would make
    out = attend(q, view, D**-0.5, mask)
    pk, pv = view.packed().dequantized()
    keys, values = torch.cat([pk, kn], -2), torch.cat([pv, vn], -2)
    want = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=D**-0.5, enable_gqa=True)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    assert layer.regions.has_codes == (spec != "full")


def test_cpu_path_turns_one_block_of_codes_into_floats_at_a_time(monkeypatch):
    """Decode over the packed past never builds a float copy of the whole past: the largest float buffer
    made from codes is one CPU_BLOCK of positions, and the result equals the unblocked computation."""
    cache, _, _ = _fill("int4:s4", 1100)
    kv = cache.layers[0].packed()
    q = torch.randn(B, HQ, 1, D, generator=torch.Generator().manual_seed(9))
    whole_out, whole_lse = reference_attention.past_attention(q, kv, D**-0.5)  # CPU_BLOCK 4096 > 1100: one block
    sizes, real = [], reference.codes_to_float

    def recording(codes, fmt):
        out = real(codes, fmt)
        sizes.append(out.shape[-2])  # positions turned into floats at once
        return out

    monkeypatch.setattr(reference, "codes_to_float", recording)
    monkeypatch.setattr(reference_attention, "CPU_BLOCK", 256)
    out, lse = reference_attention.past_attention(q, kv, D**-0.5)
    assert max(sizes) <= 256 and sum(sizes) >= 2 * (1024 - 4)  # keys and values, every coded position
    torch.testing.assert_close(out, whole_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, whole_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", ["int4:s4", "int2:g16:r32", "k8v4:ktoken", "fp8:g64:r128:s2", "full"])
@pytest.mark.parametrize("window", [None, 300])
def test_streamed_past_attention_equals_the_one_pass(spec, window, monkeypatch):
    """The prefill path reads the past piece by piece (online softmax, pieces of 256 here): same output and
    log-sum-exp as one pass over the whole past, with a mask, a softcap and a sliding window."""
    cache, _, _ = _fill(spec, 900)
    kv = cache.layers[0].packed()
    g = torch.Generator().manual_seed(11)
    n = 40
    q = torch.randn(B, HQ, n, D, generator=g)
    holes = torch.rand(B, 1, n, 900, generator=g) > 0.1
    mask = holes
    if window is not None:  # query i sits at position 900 + i: it sees keys k > 900 + i - window
        k_pos, q_pos = torch.arange(900), 900 + torch.arange(n)
        mask = holes & (k_pos[None, :] > q_pos[:, None] - window)
    want_out, want_lse = reference_attention.past_attention(q, kv, D**-0.5, mask, softcap=5.0)
    monkeypatch.setattr(reference_attention, "SCORE_ELEMENTS", 1)  # the smallest pieces: 256 positions
    out, lse = reference_attention.past_attention_streamed(q, kv, D**-0.5, holes, 5.0, window)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("spec", ["int4:s4", "k8v4:ktoken", "int2:g16:r32", "full"])
def test_streamed_past_attention_through_the_fused_kernel(spec, monkeypatch):
    """Without a mask, softcap or window the CPU path dequantizes pieces of the past and runs PyTorch's
    fused flash-attention kernel on each: the same output and log-sum-exp as the one-pass reference."""
    cache, _, _ = _fill(spec, 1300)
    kv = cache.layers[0].packed()
    q = torch.randn(B, HQ, 33, D, generator=torch.Generator().manual_seed(12))
    want_out, want_lse = reference_attention.past_attention(q, kv, D**-0.5)
    monkeypatch.setattr(reference_attention, "CPU_BLOCK", 512)  # three pieces of codes
    out, lse = reference_attention.past_attention_streamed(q, kv, D**-0.5)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=1e-4)
