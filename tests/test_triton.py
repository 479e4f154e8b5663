"""Triton quantize and decode kernels (kvdemo/quant/triton_quantize.py, triton_decode.py) against the PyTorch
reference, under TRITON_INTERPRET=1.

Stated bounds:
- quantize: codes, scales and zero points are bit-identical to `reference.quantize` (every format,
  both axes, fp32/fp16/bf16 inputs, outliers, inf/nan, constant groups, strided inputs);
- past_attention, against `reference.past_attention` in fp32, with scale = max(1, max |reference|):
  lse within atol 1e-4 * scale: scores are fp32 sums of exact products on fp16 tensor cores (fp32
  operands split into fp16 hi + lo halves; codes are exact in fp16); measured up to 3e-5 * scale;
  where 8- and 4-bit keys are coded per channel (the plane-split loop), the query times the key scales is
  rounded to fp16 (4-bit keys: the query too), with no hi + lo split: lse within the larger of that and
  `query_rounding_bound` (2^-11 (1 + 2^-10) * scaling * max_t sum_c |q_c| (|k_tc| + |s_c| (code + 1)));
  `test_plane_split_scores_need_no_hi_lo_query` shows
  it closer to fp32 than a bf16 SDPA over the same cache; outputs then within 2e-3 * scale + 4 * that bound
  * max |v| (`assert_out_close`);
  out within atol 2e-3 * scale: attention weights and dequantized values are fp16 operands of the
  second dot, as in FlashAttention (each 2^-11 relative); measured up to 1e-3 * scale.
  The interpreter computes fp16 dots in fp32 as the tensor cores do, so the bounds hold on a GPU.
Shapes are tiny: the interpreter runs every program in Python.

On a GPU machine the same tests run compiled: ``KVDEMO_TRITON_TEST_DEVICE=cuda TRITON_INTERPRET=0
pytest tests/test_triton.py`` (bench/device_check.sh does). The `tq` and `td` fixtures then move each kernel
call's tensors to the GPU and its results back, so every test compares the compiled kernels with the
CPU reference unchanged.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

DEVICE = os.environ.get("KVDEMO_TRITON_TEST_DEVICE", "cpu")  # "cuda": the same tests, compiled on a GPU
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels become interpreted functions

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from kvdemo import attention, formats  # noqa: E402
from kvdemo.cache import CacheView, QuantizedLayer  # noqa: E402
from kvdemo.precision import parse_precision  # noqa: E402
from kvdemo.quant import backend as quant_backend  # noqa: E402
from kvdemo.quant import (  # noqa: E402
    launch,
    triton_codes,
)
from kvdemo.quant import reference as ref  # noqa: E402
from kvdemo.quant import reference_attention as ref_attn  # noqa: E402

pytestmark = pytest.mark.triton
ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2")
KERNEL_MODULES = ("ptx", "triton_codes", "triton_quantize", "launch", "triton_decode")  # each after its imports


def shallow(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a new thread, which starts its own frame stack. CPython 3.11 keeps frames in 16 KiB
    chunks, mapped when the stack grows past one and unmapped when it shrinks back: at pytest's depth the
    interpreter's per-op calls crossed a chunk edge each time (1.6M mmap/munmap pairs, half the time in the
    kernel, 2.5x slower than the same work from a script)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def assert_attention_close(got: torch.Tensor, want: torch.Tensor, what: str = "out") -> None:
    """The stated bound for attention outputs ("out") or log-sum-exps ("lse"), see the module docstring."""
    scale = max(1.0, float(want[torch.isfinite(want)].abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=0.0, atol={"out": 2e-3, "lse": 1e-4}[what] * scale)


def query_rounding_bound(query: torch.Tensor, kv, scaling: float) -> torch.Tensor:
    """[B, Hq, n]: how far the plane-split loop's fp16 roundings (8- and 4-bit keys per channel, no hi + lo
    split) can move a log-sum-exp. 4-bit keys: q rounded to fp16, then q_c s_c in fp16, each within 2^-11
    relative: score_t = sum_c q_c (1 + e1) (s_c c_tc (1 + e2) + z_c), off by at most 2^-11 (1 + 2^-11) sum_c |q_c|
    (|k_tc| + |s_c| c_tc); 8-bit keys: q_c s_c rounded from fp32 once, with the 1024 offset the biased codes
    carry taken off in fp32, at most 2^-11 sum_c |q_c s_c| (c_tc + 1). Both within |d lse| <= max_t |d score_t| <=
    2^-11 (1 + 2^-10) * scaling * max_t sum_c |q_c| (|k_tc| + |s_c| (c_tc + 1)), over the stored codes (k: the
    dequantized key). 0 where no keys are coded per channel."""
    b, hq, n, _ = query.shape
    if not kv.regions.has_codes or kv.spec.key_axis != "channel":
        return torch.zeros(b, hq, n)
    keys = kv.keys.quantized
    codes = ref.code_values(keys).float().cpu()  # [B, Hkv, T, D]
    scale = ref.group_scale(keys).float().cpu().repeat_interleave(keys.group, dim=-2)[..., : codes.shape[-2], :]
    k = ref.scaled_codes(keys).float().cpu()  # the stored keys, dequantized
    weight = k.abs() + (codes.abs() + 1) * scale.abs()  # |k_tc| + |s_c| (c_tc + 1)
    weight = weight.repeat_interleave(hq // kv.kv_heads, dim=1)  # [B, Hq, T, D]
    bound = torch.einsum("bhnd,bhtd->bhnt", query.float().cpu().abs(), weight).amax(-1)
    return 2**-11 * (1 + 2**-10) * scaling * bound


def assert_out_close(got: torch.Tensor, want: torch.Tensor, query: torch.Tensor, kv, scaling: float) -> None:
    """Outputs within the stated bound: 2e-3 * max(1, max |out|), plus what the query's fp16 rounding can do to
    the weights where it applies: scores off by at most d move each weight by a factor within e^(+-2d), so the
    output by at most 4 d max |v|."""
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    keys, values = kv.dequantized()
    d = query_rounding_bound(query, kv, scaling)  # [B, Hq, n]
    bound = 2e-3 * scale + 4 * d[..., None] * float(values.abs().max())
    assert bool(((got.cpu() - want.cpu()).abs() <= bound).all()), f"out off by {float((got - want).abs().max()):.3g}"


def assert_lse_close(got: torch.Tensor, want: torch.Tensor, query: torch.Tensor, kv, scaling: float) -> None:
    """lse within the stated bound: 1e-4 * max(1, max |lse|), or the query's fp16 rounding where larger."""
    scale = max(1.0, float(want[torch.isfinite(want)].abs().max())) if want.numel() else 1.0
    bound = torch.clamp(query_rounding_bound(query, kv, scaling), min=1e-4 * scale)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    excess = ((got - want).abs() - bound)[finite]
    assert excess.numel() == 0 or float(excess.max()) <= 0, f"lse off by {float((got - want).abs().max()):.3g}"


