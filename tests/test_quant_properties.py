"""Property tests (hypothesis) for the reference quantizers, the packing and the cache's attention.

Over shapes, group sizes, axes and every format: quantize -> dequantize never gives NaN/Inf where the
input was finite (all-equal groups, huge and tiny magnitudes, values beyond the fp16 range included),
maps NaN / +-Inf inputs to finite values, keeps scales positive and finite (no division by zero),
stays within `max_abs_error_bound`; pack/unpack is exact; and a `QuantizedLayer` filled with
all-equal or extreme keys/values still gives finite attention that agrees with attention over its
own dequantized contents. Tensors are drawn from a seed plus a "kind" (not element by element), so
examples stay cheap on 2 CPU cores.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdemo import formats
from kvdemo.attention import attend
from kvdemo.cache import QuantizedLayer
from kvdemo.precision import GROUP_SIZES, PrecisionSpec
from kvdemo.quant import reference
from kvdemo.quant.reference import FP16_MAX

FORMATS = ("int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2")
SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KINDS = ("normal", "constant", "outlier_channels", "huge", "tiny", "subnormal", "sign_split", "zeros")


def make_tensor(shape: tuple[int, ...], kind: str, magnitude: float, seed: int) -> torch.Tensor:
    """A float32 tensor [B, H, T, D] of one `kind`, scaled by `magnitude` where that applies."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)  # [B, H, T, D]
    if kind == "normal":
        return x * magnitude
    if kind == "constant":  # every element equal: zero span, the classic divide-by-zero case
        return torch.full(shape, magnitude)
    if kind == "outlier_channels":  # a few channels 100x larger, as real keys have (KIVI, KVQuant)
        x[..., :: max(shape[-1] // 4, 1)] *= 100.0
        return x * magnitude
    if kind == "huge":  # at and near the edge of fp16
        return (x.sign() * FP16_MAX * (1 - 1e-3 * x.abs().clamp(max=1))).where(x != 0, torch.tensor(FP16_MAX))
    if kind == "tiny":
        return x * 1e-30
    if kind == "subnormal":
        return x * 1e-41
    if kind == "sign_split":  # -FP16_MAX and +FP16_MAX in the same groups: the widest span
        return torch.where(x > 0, FP16_MAX, -FP16_MAX)
    return torch.zeros(shape)


@st.composite
def cases(draw, finite: bool = True):
    """(x [B, H, T, D], fmt, axis, group) with T and D compatible with the axis and group."""
    fmt = draw(st.sampled_from(FORMATS))
    axis = draw(st.sampled_from(("channel", "token")))
    d = draw(st.sampled_from((8, 16, 32, 64)))
    if axis == "channel":  # groups of `group` tokens
        group = draw(st.sampled_from(GROUP_SIZES[:3]))
        t = group * draw(st.integers(1, 2))
    else:  # groups of `group` channels
        group = draw(st.sampled_from([g for g in (4, 8, 16, 32, 64) if g <= d]))
        t = draw(st.integers(1, 40))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), t, d)
    kind = draw(st.sampled_from(KINDS))
    magnitude = draw(st.floats(-FP16_MAX, FP16_MAX, allow_nan=False, width=32))
    x = make_tensor(shape, kind, magnitude, draw(st.integers(0, 2**31 - 1)))
    return x.clamp(-FP16_MAX, FP16_MAX), fmt, axis, group  # beyond fp16: test_nan_inf_and_out_of_range_...


def assert_finite_metadata(q: reference.QuantizedTensor) -> None:
    scale = q.scale.float()
    assert torch.isfinite(scale).all() and (scale > 0).all(), "scales must be positive and finite"
    if q.zero is not None:
        assert torch.isfinite(q.zero.float()).all()
    codes = reference.decode_codes(q.codes, q.fmt)
    assert torch.isfinite(codes).all(), "codes must decode to finite values"


@SETTINGS
@given(cases())
def test_round_trip_is_finite_and_within_the_bound(case):
    x, fmt, axis, group = case
    q = reference.quantize(x, fmt, axis, group)
    assert_finite_metadata(q)
    y = reference.dequantize(q)  # [B, H, T, D] fp32
    assert y.shape == x.shape and torch.isfinite(y).all()
    err = (y - x).abs()
    bound = reference.max_abs_error_bound(x, fmt, axis, group)
    worst = (err - bound).max().item()
    assert worst <= 0, f"error exceeds the bound by {worst} ({fmt}, {axis}, g{group})"


@SETTINGS
@given(cases())
def test_dequantize_to_16_bit_stays_finite(case):
    """On GPU the cache dequantizes into fp16/bf16: values at the edge of fp16 must not round to inf."""
    x, fmt, axis, group = case
    q = reference.quantize(x, fmt, axis, group)
    for dtype in (torch.float16, torch.bfloat16):
        y = reference.dequantize(q, dtype)
        assert y.dtype == dtype and torch.isfinite(y).all(), f"{fmt} {axis} -> {dtype} gave inf/nan"


