"""The Triton decode kernel over the methods beyond uniform codes (kvdemo/precision.py) against the PyTorch
reference, under TRITON_INTERPRET=1: nuq codebooks, bit-sliced 3-bit codes, nvfp4, dense-and-sparse outliers,
Hadamard rotation, pre-RoPE keys, and combinations of them, read from real `QuantizedKVCache` layers.

Bounds: tests/test_triton.py's (`assert_attention_close`): lse within 1e-4 * scale, out within 2e-3 * scale.
Every case first checks that `supports_attention` takes it, so the comparison is the kernel's, never the
reference's fallback against itself; `test_each_method_is_seen_by_the_comparison` shows the bounds are tight
enough to catch a method the kernel left out. Shapes are tiny: the interpreter runs every program in Python.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_families import _model
from test_triton import (
    DEVICE,
    _keys,
    _to,
    assert_attention_close,
    fixture_kernel_modules,  # noqa: F401  (test_triton's fixtures, registered here as kernel_modules, td, tq)
    fixture_td,  # noqa: F401
    fixture_tq,  # noqa: F401
)

from kvdemo import attention
from kvdemo import quant as kvquant
from kvdemo.cache import QuantizedKVCache
from kvdemo.precision import parse_precision
from kvdemo.quant import backend as quant_backend
from kvdemo.quant import launch, triton_codes
from kvdemo.quant import reference as ref
from kvdemo.quant import reference_attention as ref_attn
from kvdemo.quant.rotations import Rope

pytestmark = pytest.mark.triton


def _rope(head_dim: int, partial: bool = False) -> Rope:
    """A tiny random model's rotary embedding: Llama at `head_dim`, or Phi-3 with half its 16 channels turned."""
    return Rope.from_model(_model("phi3", partial_rotary_factor=0.5) if partial else _model("llama", head_dim=head_dim))


def _packed(spec: str, hkv: int, head_dim: int, chunks, seed: int, partial_rope: bool = False):
    """The packed past of a one-layer QuantizedKVCache fed `chunks` tokens at a time."""
    s = parse_precision(spec)
    rope = _rope(head_dim, partial_rope) if s.pre_rope else None
    cache = QuantizedKVCache(spec, num_layers=1, rope=rope)
    g = torch.Generator().manual_seed(seed)
    for n in chunks:
        k = _keys((1, hkv, n, head_dim), seed=int(torch.randint(0, 2**30, (1,), generator=g)))
        cache.update(k, torch.randn(1, hkv, n, head_dim, generator=g) * 2, 0)
    return cache.layers[0].packed()


def _compare(td, query, kv, scaling, **settings):
    """The kernel (which must take the call) against the reference: out and lse within the stated bounds."""
    assert launch.supports_attention(query, kv), "the kernel must take this call (not hand it to the reference)"
    want_out, want_lse = ref_attn.past_attention(query, kv, scaling)
    out, lse = td.past_attention(query, kv, scaling, **settings)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_attention_close(out, want_out)
    assert_attention_close(lse, want_lse, "lse")