@pytest.fixture(scope="module", name="kernel_modules")
def fixture_kernel_modules():
    """kvdemo.quant's Triton modules by name (`kernel_modules.triton_decode`, ...), their kernels interpreted on
    CPU tensors: modules first imported compiled are reloaded in KERNEL_MODULES' order, so each one's kernels
    call the interpreted helpers of the modules before it. Compiled on DEVICE (see the docstring)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    modules = {name: importlib.import_module(f"kvdemo.quant.{name}") for name in KERNEL_MODULES}

    def jitted():
        return [
            f for m in modules.values() for f in vars(m).values() if isinstance(f, JITFunction | InterpretedFunction)
        ]

    if DEVICE != "cpu":
        assert not any(isinstance(f, InterpretedFunction) for f in jitted()), "unset TRITON_INTERPRET"
    elif not all(isinstance(f, InterpretedFunction) for f in jitted()):
        modules = {name: importlib.reload(module) for name, module in modules.items()}
    assert jitted() and all(isinstance(f, InterpretedFunction) == (DEVICE == "cpu") for f in jitted())
    return SimpleNamespace(**modules)


@pytest.fixture(scope="module", name="tq")
def fixture_tq(kernel_modules):
    """kvdemo.quant.triton_quantize: interpreted on CPU tensors, or compiled behind `OnDevice`."""
    module = kernel_modules.triton_quantize
    return module if DEVICE == "cpu" else OnDevice(module)


@pytest.fixture(scope="module", name="td")
def fixture_td(kernel_modules):
    """kvdemo.quant.triton_decode: interpreted on CPU tensors, or compiled behind `OnDevice`."""
    module = kernel_modules.triton_decode
    return module if DEVICE == "cpu" else OnDevice(module)


def _to(obj, device):
    """A tensor, or a dataclass's tensor fields, nested ones too (QuantizedTensor, PackedKV), on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    moved = {
        f.name: _to(getattr(obj, f.name), device)
        for f in dataclasses.fields(obj)
        if isinstance(getattr(obj, f.name), torch.Tensor) or dataclasses.is_dataclass(getattr(obj, f.name))
    }
    return dataclasses.replace(obj, **moved)


