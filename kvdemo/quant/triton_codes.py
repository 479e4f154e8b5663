"""Triton device helpers for the stored codes, shared by the quantize and the decode kernels.

The storage layout is `kvdemo.quant.reference`'s (see its docstring). Here, as @triton.jit functions:

- encoding: `_round_half_even` (torch.round's half-to-even, in fp32) and `_fp8_encode`: fp8 codes built
  with integer ops that replicate `c10::Float8_e4m3fn` / `Float8_e5m2` round-to-nearest-even (Triton's
  interpreter rounds fp8 casts differently from the hardware, so no float8 cast is used anywhere in the
  kernels);
- decoding: `_fp8_decode` (fp8 bits -> value / 256 as fp16, exactly); `_unpack` (planar int8/int4/int2 and
  fp8 rows -> fp16 codes, exact: the fp16 with bits 0x6400 | c is 1024 + c); `_code_value` and
  `_unpack_values` (int3 and nuq rows, bit-sliced or planar, and nvfp4's E2M1 codes -> their values; nuq
  levels by a select tree over the code's bits); `_dequantize_rows`; `_nvfp4_scales` (E4M3 scale bytes
  times the block's fp32 tensor scale); `_outlier_tile` (a row's sparse corrections as a dense fp16 tile).
  With PTX set (compiled for NVIDIA) the unpacking runs `kvdemo.quant.ptx`'s inline blocks instead of the
  Triton ops, with the same values.

Also the constants both kernel families read: MAX_OUTLIERS, and the constexpr copies of
FP16_MAX and of the fp8 unit (fp8 codes are unpacked as value / 256).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .ptx import (
    _INT3_HI0,
    _INT3_HI1,
    _PTX_E4M3,
    _PTX_E5M2,
    _PTX_INT2,
    _PTX_INT4,
    _PTX_INT4_BIASED,
    _PTX_INT4_HIGH_BIASED,
    _PTX_INT4_LOW_BIASED,
    _PTX_INT8,
    _PTX_INT8_BIASED,
    _codebook_word,
    _ptx,
    _ptx_bit_sliced,
    _ptx_nuq2,
    _ptx_nuq4,
    _ptx_traced,
)
from .reference import FP16_MAX

MAX_OUTLIERS = 4  # sparse corrections per row the decode kernel expands (each a compare-and-select per tile)
_FP16_MAX = tl.constexpr(FP16_MAX)  # globals read inside kernels must be constexpr
_FP8_UNIT = tl.constexpr(256.0)  # fp8 codes are unpacked as value / 256 (see _fp8_decode)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of Python integers, for grids and tile counts (triton.cdiv is a jit function: a few
    microseconds a call from the host, several calls a decode step)."""
    return -(-a // b)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@triton.jit
def _round_half_even(y):
    """fp32 round-to-nearest-even (torch.round) for |y| < 2^22: the 1.5 * 2^23 trick (exact in IEEE fp32)."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _fp8_encode(y, FP8: tl.constexpr):
    """fp32 y (finite, |y| <= fp8 max) -> fp8 bits as int32, round-to-nearest-even, as c10's Float8 types."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 31).to(tl.int32)
    mag = bits & 0x7FFFFFFF
    magf = mag.to(tl.float32, bitcast=True)
    if FP8 == 1:  # e4m3fn: bias 7, 3 mantissa bits, subnormal below 2^-6 (step 2^-9)
        sub = (magf + 16384.0).to(tl.uint32, bitcast=True) - (141 << 23)
        norm = (mag - (120 << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
        code = tl.where(mag < (121 << 23), sub, norm).to(tl.int32)
    else:  # e5m2: bias 15, 2 mantissa bits, subnormal below 2^-14 (step 2^-16)
        sub = (magf + 128.0).to(tl.uint32, bitcast=True) - (134 << 23)
        norm = (mag - (112 << 23) + 0xFFFFF + ((mag >> 21) & 1)) >> 21
        code = tl.where(mag < (113 << 23), sub, norm).to(tl.int32)
    return code | (sign << 7)


@triton.jit
def _fp8_decode(byte, FP8: tl.constexpr):
    """fp8 bits (int32 in [0, 255]) -> the fp8 value / FP8_UNIT as fp16, exactly, for both formats (the
    callers fold FP8_UNIT into the scales: small codes keep the hi + lo halves of the scores in range)."""
    if FP8 == 1:  # e4m3 bits moved into fp16's exponent/mantissa fields are the value / 2^8
        x = (((byte & 0x80) << 8) | ((byte & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
    else:  # e5m2 is the top byte of an fp16; / 2^8 is exact (its smallest step, 2^-16, becomes 2^-24)
        x = (byte << 8).to(tl.uint16).to(tl.float16, bitcast=True) * (1.0 / _FP8_UNIT)
    return x


@triton.jit
def _int_code(b, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """Bits [SHIFT, SHIFT + BITS) of int32 b as fp16, exactly: 0x6400 | c is the fp16 1024 + c."""
    c = (b >> SHIFT) & ((1 << BITS) - 1)
    return (c | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _unpack(byte, BITS: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, PTX: tl.constexpr):
    """Packed rows [BLOCK_N, D * BITS / 8] uint8 -> codes [BLOCK_N, D] fp16, exactly.

    Planar packing: byte column j holds channels p * DP + j in bits [p * BITS, (p + 1) * BITS).
    PTX: the _PTX_* blocks (compiled, NVIDIA); else the same values from Triton ops (the interpreter).
    """
    if FP8 != 0:
        if PTX:
            codes = _ptx(byte, _PTX_E4M3 if FP8 == 1 else _PTX_E5M2, 1)
        else:
            codes = _fp8_decode(byte.to(tl.int32), FP8)
    elif BITS == 8:
        codes = _ptx(byte, _PTX_INT8, 1) if PTX else _int_code(byte.to(tl.int32), 0, 8)
    elif BITS == 4:
        if PTX:
            lo, hi = _ptx(byte, _PTX_INT4, 2)
        else:
            lo, hi = _int_code(byte.to(tl.int32), 0, 4), _int_code(byte.to(tl.int32), 4, 4)
        planes = tl.join(lo, hi)  # [BN, DP, 2 (p)]
        codes = tl.reshape(tl.permute(planes, (0, 2, 1)), (BLOCK_N, D))
    else:
        if PTX:
            c0, c1, c2, c3 = _ptx(byte, _PTX_INT2, 4)
        else:
            b = byte.to(tl.int32)
            c0, c1, c2, c3 = _int_code(b, 0, 2), _int_code(b, 2, 2), _int_code(b, 4, 2), _int_code(b, 6, 2)
        planes = tl.join(tl.join(c0, c1), tl.join(c2, c3))  # [BN, DP, 2 (p % 2), 2 (p // 2)]
        codes = tl.reshape(tl.permute(planes, (0, 3, 2, 1)), (BLOCK_N, D))
    return codes


@triton.jit
def _int_planes(byte, BITS: tl.constexpr, BIASED: tl.constexpr, PTX: tl.constexpr):
    """Packed rows [BLOCK_N, DP] uint8 of an 8- or 4-bit integer format -> its code planes, fp16 [BLOCK_N, DP]
    each, exactly: (channels [0, DP), channels [DP, 2 DP)); 8 bits have one plane (returned twice). The planes
    are not interleaved into [BLOCK_N, D]: each feeds its own dot, so no register shuffles join them.
    BIASED: the values the bytes' fields make with 0x64 high bytes, 1024 + c * 2^(p * BITS) for plane p (no
    arithmetic at all; the caller folds the offset and the plane's scale into the other operand)."""
    if BITS == 8:
        if PTX:
            c = _ptx(byte, _PTX_INT8_BIASED if BIASED else _PTX_INT8, 1)
        else:
            c = _int_code(byte.to(tl.int32), 0, 8) + (1024.0 if BIASED else 0.0)
        return c, c
    else:
        if PTX:
            lo, hi = _ptx(byte, _PTX_INT4_BIASED if BIASED else _PTX_INT4, 2)
        else:
            lo, hi = _int_code(byte.to(tl.int32), 0, 4), _int_code(byte.to(tl.int32), 4, 4)
            if BIASED:
                lo, hi = lo + 1024.0, hi * 16.0 + 1024.0
        return lo, hi


@triton.jit
def _int_planes_traced(byte, BITS: tl.constexpr, PTX: tl.constexpr):
    """`_int_planes` biased, for the direct-keys loop: compiled for NVIDIA, each plane by its own one-output block
    marked pure (`_ptx_traced`), so the dot that takes a plane reads its bytes from the asynchronous copy's
    buffer in the tensor cores' layout; the same values otherwise."""
    if PTX:
        if BITS == 8:
            c = _ptx_traced(byte, _PTX_INT8_BIASED)
            return c, c
        return _ptx_traced(byte, _PTX_INT4_LOW_BIASED), _ptx_traced(byte, _PTX_INT4_HIGH_BIASED)
    return _int_planes(byte, BITS, True, PTX)


@triton.jit
def _dequantize_rows(
    code, scale, zero, GROUP: tl.constexpr, ZERO: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr
):
    """codes [BN, D] fp16, per-row groups of GROUP channels: scale, zero [BN, D / GROUP] -> [BN, D] in
    the dtype of scale (fp16 for values, the dot's operand; fp32 for per-token keys, see _dot_f32).
    ZERO: the format has zero points (integer codes; nuq keys per channel), else `zero` is not read."""
    c = tl.reshape(code, (BLOCK_N, D // GROUP, GROUP)).to(scale.dtype)
    x = c * scale[:, :, None]
    if ZERO:
        x += zero[:, :, None]
    return tl.reshape(x, (BLOCK_N, D))


@triton.jit
def _pick4(c, levels_ptr, FIRST: tl.constexpr):
    """levels[FIRST + (c & 3)] for int32 codes c, fp16: two bits, three selects on scalar levels (registers)."""
    b0 = (c & 1) != 0
    low = tl.where(b0, tl.load(levels_ptr + FIRST + 1), tl.load(levels_ptr + FIRST))
    high = tl.where(b0, tl.load(levels_ptr + FIRST + 3), tl.load(levels_ptr + FIRST + 2))
    return tl.where((c & 2) != 0, high, low)


@triton.jit
def _code_value(c, CODE: tl.constexpr, BITS: tl.constexpr, levels_ptr):
    """int32 codes c (< 2^BITS) -> their values before scaling, exactly: fp16, or the codebook's dtype.
    CODE 0: the integer itself (int3); 1: nuq's codebook entry levels[c], by a select tree over the code's
    bits on scalar levels (registers; depth-first, so few values are live at once); 2: E2M1 (nvfp4): sign
    bit 3, magnitude bits 0-2 moved into fp16's exponent and mantissa fields are the value times 2^-14."""
    if CODE == 1:
        if BITS == 2:
            x = _pick4(c, levels_ptr, 0)
        elif BITS == 3:
            x = tl.where((c & 4) != 0, _pick4(c, levels_ptr, 4), _pick4(c, levels_ptr, 0))
        else:
            x07 = tl.where((c & 4) != 0, _pick4(c, levels_ptr, 4), _pick4(c, levels_ptr, 0))
            x8f = tl.where((c & 4) != 0, _pick4(c, levels_ptr, 12), _pick4(c, levels_ptr, 8))
            x = tl.where((c & 8) != 0, x8f, x07)
    elif CODE == 2:
        x = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True) * 16384.0
    else:
        x = (c | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True) - 1024.0
    return x


@triton.jit
def _bit_sliced_values(plane0, plane1, plane2, CODE: tl.constexpr, BITS: tl.constexpr, levels_ptr):
    """uint8 bytes of the three bit planes of 3-bit rows -> channel groups 0-7 as `_code_value`s (the Triton-op
    twin of `_PTX_NUQ3`, and int3's path)."""
    w = plane0.to(tl.int32) | (plane1.to(tl.int32) << 8) | (plane2.to(tl.int32) << 16)
    # group p: bit p of each plane (bits p, 8 + p, 16 + p of w) -> code bits 0, 1, 2
    v0 = _code_value((w & 1) | ((w >> 7) & 2) | ((w >> 14) & 4), CODE, BITS, levels_ptr)
    v1 = _code_value(((w >> 1) & 1) | ((w >> 8) & 2) | ((w >> 15) & 4), CODE, BITS, levels_ptr)
    v2 = _code_value(((w >> 2) & 1) | ((w >> 9) & 2) | ((w >> 16) & 4), CODE, BITS, levels_ptr)
    v3 = _code_value(((w >> 3) & 1) | ((w >> 10) & 2) | ((w >> 17) & 4), CODE, BITS, levels_ptr)
    v4 = _code_value(((w >> 4) & 1) | ((w >> 11) & 2) | ((w >> 18) & 4), CODE, BITS, levels_ptr)
    v5 = _code_value(((w >> 5) & 1) | ((w >> 12) & 2) | ((w >> 19) & 4), CODE, BITS, levels_ptr)
    v6 = _code_value(((w >> 6) & 1) | ((w >> 13) & 2) | ((w >> 20) & 4), CODE, BITS, levels_ptr)
    v7 = _code_value(((w >> 7) & 1) | ((w >> 14) & 2) | ((w >> 21) & 4), CODE, BITS, levels_ptr)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _unpack_values(
    row_ptrs,
    valid,
    BITS: tl.constexpr,
    CODE: tl.constexpr,
    levels_ptr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    PTX: tl.constexpr,
):
    """Packed rows of 2-, 3- or 4-bit codes (row_ptrs [BN, 1]: each row's first byte; invalid rows read as
    code 0) -> code values [BN, D] (`_code_value`): codebook levels (the codebook's dtype), E2M1 values or
    int3 integers (fp16).

    2 and 4 bits: planar like `_unpack`. 3 bits: bit-sliced, three planes of D/8 bytes with plane j holding
    bit j; byte column i of a plane holds channels p * D/8 + i at bit p (p = 0..7)."""
    if BITS == 3:
        DP: tl.constexpr = D // 8
        cols = tl.arange(0, DP)[None, :]
        p0 = tl.load(row_ptrs + cols, mask=valid[:, None], other=0)
        p1 = tl.load(row_ptrs + DP + cols, mask=valid[:, None], other=0)
        p2 = tl.load(row_ptrs + 2 * DP + cols, mask=valid[:, None], other=0)
        if CODE == 1 and PTX:  # nuq3 compiled for NVIDIA: byte-permute lookups (_PTX_NUQ3)
            lo0, lo1 = _codebook_word(levels_ptr, 0, 0), _codebook_word(levels_ptr, 4, 0)
            hi0, hi1 = _codebook_word(levels_ptr, 0, 1), _codebook_word(levels_ptr, 4, 1)
            v0, v1, v2, v3, v4, v5, v6, v7 = _ptx_bit_sliced(p0, p1, p2, lo0, lo1, hi0, hi1)
        elif CODE == 0 and PTX:  # int3: the same lookups in the codebook 0..7 (fp16 bytes as constants)
            zero = tl.zeros([], dtype=tl.int32)
            v0, v1, v2, v3, v4, v5, v6, v7 = _ptx_bit_sliced(p0, p1, p2, zero, zero, zero + _INT3_HI0, zero + _INT3_HI1)
        else:
            v0, v1, v2, v3, v4, v5, v6, v7 = _bit_sliced_values(p0, p1, p2, CODE, BITS, levels_ptr)
        low = tl.join(tl.join(v0, v1), tl.join(v2, v3))  # [BN, DP, 2 (p % 2), 2 (p // 2 % 2)]
        planes = tl.join(low, tl.join(tl.join(v4, v5), tl.join(v6, v7)))  # [BN, DP, 2, 2, 2 (p // 4)]
        codes = tl.reshape(tl.permute(planes, (0, 4, 3, 2, 1)), (BLOCK_N, D))
    else:
        DP: tl.constexpr = D * BITS // 8
        byte = tl.load(row_ptrs + tl.arange(0, DP)[None, :], mask=valid[:, None], other=0)
        b = byte.to(tl.int32)
        if BITS == 4:
            if CODE == 1 and PTX:  # nuq4 compiled for NVIDIA: byte-permute lookups (_PTX_NUQ4)
                lo, hi = _ptx_nuq4(byte, levels_ptr)
            else:
                lo, hi = _code_value(b & 15, CODE, BITS, levels_ptr), _code_value(b >> 4, CODE, BITS, levels_ptr)
            planes = tl.join(lo, hi)
            codes = tl.reshape(tl.permute(planes, (0, 2, 1)), (BLOCK_N, D))  # [BN, DP, 2 (p)] -> channel p * DP + j
        else:
            if CODE == 1 and PTX:  # nuq2 compiled for NVIDIA: one byte permute per 2 codes (_PTX_NUQ2)
                c0, c1, c2, c3 = _ptx_nuq2(byte, levels_ptr)
            else:
                c0 = _code_value(b & 3, CODE, BITS, levels_ptr)
                c1 = _code_value((b >> 2) & 3, CODE, BITS, levels_ptr)
                c2 = _code_value((b >> 4) & 3, CODE, BITS, levels_ptr)
                c3 = _code_value(b >> 6, CODE, BITS, levels_ptr)
            planes = tl.join(tl.join(c0, c1), tl.join(c2, c3))  # [BN, DP, 2 (p % 2), 2 (p // 2)]
            codes = tl.reshape(tl.permute(planes, (0, 3, 2, 1)), (BLOCK_N, D))
    return codes


@triton.jit
def _outlier_tile(
    delta_base, index_base, sd_t, si_t, pos, valid, CAP: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr
):
    """Sparse corrections of rows pos (CAP per row: fp16 delta at uint8 channel index, distinct channels) as
    a dense tile [BN, D] fp16 (the deltas exactly), zero elsewhere and on invalid rows."""
    offs_d = tl.arange(0, D)
    corr = tl.zeros([BLOCK_N, D], dtype=tl.float16)
    for j in tl.static_range(CAP):
        idx = tl.load(index_base + pos * si_t + j, mask=valid, other=0).to(tl.int32)  # [BN]
        delta = tl.load(delta_base + pos * sd_t + j, mask=valid, other=0.0).to(tl.float16)
        corr = tl.where(offs_d[None, :] == idx[:, None], delta[:, None], corr)
    return corr


@triton.jit
def _nvfp4_scales(s_base, ts_base, s_t, pos, valid, row0, ts_block, NG: tl.constexpr):
    """nvfp4 group scales of rows pos, fp32 [BN, NG]: the E4M3 byte per 16 channels times the row's block
    tensor scale (row0: absolute position of code row 0; blocks of ts_block positions counted from row0's),
    the same fp32 product as reference.group_scale."""
    byte = tl.load(s_base + pos[:, None] * s_t + tl.arange(0, NG)[None, :], mask=valid[:, None], other=0)
    ts = tl.load(ts_base + (row0 + pos) // ts_block - row0 // ts_block, mask=valid, other=0.0)  # [BN] fp32
    return _fp8_decode(byte.to(tl.int32), 1).to(tl.float32) * _FP8_UNIT * ts[:, None]