METHOD_CASES = [
    # spec, kv heads, GQA ratio, head_dim, chunks fed, queries, splits
    ("nuq4:g16:r16:s2", 1, 3, 32, [70], 1, 2),  # 4-bit codebook, keys per channel (scale + zero), fp32 levels
    ("nuq3:g16:r16", 2, 2, 32, [50, 1], 1, None),  # bit-sliced 3-bit codebook
    ("nuq2:g16:r16:s3", 1, 4, 16, [45], 1, 3),  # 2-bit codebook, head_dim 16
    ("int3:g16:r16:s1", 1, 2, 32, [60], 2, 2),  # bit-sliced uniform 3-bit, two queries
    ("int3:g32:r32", 1, 2, 64, [75], 1, None),
    ("nuq3:ktoken:g16:r16", 1, 2, 32, [50], 1, 2),  # codebook keys per token (absmax scale, no zero)
    ("int3:ktoken:g16:r16:s2", 1, 2, 32, [40], 1, None),
    ("nvfp4:g16:r16:s2", 1, 3, 32, [70], 1, 2),  # E2M1 codes, E4M3 scales, a tensor scale per 16 tokens
    ("nvfp4:g32:r32", 2, 2, 64, [100], 1, 3),
    ("int4:o7:g16:r16", 1, 2, 32, [50], 1, 2),  # 3 sparse outliers per row, keys and values
    ("nuq3:o1:g16:r16", 1, 3, 32, [60], 1, None),  # nuq3 + outliers
    ("k8v4:o4:ktoken:g16:r16", 1, 2, 32, [50], 1, 2),  # outliers on per-token keys
    ("int4:hadamard:g16:r16:s2", 1, 3, 32, [60], 1, 2),  # queries turned by R, outputs back by R.T
    ("k8v4:hadamard:g16:r16", 2, 2, 32, [50, 1], 1, None),
    ("k8v4:hadamard:o1:g16:r16", 1, 2, 32, [55], 1, 2),  # outliers in the rotated space
    ("int4:prerope:g16:r16:s2", 1, 3, 32, [60], 1, 2),  # keys turned by RoPE after dequantizing
    ("nuq2:o1:prerope:g16:r16", 1, 2, 32, [50], 1, None),
    ("int8:prerope:ktoken:g16:r16", 1, 2, 32, [45], 1, 2),
    ("nuq4:o1:s1:g16:r16", 1, 4, 32, [70, 1, 1], 1, 2),  # sinks, residual, appends after the prefill
    ("nuq4:o1:prerope:g32:r32", 1, 2, 64, [80], 1, 2),  # the ablation's best combination
    ("knuq4vnuq2:o1:s1:g16:r16", 1, 2, 32, [60], 1, 2),  # keys and values in two formats: two codebooks
    ("k8vnuq3:g16:r16", 1, 3, 32, [50, 1], 1, None),  # integer keys, bit-sliced codebook values
    ("knvfp4v4:g16:r16", 1, 2, 32, [55], 1, 2),  # nvfp4 keys (per token) beside integer values
    ("k4vnvfp4:prerope:g16:r16", 1, 2, 32, [50], 1, None),  # pre-RoPE integer keys, nvfp4 values
]


@pytest.mark.parametrize("spec,hkv,grp,head_dim,chunks,n_q,splits", METHOD_CASES)
def test_methods_match_the_reference(td, spec, hkv, grp, head_dim, chunks, n_q, splits):
    kv = _packed(spec, hkv, head_dim, chunks, seed=len(spec) + sum(chunks))
    assert kv.regions.has_codes and not (kv.keys.quantized.plain and kv.values.quantized.plain)
    query = torch.randn(1, hkv * grp, n_q, head_dim, generator=torch.Generator().manual_seed(7))
    _compare(td, query, kv, head_dim**-0.5, num_splits=splits)


def test_partial_rotary_prerope_keys(td):
    """Phi-3 with partial_rotary_factor 0.5: RoPE turns 8 of 16 channels, the rest pass through."""
    kv = _packed("int4:prerope:g16:r16:s1", 1, 16, [50], seed=3, partial_rope=True)
    cos, _ = kv.keys.quantized.rope.tables(0, 4, "cpu")
    assert cos.shape[-1] == 8
    _compare(td, torch.randn(1, 3, 1, 16, generator=torch.Generator().manual_seed(4)), kv, 0.25, num_splits=2)


def test_fp16_codebooks(td):
    """The cache holds fp16 codebooks (NormalFloat rounded too), the quantizer picks codes with those very levels,
    and the kernel reads them as exact fp16 dot operands."""
    kv = _packed("nuq4:g16:r16:s2", 1, 32, [60], seed=5)
    for part in (kv.keys, kv.values):
        assert part.quantized.levels.dtype == torch.float16
    query = torch.randn(1, 2, 1, 32, generator=torch.Generator().manual_seed(6))
    _compare(td, query, kv, 32**-0.5, num_splits=2)


@pytest.mark.parametrize("block_n", [16, 32])
def test_methods_with_other_tiles(td, block_n):
    """Tiles of 16 and 32 tokens (per-token keys: more than one tile per nvfp4 block, or a block per tile)."""
    for i, spec in enumerate(("nvfp4:g32:r32:s2", "nuq3:o1:prerope:g32:r32", "int3:hadamard:g32:r32")):
        kv = _packed(spec, 1, 32, [90], seed=20 + i)
        query = torch.randn(1, 2, 1, 32, generator=torch.Generator().manual_seed(21 + i))
        _compare(td, query, kv, 32**-0.5, num_splits=2, block_n=block_n)