class OnDevice:
    """A kernels module (triton_quantize, triton_decode) with each call's tensors on DEVICE and its results back
    on the CPU."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def quantize(self, x, *args, **methods):
        methods = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in methods.items()}
        return _to(self._module.quantize(x.to(DEVICE), *args, **methods), "cpu")

    def quantize_into(self, x, fmt, axis, group, codes, scale, zero):
        outs = [t if t is None else t.to(DEVICE) for t in (codes, scale, zero)]
        self._module.quantize_into(x.to(DEVICE), fmt, axis, group, *outs)
        for cpu, dev in zip((codes, scale, zero), outs, strict=True):
            if cpu is not None:
                cpu.copy_(dev)

    def past_attention(self, query, kv, scaling, mask=None, **settings):
        mask = None if mask is None else mask.to(DEVICE)
        out, lse = self._module.past_attention(query.to(DEVICE), _to(kv, DEVICE), scaling, mask, **settings)
        return out.cpu(), lse.cpu()


def _keys(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Keys-like data: per-channel magnitudes spanning decades, one outlier channel."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[:2] + (1, shape[-1]), generator=g) * 1.5)
    x[..., 1] += 8.0
    return x.to(dtype)


def _assert_same_quantized(a: ref.QuantizedTensor, b: ref.QuantizedTensor) -> None:
    assert a.codes.dtype == b.codes.dtype == torch.uint8 and a.codes.shape == b.codes.shape
    assert torch.equal(a.codes, b.codes), f"{int((a.codes != b.codes).sum())} code bytes differ"
    assert torch.equal(a.scale, b.scale), "scales differ"
    assert (a.zero is None) == (b.zero is None)
    if a.zero is not None:
        assert torch.equal(a.zero, b.zero), "zero points differ"


# --- fp8 bit conversion ---------------------------------------------------------------------------


@triton.jit
def _fp8_roundtrip_kernel(x_ptr, enc_ptr, byte_ptr, dec_ptr, n, FP8: tl.constexpr, BLOCK: tl.constexpr):
    # the helpers through the module (an import statement does not compile; reload keeps the module object)
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    tl.store(enc_ptr + offs, triton_codes._fp8_encode(x, FP8).to(tl.uint8), mask=ok)
    byte = tl.load(byte_ptr + offs, mask=ok, other=0).to(tl.int32)
    tl.store(dec_ptr + offs, triton_codes._fp8_decode(byte, FP8), mask=ok)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply")  # NaN bytes / 256 in numpy
def test_fp8_bits_match_torch(kernel_modules, fmt):
    """Encode: round-to-nearest-even like torch, ties, subnormals and carries into the exponent
    included (Triton's interpreter gets these wrong with a float8 cast). Decode: every byte exactly
    (as value / 256, the unit the attention kernel unpacks fp8 codes in)."""
    dtype, fmax = getattr(torch, formats.get(fmt).fp8_dtype), formats.get(fmt).fp8_max
    g = torch.Generator().manual_seed(1)
    mags = torch.exp2(torch.empty(6000).uniform_(-24, 17, generator=g)).clamp(max=fmax)
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[torch.isfinite(grid)].abs().unique()
    ties = (grid[1:] + grid[:-1]) / 2  # exact midpoints between neighbouring fp8 values
    x = torch.cat([mags, -mags, ties, -ties, grid, -grid, torch.tensor([0.0, -0.0, fmax, -fmax])])
    n = x.numel()
    enc = torch.empty(n, dtype=torch.uint8)
    byte = torch.arange(n, dtype=torch.int64).remainder(256).to(torch.uint8)
    dec = torch.empty(n)
    args = [t.to(DEVICE) for t in (x, enc, byte, dec)]
    _fp8_roundtrip_kernel[(1,)](*args, n, FP8=formats.get(fmt).fp8_code, BLOCK=triton.next_power_of_2(n))
    enc, dec = args[1].cpu(), args[3].cpu()
    assert torch.equal(enc, x.to(dtype).view(torch.uint8))
    want = byte.view(dtype).float()
    finite = torch.isfinite(want)
    assert torch.equal(dec[finite] * 256, want[finite])  # decoded as value / 256 (exact in fp16)


# --- quantize-and-pack ----------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_matches_reference(tq, fmt, head_dim):
    # keys per channel (two 32-token blocks), values per token with groups smaller than, equal to
    # and (for packed formats) spanning several code planes; an odd token count on the token axis
    for axis, group, tokens in (("channel", 32, 64), ("token", 16, 37), ("token", head_dim, 37)):
        x = _keys((1, 2, tokens, head_dim), seed=head_dim + tokens)
        _assert_same_quantized(ref.quantize(x, fmt, axis, group), tq.quantize(x, fmt, axis, group))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_edge_values_and_dtypes(tq, fmt):
    x = _keys((2, 1, 32, 64), seed=3)
    x[0, 0, 5, 7] = float("nan")
    x[0, 0, 6, 8] = float("inf")
    x[1, 0, 9, 9] = float("-inf")
    x[1, 0, :, 20] = 0.25  # a constant channel: scale clamped to MIN_SCALE
    x[1, 0, 3, :] = -1.5  # a constant token
    x[0, 0, 2, 30] = 1e30  # beyond fp16: clamped
    x[0, 0, 4, 31] = 3e-7  # tiny values: fp16-subnormal scales
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        xd = x.to(dtype)
        for axis, group in (("channel", 16), ("token", 32)):
            _assert_same_quantized(ref.quantize(xd, fmt, axis, group), tq.quantize(xd, fmt, axis, group))


@pytest.mark.parametrize("fmt", ["int8", "int4", "int2"])
def test_quantize_rounds_ties_to_even(tq, fmt):
    """Groups spanning [0, levels] have scale 1, so k + 0.5 is an exact tie: half-to-even, as torch."""
    levels = (1 << formats.get(fmt).bits) - 1
    row = torch.cat([torch.tensor([0.0, float(levels)]), torch.arange(levels) + 0.5])  # 2 + levels values
    row = row.repeat(-(-32 // row.numel()))[:32]
    row[0], row[1] = 0.0, float(levels)
    x = row.view(1, 1, 1, 32).expand(1, 1, 32, 32).clone()  # token axis: each token is one group of 32
    q = tq.quantize(x, fmt, "token", 32)
    _assert_same_quantized(ref.quantize(x, fmt, "token", 32), q)
    codes = ref.unpack(q.codes, formats.get(fmt).bits)[0, 0, 0].float()
    assert torch.equal(codes, row.round())  # torch.round: half to even
    xt = x.transpose(-1, -2).contiguous()  # channel axis: each channel is one group of 32 tokens
    _assert_same_quantized(ref.quantize(xt, fmt, "channel", 32), tq.quantize(xt, fmt, "channel", 32))


def test_quantize_strided_input_and_large_groups(tq):
    base = _keys((1, 24, 3, 64), seed=5)  # [B, T, H, D] as a model's projection would lay it out
    x = base.transpose(1, 2)  # [B, H, T, D], non-contiguous
    for fmt in ("int4", "fp8_e4m3"):
        _assert_same_quantized(ref.quantize(x, fmt, "token", 64), tq.quantize(x, fmt, "token", 64))
    y = _keys((1, 1, 256, 64), seed=6)
    for fmt in ("int8", "int2"):
        _assert_same_quantized(ref.quantize(y, fmt, "channel", 256), tq.quantize(y, fmt, "channel", 256))


def test_quantize_into_writes_only_its_rows(tq):
    x = _keys((1, 2, 32, 64), seed=7)
    codes = torch.full((1, 2, 96, 32), 0xAB, dtype=torch.uint8)  # a preallocated int4 buffer
    scale = torch.full((1, 2, 6, 64), 7.0, dtype=torch.float16)
    zero = torch.full((1, 2, 6, 64), 7.0, dtype=torch.float16)
    tq.quantize_into(x, "int4", "channel", 16, codes[:, :, 32:64], scale[:, :, 2:4], zero[:, :, 2:4])
    want = ref.quantize(x, "int4", "channel", 16)
    assert torch.equal(codes[:, :, 32:64], want.codes)
    assert torch.equal(scale[:, :, 2:4], want.scale) and torch.equal(zero[:, :, 2:4], want.zero)
    assert bool((codes[:, :, :32] == 0xAB).all() and (codes[:, :, 64:] == 0xAB).all())
    assert bool((scale[:, :, :2] == 7).all() and (scale[:, :, 4:] == 7).all() and (zero[:, :, 4:] == 7).all())


def test_quantize_rejects_bad_input(tq):
    x = torch.randn(1, 1, 20, 64)
    with pytest.raises(ValueError, match="whole number"):
        tq.quantize(x, "int4", "channel", 16)
    with pytest.raises(ValueError, match="head_dim"):
        tq.quantize(torch.randn(1, 1, 16, 80), "int4", "token", 16)
    with pytest.raises(ValueError, match=r"\[B, H, T, D\]"):
        tq.quantize(torch.randn(20, 64), "int8", "token", 64)
    with pytest.raises(ValueError, match="codes must be"):
        tq.quantize_into(x, "int8", "token", 64, torch.empty(1, 1, 20, 32, dtype=torch.uint8), None, None)


# --- fused decode attention -----------------------------------------------------------------------


def _layer(spec: str, hkv: int, head_dim: int, chunks, seed: int, dtype=torch.float32) -> QuantizedLayer:
    """A real cache layer fed `chunks` tokens at a time (the regions come from QuantizedLayer itself)."""
    layer = QuantizedLayer(parse_precision(spec))
    g = torch.Generator().manual_seed(seed)
    for n in chunks:
        k = _keys((1, hkv, n, head_dim), seed=int(torch.randint(0, 2**30, (1,), generator=g)))
        v = torch.randn(1, hkv, n, head_dim, generator=g)
        layer.update(k.to(dtype), v.to(dtype))
    return layer


ATTENTION_CASES = [
    # spec, kv heads, GQA ratio, head_dim, chunks fed, queries, splits
    ("int4:g32:r32:s4", 1, 1, 64, [77], 1, None),  # odd length, sinks, residual, default splits
    ("int8:g16:r16:s3", 2, 3, 64, [50, 1, 1], 1, 2),  # appends after prefill
    ("int2:g32:r32:s4", 1, 8, 128, [101], 2, 3),  # GQA 8, head_dim 128, two queries
    ("fp8:g16:r16:s4", 1, 3, 128, [61], 1, None),
    ("fp8-e5m2:g16:r16", 1, 3, 64, [40], 1, 1),  # no sinks
    ("k8v4:g16:r16:s2:ktoken", 2, 1, 64, [45], 1, None),  # keys per token
    ("k4v8:g16:r16:s4", 1, 8, 64, [32], 1, 2),  # residual empty after the flush
    ("k8v2:g64:r64:s4", 1, 3, 128, [140], 1, 4),  # tile of 64 tokens inside 64-token key blocks
    ("int4:g128:r128:s4", 1, 3, 64, [130], 1, 2),  # 128-token key blocks, 64-token tiles
    ("int4:g32:r32:s4", 1, 3, 64, [20], 1, None),  # no quantized region yet: sinks + residual only
    ("full", 2, 3, 64, [150], 1, 3),  # unquantized: the residual alone, split over programs
    ("int4:g32:r32:s4", 1, 4, 256, [100], 1, 2),  # head_dim 256: 16-token tiles, the key fold on every tile
    ("k8v4:g16:r16:s2", 2, 2, 32, [70], 1, None),  # head_dim 32
    ("int2:g16:r16", 1, 4, 16, [60], 1, 2),  # head_dim 16: one packed int32 word per int2 row
    # the plane-split loop (values in one group of head_dim channels; see `launch.plane_split`)
    ("int4:g64:r64:s4", 2, 4, 64, [200, 1], 1, 2),  # GQA 4, appends, 64-token tiles in 64-token key blocks
    ("k8v4:g128:r128:s4", 1, 8, 128, [300], 1, None),  # head_dim 128, 128-token key blocks, default splits
    ("k4v8:g32:r32:s2", 1, 3, 32, [90], 2, 3),  # head_dim 32: 16-channel planes
    ("int8:g64:r64", 1, 1, 64, [130], 1, 50),  # no sinks, more splits than tiles
]


@pytest.mark.parametrize("spec,hkv,grp,head_dim,chunks,n_q,splits", ATTENTION_CASES)
def test_past_attention_matches_reference(td, spec, hkv, grp, head_dim, chunks, n_q, splits):
    kv = _layer(spec, hkv, head_dim, chunks, seed=len(spec) + sum(chunks)).packed()
    query = torch.randn(1, hkv * grp, n_q, head_dim, generator=torch.Generator().manual_seed(9))
    want_out, want_lse = ref_attn.past_attention(query, kv, head_dim**-0.5)
    out, lse = td.past_attention(query, kv, head_dim**-0.5, num_splits=splits)
    assert out.dtype == lse.dtype == torch.float32
    assert_out_close(out, want_out, query, kv, head_dim**-0.5)
    assert_lse_close(lse, want_lse, query, kv, head_dim**-0.5)


def test_plane_split_takes_the_8_and_4_bit_integer_formats():
    """The loop `launch.plane_split` picks: 8- and 4-bit integer keys per channel and values in one group."""
    split = {
        s: launch.plane_split(parse_precision(s), d)
        for s, d in [("int4", 128), ("int8", 128), ("k8v4", 64), ("k4v8:g32", 32), ("int4:g64", 128), ("int2", 128)]
        + [("fp8", 128), ("int4:ktoken", 128), ("nuq4", 128), ("int4:hadamard", 128), ("int4:g16", 16), ("full", 64)]
    }
    assert split == {"int4": True, "int8": True, "k8v4": True, "k4v8:g32": True} | dict.fromkeys(
        ["int4:g64", "int2", "fp8", "int4:ktoken", "nuq4", "int4:hadamard", "int4:g16", "full"], False
    )


@pytest.mark.parametrize(
    "spec,grp,head_dim,chunks,splits",
    [
        ("int4:g64:r64:s4", 4, 64, [200, 1], 2),  # 64-token tiles in 64-token key blocks, appends
        ("k8v4:g128:r128:s4", 8, 128, [300], None),  # 8-bit keys, 128-token key blocks: two tiles share a fold
        ("int4:g32:r32:s2", 3, 32, [90], 3),  # head_dim 32: 16-channel planes
        ("int4:g128:r128:s4", 4, 128, [500, 3], None),  # one warp, 16-token tiles, q . z on the tensor cores
        ("int8:g128:r128:s4", 4, 128, [300], 3),  # one warp: 8-bit keys' query rounded to fp16, 8-bit values
    ],
)
def test_direct_keys_form_gives_the_staged_forms_values(td, spec, grp, head_dim, chunks, splits):
    """The plane-split loop's direct-keys form (`launch.direct_keys_config`: 4-bit values; with 4-bit keys at head_dim
    128 one warp per program) reorders the same arithmetic: the reference's attention, and the staged form's to
    fp32 rounding of the sums. Where q . z is summed on the tensor cores (4-bit keys, and one warp), it is summed
    in another order than the staged form's fp32 sum, and both sums hold the codes' bias (terms of 1024 q s):
    fp32 rounding there moves scores by about 1e-3, weights by 1e-3 relative, so the two forms agree to 5e-4
    there (elsewhere 1e-5). One warp rounds 8-bit keys' query to fp16 too, as 4-bit keys': held to the bound on
    the reference only (`query_rounding_bound`; test_plane_split_scores_need_no_hi_lo_query checks it on keys
    spanning decades)."""
    kv = _layer(spec, 2, head_dim, chunks, seed=70 + head_dim).packed()
    stages = 3 if kv.spec.key.bits == kv.spec.value.bits == 4 else 2  # one warp: as deep as shared memory allows
    assert launch.direct_keys_config(kv.spec, head_dim, 16) == ((16, 1, stages) if head_dim == 128 else (64, 4, 3))
    query = torch.randn(1, 2 * grp, 1, head_dim, generator=torch.Generator().manual_seed(71))
    want_out, want_lse = ref_attn.past_attention(query, kv, head_dim**-0.5)
    out, lse = td.past_attention(query, kv, head_dim**-0.5, num_splits=splits, direct_keys=True)
    assert_out_close(out, want_out, query, kv, head_dim**-0.5)
    assert_lse_close(lse, want_lse, query, kv, head_dim**-0.5)
    staged_out, staged_lse = td.past_attention(query, kv, head_dim**-0.5, num_splits=splits)
    if kv.spec.key.bits == 8 and head_dim == 128:  # fp16 query against the staged form's fp32: the bound above
        return
    tol = 5e-4 if kv.spec.key.bits == 4 else 1e-5
    torch.testing.assert_close(out, staged_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, staged_lse, rtol=tol, atol=tol)


@pytest.mark.parametrize("spec", ["int4:g128:r128:s4", "int8:g128:r128:s4"])
def test_one_warp_programs_of_the_staged_form(td, spec):
    """A one-warp launch of the default (staged) form takes the kernel's one-warp paths too (`ONE_WARP`: weights
    summed per tile, the query re-read per key block, 8-bit keys' query rounded to fp16): the reference's
    attention within the bound."""
    kv = _layer(spec, 2, 128, [300], seed=5).packed()
    query = torch.randn(1, 8, 1, 128, generator=torch.Generator().manual_seed(6))
    want_out, want_lse = ref_attn.past_attention(query, kv, 128**-0.5)
    out, lse = td.past_attention(query, kv, 128**-0.5, num_warps=1, num_splits=3)
    assert_out_close(out, want_out, query, kv, 128**-0.5)
    assert_lse_close(lse, want_lse, query, kv, 128**-0.5)


def test_values_stored_elsewhere_are_paired_for_the_plane_split_loop(td):
    """The cache stores a token's value scale and zero side by side (`reference.paired`, `QuantizedTensor.paired`),
    which the plane-split loop reads as one word; values built elsewhere (separate scale and zero tensors) are
    paired by the launcher, with the same attention."""
    kv = _layer("int4:g64:r64:s4", 2, 64, [200], seed=80).packed()
    values = kv.values.quantized
    assert values.paired and values.zero.data_ptr() == values.scale.data_ptr() + 2  # one word a token
    apart = dataclasses.replace(values, scale=values.scale.contiguous(), zero=values.zero.contiguous(), paired=False)
    again = ref.paired(apart)
    assert again.paired and torch.equal(again.scale, values.scale) and torch.equal(again.zero, values.zero)
    assert ref.paired(values) is values  # already paired: no copy
    foreign = dataclasses.replace(kv, values=dataclasses.replace(kv.values, quantized=apart))
    query = torch.randn(1, 8, 1, 64, generator=torch.Generator().manual_seed(81))
    for direct in (False, True):
        got = td.past_attention(query, foreign, 0.125, direct_keys=direct)
        want = td.past_attention(query, kv, 0.125, direct_keys=direct)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_plane_split_formats_before_sm80_take_the_first_loop(td, monkeypatch):
    """Before sm_80 the key fold is not kept across tiles (`launch.fold_once`), so 8- and 4-bit formats take the
    first loop, which reads the values' paired scale and zero by their element strides: the same attention."""
    monkeypatch.setattr(td, "capability", lambda device: (7, 5))  # a T4
    for spec in ("int4:g64:r64:s4", "k8v4:g64:r64"):
        kv = _layer(spec, 2, 64, [150], seed=82).packed()
        assert launch.plane_split(kv.spec, 64) and not launch.fold_once(64, (7, 5))
        query = torch.randn(1, 6, 1, 64, generator=torch.Generator().manual_seed(83))
        want_out, want_lse = ref_attn.past_attention(query, kv, 0.125)
        out, lse = td.past_attention(query, kv, 0.125, num_splits=2, direct_keys=True)  # not taken there
        assert_out_close(out, want_out, query, kv, 0.125)
        assert_lse_close(lse, want_lse, query, kv, 0.125)