@SETTINGS
@given(cases(), st.floats(0.0, 0.3), st.integers(0, 2**31 - 1), st.floats(1e5, 3e38))
def test_nan_inf_and_out_of_range_inputs_give_finite_codes(case, fraction, seed, beyond):
    x, fmt, axis, group = case
    gen = torch.Generator().manual_seed(seed)
    pick = torch.rand(x.shape, generator=gen)  # [B, H, T, D]
    x = x.clone()
    x[pick < fraction / 4] = float("nan")
    x[(pick >= fraction / 4) & (pick < fraction / 2)] = float("inf")
    x[(pick >= fraction / 2) & (pick < 3 * fraction / 4)] = float("-inf")
    x[(pick >= 3 * fraction / 4) & (pick < fraction)] = beyond  # finite but beyond fp16
    q = reference.quantize(x, fmt, axis, group)
    assert_finite_metadata(q)
    y = reference.dequantize(q)
    assert torch.isfinite(y).all()
    assert y.abs().max() <= FP16_MAX * (1 + 2e-3)  # saturates at the fp16 range, never beyond


@SETTINGS
@given(
    st.sampled_from(FORMATS),
    st.sampled_from(("channel", "token")),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.sampled_from((16, 32)),
)
def test_all_equal_groups(fmt, axis, value, group):
    """A constant group has zero span: scale falls back to MIN_SCALE, the value comes back."""
    x = torch.full((1, 2, 32, 32), value)  # [B, H, T, D]
    q = reference.quantize(x, fmt, axis, group)
    assert_finite_metadata(q)
    y = reference.dequantize(q)
    assert torch.isfinite(y).all()
    target = min(max(value, -FP16_MAX), FP16_MAX)  # inputs are clamped to the fp16 range
    tol = abs(target) * (2.0**-3 if fmt == "fp8_e5m2" else 2.0**-4) + 1e-5
    assert (y - target).abs().max().item() <= tol
    assert torch.unique(y).numel() == 1, "identical inputs must give identical outputs"