def _without(kv, part: str, **fields):
    """kv with fields of one stored part's QuantizedTensor replaced (a method taken away)."""
    stored = getattr(kv, part)
    return dataclasses.replace(
        kv, **{part: dataclasses.replace(stored, quantized=dataclasses.replace(stored.quantized, **fields))}
    )


@pytest.mark.parametrize(
    "spec,part,fields",
    [
        ("int4:o7:g16:r16", "keys", dict(outlier_delta=None, outlier_index=None)),
        ("int4:o7:g16:r16", "values", dict(outlier_delta=None, outlier_index=None)),
        ("int4:hadamard:g16:r16", "keys", dict(rotation=None)),
        ("int4:hadamard:g16:r16", "values", dict(rotation=None)),
        ("int4:prerope:g16:r16", "keys", dict(start=1)),  # RoPE one position off
    ],
)
def test_each_method_is_seen_by_the_comparison(td, spec, part, fields):
    """The bounds catch a kernel that leaves a method out: the kernel over the past without it (or with it
    one position off) misses the reference over the real past."""
    kv = _packed(spec, 1, 32, [60], seed=9)
    query = torch.randn(1, 2, 1, 32, generator=torch.Generator().manual_seed(10))
    want_out, want_lse = ref_attn.past_attention(query, kv, 32**-0.5)
    broken = _without(kv, part, **fields)
    if part == "keys" and "start" in fields:
        broken = _without(broken, "values", start=1)  # keys and values share their start
    assert launch.supports_attention(query, broken)
    out, lse = td.past_attention(query, broken, 32**-0.5)
    got, want, what = (lse, want_lse, "lse") if part == "keys" else (out, want_out, "out")
    with pytest.raises(AssertionError):
        assert_attention_close(got, want, what)


def test_supports_attention_takes_the_methods_and_refuses_the_rest(td):
    query = torch.randn(1, 2, 1, 32)
    for spec in ("nuq4", "nuq3:o1", "nuq2:o1:prerope", "int3", "nvfp4", "int4:hadamard", "k8v4:hadamard:o1"):
        kv = _packed(spec + ":g16:r16", 1, 32, [40], seed=1)
        assert launch.supports_attention(query, kv), spec
    too_many = _packed("int4:o20:g16:r16", 1, 32, [40], seed=1)  # ceil(6.4) = 7 outliers per row
    assert too_many.keys.quantized.outlier_index.shape[-1] > triton_codes.MAX_OUTLIERS
    assert not launch.supports_attention(query, too_many)
    _compare_fallback(td, query, too_many)
    kv = _packed("int4:prerope:g16:r16", 1, 32, [40], seed=1)
    rope = kv.keys.quantized.rope
    assert not launch.supports_attention(query, _without(kv, "values", rope=rope))  # values are never pre-RoPE
    assert not launch.supports_attention(query, _without(kv, "keys", rotation=torch.eye(32)))  # RoPE after R: no
    assert not launch.supports_attention(query, _without(kv, "keys", start=16))  # keys and values start apart
    odd = _packed("nvfp4:g16:r16", 1, 16, [40], seed=1)  # per-token keys at head_dim 16: not compiled for
    assert not launch.supports_attention(torch.randn(1, 2, 1, 16), odd)


def _compare_fallback(td, query, kv):
    """A call the kernel refuses is the reference's, exactly."""
    got = td.past_attention(query, kv, 0.2)
    want = ref_attn.past_attention(query.to(DEVICE), _to(kv, DEVICE), 0.2)
    torch.testing.assert_close(got, tuple(t.cpu() for t in want), rtol=0, atol=0)


def test_nuq3_outliers_through_the_triton_backend(td, monkeypatch):
    """kvdemo attention's decode path with KVDEMO_BACKEND=triton reaches the kernel for nuq3:o1 (a spy counts
    its launches) and gives the torch backend's attention within the bounds."""
    module = getattr(td, "_module", td)
    launches = []
    real = module._launch_decode

    def spy(*args, **kwargs):
        launches.append(args[1].spec.label)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "_launch_decode", spy)
    spec, grp = "nuq3:o1:g16:r16:s2", 3
    states = [_keys((1, 2, n, 32), seed=60 + n).to(DEVICE) for n in (37, 1, 1)]
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(quant_backend.BACKEND_ENV, backend)
        cache = QuantizedKVCache(spec, num_layers=1)
        outs = []
        for i, k in enumerate(states):
            view, _ = cache.layers[0].update(k, k.flip(-1) * 0.5)
            if view.past_len:
                query = torch.randn(1, 2 * grp, k.shape[-2], 32, generator=torch.Generator().manual_seed(i))
                outs.append(attention.attend(query.to(DEVICE), view, 32**-0.5).cpu())
        runs[backend] = outs
        assert cache.layers[0].quant_len == 32
    assert len(launches) == 2 and all(label.startswith("nuq3:o1") for label in launches)
    for x, y in zip(runs["torch"], runs["triton"], strict=True):
        assert_attention_close(y, x)


