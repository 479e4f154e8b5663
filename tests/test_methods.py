"""Methods beyond uniform codes (kvdemo/precision.py): int3, nuq codebooks, nvfp4, dense-and-sparse outliers,
pre-RoPE keys, Hadamard rotation. Grammar, packing, round-trip bounds, row slicing, bytes to the byte,
attention over the packed past, the rotary embedding of every model family, codebook calibration. CPU only,
no embedded model (the tiny random-weight models of tests/test_families.py)."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from test_families import FAMILIES, INT8_LOGIT_ERROR, PROMPT_SEED, VOCAB, _lm, _model, _prompt

from kvdemo import calibration, codebooks, formats, layout, runner
from kvdemo.cache import QuantizedKVCache
from kvdemo.calibration import weighted_kmeans
from kvdemo.codebooks import Codebooks, normal_float
from kvdemo.precision import parse_precision
from kvdemo.quant import reference, reference_attention
from kvdemo.quant.reference import E2M1, dequantize, quantize
from kvdemo.quant.rotations import Rope, hadamard

B, H, HQ, D = 1, 2, 4, 64


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _rope64() -> Rope:
    """The rotary embedding of a tiny random Llama with head_dim 64 (the D of these tests)."""
    return Rope.from_model(_model("llama", head_dim=D))


# --- 1. grammar ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,fields",
    [
        ("nuq4", dict(key_format="nuq4", value_format="nuq4")),
        ("nuq3:o1", dict(key_format="nuq3", outliers=1.0)),
        ("nuq2:o1:s1", dict(key_format="nuq2", outliers=1.0, sinks=1)),
        ("int4:prerope", dict(key_format="int4", pre_rope=True, hadamard=False)),
        ("int4:hadamard", dict(key_format="int4", hadamard=True, pre_rope=False)),
        ("int3", dict(key_format="int3", value_format="int3")),
        ("nvfp4", dict(key_format="nvfp4", value_format="nvfp4", key_axis="token")),
        ("k8v4:hadamard", dict(key_format="int8", value_format="int4", hadamard=True)),
        ("int4:o0.5", dict(outliers=0.5)),
        ("nuq2:o1:s1:g32:r64", dict(outliers=1.0, sinks=1, group_size=32, residual=64)),
        ("int3:g64", dict(key_format="int3", group_size=64, residual=128)),
        ("nvfp4:g32", dict(key_format="nvfp4", group_size=32)),
    ],
)
def test_method_specs_parse_and_their_labels_round_trip(text, fields):
    spec = parse_precision(text)
    for name, want in fields.items():
        assert getattr(spec, name) == want, name
    assert parse_precision(spec.label) == spec
    assert parse_precision(spec.to_dict()["label"]) == spec


@pytest.mark.parametrize(
    "text,reason",
    [
        ("fp8:o1", "no range to narrow"),
        ("nvfp4:o1", "no range to narrow"),
        ("nvfp4:kchannel", "no per-channel key mode"),
        ("int4:prerope:hadamard", "do not combine"),
        ("full:o1", "takes no options"),
        ("int4:o60", r"must be in \[0, 50\)"),
        ("int4:ofoo", "unknown precision option"),
    ],
)
def test_impossible_method_specs_are_refused_with_the_reason(text, reason):
    with pytest.raises(ValueError, match=reason):
        parse_precision(text)


def test_outlier_cap_and_codebook_levels():
    assert parse_precision("int4:o1").outlier_cap(64) == 1  # ceil(0.64)
    assert parse_precision("int4:o3").outlier_cap(64) == 2  # ceil(1.92)
    assert parse_precision("int4:o1").outlier_cap(100) == 1  # exactly 1, not 2
    assert parse_precision("int4").outlier_cap(64) == 0
    assert parse_precision("nuq3").codebook_levels() == {"key": 8, "value": 8}
    assert parse_precision("int4").codebook_levels() == {"key": 0, "value": 0}


# --- 2. packing ---------------------------------------------------------------------------------------


def test_3bit_pack_unpack_is_exact_and_wastes_no_bit():
    codes = torch.randint(0, 8, (2, 3, 17, 64), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    packed = reference.pack(codes, 3)
    assert packed.shape == (2, 3, 17, 3 * 64 // 8) and packed.dtype == torch.uint8
    assert torch.equal(reference.unpack(packed, 3), codes)
    assert formats.get("int3").packed_width(64) == formats.get("nuq3").packed_width(64) == 24
    with pytest.raises(ValueError, match="multiple of 8"):
        formats.get("int3").packed_width(60)


def test_3bit_packing_is_bit_sliced():
    """D = 16: plane j (bytes 2j, 2j + 1), byte c holds bit j of channels c, c + 2, ..., c + 14 at bits 0..7."""
    codes = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    codes[..., 11] = 0b101  # channel 11 = byte 1, bit 5, in planes 0 and 2
    assert reference.pack(codes, 3).flatten().tolist() == [0, 32, 0, 0, 0, 32]
    codes = (torch.arange(16, dtype=torch.uint8) % 8).view(1, 1, 1, 16)
    # byte 0 sees codes 0,2,4,6,0,2,4,6 (bit 0: none; bit 1: odd slots 0xAA; bit 2: slots 2,3,6,7 0xCC);
    # byte 1 sees 1,3,5,7,... (bit 0: all 0xFF)
    assert reference.pack(codes, 3).flatten().tolist() == [0x00, 0xFF, 0xAA, 0xAA, 0xCC, 0xCC]


# --- 3. round-trip error ------------------------------------------------------------------------------


def _int_bound(x, bits, axis, group):
    """Half a stored (fp16) step, or the clamp error at either end, per element (as reference.max_abs_error_bound)."""
    g = reference._grouped(x.float(), axis, group)
    red = -2 if axis == "channel" else -1
    top = (1 << bits) - 1
    lo, hi = g.amin(dim=red, keepdim=True), g.amax(dim=red, keepdim=True)
    lo_h = lo.half().float()
    scale_h = ((hi - lo_h) / top).clamp(min=reference.MIN_SCALE).half().float()
    exact = torch.maximum(torch.maximum(0.5 * scale_h, hi - lo_h - top * scale_h), lo_h - lo)
    return (exact * (1 + 1e-5) + g.abs().amax(dim=red, keepdim=True) * 1e-6).expand_as(g).reshape(x.shape)


@pytest.mark.parametrize("axis,group", [("channel", 32), ("channel", 128), ("token", 64), ("token", 16)])
def test_int3_round_trip_within_half_a_step(axis, group):
    x = _randn(1, 2, 128, 64, scale=3)
    x[..., 5] *= 20
    q = quantize(x, "int3", axis, group)
    assert q.codes.shape == (1, 2, 128, 24) and q.plain is False  # not an int the Triton kernels read
    err = (dequantize(q) - x).abs()
    assert err.le(_int_bound(x, 3, axis, group)).all(), float((err - _int_bound(x, 3, axis, group)).max())
    assert int(reference.unpack(q.codes, 3).max()) == 7  # the eighth level is used


def test_int3_error_sits_between_int2_and_int4():
    x = _randn(1, 2, 128, 64, seed=1)
    errs = [float((dequantize(quantize(x, f, "channel", 32)) - x).pow(2).mean()) for f in ("int2", "int3", "int4")]
    assert errs[0] > errs[1] > errs[2]
    assert errs[1] < errs[0] / 3 and errs[1] > errs[2] * 3  # ~ (2^b - 1)^-2 each


@pytest.mark.parametrize("fmt", ["nuq2", "nuq3", "nuq4"])
@pytest.mark.parametrize("axis,group", [("channel", 32), ("token", 64), ("token", 16)])
def test_nuq_picks_the_nearest_level_and_dequantizes_to_it(fmt, axis, group):
    bits = int(fmt[-1])
    x = _randn(1, 2, 64, 64, seed=bits, scale=2)
    x[..., 9] += 6  # an offset channel: per-channel zero points matter
    levels = normal_float(bits)
    q = quantize(x, fmt, axis, group, levels=levels)
    assert (q.zero is None) == (axis == "token")  # values: absmax scale only; keys per channel: scale + zero
    lv = q.levels.float()
    assert torch.equal(lv, levels.half().float())
    g = reference._grouped(x, axis, group)
    red = -2 if axis == "channel" else -1
    scale = q.scale.float().unsqueeze(red)
    zero = 0.0 if q.zero is None else q.zero.float().unsqueeze(red)
    norm = ((g - zero) / scale).clamp(-1, 1).reshape(x.shape)
    codes = reference.unpack(q.codes, bits).long()
    chosen = (norm - lv[codes]).abs()
    nearest = (norm.unsqueeze(-1) - lv).abs().amin(-1)
    assert float((chosen - nearest).max()) < 1e-3  # the nearest level (fp16 levels: ties within 1e-3)
    assert len(codes.unique()) == 1 << bits  # every level used
    want = (lv[codes].view(g.shape) * scale + zero).reshape(x.shape)
    torch.testing.assert_close(dequantize(q), want, rtol=1e-6, atol=1e-6)
    # and the error is within half the widest gap between levels, in units of the scale (+ a clamped end)
    half_gap = float((lv[1:] - lv[:-1]).max()) / 2
    assert ((dequantize(q) - x).abs() <= (half_gap + 2e-3) * scale.expand_as(g).reshape(x.shape)).all()


@pytest.mark.parametrize("fmt", ["nuq2", "nuq3", "nuq4", "nvfp4", "int3"])
def test_code_values_are_the_table_at_each_code_even_from_a_view(fmt):
    """The lookup (a gather on the table broadcast over rows, bytes at a time at 2 and 4 bits) gives, bit for
    bit, the level of every code, also from a slice of a larger buffer, as a growing cache hands it over."""
    bits = int(fmt[-1])
    x = _randn(2, 3, 96, 64, seed=7, scale=3)
    levels = normal_float(bits) if fmt.startswith("nuq") else None
    q = quantize(x, fmt, "token", 16 if fmt == "nvfp4" else 64, levels=levels)
    fixed = {"nvfp4": torch.tensor(E2M1 + tuple(-m for m in E2M1)), "int3": torch.arange(8.0)}  # nvfp4: bit 3 = sign
    table = fixed[fmt] if fmt in fixed else q.levels.float()
    want = table[reference.unpack(q.codes, bits).long()]  # [2, 3, 96, 64]
    assert torch.equal(reference.code_values(q), want)
    wider = torch.zeros(2, 3, 128, q.codes.shape[-1], dtype=torch.uint8)
    wider[:, :, 16:112] = q.codes
    view = dataclasses.replace(q, codes=wider[:, :, 16:112])  # strided like a cache's live rows
    assert not view.codes.is_contiguous() and torch.equal(reference.code_values(view), want)


def test_nuq_without_a_codebook_is_refused():
    with pytest.raises(ValueError, match="codebook of 8 levels"):
        quantize(_randn(1, 1, 32, 64), "nuq3", "channel", 32)
    with pytest.raises(ValueError, match="codebook of 4 levels"):
        quantize(_randn(1, 1, 32, 64), "nuq2", "token", 64, levels=normal_float(3))


def _half_spacing(u: torch.Tensor) -> torch.Tensor:
    """Half the gap between E2M1 magnitudes around |x| / scale = u (0.5 apart up to 2, 1 up to 4, 2 up to 6)."""
    return torch.where(u <= 2, 0.25, torch.where(u <= 4, 0.5, 1.0))


@pytest.mark.parametrize("start,block", [(0, 64), (0, 32), (16, 32), (80, 32)])
def test_nvfp4_values_are_e2m1_times_e4m3_times_tensor_scale(start, block):
    x = _randn(1, 2, 64, 64, seed=4)
    x[:, :, 40:] *= 8  # a louder later block: per-block tensor scales differ
    x[..., 3] *= 5
    q = quantize(x, "nvfp4", "token", 16, start=start, block=block)
    rows_block = (start + torch.arange(64)) // block - start // block
    n_blocks = int(rows_block[-1]) + 1
    assert q.tensor_scale.shape == (1, 2, n_blocks) and q.tensor_scale.dtype == torch.float32
    assert q.scale.shape == (1, 2, 64, 4) and q.scale.dtype == torch.uint8 and q.codes.shape == (1, 2, 64, 32)
    for nb in range(n_blocks):  # tensor scale = block amax / (448 * 6)
        amax = x[:, :, rows_block == nb].abs().amax(dim=(-1, -2))
        torch.testing.assert_close(q.tensor_scale[..., nb], amax / (448 * 6), rtol=1e-6, atol=0)
    e4m3 = q.scale.view(torch.float8_e4m3fn).float()
    assert torch.isfinite(e4m3).all() and (e4m3 > 0).all() and (e4m3 <= 448).all()
    s_dec = (e4m3 * q.tensor_scale[:, :, rows_block].unsqueeze(-1)).repeat_interleave(16, -1)  # [B, H, T, D]
    y = dequantize(q)
    ratio = y / s_dec
    signed = torch.tensor(E2M1 + tuple(-m for m in E2M1))
    nearest = (ratio.unsqueeze(-1) - signed).abs().amin(-1)
    assert float(nearest.max()) < 1e-5  # every value is an E2M1 code times its decoded scale
    u = x.abs() / s_dec
    assert ((y - x).abs() <= _half_spacing(u) * s_dec * (1 + 1e-5) + 1e-7).all()
    assert ((y - x).abs() <= x.abs().amax() / 6 * 0.5).all()  # hence never more than a quarter of a 4-step at 6


def reference_sylvester(d):
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_hadamard_is_orthonormal_and_sign_randomized():
    r = hadamard(64)
    torch.testing.assert_close(r @ r.T, torch.eye(64), atol=1e-6, rtol=0)
    assert torch.allclose(r.abs(), torch.full((64, 64), 1 / 8))
    assert torch.equal(hadamard(64), r)  # a fixed seed: the same matrix every time
    signs = r[:, 0] * 8  # R = diag(s) H / 8 and H's first column is all ones
    assert (signs == 1).any() and (signs == -1).any()  # random signs, not the plain Sylvester matrix
    torch.testing.assert_close(r * signs[:, None], reference_sylvester(64) / 8, atol=0, rtol=0)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(48)


def test_hadamard_shrinks_per_token_error_of_an_outlier_channel():
    x = _randn(1, 2, 128, 64, seed=5)
    x[..., 17] += 40  # one huge channel: it sets every per-token range
    rot = hadamard(64)
    plain = quantize(x, "int4", "token", 64)
    turned = quantize(x, "int4", "token", 64, rotation=rot)
    assert turned.rotation is not None and not turned.plain
    torch.testing.assert_close(reference.scaled_codes(turned), x @ rot, atol=3.0, rtol=0)  # stored in the rotated space
    e_plain = float((dequantize(plain) - x).pow(2).mean())
    e_turned = float((dequantize(turned) - x).pow(2).mean())
    assert e_turned < e_plain / 2, (e_turned, e_plain)


# --- 4. outliers (dense-and-sparse) -------------------------------------------------------------------

SPIKES = [(0, 0, 3, 7, 80.0), (0, 1, 10, 20, -60.0), (0, 0, 40, 63, 100.0), (0, 1, 97, 0, -150.0)]


def _spiky(seed=6):
    x = _randn(1, 2, 128, 64, seed=seed)
    for b, h, t, c, v in SPIKES:
        x[b, h, t, c] = v
    return x


@pytest.mark.parametrize("fmt", ["int4", "int3", "int2", "nuq3", "nuq2"])
@pytest.mark.parametrize("axis,group", [("channel", 128), ("token", 64), ("token", 32)])
def test_outlier_spikes_are_kept_exactly_and_lower_the_error(fmt, axis, group):
    x = _spiky()
    levels = normal_float(int(fmt[-1])) if fmt.startswith("nuq") else None
    q = quantize(x, fmt, axis, group, levels=levels, outliers=1)
    cap = parse_precision("int4:o1").outlier_cap(64)
    assert q.outlier_index.shape == q.outlier_delta.shape == (1, 2, 128, cap)
    assert q.outlier_index.dtype == torch.uint8 and q.outlier_delta.dtype == torch.float16
    y = dequantize(q)
    for b, h, t, c, v in SPIKES:
        assert int(q.outlier_index[b, h, t, 0]) == c  # the spike is the token's correction
        assert abs(float(y[b, h, t, c]) - v) <= abs(v) * 2e-3, (fmt, t, c, float(y[b, h, t, c]))
    without = dequantize(quantize(x, fmt, axis, group, levels=levels))
    assert float((y - x).pow(2).mean()) < float((without - x).pow(2).mean()) / 1.5  # measured: 1.7x (int2) to 75x


@pytest.mark.parametrize("pct,cap", [(0.5, 1), (1, 1), (3, 2), (10, 7)])
def test_outlier_tensors_have_cap_entries_per_token(pct, cap):
    x = _spiky()
    q = quantize(x, "int4", "token", 64, outliers=pct)
    assert q.outlier_index.shape == (1, 2, 128, cap) == q.outlier_delta.shape
    assert parse_precision(f"int4:o{pct}").outlier_cap(64) == cap
    assert q.nbytes()["outliers"] == 2 * 128 * cap * 3  # fp16 + uint8 each
    # per token the picks are its largest magnitudes, and the codes' range covers every other element
    picked = q.outlier_index.long().sort(-1).values
    assert torch.equal(picked, x.abs().topk(cap, dim=-1).indices.sort(-1).values)
    rest = x.scatter(-1, picked, 0.0)
    lo, hi = q.zero.float(), q.zero.float() + q.scale.float() * 15
    assert (rest.amax(-1, keepdim=True) <= hi + 1e-2).all() and (rest.amin(-1, keepdim=True) >= lo - 1e-2).all()


# --- 5. row slices ------------------------------------------------------------------------------------


def _method_tensors():
    x = _spiky(seed=7)
    rot, rope = hadamard(64), _rope64()
    nf2, nf4 = normal_float(2), normal_float(4)
    return x, [
        ("int3 channel", quantize(x, "int3", "channel", 32), 32),
        ("int3 token", quantize(x, "int3", "token", 64), 1),
        ("nuq2 channel o2", quantize(x, "nuq2", "channel", 64, levels=nf2, outliers=2), 64),
        ("nuq4 token o1", quantize(x, "nuq4", "token", 16, levels=nf4, outliers=1), 1),
        ("nvfp4 block 32", quantize(x, "nvfp4", "token", 16, block=32), 1),
        ("nvfp4 block 32 start 16", quantize(x, "nvfp4", "token", 16, start=16, block=32), 1),
        ("nvfp4 block 32 start 80", quantize(x, "nvfp4", "token", 16, start=80, block=32), 1),
        ("int4 token hadamard", quantize(x, "int4", "token", 64, rotation=rot), 1),
        ("int8 channel hadamard o1", quantize(x, "int8", "channel", 32, rotation=rot, outliers=1), 32),
        ("int4 channel prerope start 7", quantize(x, "int4", "channel", 32, rope=rope, start=7), 32),
        ("nuq3 token prerope o1", quantize(x, "nuq3", "token", 64, levels=normal_float(3), rope=rope, outliers=1), 1),
    ]


def test_row_slices_dequantize_to_the_same_rows():
    _, tensors = _method_tensors()
    for name, q, align in tensors:
        whole = dequantize(q)
        for a, e in [(0, 128), (32, 96), (64, 128), (5, 70), (33, 34), (127, 128)]:
            if align > 1:
                a, e = a // align * align, -(-e // align) * align
            part = reference_attention._rows(q, a, e)
            assert part.start == q.start + a, name
            torch.testing.assert_close(dequantize(part), whole[:, :, a:e], rtol=1e-6, atol=2e-5, msg=name)


# --- 6. the cache to the byte -------------------------------------------------------------------------

BYTE_SPECS = [
    "nuq4:o1",
    "nuq3:o1",
    "nuq2:o1",
    "int3",
    "nvfp4",
    "int4:hadamard",
    "int4:o1",
    "k8v4:hadamard",
    "nuq2:o1:s1",
    "int3:g64",
    "nvfp4:g32:s2",
    "nuq3:ktoken:o0.5",
    "int4:o3:g32:r64:s3",
    "knuq4vnuq2:o1",  # two formats: a codebook per part and format
    "k8vnvfp4:g32",
    "knvfp4vnuq3",
]


@pytest.mark.parametrize("spec", BYTE_SPECS)
@pytest.mark.parametrize("updates", [[300, 1], [200, 60, 1], [128], [5], [1] * 20 + [250, 1]])
def test_cache_bytes_equal_the_layout_formula(spec, updates):
    s = parse_precision(spec)
    cache = QuantizedKVCache(spec, num_layers=2)
    for i, n in enumerate(updates):
        for layer in range(2):
            cache.update(_randn(B, H, n, D, seed=i), _randn(B, H, n, D, seed=100 + i), layer)
    regions = cache.layers[0].regions
    assert regions == layout.Layout(s).regions(updates)
    want = layout.region_bytes(regions, 2, H, D, s, 32)  # fp32 states
    nb = cache.nbytes()
    assert nb["total"] == want["total"]
    assert nb["codes"] + nb["scales"] + nb["outliers"] == want["quantized"]
    assert nb["codebooks"] == want["codebooks"]
    assert nb["sinks"] == want["sinks"] and nb["residual"] == want["residual"]
    assert nb["allocated"] >= nb["total"]
    if regions.has_codes:  # the methods' own bytes are really there
        assert (nb["outliers"] > 0) == (s.outliers > 0)
        levels = sum(
            1 << bits for fmt, bits in ((s.key_format, s.key_bits), (s.value_format, s.value_bits)) if "nuq" in fmt
        )
        assert nb["codebooks"] == 2 * 2 * levels  # layers x fp16 x the levels of K's and V's codebooks


# --- 7. attention over the packed past ----------------------------------------------------------------


def _exact(query, keys, values, scaling):
    grp = query.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(grp, dim=1), values.repeat_interleave(grp, dim=1)
    logits = (query @ k.transpose(-1, -2)) * scaling
    lse = torch.logsumexp(logits, -1)
    return torch.softmax(logits, -1) @ v, lse


@pytest.mark.parametrize(
    "spec",
    [
        "nuq2:o1",
        "nuq2:o1:s1:g32:r32",
        "nuq3:ktoken:o1",
        "int3",
        "nvfp4:g32:r32",
        "int4:hadamard",
        "k8v4:hadamard:o1",
        "int4:prerope",
        "int4:prerope:s2:g32:r32",
    ],
)
@pytest.mark.parametrize("n_queries", [1, 5])
def test_attention_over_codes_equals_attention_over_the_dequantized_past(spec, n_queries):
    s = parse_precision(spec)
    cache = QuantizedKVCache(spec, num_layers=1, rope=_rope64() if s.pre_rope else None)
    for i, n in enumerate([300, 37, 1]):
        cache.update(_randn(B, H, n, D, seed=i, scale=2), _randn(B, H, n, D, seed=50 + i), 0)
    packed = cache.layers[0].packed()
    assert packed.regions.has_codes and packed.keys.quantized is not None and not packed.keys.quantized.plain
    keys, values = packed.dequantized()
    query = _randn(B, HQ, n_queries, D, seed=9)
    want, want_lse = _exact(query, keys, values, D**-0.5)
    out, lse = reference_attention.past_attention(query, packed, D**-0.5)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=1e-5)
    out, lse = reference_attention.past_attention_streamed(
        query, packed, D**-0.5
    )  # fused kernel over dequantized pieces
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    mask = torch.ones(B, 1, n_queries, packed.length, dtype=torch.bool)
    out, lse = reference_attention.past_attention_streamed(
        query, packed, D**-0.5, mask=mask
    )  # online softmax from the codes
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=1e-5)
    probs = reference_attention.past_probabilities(query, packed, D**-0.5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(B, HQ, n_queries), atol=1e-5, rtol=0)


@pytest.mark.parametrize("spec,tolerance", [("int8:prerope:g32:r32", 0.05), ("nvfp4:g32:r32", 0.6)])
def test_cache_methods_keep_positions_and_blocks_apart(spec, tolerance):
    """Several appends, several flushes: a pre-RoPE key is turned back and forth at its own position, and
    each nvfp4 block has its own tensor scale (a loud block does not coarsen a quiet one)."""
    s = parse_precision(spec)
    cache = QuantizedKVCache(spec, num_layers=1, rope=_rope64() if s.pre_rope else None)
    k = torch.cat([_randn(B, H, 64, D, seed=1), _randn(B, H, 64, D, seed=2, scale=50), _randn(B, H, 60, D, seed=3)], 2)
    v = _randn(B, H, 188, D, seed=4)
    for a, e in [(0, 40), (40, 41), (41, 130), (130, 188)]:
        cache.update(k[:, :, a:e], v[:, :, a:e], 0)
    packed = cache.layers[0].packed()
    assert packed.quant_len == 160  # five 32-token blocks: quiet, quiet, loud, loud, quiet
    keys, _ = packed.dequantized()
    quiet = torch.cat([keys[:, :, :64] - k[:, :, :64], keys[:, :, 128:] - k[:, :, 128:]], 2)
    assert float(quiet.abs().max()) < tolerance
    assert float((keys[:, :, 64:128] - k[:, :, 64:128]).abs().max()) < tolerance * 50
    if s.key_format == "nvfp4":
        ts = packed.keys.quantized.tensor_scale
        assert ts.shape[-1] == 5 and float(ts[..., 2:4].min()) > 10 * float(ts[..., [0, 1, 4]].max())


def test_prerope_cache_needs_a_rope():
    with pytest.raises(ValueError, match="rotary embedding"):
        QuantizedKVCache("int4:prerope", num_layers=1)


# --- 8. pre-RoPE keys per model family ----------------------------------------------------------------

ROPE_FAMILIES = [*FAMILIES, "phi3-partial"]


def _family_model(family):
    return _model("phi3", partial_rotary_factor=0.5) if family == "phi3-partial" else _model(family)


@torch.no_grad()
def _keys_around_rope(model, ids, start):
    """(pre-RoPE, post-RoPE) keys of every layer, taken at the model's own apply_rotary_pos_emb (after any
    k_norm, as the family does it), for `ids` at positions [start, start + len(ids))."""
    module = importlib.import_module(type(model).__module__)
    original, seen = module.apply_rotary_pos_emb, []

    def spy(q, k, cos, sin, *args, **kwargs):
        q_out, k_out = original(q, k, cos, sin, *args, **kwargs)
        seen.append((k.float(), k_out.float()))
        return q_out, k_out

    module.apply_rotary_pos_emb = spy
    try:
        positions = torch.arange(start, start + len(ids))[None]
        model(torch.tensor([ids]), position_ids=positions, use_cache=False)
    finally:
        module.apply_rotary_pos_emb = original
    return seen


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_rope_undo_and_apply_match_the_models_own_rotary_embedding(family):
    model = _family_model(family)
    if family == "gemma3":  # local and global layers use different tables
        with pytest.raises(ValueError, match="per layer type"):
            Rope.from_model(model)
        return
    rope = Rope.from_model(model)
    ids = _prompt()[:24]
    for start in (0, 37):
        seen = _keys_around_rope(model, ids, start)
        assert len(seen) == model.config.num_hidden_layers
        for pre, post in seen:
            assert float((post - pre).abs().max()) > 0.01  # RoPE really turns these keys
            torch.testing.assert_close(rope.apply(pre, start), post, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(rope.undo(post, start), pre, atol=1e-5, rtol=1e-5)
    d = getattr(model.config, "head_dim", None) or 16  # qwen2 / phi3: 64 hidden / 4 heads
    x = _randn(1, 2, 50, d, seed=11, scale=3)
    torch.testing.assert_close(rope.undo(rope.apply(x, 123), 123), x, atol=1e-5, rtol=1e-5)
    assert float((rope.apply(x, 123) - rope.apply(x, 124)).abs().max()) > 0.01  # positions matter


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gemma3"])
def test_prerope_int8_runs_a_family_close_to_full_precision(family):
    lm, prompt = _lm(_model(family)), _prompt(PROMPT_SEED[family])
    full = runner.run_precision(lm, prompt, "full", 16, keep_logits=True)
    quant = runner.run_precision(lm, prompt, "int8:g16:r16:prerope", 16, keep_logits=True)
    assert quant.cache_bytes["codes"] > 0  # the past sits in codes, keys before RoPE
    err = float((torch.stack(quant.logits) - torch.stack(full.logits)).abs().max())
    assert err < INT8_LOGIT_ERROR, f"{family}: prerope int8 logits {err:.3f} from full precision"
    assert quant.tokens == full.tokens


def test_prerope_is_refused_for_gemma3_with_a_message():
    lm = _lm(_model("gemma3"))
    with pytest.raises(ValueError, match="Gemma-3"):
        runner.new_cache(lm, "int8:prerope")


# --- 9. codebooks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_normal_float_levels(bits):
    lv = normal_float(bits)
    assert lv.shape == (1 << bits,) and lv.dtype == torch.float32
    assert (lv[1:] > lv[:-1]).all()
    assert float(lv[0]) == -1.0 and float(lv[-1]) == 1.0
    torch.testing.assert_close(lv, -lv.flip(0), atol=1e-7, rtol=0)
    if bits > 2:  # denser near zero than uniform levels (normal quantiles)
        gaps = lv[1:] - lv[:-1]
        assert float(gaps[len(gaps) // 2]) < float(gaps[0])


def test_weighted_kmeans_finds_modes_and_follows_the_weights():
    g = torch.Generator().manual_seed(12)
    bimodal = torch.cat([torch.randn(5000, generator=g) * 0.05 - 0.6, torch.randn(5000, generator=g) * 0.05 + 0.5])
    levels = weighted_kmeans(bimodal, torch.ones(10000), 2, ends=False)
    torch.testing.assert_close(levels, torch.tensor([-0.6, 0.5]), atol=0.01, rtol=0)
    pinned = weighted_kmeans(bimodal, torch.ones(10000), 4)  # ends pinned at -1 and 1, the bulk in between
    torch.testing.assert_close(pinned, torch.tensor([-1.0, -0.6, 0.5, 1.0]), atol=0.01, rtol=0)

    uniform = torch.rand(20000, generator=g) * 2 - 1
    plain = weighted_kmeans(uniform, torch.ones(20000), 4, ends=False)
    torch.testing.assert_close(plain, torch.tensor([-0.75, -0.25, 0.25, 0.75]), atol=0.03, rtol=0)
    heavy = weighted_kmeans(uniform, torch.where(uniform > 0.5, 100.0, 1.0), 4, ends=False)
    assert (heavy[1:] > heavy[:-1]).all()
    assert int((heavy > 0.5).sum()) >= 2 > int((plain > 0.5).sum())  # levels pulled where the weight is


def test_codebooks_save_load_round_trip_and_fallback(tmp_path):
    fitted = torch.tensor([-1.0, -0.1, 0.3, 1.0]).half()
    books = Codebooks(
        {
            codebooks.tensor_name(0, "key", 2, False, False): fitted,
            codebooks.tensor_name(1, "value", 3, True, False): normal_float(3).half(),
            codebooks.tensor_name(0, "key", 2, True, True): -fitted.flip(0),
        },
        {"model": "tiny", "layers": "2", "calibration_tokens": "256"},
    )
    loaded = Codebooks.load(books.save(tmp_path / "sub" / "tiny.safetensors"))
    assert loaded.fitted and set(loaded.tensors) == set(books.tensors)
    for name, t in books.tensors.items():
        assert loaded.tensors[name].dtype == torch.float16 and torch.equal(loaded.tensors[name], t), name
    assert loaded.metadata == books.metadata
    nuq2 = parse_precision("nuq2")
    nf2 = normal_float(2).half()  # levels are fp16, as stored and read by the kernels
    assert torch.equal(loaded.levels(0, "key", nuq2), fitted.half())
    assert torch.equal(loaded.levels(0, "value", nuq2), nf2)  # missing: NormalFloat
    assert torch.equal(loaded.levels(1, "key", nuq2), nf2)
    assert torch.equal(loaded.levels(0, "key", parse_precision("nuq2:o1")), nf2)  # no plain `.o` key
    assert torch.equal(loaded.levels(0, "key", parse_precision("nuq2:o1:prerope")), -fitted.flip(0).half())
    assert torch.equal(loaded.levels(0, "value", parse_precision("nuq2:o1:prerope")), nf2)  # values: no RoPE
    # a cache takes its levels from the codebooks, layer by layer
    cache = QuantizedKVCache("nuq2", num_layers=2, codebooks=loaded)
    cache.update(_randn(B, H, 300, D), _randn(B, H, 300, D, seed=1), 0)
    assert torch.equal(cache.layers[0].packed().keys.quantized.levels, fitted)
    assert torch.equal(cache.layers[1].keys.method.levels, nf2)
    assert not Codebooks.normal_float().fitted


def test_shipped_codebooks_are_well_formed():
    path = codebooks.ASSET_DIR / "embedded.safetensors"
    if not path.exists():
        pytest.skip("no shipped codebook file")
    books = Codebooks.load(path)
    layers = int(books.metadata["layers"])
    assert len(books.tensors) == layers * 18  # (K plain + K pre-RoPE + V) x (plain, .o) x nuq2/3/4
    for name, lv in books.tensors.items():
        assert lv.numel() == 1 << int(name.split("nuq")[1][0]), name
        assert (lv[1:] > lv[:-1]).all() and float(lv.abs().max()) <= 1.0, name


def test_calibrate_fits_every_layer_part_and_variant():
    model = _model("llama")
    lm = _lm(model)
    ids = torch.randint(3, VOCAB, (256,), generator=torch.Generator().manual_seed(13)).tolist()
    try:
        books = calibration.calibrate(lm, ids=ids, bits=(2,))
    finally:
        model.zero_grad(set_to_none=True)
    want = {
        codebooks.tensor_name(i, part, 2, o, pre)
        for i in range(2)
        for part, pre in (("key", False), ("key", True), ("value", False))
        for o in (False, True)
    }
    assert set(books.tensors) == want
    assert books.metadata["layers"] == "2" and books.metadata["calibration_tokens"] == "256"
    for name, lv in books.tensors.items():
        assert lv.shape == (4,) and lv.dtype == torch.float16, name
        assert (lv[1:] > lv[:-1]).all() and float(lv.abs().max()) <= 1.0, name
    assert any(not torch.equal(lv.float(), normal_float(2).half().float()) for lv in books.tensors.values())
    assert model.config._attn_implementation == "kvdemo"  # the calibration hook is gone again