@SETTINGS
@given(
    st.sampled_from((8, 4, 2)),
    st.integers(1, 3),
    st.integers(1, 9),
    st.sampled_from((4, 8, 16, 64, 128)),
    st.integers(0, 2**31 - 1),
)
def test_pack_unpack_is_exact_and_planar(bits, batch, tokens, d, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (batch, 2, tokens, d), generator=gen, dtype=torch.int64).to(torch.uint8)
    packed = reference.pack(codes, bits)
    per_byte = 8 // bits
    assert packed.dtype == torch.uint8 and packed.shape == (batch, 2, tokens, d // per_byte)
    assert torch.equal(reference.unpack(packed, bits), codes)
    planes = reference.unpack_planes(packed, bits)
    assert len(planes) == per_byte
    for p, plane in enumerate(planes):  # plane p holds channels [p*D/P, (p+1)*D/P)
        assert torch.equal(plane, codes[..., p * (d // per_byte) : (p + 1) * (d // per_byte)])
    extremes = torch.full_like(codes, (1 << bits) - 1)
    assert torch.equal(reference.unpack(reference.pack(extremes, bits), bits), extremes)


def test_pack_rejects_an_unpackable_head_dim():
    with pytest.raises(ValueError, match="not a multiple of 4"):
        reference.pack(torch.zeros(1, 1, 1, 6, dtype=torch.uint8), 2)


@SETTINGS
@given(st.sampled_from(("fp8_e4m3", "fp8_e5m2")), st.integers(0, 2**31 - 1))
def test_fp8_codes_round_trip_bytes(fmt, seed):
    """Every fp8 byte that is a finite value decodes and re-encodes to itself."""
    raw = torch.arange(256, dtype=torch.uint8)
    values = raw.view(getattr(torch, formats.get(fmt).fp8_dtype)).float()
    finite = torch.isfinite(values)
    again = values[finite].to(getattr(torch, formats.get(fmt).fp8_dtype)).view(torch.uint8)
    same = (again == raw[finite]) | (values[finite] == 0)  # +0 and -0 are both zero
    assert same.all()
    q = reference.quantize(make_tensor((1, 1, 16, 16), "normal", 1.0, seed), fmt, "token", 16)
    assert torch.isfinite(reference.decode_codes(q.codes, fmt)).all()


# --- the cache: QuantizedLayer.update on random tensors, then attention ---------------------------

SPECS = [
    PrecisionSpec("int8", "int8", group_size=16, residual=16, sinks=4),
    PrecisionSpec("int4", "int4", group_size=16, residual=32, sinks=0),
    PrecisionSpec("int2", "int2", group_size=32, residual=32, sinks=2),
    PrecisionSpec("int8", "int4", group_size=16, residual=16, sinks=1, key_axis="token"),
    PrecisionSpec("fp8_e4m3", "fp8_e4m3", group_size=16, residual=16, sinks=4),
    PrecisionSpec("fp8_e5m2", "int2", group_size=16, residual=16, sinks=0, key_axis="token"),
]
CACHE_KINDS = ("normal", "constant", "outlier_channels", "huge", "tiny", "sign_split", "zeros")


def reference_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float):
    """Plain softmax attention of the last queries over all keys (the queries are the newest tokens)."""
    hq, hkv = query.shape[1], keys.shape[1]
    k = keys.float().repeat_interleave(hq // hkv, dim=1)  # [B, Hq, T, D]
    v = values.float().repeat_interleave(hq // hkv, dim=1)
    n, t = query.shape[-2], keys.shape[-2]
    logits = (query.float() @ k.transpose(-1, -2)) * scaling  # [B, Hq, n, T]
    causal = torch.ones(n, t, dtype=torch.bool).tril(diagonal=t - n)
    probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    return probs @ v  # [B, Hq, n, D]


def logit_rounding(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> float:
    """A bound on fp32 rounding in any logit q . k_t computed from codes (scale * code + zero: terms up to
    2 max|k| and max|k|) over D channels: D * 2^-24 * sum|q| * 3 max|k| * scaling. Above ~0.05 the softmax
    is so peaked that two correct computation orders can split a near-tie differently."""
    d = query.shape[-1]
    return d * 2**-24 * float(query.float().abs().sum(-1).max()) * 3 * float(keys.float().abs().max()) * scaling


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(SPECS),
    st.sampled_from(CACHE_KINDS),
    st.sampled_from(CACHE_KINDS),
    st.floats(-100, 100, allow_nan=False, width=32),
    st.integers(1, 70),
    st.integers(1, 3),
    st.integers(0, 2**31 - 1),
)
def test_cache_attention_stays_finite(spec, key_kind, value_kind, magnitude, prompt, steps, seed):
    """Prefill a layer, decode a few tokens, attend after each: finite, and equal (up to rounding)
    to plain attention over the layer's own dequantized contents plus the new exact states."""
    b, hkv, hq, d = 1, 2, 4, 32
    layer = QuantizedLayer(spec)
    keys = make_tensor((b, hkv, prompt + steps, d), key_kind, magnitude, seed)  # [B, Hkv, T, D]
    values = make_tensor((b, hkv, prompt + steps, d), value_kind, magnitude, seed + 1)
    query = make_tensor((b, hq, prompt + steps, d), "normal", 1.0, seed + 2)  # [B, Hq, T, D]
    scaling = d**-0.5
    view, _ = layer.update(keys[:, :, :prompt], values[:, :, :prompt])
    out = attend(query[:, :, :prompt], view, scaling)  # prefill: exact causal attention
    assert torch.isfinite(out).all()
    for i in range(prompt, prompt + steps):
        view, _ = layer.update(keys[:, :, i : i + 1], values[:, :, i : i + 1])
        past_k, past_v = view.packed().dequantized()  # [B, Hkv, i, D]: what the quantized past holds
        out = attend(query[:, :, i : i + 1], view, scaling)  # [B, Hq, 1, D]
        assert out.shape == (b, hq, 1, d) and torch.isfinite(out).all(), f"{spec.label} step {i}"
        assert torch.isfinite(past_k).all() and torch.isfinite(past_v).all()
        all_k = torch.cat([past_k, keys[:, :, i : i + 1]], dim=-2)
        all_v = torch.cat([past_v, values[:, :, i : i + 1]], dim=-2)
        expected = reference_attention(query[:, :, i : i + 1], all_k, all_v, scaling)
        span = all_v.float().abs().max().item() + 1e-30
        if logit_rounding(query[:, :, i : i + 1], all_k, scaling) > 0.05:  # near-ties may go either way
            v = all_v.float()  # so the output is some average of the values (up to the same 2e-3 of span)
            lo, hi = (x.repeat_interleave(hq // hkv, dim=1) for x in (v.amin(-2, True), v.amax(-2, True)))
            assert ((out.float() >= lo - 2e-3 * span) & (out.float() <= hi + 2e-3 * span)).all(), spec.label
            continue
        torch.testing.assert_close(out.float() / span, expected / span, atol=2e-3, rtol=0)
    assert layer.get_seq_length() == prompt + steps


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label)
def test_cache_with_nan_and_inf_states_stays_finite(spec):
    """A NaN/Inf key or value in the model's states (a numerical blow-up upstream) does not poison
    the quantized part of the cache: codes and scales stay finite, attention over them stays finite."""
    b, hkv, d, t = 1, 2, 32, 64
    keys = make_tensor((b, hkv, t + 1, d), "normal", 1.0, 3)
    values = make_tensor((b, hkv, t + 1, d), "normal", 1.0, 4)
    keys[0, 0, spec.sinks + 1, 3] = float("nan")  # in the first quantized block
    values[0, 1, spec.sinks + 2, 5] = float("inf")
    layer = QuantizedLayer(spec)
    layer.update(keys[:, :, :t], values[:, :, :t])
    assert layer.quant_len > spec.sinks + 2  # the bad tokens were quantized
    view, _ = layer.update(keys[:, :, t:], values[:, :, t:])
    packed = view.packed()
    for q in (packed.keys.quantized, packed.values.quantized):
        assert_finite_metadata(q)
    query = make_tensor((b, 4, 1, d), "normal", 1.0, 5)
    assert torch.isfinite(attend(query, view, d**-0.5)).all()