# --- quantize-on-append with the methods: the same bytes as reference.quantize ------------------------------

QUANT_FIELDS = ("codes", "scale", "zero", "tensor_scale", "outlier_delta", "outlier_index", "levels")


def _assert_same_bytes(want: ref.QuantizedTensor, got: ref.QuantizedTensor) -> None:
    """Every stored tensor equal (dtype, shape, bits) and the same layout fields."""
    for name in QUANT_FIELDS:
        a, b = getattr(want, name), getattr(got, name)
        assert (a is None) == (b is None), f"{name}: {a is None} vs {b is None}"
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, (
                f"{name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
            )
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name}: {int((a != b).sum())} differ"
    for name in ("fmt", "axis", "group", "head_dim", "block", "start"):
        assert getattr(want, name) == getattr(got, name), name


def _levels(bits: int, seed: int) -> torch.Tensor:
    """A random ascending codebook in [-1, 1] with both ends, fp32 (the quantizer rounds it to fp16)."""
    inner = torch.rand((1 << bits) - 2, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return torch.cat([torch.tensor([-1.0, 1.0]), inner]).sort().values


def _method_input(shape, seed: int, huge: float = 3e4) -> torch.Tensor:
    """Keys-like data with a constant key block of one channel (0.1: torch's mean misses it by an ulp), a
    constant value group (small and at most half the token, so no tie among its largest magnitudes: ties are
    the documented exception) and a huge outlier. Pre-RoPE cases take a smaller one: turned back, a huge one
    fills two channels of its token, each dominating its channel's block, and both score exactly
    (G - 1) / sqrt(G), a tie (`test_outlier_ties_go_to_the_lowest_channel`)."""
    x = _keys(shape, seed=seed)
    x[0, 0, :16, 3] = 0.1
    x[0, -1, 5, : min(16, shape[-1] // 2)] = 0.01
    x[0, -1, 9, 7] = huge
    return x


QUANT_CASES = [
    # fmt, axis, group, head_dim, tokens, methods (levels: bits of a random codebook)
    ("int3", "channel", 16, 32, 32, {}),
    ("int3", "token", 16, 32, 21, {}),
    ("nuq4", "channel", 16, 32, 32, {"levels": 4}),
    ("nuq3", "channel", 16, 32, 32, {"levels": 3, "outliers": 1}),  # keys per channel, one outlier per token
    ("nuq3", "token", 32, 32, 21, {"levels": 3, "outliers": 1}),  # values per token
    ("nuq3", "token", 16, 64, 19, {"levels": 3, "outliers": 1}),
    ("nuq2", "token", 16, 16, 19, {"levels": 2, "outliers": 1}),
    ("nuq2", "channel", 32, 16, 64, {"levels": 2, "outliers": 7}),  # head_dim 16: torch's other sum order
    ("int4", "channel", 64, 32, 64, {"outliers": 10}),  # 4 outliers, a block read in two pieces
    ("int4", "token", 16, 32, 21, {"outliers": 10}),
    ("int8", "channel", 16, 64, 32, {"outliers": 2}),
    ("nvfp4", "token", 16, 32, 40, {"start": 5, "block": 16}),  # blocks cut at positions 16, 32 (rows 11, 27)
    ("nvfp4", "token", 16, 64, 21, {}),  # one tensor scale over all rows
    ("int4", "channel", 16, 32, 32, {"rotation": True}),  # Hadamard
    ("int2", "token", 32, 32, 21, {"rotation": True}),
    ("nuq4", "channel", 16, 32, 32, {"levels": 4, "outliers": 1, "rope": True, "start": 16}),  # pre-RoPE keys
    ("nvfp4", "token", 16, 32, 16, {"rope": True, "rotation": True, "start": 3, "block": 16}),
]


def _methods(spec: dict, head_dim: int, seed: int) -> dict:
    """reference.quantize's keywords from a QUANT_CASES entry."""
    methods = dict(spec)
    if "levels" in methods:
        methods["levels"] = _levels(methods["levels"], seed)
    if methods.get("rotation"):
        from kvdemo.quant.rotations import hadamard

        methods["rotation"] = hadamard(head_dim)
    if methods.get("rope"):
        methods["rope"] = _rope(head_dim)
    return methods


@pytest.mark.parametrize("fmt,axis,group,head_dim,tokens,spec", QUANT_CASES)
def test_quantize_methods_match_the_reference(tq, fmt, axis, group, head_dim, tokens, spec):
    methods = _methods(spec, head_dim, seed=head_dim + tokens)
    assert tq.supports_quantize_methods(fmt, axis, group, head_dim, **methods)
    x = _method_input((1, 2, tokens, head_dim), seed=tokens + group, huge=300.0 if spec.get("rope") else 3e4)
    want = ref.quantize(x, fmt, axis, group, **methods)
    _assert_same_bytes(want, tq.quantize(x, fmt, axis, group, **methods))
    if spec.get("outliers") and not spec.get("rope") and axis == "channel" and group == 16 and head_dim == 32:
        assert bool((want.outlier_index[0, 0, :16] == 3).any(dim=-1).all()), "the constant channel is picked"


def test_quantize_methods_fp16_input_and_strides(tq):
    """fp16 / bf16 inputs with inf and nan, and a [B, T, H, D] projection seen as [B, H, T, D]."""
    levels = _levels(3, 1)
    x = _method_input((1, 2, 32, 32), seed=2)
    x[0, 1, 3, 4], x[0, 0, 7, 8], x[0, 1, 20, 9] = float("nan"), float("inf"), float("-inf")
    for dtype in (torch.float16, torch.bfloat16):
        for axis, group in (("channel", 16), ("token", 16)):
            xd = x.to(dtype)
            _assert_same_bytes(
                ref.quantize(xd, "nuq3", axis, group, levels=levels, outliers=1),
                tq.quantize(xd, "nuq3", axis, group, levels=levels, outliers=1),
            )
        _assert_same_bytes(ref.quantize(xd, "nvfp4", "token", 16), tq.quantize(xd, "nvfp4", "token", 16))
    strided = _keys((1, 32, 2, 32), seed=3).transpose(1, 2)
    _assert_same_bytes(
        ref.quantize(strided, "int3", "token", 16, outliers=5), tq.quantize(strided, "int3", "token", 16, outliers=5)
    )


def test_quantize_methods_comparison_sees_a_wrong_choice(tq):
    """The byte comparison fails for a neighbouring choice (another codebook, one outlier fewer, another start)."""
    x = _method_input((1, 2, 32, 32), seed=4)
    got = tq.quantize(x, "nuq3", "channel", 16, levels=_levels(3, 5), outliers=1)
    for other in (dict(levels=_levels(3, 6), outliers=1), dict(levels=_levels(3, 5))):
        with pytest.raises(AssertionError):
            _assert_same_bytes(ref.quantize(x, "nuq3", "channel", 16, **other), got)
    got = tq.quantize(x, "nvfp4", "token", 16, start=5, block=16)
    with pytest.raises(AssertionError):
        _assert_same_bytes(ref.quantize(x, "nvfp4", "token", 16, start=6, block=16), got)


def test_outlier_ties_go_to_the_lowest_channel(tq):
    """The documented exception: a constant token ties every |x|; the kernel picks the lowest channels (torch's
    CPU topk another order), and both store the token exactly."""
    x = torch.randn(1, 1, 4, 32, generator=torch.Generator().manual_seed(8))
    x[0, 0, 2] = 0.75
    got = tq.quantize(x, "int4", "token", 32, outliers=10)
    assert got.outlier_index[0, 0, 2].tolist() == [0, 1, 2, 3]
    want = ref.quantize(x, "int4", "token", 32, outliers=10)
    torch.testing.assert_close(ref.dequantize(got), ref.dequantize(want), rtol=0, atol=0)
    # keys: a value dominating its channel's block scores exactly (G - 1) / sqrt(G) = 3.75 (G = 16); two such
    # channels in one token tie, and the kernel keeps the lower one
    keys = torch.randn(1, 1, 16, 32, generator=torch.Generator().manual_seed(9))
    keys[0, 0, 4, 9] = keys[0, 0, 4, 20] = 3e4
    got = tq.quantize(keys, "int4", "channel", 16, outliers=1)
    assert got.outlier_index[0, 0, 4].tolist() == [9]
    score = ref.outlier_picks(keys, "channel", 16, 32)  # every channel, highest score first
    picked = ref.quantize(keys, "int4", "channel", 16, outliers=1).outlier_index[0, 0, 4, 0]
    assert int(picked) in (9, 20) and set(score[0, 0, 4, :2].tolist()) == {9, 20}


def test_supports_quantize_methods_refuses_the_rest(tq):
    lv = _levels(3, 1)
    assert not tq.supports_quantize_methods("fp8_e4m3", "token", 32, 32, outliers=1)  # fp8 with methods
    assert not tq.supports_quantize_methods("nuq3", "token", 32, 32)  # no codebook
    assert not tq.supports_quantize_methods("nuq3", "token", 32, 32, levels=lv, outliers=20)  # 7 > MAX_OUTLIERS
    assert not tq.supports_quantize_methods("nuq3", "channel", 8, 32, levels=lv, outliers=1)  # unreplicated sum
    assert not tq.supports_quantize_methods("int3", "token", 16, 80)
    assert kvquant.quantize(torch.randn(1, 1, 16, 32), "fp8_e4m3", "token", 32, outliers=3.0).outlier_delta is not None


@pytest.mark.parametrize("spec", ["nuq3:o1:g16:r16:s2", "nvfp4:g16:r16:s1", "nuq4:o1:prerope:g16:r16"])
def test_cache_append_on_the_triton_backend_stores_the_torch_bytes(tq, monkeypatch, spec):
    """QuantizedKVCache appends (prefill, then tokens one at a time) on KVDEMO_BACKEND=triton reach the method
    kernels (a spy counts them) and store byte-identical tensors to the torch backend's."""
    module = getattr(tq, "_module", tq)
    calls = []
    real = module._quantize_methods

    def spy(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "_quantize_methods", spy)
    g = torch.Generator().manual_seed(11)
    chunks = [_method_input((1, 2, 37, 32), seed=12, huge=300.0)] + [
        torch.randn(1, 2, 1, 32, generator=g) for _ in range(20)
    ]
    rope = _rope(32) if "prerope" in spec else None
    stored = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(quant_backend.BACKEND_ENV, backend)
        cache = QuantizedKVCache(spec, num_layers=1, rope=rope)
        for k in chunks:
            cache.update(k.to(DEVICE), (k.flip(-1) * 0.5).to(DEVICE), 0)
        stored[backend] = _to(cache.layers[0].packed(), "cpu")
    assert len(calls) >= 4 and len(calls) % 2 == 0  # keys and values of every flushed block
    for part in ("keys", "values"):
        want, got = getattr(stored["torch"], part), getattr(stored["triton"], part)
        _assert_same_bytes(want.quantized, got.quantized)
        assert torch.equal(want.sinks, got.sinks) and torch.equal(want.residual, got.residual)


def test_codebook_words_hold_the_levels_bytes_for_the_compiled_lookup(kernel_modules):
    """On NVIDIA the decode kernel looks nuq4 codes up with byte permutes (`_PTX_NUQ4`, run on every byte by
    tests/test_triton_ptx.py) in 8 words built from the codebook by `_codebook_word`: word w < 4 holds the low
    bytes of levels 4w..4w+3, word w >= 4 their high bytes. This runs that builder and checks its bytes."""
    import triton
    import triton.language as tl

    global _codebook_word  # a jit function reaches others through its module's globals
    _codebook_word = kernel_modules.ptx._codebook_word

    @triton.jit
    def words(levels_ptr, out_ptr):
        for w in tl.static_range(8):
            tl.store(out_ptr + w, _codebook_word(levels_ptr, 4 * (w % 4), w // 4))

    levels = torch.linspace(-1, 1, 16).half()
    levels[5], levels[9] = -65504.0, -0.0  # bytes with their top bits set, and a signed zero
    got = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    words[(1,)](levels.to(DEVICE), got)
    bits = levels.view(torch.int16).int() & 0xFFFF
    want = [sum(((int(bits[4 * (w % 4) + k]) >> (8 * (w // 4))) & 0xFF) << (8 * k) for k in range(4)) for w in range(8)]
    assert [int(x) & 0xFFFFFFFF for x in got.cpu()] == want