def test_direct_keys_only_where_it_compiles_without_spills():
    """Any plane-split format on one warp, 4-bit values on 4 warps; elsewhere (8-bit values on 4 warps, 8-warp
    blocks, loops other than plane-split) the call runs the staged form. Its launch: one warp on 16-token tiles
    (`launch.ONE_WARP_STAGES`) at head_dim 128, the default tile on 4 warps elsewhere; not for more query rows than decode's 16,
    nor before sm_80."""
    allowed = {
        (s, w): launch.direct_keys_allowed(parse_precision(s), 128, w)
        for s in ("int4", "k8v4", "int8", "k4v8", "int2", "fp8")
        for w in (1, 4, 8)
    }
    assert {k for k, v in allowed.items() if v} == {("int4", 4), ("k8v4", 4)} | {
        (s, 1) for s in ("int4", "k8v4", "int8", "k4v8")
    }
    config = {s: launch.direct_keys_config(parse_precision(s), 128, 16) for s in ("int4", "k8v4", "int8", "fp8")}
    assert config == {"int4": (16, 1, 3), "k8v4": (16, 1, 2), "int8": (16, 1, 2), "fp8": None}
    assert launch.direct_keys_config(parse_precision("int4"), 64, 16) == (64, 4, 3)
    assert launch.direct_keys_config(parse_precision("int8"), 64, 16) is None
    assert launch.direct_keys_config(parse_precision("int4"), 128, 32) is None
    assert launch.direct_keys_config(parse_precision("int4"), 128, 16, (7, 5)) is None


