"""Triton kernels that quantize and pack K/V on append: twins of `reference.quantize` (same signatures,
same storage layout, the same bytes; see the reference's docstring).

- `quantize(x, fmt, axis, group) -> QuantizedTensor` and `quantize_into(...)` (writes codes and
  fp16 scale/zero into given tensors, in place, any strides). int8/int4/int2 asymmetric and fp8
  e4m3/e5m2 with scales; keys per channel (groups of `group` tokens) or per token, values per token,
  on `_quantize_kernel`.
  The codes are bit-identical to the reference: divisions use `div_rn` (IEEE, as torch on CPU),
  rounding is half-to-even, and fp8 codes are built with integer ops that replicate
  `c10::Float8_e4m3fn` / `Float8_e5m2` round-to-nearest-even (`kvdemo.quant.triton_codes`; Triton's
  interpreter rounds fp8 casts differently from the hardware, so no float8 cast is used).
- `quantize(x, fmt, axis, group, **methods)` takes reference.quantize's keywords too: int3 and nuq4/3/2
  (bit-sliced 3-bit rows; nearest fp16 level by the reference's fp32 midpoints), sparse outliers (up to
  MAX_OUTLIERS per token) on those and on int8/4/2, and nvfp4 (E4M3 scale bytes and fp32 tensor scales
  per block from `start`) run on two more kernels (`_quantize_methods_kernel`, `_quantize_nvfp4_kernel`);
  a Hadamard rotation and pre-RoPE keys are applied first by the wrapper with the reference's torch ops.
  Their bytes are the reference's too (codes, scales, zeros, tensor scales, outlier deltas and indices),
  with one documented exception: outliers are picked highest score first, ties to the lowest channel,
  where torch.topk on CPU breaks ties in an implementation-defined order (a constant token, two equal
  magnitudes); then the indices (and, when the tied elements differ, the ranges and codes) may differ.
  The key picks' per-channel mean and std replicate torch 2.13's CPU arithmetic (its cascade sum order,
  a Welford std in fp64; `_column_mean_std`), so even constant channels, whose torch mean can miss the
  constant by an ulp (then score |x - mean| / 1e-12), are picked as the reference picks them; another
  torch build or a CUDA reference may sum in another order. `supports_quantize_methods` says what runs
  here; fp8 with methods and the rest go to the reference.

Tensors are CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (the tests). Head dims are
powers of two from 16 to 256 (`supports_quantize` and `supports_quantize_methods` say so; the
dispatcher in `kvdemo.quant` sends anything else to the reference). The interpreter misses what only
the GPU compiler sees (register spills, shared memory, unsupported ops): `bench/compile_sm90.py`
compiles every variant for sm_90 on a CPU and reports them; tests keep them compiling without spills.
References: KIVI (arXiv 2402.02750), KVQuant (arXiv 2401.18079).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import formats
from ..precision import outlier_cap
from . import reference
from .reference import MIN_SCALE, QuantizedTensor
from .triton_codes import (
    _FP8_UNIT,
    _FP16_MAX,
    MAX_OUTLIERS,
    _code_value,
    _fp8_decode,
    _fp8_encode,
    _pow2,
    _round_half_even,
    cdiv,
)

QUANT_TILE = 4096  # elements per quantize program (registers: ~32 fp32 values per thread at 4 warps)
_MIN_SCALE = tl.constexpr(MIN_SCALE)  # globals read inside kernels must be constexpr


def _plain(fmt: str) -> bool:
    """A format the plain quantize kernel codes (its registry entry lists the "quantize" kernel)."""
    return "quantize" in formats.get(fmt).kernels


def supports_quantize(fmt: str, head_dim: int) -> bool:
    """Plain formats and head dims the plain quantize kernel handles (`quantize_into` too); calls with methods
    or other formats: `supports_quantize_methods`; the rest goes to the reference."""
    return _plain(fmt) and _pow2(head_dim) and 16 <= head_dim <= 256


@triton.jit
def _quantize_tile(x, RED: tl.constexpr, BITS: tl.constexpr, FP8: tl.constexpr):
    """x fp32 tile, groups along axis RED -> (codes int32, scale fp32, zero fp32), as reference.quantize."""
    x = tl.where(x != x, 0.0, x)  # nan -> 0, +-inf and beyond -> +-FP16_MAX
    x = tl.minimum(tl.maximum(x, -_FP16_MAX), _FP16_MAX)
    if FP8 == 0:
        levels: tl.constexpr = (1 << BITS) - 1
        lo = tl.min(x, axis=RED).to(tl.float16).to(tl.float32)
        hi = tl.max(x, axis=RED)
        scale = tl.math.div_rn(hi - lo, levels * 1.0)
        scale = tl.minimum(tl.maximum(scale, _MIN_SCALE), _FP16_MAX).to(tl.float16).to(tl.float32)
        y = tl.math.div_rn(x - tl.expand_dims(lo, RED), tl.expand_dims(scale, RED))
        y = tl.minimum(tl.maximum(y, 0.0), levels * 1.0)  # clamp then round == round then clamp
        codes = _round_half_even(y).to(tl.int32)
        return codes, scale, lo
    fmax: tl.constexpr = 448.0 if FP8 == 1 else 57344.0
    amax = tl.max(tl.abs(x), axis=RED)
    scale = tl.maximum(tl.math.div_rn(amax, fmax), _MIN_SCALE).to(tl.float16).to(tl.float32)
    y = tl.math.div_rn(x, tl.expand_dims(scale, RED))
    y = tl.minimum(tl.maximum(y, -fmax), fmax)
    return _fp8_encode(y, FP8), scale, scale


# --- quantize and pack --------------------------------------------------------------------------


@triton.jit
def _quantize_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    H,
    T,
    sx_b,
    sx_h,
    sx_t,
    sx_d,
    sc_b,
    sc_h,
    sc_t,
    ss_b,
    ss_h,
    ss_t,
    sz_b,
    sz_h,
    sz_t,
    D: tl.constexpr,
    BITS: tl.constexpr,
    FP8: tl.constexpr,
    CHANNEL: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """One program: one (batch, head) and a tile of tokens. Writes packed codes [.., T, D/P] and scales.

    CHANNEL: a block of GROUP tokens x BLOCK_J byte columns (x all P planes); stats over tokens.
    token axis: BLOCK_T tokens x all D channels, stats over GROUP consecutive channels.
    """
    P: tl.constexpr = 8 // BITS
    DP: tl.constexpr = D // P
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    x_base = x_ptr + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h
    c_base = codes_ptr + b.to(tl.int64) * sc_b + h.to(tl.int64) * sc_h
    s_base = scale_ptr + b.to(tl.int64) * ss_b + h.to(tl.int64) * ss_h
    z_base = zero_ptr + b.to(tl.int64) * sz_b + h.to(tl.int64) * sz_h
    if CHANNEL:
        blk = tl.program_id(1)
        t = (blk * GROUP + tl.arange(0, GROUP)).to(tl.int64)  # [G]
        p = tl.arange(0, P)  # [P]
        j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)  # [J]
        ch = p[:, None] * DP + j[None, :]  # [P, J]: plane p holds channels p*DP + j
        x = tl.load(x_base + t[:, None, None] * sx_t + ch[None, :, :] * sx_d).to(tl.float32)  # [G, P, J]
        codes, scale, zero = _quantize_tile(x, 0, BITS, FP8)  # [G, P, J], [P, J], [P, J]
        packed = tl.sum(codes << (p * BITS)[None, :, None], axis=1).to(tl.uint8)  # [G, J]
        tl.store(c_base + t[:, None] * sc_t + j[None, :], packed)
        tl.store(s_base + blk * ss_t + ch, scale.to(tl.float16))
        if FP8 == 0:
            tl.store(z_base + blk * sz_t + ch, zero.to(tl.float16))
    else:
        NG: tl.constexpr = D // GROUP
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
        tmask = t < T
        t64 = t.to(tl.int64)
        g = tl.arange(0, NG)[None, :, None]
        k = tl.arange(0, GROUP)[None, None, :]
        x = tl.load(
            x_base + t64[:, None, None] * sx_t + (g * GROUP + k) * sx_d, mask=tmask[:, None, None], other=0.0
        ).to(tl.float32)  # [BT, NG, GROUP]
        codes, scale, zero = _quantize_tile(x, 2, BITS, FP8)  # [BT, NG, GROUP], [BT, NG], [BT, NG]
        planes = tl.reshape(codes, (BLOCK_T, P, DP))  # channel c = p * DP + j
        p = tl.arange(0, P)[None, :, None]
        packed = tl.sum(planes << (p * BITS), axis=1).to(tl.uint8)  # [BT, DP]
        jj = tl.arange(0, DP)[None, :]
        tl.store(c_base + t64[:, None] * sc_t + jj, packed, mask=tmask[:, None])
        gg = tl.arange(0, NG)[None, :]
        tl.store(s_base + t64[:, None] * ss_t + gg, scale.to(tl.float16), mask=tmask[:, None])
        if FP8 == 0:
            tl.store(z_base + t64[:, None] * sz_t + gg, zero.to(tl.float16), mask=tmask[:, None])


def _meta_shape(x: torch.Tensor, axis: str, group: int) -> tuple[int, int, int, int]:
    b, h, t, d = x.shape
    return (b, h, t // group, d) if axis == "channel" else (b, h, t, d // group)


def _check_quantize(x: torch.Tensor, fmt: str, axis: str, group: int) -> None:
    if x.dim() != 4:
        raise ValueError(f"expected [B, H, T, D], got shape {tuple(x.shape)}")
    if not supports_quantize(fmt, x.shape[-1]):
        raise ValueError(
            f"the Triton quantizer takes int8/int4/int2/fp8_e4m3/fp8_e5m2 and head_dim 16..256 (2^k), got {fmt!r}, {x.shape[-1]}"
        )
    if not _pow2(group):
        raise ValueError(f"group size {group} must be a power of two")
    if axis == "channel" and x.shape[-2] % group:
        raise ValueError(f"{x.shape[-2]} tokens is not a whole number of {group}-token groups")
    if axis == "token" and x.shape[-1] % group:
        raise ValueError(f"head_dim {x.shape[-1]} is not a multiple of group size {group}")
    if axis not in ("channel", "token"):
        raise ValueError(f"axis {axis!r}; allowed: channel, token")


def quantize_into(
    x: torch.Tensor,
    fmt: str,
    axis: str,
    group: int,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
) -> None:
    """Quantize x [B, H, T, D] (any float dtype, any strides) into existing tensors, in place.

    codes: uint8 [B, H, T, D // P]; scale (and zero, None for fp8): fp16 [B, H, T // G, D] for
    axis="channel" or [B, H, T, D // G] for axis="token". Last dims contiguous; other strides free
    (e.g. `narrow()` views of a preallocated cache buffer).
    """
    _check_quantize(x, fmt, axis, group)
    b, h, t, d = x.shape
    bits, fp8 = formats.get(fmt).bits, formats.get(fmt).fp8_code
    want_codes, want_meta = (b, h, t, d * bits // 8), _meta_shape(x, axis, group)
    if tuple(codes.shape) != want_codes or codes.dtype != torch.uint8 or codes.stride(-1) != 1:
        raise ValueError(f"codes must be uint8 {want_codes} with a contiguous last dim")
    metas = [scale] if fp8 else [scale, zero]
    for m in metas:
        if m is None or tuple(m.shape) != want_meta or m.dtype != torch.float16 or m.stride(-1) != 1:
            raise ValueError(f"scale/zero must be fp16 {want_meta} with a contiguous last dim")
    if t == 0 or b * h == 0:
        return
    zero = scale if zero is None else zero
    if axis == "channel":
        dp = d * bits // 8
        block_j = max(1, min(dp, QUANT_TILE // (group * (8 // bits))))
        grid = (b * h, t // group, dp // block_j)
        block_t = group
    else:
        block_t = max(1, QUANT_TILE // d)
        block_j = 1
        grid = (b * h, cdiv(t, block_t))
    _quantize_kernel[grid](
        x,
        codes,
        scale,
        zero,
        h,
        t,
        *x.stride(),
        *codes.stride()[:3],
        *scale.stride()[:3],
        *zero.stride()[:3],
        D=d,
        BITS=bits,
        FP8=fp8,
        CHANNEL=axis == "channel",
        GROUP=group,
        BLOCK_T=block_t,
        BLOCK_J=block_j,
        num_warps=4,
    )


def quantize(x: torch.Tensor, fmt: str, axis: str, group: int, **methods) -> QuantizedTensor:
    """x [B, H, T, D] float -> QuantizedTensor, the same bytes as `reference.quantize`. `methods`:
    reference.quantize's keywords (levels, outliers, rotation, rope, start, block); a call with any of them,
    or a format beyond the plain ones, runs the method kernels (`supports_quantize_methods` says which)."""
    plain = not methods.get("outliers") and all(methods.get(k) is None for k in ("levels", "rotation", "rope"))
    if not (plain and _plain(fmt)):
        if x.dim() != 4:
            raise ValueError(f"expected [B, H, T, D], got shape {tuple(x.shape)}")
        if not supports_quantize_methods(fmt, axis, group, x.shape[-1], **methods):
            raise ValueError(
                f"the Triton quantizer does not take {fmt!r}, axis {axis}, group {group}, head_dim {x.shape[-1]}, {methods}"
            )
        full = {"levels": None, "outliers": 0.0, "rotation": None, "rope": None, "start": 0, "block": 0} | methods
        return _quantize_methods(x, fmt, axis, group, **full)
    _check_quantize(x, fmt, axis, group)
    b, h, t, d = x.shape
    codes = torch.empty((b, h, t, formats.get(fmt).packed_width(d)), dtype=torch.uint8, device=x.device)
    scale = torch.empty(_meta_shape(x, axis, group), dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale) if formats.get(fmt).has_zero(axis) else None
    quantize_into(x, fmt, axis, group, codes, scale, zero)
    return QuantizedTensor(codes, scale, zero, fmt, axis, group, d)


# --- quantize with the methods beyond uniform codes -------------------------------------------------
# Separate kernels (the plain kernel above is unchanged): int3 / nuq bit-sliced or planar codes with sparse
# outliers (`_quantize_methods_kernel`), nvfp4 (`_quantize_nvfp4_kernel`). A rotation and pre-RoPE keys are
# applied by the wrapper with the reference's own torch ops, so the kernels see the same fp32 tensor.
# Both run with enable_fp_fusion=False: `a * b + c` (the dequantized value behind an outlier's correction)
# stays two roundings, as in torch, instead of one fma.

OUTLIER_GROUPS = (16, 32, 64, 128, 256)  # key blocks whose channel mean follows torch's summation order


@triton.jit
def _clean(x, CLEAN: tl.constexpr):
    """reference.quantize's input clean-up (nan -> 0, clamp to the fp16 range); CLEAN off: x as given (turned
    by the wrapper after its clean-up, which the reference does not clamp again)."""
    if CLEAN:
        x = tl.where(x != x, 0.0, x)
        x = tl.minimum(tl.maximum(x, -_FP16_MAX), _FP16_MAX)
    return x


@triton.jit
def _column_mean_std(
    x_base, t0, sx_t, sx_d, ROWS: tl.constexpr, D: tl.constexpr, ILP: tl.constexpr, CLEAN: tl.constexpr
):
    """Mean and unbiased std of each channel over rows [t0, t0 + ROWS), fp32 [D] each, in torch's CPU arithmetic
    (reference.outlier_picks: g.mean(-2), g.std(-2)): the mean sums steps of ILP rows (into ILP accumulators,
    added in order at the end) in fp32, 16 steps per chunk in order, the chunk sums in order, then divides by
    ROWS (torch 2.13's cascade sum: ILP 1 for head_dim >= 32, 4 at head_dim 16); the std is Welford's in fp64,
    rounded to fp32 (a two-pass fp64 std rounds the same, as measured)."""
    offs_d = tl.arange(0, D)
    lane = tl.arange(0, ILP)
    total = tl.zeros([ILP, D], dtype=tl.float32)
    for c in range(0, ROWS // ILP, 16):
        chunk = tl.zeros([ILP, D], dtype=tl.float32)
        for r in tl.static_range(16):
            rows = (c + r) * ILP + lane  # [ILP]
            ok = rows < ROWS
            ptrs = x_base + (t0 + rows).to(tl.int64)[:, None] * sx_t + offs_d[None, :] * sx_d
            chunk += _clean(tl.load(ptrs, mask=ok[:, None], other=0.0).to(tl.float32), CLEAN)  # + 0: exact
        total += chunk
    s = tl.sum(tl.where(lane[:, None] == 0, total, 0.0), axis=0)  # [D]: accumulator 0 (a one-term sum)
    for i in tl.static_range(1, ILP):
        s += tl.sum(tl.where(lane[:, None] == i, total, 0.0), axis=0)
    mean = tl.math.div_rn(s, ROWS * 1.0)
    m = tl.zeros([D], dtype=tl.float64)
    m2 = tl.zeros([D], dtype=tl.float64)
    for i in range(ROWS):  # torch's WelfordOps.reduce, one row at a time
        v = _clean(tl.load(x_base + (t0 + i).to(tl.int64) * sx_t + offs_d * sx_d).to(tl.float32), CLEAN)
        delta = v.to(tl.float64) - m
        m = m + delta / (i + 1.0)
        m2 = m2 + delta * (v.to(tl.float64) - m)
    return mean, tl.sqrt(m2 / (ROWS - 1.0)).to(tl.float32)  # fp64 sqrt is correctly rounded


@triton.jit
def _store_packed(codes, row_ptrs, ok, BITS: tl.constexpr, R: tl.constexpr, D: tl.constexpr):
    """int32 codes [R, D] -> packed rows at row_ptrs [R, 1] (reference.pack): planar P = 8 / BITS codes per
    byte, or at 3 bits three 1-bit planes of D/8 bytes (plane j: bit j; byte i: channels p * D/8 + i at bit p)."""
    if BITS == 3:
        DP: tl.constexpr = D // 8
        cols = tl.arange(0, DP)[None, :]
        shift = tl.arange(0, 8)[None, :, None]
        for j in tl.static_range(3):
            bit = tl.reshape((codes >> j) & 1, (R, 8, DP))  # [R, 8 (p), DP]
            tl.store(row_ptrs + j * DP + cols, tl.sum(bit << shift, axis=1).to(tl.uint8), mask=ok[:, None])
    else:
        P: tl.constexpr = 8 // BITS
        DP: tl.constexpr = D // P
        planes = tl.reshape(codes, (R, P, DP))  # channel p * DP + i
        packed = tl.sum(planes << (tl.arange(0, P) * BITS)[None, :, None], axis=1)  # [R, DP]
        tl.store(row_ptrs + tl.arange(0, DP)[None, :], packed.to(tl.uint8), mask=ok[:, None])


@triton.jit
def _group_ranges(x, picked, RED: tl.constexpr, CAP: tl.constexpr):
    """reference._ranges: (lo, hi) of each group (reduced along RED) over its elements not `picked`; a group
    with every element picked keeps its whole range."""
    lo = tl.min(tl.where(picked, float("inf"), x), axis=RED)
    hi = tl.max(tl.where(picked, float("-inf"), x), axis=RED)
    empty = lo == float("inf")
    return tl.where(empty, tl.min(x, axis=RED), lo), tl.where(empty, tl.max(x, axis=RED), hi)


@triton.jit
def _method_codes(x, lo, hi, RED: tl.constexpr, BITS: tl.constexpr, CODE: tl.constexpr, ZERO: tl.constexpr, mids_ptr):
    """x fp32 (groups along RED, their lo / hi) -> (codes int32, scale fp32, zero fp32), as reference.quantize:
    CODE 0 uniform asymmetric integers; 1 nuq (ZERO: zero = (max + min) / 2, scale = the larger half-range
    after zero's fp16 rounding; else scale = absmax) with the nearest level: the count of the fp32 midpoints
    of the fp16 levels (mids_ptr) below the normalized value (torch.bucketize, right=False)."""
    if CODE == 0:
        top: tl.constexpr = (1 << BITS) - 1
        zero = lo.to(tl.float16).to(tl.float32)
        scale = tl.math.div_rn(hi - zero, top * 1.0)
        scale = tl.minimum(tl.maximum(scale, _MIN_SCALE), _FP16_MAX).to(tl.float16).to(tl.float32)
        y = tl.math.div_rn(x - tl.expand_dims(zero, RED), tl.expand_dims(scale, RED))
        codes = _round_half_even(tl.minimum(tl.maximum(y, 0.0), top * 1.0)).to(tl.int32)  # clamp, round: as torch
        return codes, scale, zero
    if ZERO:
        zero = tl.math.div_rn(hi + lo, 2.0)
        zero = tl.minimum(tl.maximum(zero, -_FP16_MAX), _FP16_MAX).to(tl.float16).to(tl.float32)
        half = tl.maximum(hi - zero, zero - lo)
        norm_x = x - tl.expand_dims(zero, RED)
    else:
        zero = lo  # unused: no zero point
        half = tl.maximum(tl.abs(hi), tl.abs(lo))
        norm_x = x
    scale = tl.minimum(tl.maximum(half, _MIN_SCALE), _FP16_MAX).to(tl.float16).to(tl.float32)
    norm = tl.math.div_rn(norm_x, tl.expand_dims(scale, RED))
    norm = tl.minimum(tl.maximum(norm, -1.0), 1.0)
    codes = tl.zeros(norm.shape, dtype=tl.int32)
    for j in tl.static_range((1 << BITS) - 1):
        codes += (norm > tl.load(mids_ptr + j)).to(tl.int32)
    return codes, scale, zero


@triton.jit
def _outlier_rank(score, CAP: tl.constexpr, R: tl.constexpr, D: tl.constexpr):
    """The CAP highest scores (>= 0) of each row of score [R, D] (ties: the lowest channel first) as a rank tile
    int32 [R, D]: k at the k-th pick's channel, -1 elsewhere (reference.outlier_picks' topk order)."""
    offs_d = tl.arange(0, D)
    rank = tl.full([R, D], -1, dtype=tl.int32)
    for k in tl.static_range(CAP):
        best = tl.max(score, axis=1)  # [R]
        idx = tl.min(tl.where(score == best[:, None], offs_d[None, :], D), axis=1)
        hit = offs_d[None, :] == idx[:, None]
        rank = tl.where(hit, k, rank)
        score = tl.where(hit, -1.0, score)
    return rank


@triton.jit
def _store_outliers(x, dense, rank, row, ok, delta_ptr, index_ptr, CAP: tl.constexpr, D: tl.constexpr):
    """Corrections fp16(x - dense) [R, D] at the picks of `rank` -> delta fp16 / index uint8 rows [R, CAP],
    by one-term integer sums (the pick's channel, its delta's bits: exact, -0.0 kept)."""
    offs_d = tl.arange(0, D)
    bits = (x - dense).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)  # [R, D]
    for k in tl.static_range(CAP):
        at = rank == k
        idx = tl.sum(tl.where(at, offs_d[None, :], 0), axis=1)  # [R]
        delta = tl.sum(tl.where(at, bits, 0), axis=1).to(tl.int16).to(tl.float16, bitcast=True)
        tl.store(index_ptr + row * CAP + k, idx.to(tl.uint8), mask=ok)
        tl.store(delta_ptr + row * CAP + k, delta, mask=ok)


@triton.jit
def _dense_values(codes, scale, zero, BITS: tl.constexpr, CODE: tl.constexpr, ZERO: tl.constexpr, levels_ptr):
    """reference.scaled_codes on a tile: code value (integer, or fp16 level) * scale (+ zero), fp32, two roundings."""
    if CODE == 0:
        value = codes.to(tl.float32)
    else:
        value = _code_value(codes, 1, BITS, levels_ptr).to(tl.float32)
    dense = value * scale
    if ZERO:
        dense = dense + zero
    return dense


@triton.jit
def _quantize_methods_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    levels_ptr,
    mids_ptr,
    delta_ptr,
    index_ptr,
    H,
    T,
    sx_b,
    sx_h,
    sx_t,
    sx_d,
    D: tl.constexpr,
    BITS: tl.constexpr,
    CODE: tl.constexpr,
    CHANNEL: tl.constexpr,
    GROUP: tl.constexpr,
    CAP: tl.constexpr,
    CLEAN: tl.constexpr,
    ILP: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One program: one (batch, head) and whole rows of x (outliers are picked per token over all D channels):
    a key block of GROUP tokens (CHANNEL: groups are channels over the block; with outliers read BLOCK_T rows
    at a time, twice: picks and ranges, then codes), or BLOCK_T tokens (groups of GROUP channels).
    Outputs are contiguous: codes [B, H, T, D * BITS / 8]; scale / zero [B, H, T / GROUP, D] (CHANNEL) or
    [B, H, T, D / GROUP]; delta fp16 / index uint8 [B, H, T, CAP].
    CODE: 0 uniform integers, 1 nuq (levels_ptr: fp16 levels, mids_ptr: fp32 midpoints). CAP: outliers per
    token, picked like reference.outlier_picks (keys by |x - mean| / (std + 1e-12) per channel over the block,
    values by |x|), the highest first, ties to the lowest channel (`_outlier_rank`)."""
    W: tl.constexpr = D * BITS // 8
    NG: tl.constexpr = D // GROUP
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, BLOCK_T)
    x_base = x_ptr + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h
    if CHANNEL:
        t0 = tl.program_id(1) * GROUP
        meta = (pid_bh.to(tl.int64) * (T // GROUP) + tl.program_id(1)) * D + offs_d  # [D]
        if CAP == 0:  # the block in one tile [GROUP, D]
            t = t0 + tl.arange(0, GROUP)
            x = tl.load(x_base + t.to(tl.int64)[:, None] * sx_t + offs_d[None, :] * sx_d).to(tl.float32)
            x = _clean(x, CLEAN)
            lo, hi = tl.min(x, axis=0), tl.max(x, axis=0)
            codes, scale, zero = _method_codes(x, lo, hi, 0, BITS, CODE, True, mids_ptr)
            _store_packed(codes, codes_ptr + (pid_bh.to(tl.int64) * T + t)[:, None] * W, t < T, BITS, GROUP, D)
        else:
            mean, std = _column_mean_std(x_base, t0, sx_t, sx_d, GROUP, D, ILP, CLEAN)
            inf = tl.full([D], float("inf"), dtype=tl.float32)
            lo, hi, lo_all, hi_all = inf, -inf, inf, -inf
            for c in range(0, GROUP, BLOCK_T):  # pass 1: picks, ranges over the rest (and over all)
                t = t0 + c + offs_t
                x = tl.load(x_base + t.to(tl.int64)[:, None] * sx_t + offs_d[None, :] * sx_d).to(tl.float32)
                x = _clean(x, CLEAN)
                score = tl.math.div_rn(tl.abs(x - mean[None, :]), (std + 1e-12)[None, :])
                picked = _outlier_rank(score, CAP, BLOCK_T, D) >= 0
                lo = tl.minimum(lo, tl.min(tl.where(picked, float("inf"), x), axis=0))
                hi = tl.maximum(hi, tl.max(tl.where(picked, float("-inf"), x), axis=0))
                lo_all, hi_all = tl.minimum(lo_all, tl.min(x, axis=0)), tl.maximum(hi_all, tl.max(x, axis=0))
            empty = lo == float("inf")  # every element picked: the whole range (reference._ranges)
            lo, hi = tl.where(empty, lo_all, lo), tl.where(empty, hi_all, hi)
            lo_codes, scale, zero = _method_codes(lo[None, :], lo, hi, 0, BITS, CODE, True, mids_ptr)  # metadata
            for c in range(0, GROUP, BLOCK_T):  # pass 2: the same picks again, codes, corrections
                t = t0 + c + offs_t
                row = pid_bh.to(tl.int64) * T + t
                x = tl.load(x_base + t.to(tl.int64)[:, None] * sx_t + offs_d[None, :] * sx_d).to(tl.float32)
                x = _clean(x, CLEAN)
                score = tl.math.div_rn(tl.abs(x - mean[None, :]), (std + 1e-12)[None, :])
                rank = _outlier_rank(score, CAP, BLOCK_T, D)
                codes, piece_scale, piece_zero = _method_codes(x, lo, hi, 0, BITS, CODE, True, mids_ptr)
                _store_packed(codes, codes_ptr + row[:, None] * W, t < T, BITS, BLOCK_T, D)
                dense = _dense_values(codes, scale[None, :], zero[None, :], BITS, CODE, True, levels_ptr)
                _store_outliers(x, dense, rank, row, t < T, delta_ptr, index_ptr, CAP, D)
        tl.store(scale_ptr + meta, scale.to(tl.float16))
        tl.store(zero_ptr + meta, zero.to(tl.float16))
    else:
        t = tl.program_id(1) * BLOCK_T + offs_t  # [BT]
        ok = t < T
        row = pid_bh.to(tl.int64) * T + t
        x = tl.load(x_base + t.to(tl.int64)[:, None] * sx_t + offs_d[None, :] * sx_d, mask=ok[:, None], other=0.0)
        x = _clean(x.to(tl.float32), CLEAN)  # [BT, D]
        x3 = tl.reshape(x, (BLOCK_T, NG, GROUP))
        if CAP > 0:
            rank = _outlier_rank(tl.abs(x), CAP, BLOCK_T, D)
            picked = tl.reshape(rank >= 0, (BLOCK_T, NG, GROUP))
            lo, hi = _group_ranges(x3, picked, 2, CAP)  # [BT, NG]
        else:
            lo, hi = tl.min(x3, axis=2), tl.max(x3, axis=2)
        codes3, scale, zero = _method_codes(x3, lo, hi, 2, BITS, CODE, CODE == 0, mids_ptr)
        codes = tl.reshape(codes3, (BLOCK_T, D))
        meta = row[:, None] * NG + tl.arange(0, NG)[None, :]
        tl.store(scale_ptr + meta, scale.to(tl.float16), mask=ok[:, None])
        if CODE == 0:
            tl.store(zero_ptr + meta, zero.to(tl.float16), mask=ok[:, None])
        _store_packed(codes, codes_ptr + row[:, None] * W, ok, BITS, BLOCK_T, D)
        if CAP > 0:
            dense3 = _dense_values(codes3, scale[:, :, None], zero[:, :, None], BITS, CODE, CODE == 0, levels_ptr)
            _store_outliers(x, tl.reshape(dense3, (BLOCK_T, D)), rank, row, ok, delta_ptr, index_ptr, CAP, D)


@triton.jit
def _quantize_nvfp4_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    ts_ptr,
    H,
    T,
    n_blocks,
    start,
    block,
    sx_b,
    sx_h,
    sx_t,
    sx_d,
    D: tl.constexpr,
    CLEAN: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One program: one (batch, head) and one block of `block` positions (rows [r0, r1) of x, the first block
    cut where `start` is inside it), as reference._quantize_nvfp4: pass 1 the block's amax -> its fp32 tensor
    scale (amax / (448 * 6), at least 1e-12); pass 2, BLOCK_T rows at a time: per 16 channels an E4M3 scale
    byte (amax / 6 / tensor_scale, round-to-nearest-even by `_fp8_encode`), E2M1 codes of x / (e4m3 * ts)
    (nearest magnitude; sign bit 3 unless the magnitude is 0). Outputs contiguous: codes [B, H, T, D / 2],
    scale bytes [B, H, T, D / 16], tensor scales fp32 [B, H, n_blocks]."""
    NG: tl.constexpr = D // 16
    pid_bh = tl.program_id(0)
    nb = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    first = nb * block - start % block
    r0 = tl.maximum(first, 0)
    r1 = tl.minimum(first + block, T)
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D)
    x_base = x_ptr + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h
    amax = tl.zeros([BLOCK_T], dtype=tl.float32)
    for r in range(r0, r1, BLOCK_T):
        ok = r + offs_t < r1
        ptrs = x_base + (r + offs_t).to(tl.int64)[:, None] * sx_t + offs_d[None, :] * sx_d
        x = _clean(tl.load(ptrs, mask=ok[:, None], other=0.0).to(tl.float32), CLEAN)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    ts = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 2688.0), 1e-12)  # E4M3_MAX * E2M1_MAX
    tl.store(ts_ptr + pid_bh * n_blocks + nb, ts)
    for r in range(r0, r1, BLOCK_T):
        ok = r + offs_t < r1
        row = pid_bh.to(tl.int64) * T + r + offs_t  # [BT]
        ptrs = x_base + (r + offs_t).to(tl.int64)[:, None] * sx_t + offs_d[None, :] * sx_d
        x = _clean(tl.load(ptrs, mask=ok[:, None], other=0.0).to(tl.float32), CLEAN)
        x3 = tl.reshape(x, (BLOCK_T, NG, 16))
        s = tl.math.div_rn(tl.math.div_rn(tl.max(tl.abs(x3), axis=2), 6.0), ts)  # [BT, NG]
        s_bits = _fp8_encode(tl.minimum(s, 448.0), 1)  # E4M3 bits, int32
        s_dec = tl.maximum(_fp8_decode(s_bits, 1).to(tl.float32) * _FP8_UNIT * ts, 1e-30)
        y = tl.math.div_rn(x3, s_dec[:, :, None])
        a = tl.minimum(tl.abs(y), 6.0)
        mag = (a > 0.25).to(tl.int32) + (a > 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
        mag += (a > 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a > 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
        codes = mag | (((y < 0.0) & (mag > 0)).to(tl.int32) << 3)
        _store_packed(tl.reshape(codes, (BLOCK_T, D)), codes_ptr + row[:, None] * (D // 2), ok, 4, BLOCK_T, D)
        cols = tl.arange(0, NG)[None, :]
        tl.store(scale_ptr + row[:, None] * NG + cols, s_bits.to(tl.uint8), mask=ok[:, None])


def method_tile(fmt: str, axis: str, group: int, head_dim: int, outliers: bool = False) -> tuple[int, int]:
    """(BLOCK_T, warps) of the method kernels: a key block (axis "channel"; with outliers it is read in
    pieces of BLOCK_T rows), else QUANT_TILE // 2 elements of whole rows (nvfp4: a block's rows at a time); warps grow with the tile (about 32 values of
    each per-element tile per thread) so that sm_90 code does not spill (bench/compile_sm90.py)."""
    rows = max(1, QUANT_TILE // 2 // head_dim)
    if axis == "channel" and formats.get(fmt).family != "nvfp4":
        if outliers:  # the block BLOCK_T rows at a time, twice; 8 warps (4 spill the nuq4 lookups at d128)
            return min(rows, group), 8
        rows = group
    return rows, max(4, min(16, rows * head_dim // 1024))


def supports_quantize_methods(
    fmt: str,
    axis: str,
    group: int,
    head_dim: int,
    *,
    levels: torch.Tensor | None = None,
    outliers: float = 0.0,
    rotation: torch.Tensor | None = None,
    rope=None,
    start: int = 0,
    block: int = 0,
) -> bool:
    """Whether `quantize` runs a call with these formats and methods (reference.quantize's keywords) on the
    method kernels: formats whose registry entry lists "quantize-methods" (a codebook format with its 2^bits
    levels) at head_dim 16..256 (2^k),
    groups a power of two, up to MAX_OUTLIERS outliers per token, and for outliers on keys per channel blocks
    of OUTLIER_GROUPS tokens (where the channel mean follows torch's summation order). fp8 with methods,
    anything else: the reference."""
    f = formats.get(fmt)
    if "quantize-methods" not in f.kernels or not (_pow2(head_dim) and 16 <= head_dim <= 256):
        return False
    if f.codebook and (levels is None or levels.numel() != f.levels):
        return False
    if f.family == "nvfp4":
        return True  # nvfp4 has no outliers, groups or axis of its own (16 channels per token)
    cap = outlier_cap(outliers, head_dim)
    if axis not in ("channel", "token") or not _pow2(group) or cap > MAX_OUTLIERS:
        return False
    if axis == "token" and (group > head_dim or (f.bits == 3 and head_dim < 16)):
        return False
    return not (cap and axis == "channel" and group not in OUTLIER_GROUPS)


def _quantize_methods(x, fmt, axis, group, levels, outliers, rotation, rope, start, block) -> QuantizedTensor:
    """`quantize` for calls `supports_quantize_methods` takes: the same bytes as reference.quantize."""
    b, h, t, d = x.shape
    nvfp4 = formats.get(fmt).family == "nvfp4"
    if axis == "channel" and not nvfp4 and t % group:
        raise ValueError(f"{t} tokens is not a whole number of {group}-token groups")
    # reference.turned's ops where x is turned; unturned x is cleaned up inside the kernels (CLEAN)
    turned = None if rotation is None and rope is None else reference.turned(x, rotation, rope, start)
    xin = x if turned is None else turned
    extras = dict(rotation=rotation, rope=rope, start=start)
    bits, cap = formats.get(fmt).bits, outlier_cap(outliers, d)
    rows, warps = method_tile(fmt, axis, group, d, bool(cap))
    if nvfp4:
        block = block or t
        n_blocks = (start + t - 1) // block - start // block + 1 if t else 0
        codes = torch.empty((b, h, t, d // 2), dtype=torch.uint8, device=x.device)
        scale = torch.empty((b, h, t, d // 16), dtype=torch.uint8, device=x.device)
        ts = torch.empty((b, h, n_blocks), dtype=torch.float32, device=x.device)
        if t and b * h:
            _quantize_nvfp4_kernel[(b * h, n_blocks)](
                xin, codes, scale, ts, h, t, n_blocks, start, block, *xin.stride(),
                D=d, CLEAN=turned is None, BLOCK_T=rows, num_warps=warps, enable_fp_fusion=False,
            )  # fmt: skip
        return QuantizedTensor(codes, scale, None, fmt, "token", 16, d, tensor_scale=ts, block=block, **extras)
    codes = torch.empty((b, h, t, d * bits // 8), dtype=torch.uint8, device=x.device)
    scale = torch.empty(_meta_shape(x, axis, group), dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale) if formats.get(fmt).has_zero(axis) else None
    delta = torch.empty((b, h, t, cap), dtype=torch.float16, device=x.device) if cap else None
    index = torch.empty((b, h, t, cap), dtype=torch.uint8, device=x.device) if cap else None
    nuq = formats.get(fmt).codebook
    lv = levels.to(x.device).half() if levels is not None else None
    mids = (lv[1:].float() + lv[:-1].float()) / 2 if nuq else None  # reference's boundaries, fp32
    dummy16 = scale
    if t and b * h:
        programs = t // group if axis == "channel" else cdiv(t, rows)
        _quantize_methods_kernel[(b * h, programs)](
            xin, codes, scale, dummy16 if zero is None else zero, lv if nuq else dummy16,
            mids if nuq else xin, dummy16 if delta is None else delta, codes if index is None else index,
            h, t, *xin.stride(),
            D=d, BITS=bits, CODE=int(nuq), CHANNEL=axis == "channel", GROUP=group, CAP=cap,
            CLEAN=turned is None, ILP=4 if d == 16 else 1, BLOCK_T=rows, num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip
    q = QuantizedTensor(codes, scale, zero, fmt, axis, group, d, levels=lv, **extras)
    q.outlier_delta, q.outlier_index = delta, index
    return q