def sixteen_bit_attention(query: torch.Tensor, kv, scaling: float, dtype: torch.dtype):
    """(out, lse) of attention as a 16-bit SDPA computes it over the dequantized past: query, keys, values and
    weights rounded to `dtype`, products summed in fp32 (the path a quantized kernel replaces)."""
    keys, values = kv.dequantized()
    grp = query.shape[1] // keys.shape[1]
    k, v = (x.repeat_interleave(grp, 1).to(dtype).float() for x in (keys, values))
    scores = (query.to(dtype).float() @ k.transpose(-1, -2)) * scaling
    lse = torch.logsumexp(scores, -1)
    return torch.exp(scores - lse[..., None]).to(dtype).float() @ v, lse


@pytest.mark.parametrize(
    "spec,direct",
    [("int4", False), ("int8", False), ("k8v4", False), ("int4", True), ("int8", True), ("k8v4", True)],
)
def test_plane_split_scores_need_no_hi_lo_query(td, spec, direct):
    """The plane-split loop rounds q * (key scale) to fp16 once per tile, with no hi + lo split. Keys and queries
    with channels spanning decades (scores in the hundreds): its lse stays within `query_rounding_bound`, and
    both its outputs and its lse are closer to the fp32 reference than a bf16 SDPA over the same dequantized
    cache (the 16-bit path most models run). Measured here (fp32 reference): lse off by 0.030-0.061 and
    outputs by 0.021-0.037 (of 2.7); fp16 SDPA 0.023-0.042 and 0.037-0.040; bf16 SDPA 0.38-0.40 and 0.05-0.17."""
    kv = _layer(spec + ":g128:r128:s4", 2, 128, [700], seed=60).packed()
    query = _keys((1, 8, 1, 128), seed=61) * 0.5
    want_out, want_lse = ref_attn.past_attention(query, kv, 128**-0.5)
    out, lse = td.past_attention(query, kv, 128**-0.5, direct_keys=direct)  # direct: the direct-keys form
    assert_lse_close(lse, want_lse, query, kv, 128**-0.5)
    bf16_out, bf16_lse = sixteen_bit_attention(query, kv, 128**-0.5, torch.bfloat16)
    assert float((out - want_out).abs().max()) < float((bf16_out - want_out).abs().max())
    assert float((lse - want_lse).abs().max()) < float((bf16_lse - want_lse).abs().max())


@pytest.mark.parametrize("fmt", FORMATS)
def test_past_attention_every_format_with_split_merge(td, fmt):
    spec = {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8-e5m2"}.get(fmt, fmt) + ":g16:r16:s4"
    kv = _layer(spec, 1, 64, [71], seed=11).packed()
    query = torch.randn(1, 3, 1, 64, generator=torch.Generator().manual_seed(12))
    want_out, want_lse = ref_attn.past_attention(query, kv, 0.125)
    for splits in (1, 3, 50):  # one program, several, more than there are tiles
        out, lse = td.past_attention(query, kv, 0.125, num_splits=splits)
        assert_out_close(out, want_out, query, kv, 0.125)
        assert_lse_close(lse, want_lse, query, kv, 0.125)


def test_past_attention_mid_block_past_and_half_precision(td):
    # the past of a call whose own tokens were already flushed: Q is not a multiple of the group size
    layer = _layer("int4:g16:r16:s4", 1, 64, [40, 8], seed=13)
    kv = layer.packed(45)
    assert kv.quant_len == 45 and kv.quant_len % 16
    query = torch.randn(1, 3, 64, 2)[..., :1].transpose(-1, -2)  # [B, Hq, n, D], last-dim stride 2
    assert query.stride(-1) == 2
    assert_attention_close(td.past_attention(query, kv, 0.125)[0], ref_attn.past_attention(query, kv, 0.125)[0])
    for dtype in (torch.float16, torch.bfloat16):  # a 16-bit model's queries, sinks and residual
        half = _layer("int8:g16:r16:s4", 1, 64, [53], seed=14, dtype=dtype).packed()
        q16 = torch.randn(1, 3, 1, 64).to(dtype)
        want = ref_attn.past_attention(q16, half, 0.125)
        got = td.past_attention(q16, half, 0.125)
        assert_out_close(got[0], want[0], q16, half, 0.125)
        assert_lse_close(got[1], want[1], q16, half, 0.125)


@pytest.mark.parametrize("block_n,num_warps", [(16, 4), (64, 8), (128, 4)])
def test_past_attention_launch_settings_change_only_speed(td, block_n, num_warps):
    """Tiles of 16..128 tokens (capped by the key group) give the same attention as the reference."""
    for i, spec in enumerate(("int4:g32:r32:s4", "k8v4:g16:r16:s2:ktoken", "int8:g128:r128:s4", "full")):
        kv = _layer(spec, 2, 64, [150, 1], seed=30 + i).packed()
        query = torch.randn(1, 6, 1, 64, generator=torch.Generator().manual_seed(31 + i))
        want_out, want_lse = ref_attn.past_attention(query, kv, 0.125)
        out, lse = td.past_attention(query, kv, 0.125, num_splits=3, block_n=block_n, num_warps=num_warps)
        assert_out_close(out, want_out, query, kv, 0.125)
        assert_lse_close(lse, want_lse, query, kv, 0.125)
    with pytest.raises(ValueError, match="power of two"):
        td.past_attention(query, kv, 0.125, block_n=24)


def test_past_attention_halves_the_default_tile_where_shared_memory_is_short(td, monkeypatch):
    """A GPU with less shared memory per block than sm_90 (a T4: 64 KiB) rejects the default 64-token tile
    at launch: the call retries with 32 and remembers it for the shape; a tile the caller chose stays."""
    module = getattr(td, "_module", td)
    real = module._decode_split_kernel
    tiles = []

    class SmallSharedMemory:  # launches as on such a GPU: tiles past 32 tokens are out of resources
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                tiles.append(kwargs["BLOCK_N"])
                if kwargs["BLOCK_N"] > 32:
                    raise triton.runtime.errors.OutOfResources(74 * 1024, 64 * 1024, "shared memory")
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(module, "_decode_split_kernel", SmallSharedMemory())
    monkeypatch.setattr(module, "_FITTING_BLOCK_N", {})
    kv = _layer("int4:g128:r128:s4", 1, 64, [300], seed=41).packed()
    query = torch.randn(1, 4, 1, 64, generator=torch.Generator().manual_seed(42))
    want_out, want_lse = ref_attn.past_attention(query, kv, 0.125)
    for _ in range(2):
        out, lse = td.past_attention(query, kv, 0.125)
        assert_out_close(out, want_out, query, kv, 0.125)
        assert_lse_close(lse, want_lse, query, kv, 0.125)
    assert tiles == [64, 32, 32]  # halved once, then remembered for the shape
    with pytest.raises(triton.runtime.errors.OutOfResources):
        td.past_attention(query, kv, 0.125, block_n=64)


def test_past_attention_many_query_rows(td):
    """GQA 8 x 5 queries = 40 rows (a 64-row program); past the tile limit the reference takes over."""
    kv = _layer("int4:g32:r32:s4", 1, 64, [90], seed=40).packed()
    query = torch.randn(1, 8, 5, 64, generator=torch.Generator().manual_seed(41))
    assert launch.supports_attention(query, kv)
    want_out, want_lse = ref_attn.past_attention(query, kv, 0.125)
    out, lse = td.past_attention(query, kv, 0.125)
    assert_out_close(out, want_out, query, kv, 0.125)
    assert_lse_close(lse, want_lse, query, kv, 0.125)
    wide = _layer("int4:g32:r32:s4", 1, 128, [90], seed=42).packed()
    big = torch.randn(1, 8, 9, 128, generator=torch.Generator().manual_seed(43))  # 72 rows -> 128 x 128 > limit
    assert not launch.supports_attention(big, wide)
    handed = ref_attn.past_attention(big.to(DEVICE), _to(wide, DEVICE), 0.1)  # the reference, on the kernel's device
    torch.testing.assert_close(td.past_attention(big, wide, 0.1), tuple(t.cpu() for t in handed), rtol=0, atol=0)


@pytest.mark.parametrize(
    "spec", ["int8:g16:r16:s2", "int2:g16:r16", "fp8:g16:r16:s2", "fp8-e5m2:g16:r16", "k8v4:g16:r16:ktoken"]
)
@pytest.mark.parametrize("magnitude", [1e-3, 300.0])
def test_past_attention_tiny_and_huge_magnitudes(td, spec, magnitude):
    """Keys and values far from 1 (fp16 operands have 5 exponent bits): scores stay fp32-accurate."""
    layer = QuantizedLayer(parse_precision(spec))
    g = torch.Generator().manual_seed(50)
    k = _keys((1, 1, 70, 64), seed=51) * magnitude
    layer.update(k, torch.randn(1, 1, 70, 64, generator=g) * magnitude)
    kv = layer.packed()
    query = torch.randn(1, 3, 1, 64, generator=g) * (1.0 / magnitude if magnitude > 1 else 10.0)
    want_out, want_lse = ref_attn.past_attention(query, kv, 0.125)
    out, lse = td.past_attention(query, kv, 0.125, num_splits=2)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_out_close(out, want_out, query, kv, 0.125)
    assert_lse_close(lse, want_lse, query, kv, 0.125)


def test_past_attention_falls_back_for_masks_and_odd_head_dims(td):
    kv = _layer("int8:g16:r16:s4", 1, 64, [40], seed=15).packed()
    query = torch.randn(1, 2, 1, 64)
    mask = torch.ones(1, 1, 1, kv.length, dtype=torch.bool)
    mask[..., 10:20] = False
    torch.testing.assert_close(
        td.past_attention(query, kv, 0.125, mask), ref_attn.past_attention(query, kv, 0.125, mask)
    )
    assert not launch.supports_attention(torch.randn(1, 2, 1, 80), _layer("int8:g16:r16", 1, 80, [40], seed=1).packed())
    assert launch.supports_attention(query, kv)


# --- dispatch -------------------------------------------------------------------------------------


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU dispatch rules (TRITON_INTERPRET=1)")
def test_backend_selection(monkeypatch):
    monkeypatch.delenv(quant_backend.BACKEND_ENV, raising=False)
    assert quant_backend.backend_for("cpu") == "torch"
    assert attention.backend_for(torch.device("cpu")) == "torch"
    assert quant_backend.backend_for("cuda") == "triton"  # decided by device type; nothing runs here
    monkeypatch.setenv(quant_backend.BACKEND_ENV, "torch")
    assert quant_backend.backend_for("cuda") == "torch"
    monkeypatch.setenv(quant_backend.BACKEND_ENV, "triton")
    assert quant_backend.backend_for("cpu") == "triton"  # TRITON_INTERPRET=1 is set in this module
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        quant_backend.backend_for("cpu")
    monkeypatch.setenv(quant_backend.BACKEND_ENV, "cuda-please")
    with pytest.raises(ValueError, match="allowed: torch, triton"):
        quant_backend.backend_for("cpu")


def test_cache_and_attention_through_the_triton_backend(kernel_modules, monkeypatch):
    """QuantizedLayer's quantize-on-append and kvdemo attention's decode path, dispatched to Triton,
    give the same bytes and (within tolerance) the same attention output as the torch backend."""
    spec, grp = "k8v4:g16:r16:s4", 3
    states = [_keys((1, 2, n, 64), seed=20 + n).to(DEVICE) for n in (37, 1, 1)]
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(quant_backend.BACKEND_ENV, backend)
        layer = QuantizedLayer(parse_precision(spec))
        outs = []
        for i, k in enumerate(states):
            view, _ = layer.update(k, k.flip(-1))
            if view.past_len:
                query = torch.randn(1, 2 * grp, k.shape[-2], 64, generator=torch.Generator().manual_seed(i))
                outs.append(attention.attend(query.to(DEVICE), view, 0.125).cpu())
        runs[backend] = (layer, outs)
    (a, outs_a), (b, outs_b) = runs["torch"], runs["triton"]
    assert a.quant_len == b.quant_len == 32
    for part in ("keys", "values"):
        x, y = (getattr(layer.packed(), part).quantized for layer in (a, b))
        for name in ("codes", "scale", "zero"):
            assert torch.equal(getattr(x, name), getattr(y, name)), f"{part}.{name}"
    assert isinstance(view, CacheView) and len(outs_a) == 2
    for x, y in zip(outs_a, outs_b, strict=True):
        assert_attention_close(x, y)


@pytest.mark.model
@pytest.mark.skipif(DEVICE != "cpu", reason="the model runs on the CPU here; the GPU benchmark compares backends there")
def test_embedded_model_same_greedy_tokens_on_both_backends(lm, monkeypatch):
    """The whole model with its cache on the Triton backend (quantize-on-append and decode attention in
    every layer) generates what the PyTorch reference path generates, with logits within 1e-3 (measured
    1.1e-4 of the largest logit)."""
    from kvdemo import runner
    from kvdemo.texts import prose_ids

    ids = prose_ids(lm, 150)
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(quant_backend.BACKEND_ENV, backend)
        runs[backend] = shallow(runner.run_precision, lm, ids, "k8v4:g32:r32:s4", 6, keep_logits=True)
    torch_run, triton_run = runs["torch"], runs["triton"]
    assert len(torch_run.tokens) == 6 and triton_run.tokens == torch_run.tokens
    live = lambda run: {k: v for k, v in run.cache_bytes.items() if k != "allocated"}  # noqa: E731
    assert live(triton_run) == live(torch_run)
    # the Triton path keeps room for the whole residual window (a decode step's append never moves it)
    assert triton_run.cache_bytes["allocated"] >= torch_run.cache_bytes["allocated"]
    for a, b in zip(torch_run.logits, triton_run.logits, strict=True):
        assert float((a - b).abs().max()) < 1e-3 * max(1.0, float(a.abs().max()))


# --- GPU benchmark script, smoke mode -------------------------------------------------------------


@pytest.mark.model
@pytest.mark.skipif(DEVICE != "cpu", reason="the smoke run is the interpreter's; on a GPU the benchmark runs for real")
def test_gpu_benchmark_smoke(tmp_path):
    """Every section of bench/gpu_attention.py but the long-context one (its own test below) runs and writes
    its JSON (a slice of --smoke: the end-to-end part on the torch backend only; the interpreter needs
    minutes for 30 layers)."""
    out = tmp_path / "gpu_attention.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    env.pop("KVDEMO_BACKEND", None)
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_attention.py"), "--smoke", "--out", str(out)]
    cmd += ["--sections", "copy,quantize,decode,sweep,floors,e2e"]
    cmd += ["--contexts", "96", "--batches", "1,2", "--formats", "int4,fp8_e4m3", "--method-formats", "nuq3:o1,nvfp4"]
    cmd += ["--quant-formats", "int8,int4,fp8_e4m3", "--e2e-backends", "torch", "--e2e-precisions", "int4"]
    cmd += ["--models", "embedded,random:smollm2-135m", "--e2e-batches", "1", "--sweep", "on"]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"] is True and report["device"]["type"] == "cpu" and "errors" not in report
    assert report["copy"]["gb_s"] > 0
    assert {r["format"] for r in report["quantize"]} >= {"int8", "int4", "fp8_e4m3"}
    assert all(r["fraction_of_copy"] > 0 for r in report["quantize"])
    rows = report["decode"]
    assert rows and all(r["triton_us"] > 0 and r["sdpa_us"] > 0 and r["speedup"] > 0 for r in rows)
    assert len(rows) == 6 and all(r["max_err_vs_reference"] < 2e-3 for r in rows)  # the stated bound
    # the methods' formats at the first point only (the goal point in a full run), read by the kernel itself
    assert [(r["batch"], r["precision"]) for r in rows if r["format"] in ("nuq3:o1", "nvfp4")] == [
        (1, "nuq3:o1:g32:r32"),
        (1, "nvfp4:g32:r32"),
    ]
    assert all(r["kernel"] for r in rows)
    # graph timing falls back to the eager time on the CPU, and says why
    assert all(r["triton_graph_us"] == r["triton_us"] and r["speedup_graph"] == r["speedup"] for r in rows)
    assert all(r["triton_graph_fallback"].startswith("no CUDA device") for r in rows)
    assert all(r["bit_identical_to_reference"] for r in report["quantize"])
    assert all(1.0 < r["memory_bound_limit"] < 4.0 for r in rows)
    sweep = report["sweep"]
    assert len(sweep) == 6 and {r["format"] for r in sweep} == {"int4", "int8"} and all(r["us"] > 0 for r in sweep)
    assert {r["programs_per_sm"] for r in sweep} == {4, 16}  # the default split and a swept one
    assert all(r["sdpa_graph_fallback"] and r["triton_graph_us"] == r["us"] for r in sweep)
    embedded, random = report["e2e"]
    assert embedded["source"] == "embedded" and random["source"] == "random:smollm2-135m"
    assert "random weights" in random["model"] and random["prompt_tokens"] == 48
    for e2e in (embedded, random):
        assert e2e["backend"] == "torch" and e2e["new_tokens"] == 2 and e2e["decode_tok_s"] > 0
    assert all(g["met"] is None for g in report["goals"].values())  # never judged from a smoke run
    floors = {f["format"]: f for f in report["floors"]}  # compiled for sm_90 here, as on the device
    assert {"k:int4 v:int4", "k:int8 v:int8"} <= set(floors)
    assert all(0 < f["memory_ms"] < f["sdpa_memory_ms"] and f["issue_ms"] > 0 for f in floors.values())
    int4 = report["goals"]["int4_speedup_64k_b8"]
    assert int4["floors_ms"]["issue_ms"] == floors["k:int4 v:int4"]["issue_ms"]
    assert "measured_over_issue_floor" not in int4  # smoke times measure nothing


def test_gpu_benchmark_times_the_direct_keys_form(tmp_path):
    """Where the plane-split loop runs (values in one group of head_dim channels, as the GPU run's defaults give
    them), decode and the sweep time its direct-keys form beside the default one, within the stated bound."""
    out = tmp_path / "gpu_attention.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    env.pop("KVDEMO_BACKEND", None)
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_attention.py"), "--smoke", "--out", str(out)]
    cmd += ["--sections", "decode,sweep", "--contexts", "160", "--batches", "1", "--formats", "int4,k8v4"]
    cmd += ["--method-formats", "", "--group", "64", "--residual", "64", "--sweep", "on"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "errors" not in report
    forms = [(r["format"], r.get("variant")) for r in report["decode"]]
    assert forms == [("int4", None), ("int4", "direct keys"), ("k8v4", None), ("k8v4", "direct keys")]
    assert all(r["kernel"] and r["max_err_vs_reference"] < 2e-3 for r in report["decode"])
    direct = [r for r in report["sweep"] if r["direct_keys"]]
    assert [r["format"] for r in direct] == ["int4"] and not direct[0]["default"]  # int8's values are 8-bit


def _gpu_bench(name: str = "gpu_attention"):
    """bench/<name>.py as a module (gpu_attention, or its sections' files gpu_long_context, gpu_e2e)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_gpu_benchmark_embedded_stand_in(monkeypatch):
    """Where the embedded model is not installed (the device machine), its shapes run with random weights."""
    from kvdemo import models

    bench = _gpu_bench("gpu_e2e")

    def missing():
        raise models.ModelLoadError("the embedded model is missing")

    monkeypatch.setattr(models, "embedded_gguf", missing)
    lm, ids = bench.e2e_model_and_prompt("embedded", torch.device("cpu"), 24, 2)
    assert lm.source == "random:smollm2-135m" and "random weights" in lm.name
    assert lm.model.config.num_hidden_layers == 30 and lm.model.config.num_key_value_heads == 3
    assert len(ids) == 24


@pytest.mark.model
@pytest.mark.skipif(DEVICE != "cpu", reason="the smoke run is the interpreter's; on a GPU the benchmark runs for real")
def test_gpu_benchmark_long_context_smoke(tmp_path):
    """The long-context section (--smoke: kvdemo.measured's small model at 2304 tokens, int4 and full, its first
    layer at 4096 tokens, and one row through the Triton query tiles under the interpreter) writes rows
    with their peak memory split, the formula's cache bytes beside the measured ones, and what ran over
    the packed past."""
    out = tmp_path / "gpu_long.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    env.pop("KVDEMO_BACKEND", None)
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_attention.py"), "--smoke", "--sections", "long", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "errors" not in report and list(report["section_s"]) == ["long"]
    assert _gpu_bench().SECTIONS[-1] == "long"  # after the goal-point sections
    rows = report["long"]
    assert [(r["tokens"], r["precision"], r["layers"]) for r in rows] == [
        (2304, "int4:g32:r32", 2),
        (2304, "full", 2),
        (4096, "int4:g32:r32", 1),
        (2065, "int4:g32:r32", 1),
    ]
    for r in rows:
        assert "skipped" not in r and "error" not in r, r
        # one worker runs every row: freed buffers must leave the heap, or a later row's peak reuses them
        assert r["peak_measured_by"].endswith("MALLOC_MMAP_THRESHOLD_=131072"), r["peak_measured_by"]
        assert r["peak_bytes"] > r["weights_bytes"] > 0 and r["cache_bytes"] > 0 and r["prefill_s"] > 0
        assert r["peak_bytes"] == r["weights_bytes"] + r["cache_bytes"] + r["workspace_bytes"]
        assert 1.0 <= r["cache_vs_formula"] <= 1.1  # allocated: the live bytes (the formula) + growth spare
        coded = r["bytes_per_token_formula"] * r["tokens"]  # the bytes/token rate at every position
        if r["regions"]["residual"] and r["precision"] != "full":  # residual tokens at full precision: more
            assert r["cache_bytes_formula"] > coded
        else:
            assert r["cache_bytes_formula"] == round(coded)
        assert 0 < r["past_attention_s"] <= r["prefill_s"]
        chunks = -(-r["tokens"] // r["chunk"])
        assert r["long_past_calls"] == r["layers"] * (chunks - 1)  # every chunk after the first, every layer
    int4, full, longest, tiles = rows
    assert int4["workspace_bytes"] > 0  # the first row: a fresh process
    assert int4["cache_bytes_formula"] * 6 < full["cache_bytes_formula"]  # 5 bits vs fp32 (the CPU dtype)
    assert 0 < longest["estimated_s"] and "its first 1 of 2 layers" in longest["model"]
    for r in (int4, full, longest):  # the CPU path: the streamed reference over the past
        assert r["backend"] == "torch" and r["reference_streamed_calls"] == r["long_past_calls"]
    # the GPU path: one chunk of 17 queries, Llama-8B groups of 4 -> tiles of 16 rows and 1 row
    assert tiles["backend"] == "triton" and tiles["check"] == "triton query tiles"
    assert tiles["triton_calls"] == 2 and tiles["reference_streamed_calls"] == tiles["reference_calls"] == 0


def test_gpu_benchmark_long_context_budget(monkeypatch):
    """The long section's time budget: a row that runs past it is stopped and recorded, a row that would not
    fit is skipped with its estimate, the max row gets fewer layers when time is short."""
    bench, long = _gpu_bench(), _gpu_bench("gpu_long_context")
    ref = {"tokens": 131072, "layers": 32, "prefill_s": 40.0, "past_attention_s": 30.0}
    # per layer at 1M: (30 s x 8^2 + 10 s x 8) / 32 = 62.5 s
    assert long.max_row_layers(ref, 1 << 20, 2, left_s=300, fixed_s=10) == (2, 135.0)
    assert long.max_row_layers(ref, 1 << 20, 2, left_s=100, fixed_s=10) == (1, 72.5)
    assert long.max_row_layers(ref, 1 << 20, 2, left_s=60, fixed_s=10) == (0, 72.5)

    class Worker:  # the int4 context row as measured above, the full one never answers
        def __init__(self):
            self.jobs = []

        def ended(self):
            return False

        def run(self, job, timeout_s):
            self.jobs.append(job)
            return ref | {"warmup_s": 1.0, "load_s": 9.0} if job["precision"].startswith("int4") else None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(long, "LongWorker", Worker)
    seen = []
    rows = long.bench_long(torch.device("cpu"), bench.parse_args(["--long-budget-s", "60"]), float("inf"), seen.append)
    assert len(seen) == 3 and seen[-1] is rows
    int4, full, longest = rows
    assert int4["prefill_s"] == 40.0 and int4["precision"] == "int4:g128:r128" and int4["tokens"] == 131072
    assert full["precision"] == "full" and full["skipped"].startswith("time budget: stopped after")
    assert longest["tokens"] == 1 << 20 and longest["skipped"].startswith("time budget: one layer estimated at 72 s")
    assert longest["estimated_s"] == 72.5 and longest["layers"] == 1
    # 40 s left after the int4 row: the full row (estimated as the int4 one, 41 s) is not started
    _, full, _ = long.bench_long(torch.device("cpu"), bench.parse_args(["--long-budget-s", "40"]), float("inf"))
    assert full["skipped"].startswith("time budget: estimated 41 s as the row above")
    # the section also ends by the deadline it is given (device_check.sh: before its timeout)
    rows = long.bench_long(torch.device("cpu"), bench.parse_args([]), time.perf_counter() - 1)
    assert all(r["skipped"] == "time budget: none left" for r in rows[:2])
