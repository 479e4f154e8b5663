"""Triton kernels for the packed KV cache: quantize-and-pack on append, fused decode attention.

Twins of `kvdemo.quant.reference` (same signatures, same storage layout, see its docstring):

- `quantize(x, fmt, axis, group) -> QuantizedTensor` and `quantize_into(...)` (writes codes and
  fp16 scale/zero into given tensors, in place, any strides). int8/int4/int2 asymmetric and fp8
  e4m3/e5m2 with scales; keys per channel (groups of `group` tokens) or per token, values per token.
  The codes are bit-identical to the reference: divisions use `div_rn` (IEEE, as torch on CPU),
  rounding is half-to-even, and fp8 codes are built with integer ops that replicate
  `c10::Float8_e4m3fn` / `Float8_e5m2` round-to-nearest-even (Triton's interpreter rounds fp8
  casts differently from the hardware, so no float8 cast is used anywhere here).
  `quantize(x, fmt, axis, group, **methods)` takes reference.quantize's keywords too: int3 and nuq4/3/2
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
- `past_attention(query, kv, scaling) -> (out, lse)`: every query over one layer's stored past
  (sinks + quantized region + full-precision residual), flash-decoding style: the sequence is split
  into programs of equal tile counts per (batch, kv head), quantized region and residual alike (the
  first residual program also takes the sinks), and a second kernel merges the partial results by
  log-sum-exp.
  One program serves every query head of its kv-head group (GQA: each K/V tile is read once).
  K/V stay packed in memory: a tile of packed bytes is loaded as stored and unpacked in registers to
  fp16 codes (exact: the fp16 with bits 0x6400 | c is 1024 + c), by inline PTX when compiled for
  NVIDIA (`_PTX_*`), by the same arithmetic in Triton ops in the interpreter. Per-channel keys are
  never dequantized: ``q . k_t = sum_c (q_c s_c) code_tc + sum_c q_c z_c`` inside one key block,
  with ``q_c s_c`` and ``q . z`` computed once per block.
  Both dots run on fp16 tensor cores with fp32 accumulation. Scores are about fp32-accurate: fp32
  operands are split into fp16 hi + lo halves (queries always; keys stored in fp32 or dequantized per
  token too); the weights and the dequantized values of the second dot are fp16, as in
  FlashAttention (2^-11 relative each).
  The methods beyond uniform codes (reference docstring) are read from their packed storage too, each
  behind a constexpr flag of the kernel (off: the plain variants compile to the code they had before):
  nuq codebooks (fp16 levels picked in registers: compiled for NVIDIA by byte permutes, `_PTX_NUQ4`,
  `_PTX_NUQ3`, `_PTX_NUQ2`, which int3 shares with the codebook 0..7; in the interpreter by a select tree
  over the code's bits; the key fold above holds), bit-sliced int3 / nuq3 rows (three 1-bit planes),
  nvfp4 (E2M1 codes, E4M3 scales times the block's fp32 tensor scale, keys per token), sparse outliers
  (a row's corrections expanded into a dense fp16 tile: one more dot for keys, added to the values),
  a Hadamard rotation (on the query side: the codes see q @ R, the quantized splits' partial outputs
  are turned back by R.T before the merge; the lse is unchanged) and pre-RoPE keys (the tile is
  dequantized in fp32 and turned by RoPE from the fp32 cos/sin rows of its positions, then dotted as
  per-token keys are). `supports_attention` says what the kernel reads; the rest (more than
  MAX_OUTLIERS corrections per row, a rotary dim that is not a power of two dividing head_dim, the
  methods at head_dim 256 or beyond 16 query rows at head_dim 128) goes to the reference.

Tensors are CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (the tests). Head dims are
powers of two from 16 to 256 (`supports_*` say so; the dispatcher in `kvdemo.quant` sends
anything else to the reference). The interpreter misses what only the GPU compiler sees (register
spills, shared memory, unsupported ops): `bench/compile_sm90.py` compiles every variant for sm_90
on a CPU and reports them, with the decode loop's instructions per token; tests keep them compiling
without spills and within an instruction budget.
References: KIVI (arXiv 2402.02750), KVQuant (arXiv 2401.18079), FlashAttention-2 (arXiv
2307.08691) and flash-decoding (split-K over the sequence with a log-sum-exp merge).
"""

from __future__ import annotations

import struct
from dataclasses import replace

import torch
import triton
import triton.language as tl

from ..precision import outlier_cap
from . import reference
from .backend import interpreting
from .reference import FP16_MAX, INT_BITS, MIN_SCALE, QuantizedTensor

FP8_CODE = {"fp8_e4m3": 1, "fp8_e5m2": 2}  # constexpr ids of the fp8 formats (0 = integer format)
DECODE_FORMATS = (*INT_BITS, *FP8_CODE, "int3", "nuq4", "nuq3", "nuq2", "nvfp4")  # what the decode kernel reads
MAX_OUTLIERS = 4  # sparse corrections per row the decode kernel expands (each a compare-and-select per tile)
QUANT_TILE = 4096  # elements per quantize program (registers: ~32 fp32 values per thread at 4 warps)
MAX_BLOCK_N = 128  # most tokens per attention tile (tiles of per-channel keys stay inside one key group)
LOG2E = 1.4426950408889634
_FP16_MAX = tl.constexpr(FP16_MAX)  # globals read inside kernels must be constexpr
_MIN_SCALE = tl.constexpr(MIN_SCALE)
_FP8_UNIT = tl.constexpr(256.0)  # fp8 codes are unpacked as value / 256 (see _fp8_decode)

# Compiled unpacking: PTX blocks over 4 packed bytes (bytes 0-3 of the input register are elements 0-3;
# an output register holds elements 2i, 2i + 1 as fp16x2), the same arithmetic as `_unpack`'s Triton
# ops, 1-2.5 instructions per code instead of 3-4. `prmt` with 0x64 high bytes makes the fp16 1024 + x
# (exact for x < 1024); an fma that takes off 1024 and undoes the field's bit position leaves x. The
# blocks are marked side-effecting on purpose: that stops Triton from tracing the dots' operands back
# to the 8-bit loads and laying both dots out for 8-bit data (register moves for the query on every
# tile, softmax weights through shared memory). tests/test_triton_ptx.py runs each block on every byte.


def _fp16x2(x: float) -> str:
    """The fp16x2 register value holding x in both halves, as PTX hex."""
    (half,) = struct.unpack("<H", struct.pack("<e", x))
    return f"0x{half:04X}{half:04X}"


def _int_fields_ptx(bits: int) -> str:
    """The PTX block for an integer format: the 8 // bits bit fields of each of 4 bytes as fp16 codes, field p
    (bits [p * bits, (p + 1) * bits)) in outputs 2p, 2p + 1. The masked field c sits at c * 2^(p * bits), so
    prmt makes 1024 + c * 2^(p * bits), and an fma by 2^-(p * bits) minus 1024 * 2^-(p * bits) leaves c
    (field 0: minus 1024)."""
    fields = 8 // bits
    src = f"${2 * fields}"
    lines = ["{", ".reg .b32 a, b, t, s, z;"]
    for p in range(fields):
        unit = 2.0 ** -(p * bits)
        field = src
        if bits < 8:
            lines.append(f"and.b32 t, {src}, 0x{(((1 << bits) - 1) << (p * bits)) * 0x01010101:08X};")
            field = "t"
        lines += [f"prmt.b32 a, {field}, 0x64646464, 0x5150;", f"prmt.b32 b, {field}, 0x64646464, 0x5352;"]
        if p == 0:  # the field at bit 0: just take off 1024 (a subtract takes its constant as an immediate)
            lines += [f"mov.b32 z, {_fp16x2(1024.0)};", "sub.f16x2 $0, a, z;", "sub.f16x2 $1, b, z;"]
        else:
            lines += [f"mov.b32 s, {_fp16x2(unit)};", f"mov.b32 z, {_fp16x2(-1024.0 * unit)};"]
            lines += [f"fma.rn.f16x2 ${2 * p}, a, s, z;", f"fma.rn.f16x2 ${2 * p + 1}, b, s, z;"]
    return "\n".join(lines + ["}"])


_PTX_INT8 = tl.constexpr(_int_fields_ptx(8))
_PTX_INT4 = tl.constexpr(_int_fields_ptx(4))  # outputs: low nibbles ($0, $1), high nibbles ($2, $3)
_PTX_INT2 = tl.constexpr(_int_fields_ptx(2))  # outputs: bits 0-1, 2-3, 4-5, 6-7 of each byte
_PTX_E5M2 = tl.constexpr("""{
.reg .b32 a, b, u;
mov.b32 u, 0x1C001C00;
prmt.b32 a, $2, 0, 0x1404;
prmt.b32 b, $2, 0, 0x3424;
mul.rn.f16x2 $0, a, u;
mul.rn.f16x2 $1, b, u;
}""")  # e5m2 is the high byte of an fp16; times 2^-8 (0x1C00) gives value / 256, exactly
_PTX_E4M3 = tl.constexpr("""{
.reg .b32 a, b, m;
prmt.b32 a, $2, 0, 0x1404;
prmt.b32 b, $2, 0, 0x3424;
shr.b32 m, a, 1;
and.b32 m, m, 0x3F803F80;
and.b32 a, a, 0x80008000;
or.b32 $0, a, m;
shr.b32 m, b, 1;
and.b32 m, m, 0x3F803F80;
and.b32 b, b, 0x80008000;
or.b32 $1, b, m;
}""")  # sign to bit 15, exponent and mantissa one bit down: fp16 bits of value / 256 (as _fp8_decode)


def _nuq4_lookup_ptx() -> str:
    """The PTX block for nuq4 codes: 4 packed bytes ($4; a byte's low nibble is plane 0, its high nibble plane 1)
    -> their 8 codebook levels as fp16, planes as `_PTX_INT4` lays them out (plane 0 in $0, $1; plane 1 in
    $2, $3). The 16 fp16 levels come as 8 words (`_codebook_word`, each in the first of its pack of 4
    registers: $5, $9, ..., $33): words 0-3 hold the levels' low bytes (levels 4w..4w+3), words 4-7 their high
    bytes. A prmt with the codes as its selector looks up 4 codes at once: the selector's nibble i picks byte
    i of the result from 8 bytes (two words), which is one bank of 8 levels; bit 3 of each code, moved to bit
    2 of a second selector, picks the bank per byte; two more prmt pair low and high bytes into fp16x2.
    12 instructions per 4 codes where a select tree takes about 15 selects per code."""
    w = [f"${5 + 4 * i}" for i in range(8)]
    lines = ["{", ".reg .b32 c, s, t, a, b, pl, ph;"]
    for half, (out_lo, out_hi) in enumerate((("$0", "$2"), ("$1", "$3"))):  # bytes 0-1, then bytes 2-3
        lines.append("mov.b32 c, $4;" if half == 0 else "shr.b32 c, $4, 16;")
        lines += ["and.b32 s, c, 0x7777;", "shr.b32 t, c, 1;", "and.b32 t, t, 0x4444;", "or.b32 t, t, 0x3210;"]
        for dst, bank in (("pl", w[:4]), ("ph", w[4:])):
            lines += [f"prmt.b32 a, {bank[0]}, {bank[1]}, s;", f"prmt.b32 b, {bank[2]}, {bank[3]}, s;"]
            lines.append(f"prmt.b32 {dst}, a, b, t;")
        lines += [f"prmt.b32 {out_lo}, pl, ph, 0x6240;", f"prmt.b32 {out_hi}, pl, ph, 0x7351;"]
    return "\n".join(lines + ["}"])


_PTX_NUQ4 = tl.constexpr(_nuq4_lookup_ptx())


def _nuq2_lookup_ptx() -> str:
    """The PTX block for nuq2 codes: 4 packed bytes ($8; bits 2p, 2p + 1 of a byte are plane p) -> their 16
    codebook levels as fp16, planes as `_PTX_INT2` lays them out (plane p in $2p, $2p + 1). The 4 fp16 levels
    come as 2 words (`_codebook_word`, each in the first of its pack of 4 registers: $9, $13): the levels' low
    bytes, then their high bytes. For a pair of codes x (byte 0 or 2) and y (byte 1 or 3) of one plane, the
    prmt selector with nibbles x, x + 4, y, y + 4 takes both bytes of both levels at once; it is the pair's
    bit fields t = x + 256 y times 17, plus 0x4040. 4 instructions per 2 codes."""
    lines = ["{", ".reg .b32 t, s;"]
    for p in range(4):
        for half, out in enumerate((f"${2 * p}", f"${2 * p + 1}")):  # bytes 0-1, then bytes 2-3
            lines += [f"shr.b32 t, $8, {16 * half + 2 * p};", "and.b32 t, t, 0x0303;"]
            lines += ["mad.lo.u32 s, t, 17, 0x4040;", f"prmt.b32 {out}, $9, $13, s;"]
    return "\n".join(lines + ["}"])


_PTX_NUQ2 = tl.constexpr(_nuq2_lookup_ptx())


def _nuq3_lookup_ptx() -> str:
    """The PTX block for bit-sliced nuq3 rows: the same 4 byte columns of the three bit planes ($16, $17, $18;
    bit p of plane j's byte is bit j of the code of channel p * D/8 + column) -> the 32 codes' fp16 levels,
    channel group p in outputs $2p (columns 0-1) and $2p + 1 (columns 2-3). The 8 fp16 levels come as 4 words
    ($19, $23, $27, $31: low bytes of levels 0-3 and 4-7, then their high bytes). Per group p the three bits
    are gathered into a code per byte (c), folded into nibbles (c | c >> 4: nibbles 0 and 1 are columns 0 and 1,
    bits 16-23 columns 2 and 3), looked up in the low and in the high bytes by prmt, and paired into fp16:
    17 instructions per 4 codes."""
    planes, lo, hi = ("$16", "$17", "$18"), ("$19", "$23"), ("$27", "$31")
    lines = ["{", ".reg .b32 c, x, s, u, l, h;"]
    for p in range(8):
        for j, plane in enumerate(planes):  # bit p of plane j -> bit j of each byte
            r, shift = ("c" if j == 0 else "x"), p - j
            op = f"shr.b32 {r}, {plane}, {shift};" if shift >= 0 else f"shl.b32 {r}, {plane}, {-shift};"
            lines += [op, f"and.b32 {r}, {r}, 0x{(1 << j) * 0x01010101:08X};"] + (["or.b32 c, c, x;"] if j else [])
        lines += ["shr.b32 s, c, 4;", "or.b32 s, s, c;", "shr.b32 u, s, 16;"]
        for sel, out in (("s", f"${2 * p}"), ("u", f"${2 * p + 1}")):
            lines += [f"prmt.b32 l, {lo[0]}, {lo[1]}, {sel};", f"prmt.b32 h, {hi[0]}, {hi[1]}, {sel};"]
            lines.append(f"prmt.b32 {out}, l, h, 0x5140;")
    return "\n".join(lines + ["}"])


_PTX_NUQ3 = tl.constexpr(_nuq3_lookup_ptx())


def _int3_word(first: int) -> int:
    """A high-byte word of `_PTX_NUQ3`'s codebook for int3 (codes as the fp16 integers 0..7; their low bytes
    are all 0): byte k holds the high byte of the fp16 first + k."""
    return sum((struct.unpack("<H", struct.pack("<e", float(first + k)))[0] >> 8) << (8 * k) for k in range(4))


_INT3_HI0, _INT3_HI1 = tl.constexpr(_int3_word(0)), tl.constexpr(_int3_word(4))  # 0x42403C00, 0x47464544


def _bits(fmt: str) -> int:
    return INT_BITS.get(fmt, 8)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supports_quantize(fmt: str, head_dim: int) -> bool:
    """Plain formats and head dims the plain quantize kernel handles (`quantize_into` too); calls with methods
    or other formats: `supports_quantize_methods`; the rest goes to the reference."""
    return (fmt in INT_BITS or fmt in FP8_CODE) and _pow2(head_dim) and 16 <= head_dim <= 256


def _code_kind(q: QuantizedTensor) -> int:
    """The decode kernel's K_CODE / V_CODE of a stored part: 0 integer or fp8 codes, 1 nuq levels, 2 nvfp4."""
    return 2 if q.fmt == "nvfp4" else 1 if q.levels is not None else 0


def _decodes(q: QuantizedTensor, d: int, keys: bool) -> bool:
    """Whether the decode kernel reads this stored part: its format, its methods (outliers up to
    MAX_OUTLIERS per row, a rotation, pre-RoPE keys with a rotary dim that is a power of two dividing d)."""
    if q.fmt not in DECODE_FORMATS or (q.levels is not None) != q.fmt.startswith("nuq"):
        return False
    if q.outlier_index is not None and q.outlier_index.shape[-1] > MAX_OUTLIERS:
        return False
    if q.rope is not None:
        if not keys or q.rotation is not None:  # values are never pre-RoPE; RoPE would need the unrotated keys
            return False
        rotary = q.rope.tables(q.start, q.start + 1, q.codes.device)[0].shape[-1]
        return rotary >= 2 and _pow2(rotary) and d % rotary == 0
    return True


def supports_attention(query: torch.Tensor, kv) -> bool:
    """Shapes and stored formats the decode kernel handles: head_dim a power of two in [16, 256], query rows
    per kv head (GQA group x queries) up to MAX_BLOCK_M, per-token keys at TOKEN_KEY_HEAD_DIMS, codes of
    DECODE_FORMATS with the methods `_decodes` accepts."""
    b, hq, n, d = query.shape
    hkv, spec = kv.kv_heads, kv.spec
    fmts_ok = True
    if kv.regions.has_codes:
        keys, values = kv.keys.quantized, kv.values.quantized
        fmts_ok = _decodes(keys, d, True) and _decodes(values, d, False) and keys.start == values.start
    if not (fmts_ok and _pow2(d) and 16 <= d <= 256 and hq % hkv == 0):
        return False
    if kv.regions.has_codes and spec.key_axis == "token" and d not in TOKEN_KEY_HEAD_DIMS:
        return False
    if d > 128 and method_kind(kv):  # the methods' tiles spill registers at head_dim 256
        return False
    return _block_m((hq // hkv) * n) <= max_block_m(d, kv)


def _block_m(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


# --- device helpers ---------------------------------------------------------------------------------


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
def _ptx(byte, ASM: tl.constexpr, OUTPUTS: tl.constexpr):
    """One of the _PTX_* blocks over uint8 `byte`, 4 bytes per block: OUTPUTS fp16 tensors of its shape."""
    if OUTPUTS == 1:
        return tl.inline_asm_elementwise(ASM, "=r,=r,r", [byte], dtype=tl.float16, is_pure=False, pack=4)
    elif OUTPUTS == 2:
        return tl.inline_asm_elementwise(
            ASM, "=r,=r,=r,=r,r", [byte], dtype=(tl.float16, tl.float16), is_pure=False, pack=4
        )
    else:
        return tl.inline_asm_elementwise(
            ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [byte], dtype=(tl.float16,) * 4, is_pure=False, pack=4
        )


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
def _codebook_word(levels_ptr, FIRST: tl.constexpr, HIGH: tl.constexpr):
    """One int32 word of the codebook the `_PTX_NUQ*` blocks read: byte k holds the low (HIGH 0) or high (HIGH 1)
    byte of the fp16 level FIRST + k (k = 0..3)."""
    word = 0
    for k in tl.static_range(4):
        level = tl.load(levels_ptr + FIRST + k).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        word |= ((level >> (8 * HIGH)) & 0xFF) << (8 * k)
    return word


@triton.jit
def _ptx_nuq4(byte, levels_ptr):
    """uint8 bytes of nuq4 codes -> (plane 0, plane 1) fp16 levels, by `_PTX_NUQ4` (words 0-3: the 16 levels'
    low bytes, words 4-7: their high bytes)."""
    lo0, lo1 = _codebook_word(levels_ptr, 0, 0), _codebook_word(levels_ptr, 4, 0)
    lo2, lo3 = _codebook_word(levels_ptr, 8, 0), _codebook_word(levels_ptr, 12, 0)
    hi0, hi1 = _codebook_word(levels_ptr, 0, 1), _codebook_word(levels_ptr, 4, 1)
    hi2, hi3 = _codebook_word(levels_ptr, 8, 1), _codebook_word(levels_ptr, 12, 1)
    return tl.inline_asm_elementwise(
        _PTX_NUQ4,
        "=r,=r,=r,=r,r" + ",r" * 32,
        [byte, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3],
        dtype=(tl.float16, tl.float16),
        is_pure=False,
        pack=4,
    )


@triton.jit
def _ptx_nuq2(byte, levels_ptr):
    """uint8 bytes of nuq2 codes -> planes 0-3 as fp16 levels, by `_PTX_NUQ2` (word 0: the 4 levels' low bytes,
    word 1: their high bytes)."""
    return tl.inline_asm_elementwise(
        _PTX_NUQ2,
        "=r,=r,=r,=r,=r,=r,=r,=r,r" + ",r" * 8,
        [byte, _codebook_word(levels_ptr, 0, 0), _codebook_word(levels_ptr, 0, 1)],
        dtype=(tl.float16,) * 4,
        is_pure=False,
        pack=4,
    )


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
def _ptx_bit_sliced(plane0, plane1, plane2, lo0, lo1, hi0, hi1):
    """uint8 bytes of the three bit planes of 3-bit rows (same columns) -> channel groups 0-7 as fp16 values
    of a codebook of 8, by `_PTX_NUQ3`; lo0, lo1: the 8 levels' low bytes (4 per int32 word), hi0, hi1: their
    high bytes (`_codebook_word`; int3's codebook is the integers 0..7: low bytes 0, high bytes `_INT3_HI0`, `_INT3_HI1`)."""
    return tl.inline_asm_elementwise(
        _PTX_NUQ3,
        "=r" + ",=r" * 15 + ",r,r,r" + ",r" * 16,
        [plane0, plane1, plane2, lo0, lo1, hi0, hi1],
        dtype=(tl.float16,) * 8,
        is_pure=False,
        pack=4,
    )


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


@triton.jit
def _rope_rows(k, cos, sin, BLOCK_N: tl.constexpr, D: tl.constexpr, ROPE_DIM: tl.constexpr):
    """RoPE (rotate-half layout) on key rows k [BN, D] fp32 with their cos/sin [BN, D] fp32: k * cos +
    rotate_half(k) * sin, rotate_half within each run of ROPE_DIM channels (partial rotary: channels past
    ROPE_DIM come with cos 1, sin 0, so they pass through)."""
    HALF: tl.constexpr = ROPE_DIM // 2
    x = tl.permute(tl.reshape(k, (BLOCK_N, D // ROPE_DIM, 2, HALF)), (0, 1, 3, 2))  # [BN, D/RD, HALF, 2]
    first, second = tl.split(x)
    turned = tl.permute(tl.join(-second, first), (0, 1, 3, 2))  # [BN, D/RD, 2, HALF]: (-x2, x1)
    return k * cos + tl.reshape(turned, (BLOCK_N, D)) * sin


@triton.jit
def _hi_lo(a):
    """fp32 a -> (hi, lo) fp16 with hi + lo = a to about fp32 accuracy (within fp16's range)."""
    hi = a.to(tl.float16)
    return hi, (a - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _dot_hi_lo(a_hi, a_lo, b):
    """a [BM, K] fp32, given as its fp16 halves (`_hi_lo`), @ b [K, BN] fp16 on fp16 tensor cores, to about
    fp32 accuracy."""
    return tl.dot(a_hi, b) + tl.dot(a_lo, b)


@triton.jit
def _dot_f32(a_hi, a_lo, b):
    """a [BM, K] fp32 (its fp16 halves) @ b [K, BN] fp32 on fp16 tensor cores, to about fp32 accuracy: hi/lo
    halves of both, three dots (the lo x lo term is below fp32 rounding)."""
    b_hi, b_lo = _hi_lo(b)
    return _dot_hi_lo(a_hi, a_lo, b_hi) + tl.dot(a_hi, b_lo)


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
    bits, fp8 = _bits(fmt), FP8_CODE.get(fmt, 0)
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
        grid = (b * h, triton.cdiv(t, block_t))
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
    if not (plain and (fmt in INT_BITS or fmt in FP8_CODE)):
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
    codes = torch.empty((b, h, t, d * _bits(fmt) // 8), dtype=torch.uint8, device=x.device)
    scale = torch.empty(_meta_shape(x, axis, group), dtype=torch.float16, device=x.device)
    zero = None if fmt in FP8_CODE else torch.empty_like(scale)
    quantize_into(x, fmt, axis, group, codes, scale, zero)
    return QuantizedTensor(codes, scale, zero, fmt, axis, group, d)


# --- quantize with the methods beyond uniform codes -------------------------------------------------
# Separate kernels (the plain kernel above is unchanged): int3 / nuq bit-sliced or planar codes with sparse
# outliers (`_quantize_methods_kernel`), nvfp4 (`_quantize_nvfp4_kernel`). A rotation and pre-RoPE keys are
# applied by the wrapper with the reference's own torch ops, so the kernels see the same fp32 tensor.
# Both run with enable_fp_fusion=False: `a * b + c` (the dequantized value behind an outlier's correction)
# stays two roundings, as in torch, instead of one fma.

METHOD_QUANT_FORMATS = (*INT_BITS, "int3", "nuq4", "nuq3", "nuq2", "nvfp4")  # what the method kernels code
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
    """reference._dense on a tile: code value (integer, or fp16 level) * scale (+ zero), fp32, two roundings."""
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
    if axis == "channel" and fmt != "nvfp4":
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
    method kernels: METHOD_QUANT_FORMATS (nuq with a codebook of 2^bits levels) at head_dim 16..256 (2^k),
    groups a power of two, up to MAX_OUTLIERS outliers per token, and for outliers on keys per channel blocks
    of OUTLIER_GROUPS tokens (where the channel mean follows torch's summation order). fp8 with methods,
    anything else: the reference."""
    if fmt not in METHOD_QUANT_FORMATS or not (_pow2(head_dim) and 16 <= head_dim <= 256):
        return False
    if fmt.startswith("nuq") and (levels is None or levels.numel() != 1 << reference.code_bits(fmt)):
        return False
    if fmt == "nvfp4":
        return True  # nvfp4 has no outliers, groups or axis of its own (16 channels per token)
    cap = outlier_cap(outliers, head_dim)
    if axis not in ("channel", "token") or not _pow2(group) or cap > MAX_OUTLIERS:
        return False
    if axis == "token" and (group > head_dim or (reference.code_bits(fmt) == 3 and head_dim < 16)):
        return False
    return not (cap and axis == "channel" and group not in OUTLIER_GROUPS)


def _quantize_methods(x, fmt, axis, group, levels, outliers, rotation, rope, start, block) -> QuantizedTensor:
    """`quantize` for calls `supports_quantize_methods` takes: the same bytes as reference.quantize."""
    b, h, t, d = x.shape
    if axis == "channel" and fmt != "nvfp4" and t % group:
        raise ValueError(f"{t} tokens is not a whole number of {group}-token groups")
    # reference.turned's ops where x is turned; unturned x is cleaned up inside the kernels (CLEAN)
    turned = None if rotation is None and rope is None else reference.turned(x, rotation, rope, start)
    xin = x if turned is None else turned
    extras = dict(rotation=rotation, rope=rope, start=start)
    bits, cap = reference.code_bits(fmt), outlier_cap(outliers, d)
    rows, warps = method_tile(fmt, axis, group, d, bool(cap))
    if fmt == "nvfp4":
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
    zero = None if fmt.startswith("nuq") and axis == "token" else torch.empty_like(scale)
    delta = torch.empty((b, h, t, cap), dtype=torch.float16, device=x.device) if cap else None
    index = torch.empty((b, h, t, cap), dtype=torch.uint8, device=x.device) if cap else None
    nuq = fmt.startswith("nuq")
    lv = levels.to(x.device).half() if levels is not None else None
    mids = (lv[1:].float() + lv[:-1].float()) / 2 if nuq else None  # reference's boundaries, fp32
    dummy16 = scale
    if t and b * h:
        programs = t // group if axis == "channel" else triton.cdiv(t, rows)
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


# --- fused decode attention -------------------------------------------------------------------------


@triton.jit
def _online_update(acc, m_i, l_i, s, v):
    """One flash-attention step: s [BM, BN] fp32 log2-domain scores (-inf = masked), v [BN, D] fp16."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays empty
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])  # [BM, BN]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)  # [BM, D], fp32 accumulation
    return acc, m_new, l_i


@triton.jit
def _full_segment(
    acc, m_i, l_i, q_hi, q_lo, k_base, v_base, sk_t, sv_t, row_begin, row_end, BLOCK_N: tl.constexpr, D: tl.constexpr
):
    """Full-precision keys/values rows [row_begin, row_end) of one (batch, kv head): sinks or residual.

    Keys go to the tensor cores as fp16: 16-bit keys as they are (bf16 is exact in fp16 from 2^-14 to
    65504), fp32 keys as hi + lo halves; values as fp16.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for start in range(row_begin, row_end, BLOCK_N):
        pos = start + offs_n  # [BN] int32: offsets within one head stay below 2^31 (checked by the caller)
        valid = pos < row_end
        k = tl.load(k_base + pos[:, None] * sk_t + offs_d[None, :], mask=valid[:, None], other=0.0)
        if k.dtype == tl.float32:
            s = _dot_f32(q_hi, q_lo, tl.trans(k))  # [BM, BN]
        else:
            s = _dot_hi_lo(q_hi, q_lo, tl.trans(k.to(tl.float16)))  # fp16 and bf16 values are exact in fp16
        s = tl.where(valid[None, :], s, float("-inf"))
        v = tl.load(v_base + pos[:, None] * sv_t + offs_d[None, :], mask=valid[:, None], other=0.0)
        acc, m_i, l_i = _online_update(acc, m_i, l_i, s, v.to(tl.float16))
    return acc, m_i, l_i


@triton.jit
def _decode_split_kernel(
    q_ptr,
    sq_b,
    sq_h,
    sq_t,
    sk_ptr,
    ssk_b,
    ssk_h,
    ssk_t,
    sv_ptr,
    ssv_b,
    ssv_h,
    ssv_t,
    rk_ptr,
    srk_b,
    srk_h,
    srk_t,
    rv_ptr,
    srv_b,
    srv_h,
    srv_t,
    kc_ptr,
    skc_b,
    skc_h,
    skc_t,
    ks_ptr,
    sks_b,
    sks_h,
    sks_t,
    kz_ptr,
    skz_b,
    skz_h,
    skz_t,
    vc_ptr,
    svc_b,
    svc_h,
    svc_t,
    vs_ptr,
    svs_b,
    svs_h,
    svs_t,
    vz_ptr,
    svz_b,
    svz_h,
    svz_t,
    qr_ptr,
    klv_ptr,
    vlv_ptr,
    kts_ptr,
    skts_b,
    skts_h,
    vts_ptr,
    svts_b,
    svts_h,
    row0,
    kts_block,
    vts_block,
    kod_ptr,
    skod_b,
    skod_h,
    skod_t,
    koi_ptr,
    skoi_b,
    skoi_h,
    skoi_t,
    vod_ptr,
    svod_b,
    svod_h,
    svod_t,
    voi_ptr,
    svoi_b,
    svoi_h,
    svoi_t,
    cos_ptr,
    sin_ptr,
    scs_t,
    o_part_ptr,
    lse_part_ptr,
    HKV,
    N_Q,
    M,
    S,
    Q,
    R,
    tiles_per_split,
    num_splits,
    qk_scale,
    parts,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_BITS: tl.constexpr,
    K_FP8: tl.constexpr,
    K_CHANNEL: tl.constexpr,
    K_GROUP: tl.constexpr,
    V_BITS: tl.constexpr,
    V_FP8: tl.constexpr,
    V_GROUP: tl.constexpr,
    PTX: tl.constexpr,
    FOLD_ONCE: tl.constexpr,
    K_CODE: tl.constexpr = 0,
    V_CODE: tl.constexpr = 0,
    K_OUTLIERS: tl.constexpr = 0,
    V_OUTLIERS: tl.constexpr = 0,
    K_ROTATED: tl.constexpr = False,
    K_ROPE: tl.constexpr = 0,
):
    """Program (split, batch * kv head): partial attention of the group's M query rows.

    split < num_splits: quantized tiles [split * tiles_per_split, ...) of positions [S, Q);
    split = num_splits + f: residual rows [f * tiles_per_split * BLOCK_N, ...), and for f = 0 also the
    sinks [0, S). Writes o (normalized) and lse of its slot; `parts` slots per (batch, kv head).

    The methods beyond uniform codes (defaults: off, the plain variants compile as without them):
    K_CODE / V_CODE 0: integer or fp8 codes (K_BITS 3: bit-sliced int3), 1: nuq codebook levels
    (klv_ptr / vlv_ptr, fp16 [2^bits]), 2: nvfp4 (E2M1 codes, uint8 E4M3 scales, fp32 tensor scales
    kts_ptr / vts_ptr [B, H, blocks] of kts_block / vts_block positions from row0);
    K_OUTLIERS / V_OUTLIERS: sparse corrections per row (fp16 delta kod/vod, uint8 channel koi/voi
    [B, H, rows, cap]); K_ROTATED: the codes see the query qr_ptr (fp32 q @ R, the layout of q; values'
    rotation is undone on the partial outputs by the caller); K_ROPE: rotary dim of pre-RoPE keys, turned
    by cos/sin fp32 [rows, K_ROPE] (row stride scs_t) after dequantizing the tile.
    """
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    h = (pid_bh % HKV).to(tl.int64)
    grp = M // N_Q
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < M
    head = h * grp + offs_m // N_Q  # query head of row m (rows = head in group, query index)
    q_offs = b * sq_b + head[:, None] * sq_h + (offs_m % N_Q)[:, None] * sq_t + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale  # [BM, D], log2 domain
    q_hi, q_lo = _hi_lo(q)  # the dots' fp16 halves, for full-precision and per-token keys

    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if pid_s >= num_splits:
        f = pid_s - num_splits
        if f == 0:
            acc, m_i, l_i = _full_segment(
                acc,
                m_i,
                l_i,
                q_hi,
                q_lo,
                sk_ptr + b * ssk_b + h * ssk_h,
                sv_ptr + b * ssv_b + h * ssv_h,
                ssk_t,
                ssv_t,
                0,
                S,
                BLOCK_N,
                D,
            )
        r_begin = f * tiles_per_split * BLOCK_N
        r_end = tl.minimum(r_begin + tiles_per_split * BLOCK_N, R)
        acc, m_i, l_i = _full_segment(
            acc,
            m_i,
            l_i,
            q_hi,
            q_lo,
            rk_ptr + b * srk_b + h * srk_h,
            rv_ptr + b * srv_b + h * srv_h,
            srk_t,
            srv_t,
            r_begin,
            r_end,
            BLOCK_N,
            D,
        )
    else:
        KDP: tl.constexpr = D * K_BITS // 8
        VDP: tl.constexpr = D * V_BITS // 8
        KNG: tl.constexpr = 1 if K_CHANNEL else D // K_GROUP
        VNG: tl.constexpr = D // V_GROUP
        K_PACKED: tl.constexpr = K_CODE == 0 and K_BITS != 3  # the codes `_unpack` reads (uniform int, fp8)
        V_PACKED: tl.constexpr = V_CODE == 0 and V_BITS != 3
        K_ZERO: tl.constexpr = K_FP8 == 0 and (K_CODE == 0 or (K_CODE == 1 and K_CHANNEL))  # zero points stored
        V_ZERO: tl.constexpr = V_FP8 == 0 and V_CODE == 0
        kc_base = kc_ptr + b * skc_b + h * skc_h
        ks_base = ks_ptr + b * sks_b + h * sks_h
        kz_base = kz_ptr + b * skz_b + h * skz_h
        vc_base = vc_ptr + b * svc_b + h * svc_h
        vs_base = vs_ptr + b * svs_b + h * svs_h
        vz_base = vz_ptr + b * svz_b + h * svz_h
        if K_ROTATED:  # Hadamard: q . k = (q R) . (k R), the codes' space; sinks and residual keep q
            q = tl.load(qr_ptr + q_offs, mask=row_ok[:, None], other=0.0) * qk_scale
            q_hi, q_lo = _hi_lo(q)
        n_tiles = tl.cdiv(Q, BLOCK_N)
        t_begin = pid_s * tiles_per_split
        t_end = tl.minimum(t_begin + tiles_per_split, n_tiles)
        # per-channel keys: q with the current key block's scales folded in (fp16 hi + lo halves) and q . zero;
        # a tile lies in one block (block_n <= K_GROUP), so they change once per block, not per tile
        # (FOLD_ONCE; where keeping them across tiles spills registers, the fold runs on every tile)
        qs_hi = tl.zeros([BLOCK_M, D], dtype=tl.float16)
        qs_lo = tl.zeros([BLOCK_M, D], dtype=tl.float16)
        qz = tl.zeros([BLOCK_M], dtype=tl.float32)
        for tile in range(t_begin, t_end):
            start = tile * BLOCK_N
            pos = start + offs_n  # [BN] absolute positions (int32, see _full_segment); rows [0, S) are dummies
            valid = (pos >= S) & (pos < Q)
            if K_PACKED:
                kbyte = tl.load(
                    kc_base + pos[:, None] * skc_t + tl.arange(0, KDP)[None, :], mask=valid[:, None], other=0
                )
                kcode = _unpack(kbyte, K_BITS, K_FP8, BLOCK_N, D, PTX)  # [BN, D] fp16
            else:
                kcode = _unpack_values(kc_base + pos[:, None] * skc_t, valid, K_BITS, K_CODE, klv_ptr, BLOCK_N, D, PTX)
            if K_CHANNEL and K_ROPE == 0:
                if (not FOLD_ONCE) or (tile == t_begin) or (start % K_GROUP == 0):  # entering a key block
                    blk = start // K_GROUP
                    ks = tl.load(ks_base + blk * sks_t + offs_d).to(tl.float32)  # [D]
                    if K_FP8 != 0:
                        ks = ks * _FP8_UNIT
                    qs_hi, qs_lo = _hi_lo(q * ks[None, :])
                    if K_ZERO:
                        kz = tl.load(kz_base + blk * skz_t + offs_d).to(tl.float32)
                        qz = tl.sum(q * kz[None, :], 1)
                s = _dot_hi_lo(qs_hi, qs_lo, tl.trans(kcode)) + qz[:, None]  # [BM, BN]
                if K_OUTLIERS > 0:  # + sum_j q[idx_tj] delta_tj, the fp16 deltas exact in a dense tile
                    kcorr = _outlier_tile(
                        kod_ptr + b * skod_b + h * skod_h,
                        koi_ptr + b * skoi_b + h * skoi_h,
                        skod_t,
                        skoi_t,
                        pos,
                        valid,
                        K_OUTLIERS,
                        BLOCK_N,
                        D,
                    )
                    s += _dot_hi_lo(q_hi, q_lo, tl.trans(kcorr))
            else:  # dequantize the tile in registers (fp32): per-token keys, or pre-RoPE keys to turn
                if K_CHANNEL:
                    blk = start // K_GROUP
                    ks = tl.load(ks_base + blk * sks_t + offs_d).to(tl.float32)  # [D]
                    k = kcode.to(tl.float32) * ks[None, :]
                    if K_ZERO:
                        k += tl.load(kz_base + blk * skz_t + offs_d).to(tl.float32)[None, :]
                else:
                    kg = tl.arange(0, KNG)[None, :]
                    if K_CODE == 2:
                        ks = _nvfp4_scales(
                            ks_base, kts_ptr + b * skts_b + h * skts_h, sks_t, pos, valid, row0, kts_block, KNG
                        )
                    else:
                        ks = tl.load(ks_base + pos[:, None] * sks_t + kg, mask=valid[:, None], other=0.0).to(tl.float32)
                    kz = ks
                    if K_ZERO:
                        kz = tl.load(kz_base + pos[:, None] * skz_t + kg, mask=valid[:, None], other=0.0).to(tl.float32)
                    elif K_FP8 != 0:
                        ks = ks * _FP8_UNIT
                    k = _dequantize_rows(kcode, ks, kz, K_GROUP, K_ZERO, BLOCK_N, D)  # [BN, D] fp32
                if K_OUTLIERS > 0:
                    k += _outlier_tile(
                        kod_ptr + b * skod_b + h * skod_h,
                        koi_ptr + b * skoi_b + h * skoi_h,
                        skod_t,
                        skoi_t,
                        pos,
                        valid,
                        K_OUTLIERS,
                        BLOCK_N,
                        D,
                    ).to(tl.float32)
                if K_ROPE > 0:  # the keys' RoPE at their positions, clamped to fp16's range as reference.dequantize
                    cs = pos[:, None] * scs_t + offs_d[None, :]
                    turned = valid[:, None] & (offs_d[None, :] < K_ROPE)
                    cos = tl.load(cos_ptr + cs, mask=turned, other=1.0)
                    sin = tl.load(sin_ptr + cs, mask=turned, other=0.0)
                    k = _rope_rows(k, cos, sin, BLOCK_N, D, K_ROPE)
                    k = tl.minimum(tl.maximum(k, -_FP16_MAX), _FP16_MAX)
                s = _dot_f32(q_hi, q_lo, tl.trans(k))
            s = tl.where(valid[None, :], s, float("-inf"))
            if V_PACKED:
                vbyte = tl.load(
                    vc_base + pos[:, None] * svc_t + tl.arange(0, VDP)[None, :], mask=valid[:, None], other=0
                )
            vg = tl.arange(0, VNG)[None, :]
            if V_CODE == 2:  # nvfp4: fp32 scales, the values rounded to fp16 once
                vs = _nvfp4_scales(vs_base, vts_ptr + b * svts_b + h * svts_h, svs_t, pos, valid, row0, vts_block, VNG)
            else:
                vs = tl.load(vs_base + pos[:, None] * svs_t + vg, mask=valid[:, None], other=0.0)  # [BN, VNG]
            vz = vs
            if V_ZERO:
                vz = tl.load(vz_base + pos[:, None] * svz_t + vg, mask=valid[:, None], other=0.0)
            elif V_FP8 != 0:
                vs = vs * _FP8_UNIT  # fp16: scales are at most 65504 / 448, times 256 stays finite
            if V_PACKED:
                vcode = _unpack(vbyte, V_BITS, V_FP8, BLOCK_N, D, PTX)
            else:  # looked-up values: scaled in fp32, rounded to fp16 once
                vcode = _unpack_values(vc_base + pos[:, None] * svc_t, valid, V_BITS, V_CODE, vlv_ptr, BLOCK_N, D, PTX)
                vs = vs.to(tl.float32)
            v = _dequantize_rows(vcode, vs, vz, V_GROUP, V_ZERO, BLOCK_N, D).to(tl.float16)
            if V_OUTLIERS > 0:  # + p_t delta_tj at channel idx_tj: the deltas join the fp16 values
                vcorr = _outlier_tile(
                    vod_ptr + b * svod_b + h * svod_h,
                    voi_ptr + b * svoi_b + h * svoi_h,
                    svod_t,
                    svoi_t,
                    pos,
                    valid,
                    V_OUTLIERS,
                    BLOCK_N,
                    D,
                )
                v += vcorr
            acc, m_i, l_i = _online_update(acc, m_i, l_i, s, v)

    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    slot = pid_bh.to(tl.int64) * parts + pid_s
    tl.store(o_part_ptr + (slot * BLOCK_M + offs_m[:, None]) * D + offs_d[None, :], o)
    tl.store(lse_part_ptr + slot * BLOCK_M + offs_m, lse)


@triton.jit
def _merge_kernel(o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, n_parts, M, BLOCK_M: tl.constexpr, D: tl.constexpr):
    """Program (batch * kv head): log-sum-exp merge of the n_parts partial results of its M rows."""
    pid = tl.program_id(0).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    base = pid * n_parts
    mx = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for i in range(0, n_parts):
        mx = tl.maximum(mx, tl.load(lse_part_ptr + (base + i) * BLOCK_M + offs_m))
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for i in range(0, n_parts):
        w = tl.exp(tl.load(lse_part_ptr + (base + i) * BLOCK_M + offs_m) - mx)  # [BM]
        o = tl.load(o_part_ptr + ((base + i) * BLOCK_M + offs_m[:, None]) * D + offs_d[None, :])
        acc += w[:, None] * o
        total += w
    ok = total > 0.0
    out = acc / tl.where(ok, total, 1.0)[:, None]
    lse = tl.where(ok, mx + tl.log(tl.where(ok, total, 1.0)), float("-inf"))
    row_ok = offs_m < M
    tl.store(out_ptr + (pid * M + offs_m[:, None]) * D + offs_d[None, :], out, mask=row_ok[:, None])
    tl.store(lse_ptr + pid * M + offs_m, lse, mask=row_ok)


PROGRAMS_PER_SM = 4  # decode programs per SM in all (the GPU benchmark sweeps 2-16)
NUM_STAGES = 3  # software-pipeline depth of the decode loop (the GPU benchmark sweeps 2-3)


def splits_for(heads: int, device: torch.device, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Splits of the sequence per (batch, kv head) for about `programs_per_sm` programs per SM in all."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return max(1, -(-programs_per_sm * sms // heads))


def _default_splits(n_tiles: int, heads: int, device: torch.device) -> int:
    """`splits_for` the default programs per SM, with >= 4 tiles per split."""
    return max(1, min(splits_for(heads, device), n_tiles // 4))


# Most query rows (GQA group x queries, padded) of one attention program by head_dim, and the head dims
# that take per-token keys: past these, sm_90 code spills registers (bench/compile_sm90.py), and
# `past_attention` hands the call to the reference.
MAX_BLOCK_M = {16: 128, 32: 128, 64: 128, 128: 64, 256: 16}
TOKEN_KEY_HEAD_DIMS = (32, 64, 128)


def ptx_unpacking() -> bool:
    """True where the decode kernel unpacks codes with its PTX blocks: compiled for NVIDIA (not the
    interpreter, not ROCm); elsewhere the same arithmetic runs as Triton ops."""
    return not interpreting() and torch.version.hip is None


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability the kernels are tuned for on `device`; the interpreter runs sm_90's."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (9, 0)


def fold_once(head_dim: int, cc: tuple[int, int] = (9, 0)) -> bool:
    """Whether the decode loop keeps the query folded with a key block's scales across the block's tiles:
    yes where Triton's dots run on tensor cores (sm_80 and later) up to head_dim 128; at head_dim 256,
    or with plain FMA dots (sm_75 and earlier), keeping it spills registers."""
    return head_dim <= 128 and cc >= (8, 0)


def launch_config(head_dim: int, block_m: int, cc: tuple[int, int] = (9, 0), method: str = "") -> tuple[int, int]:
    """(tokens per attention tile, warps) for a program of block_m query rows on compute capability cc: the
    largest settings that compile without register spills (`python bench/compile_sm90.py [--arch 75]`
    shows each variant). Decode rows (block_m 16) get tiles of 64 tokens: the fewest instructions per
    token that do not spill. Before sm_80 Triton's dots run on FMAs: 16 tokens, 8 warps.
    method (`method_kind`): the methods beyond uniform codes hold more per tile (looked-up or turned
    keys, sparse corrections), so at head_dim 128 their decode rows take 32-token tiles (with outliers on
    8 warps), and outliers with pre-RoPE keys at head_dim 64 too."""
    if cc < (8, 0):
        return 16, 8
    if head_dim > 128:
        return 16, 4
    if block_m > 16:
        return 32, 8
    if head_dim > 64 and method:
        return (32, 8) if method.startswith("outliers") else (32, 4)
    return (32, 4) if method == "outliers+rope" else (64, 4)


def method_kind(kv) -> str:
    """What the stored codes ask of the decode loop beyond uniform codes: "" (none; a Hadamard rotation turns
    only the query and the partial outputs), "codes" (looked-up, bit-sliced or nvfp4 codes, pre-RoPE keys),
    "outliers" (sparse corrections), "outliers+rope" (both with pre-RoPE keys)."""
    if not kv.regions.has_codes:
        return ""
    keys, values = kv.keys.quantized, kv.values.quantized
    if keys.outlier_index is not None or values.outlier_index is not None:
        return "outliers+rope" if keys.rope is not None else "outliers"
    plain = all(replace(q, rotation=None).plain for q in (keys, values))
    return "" if plain else "codes"


def max_block_m(head_dim: int, kv) -> int:
    """Most query rows (GQA group x queries, padded) of one program over `kv`: MAX_BLOCK_M, but 16 for the
    methods beyond uniform codes at head_dim 128 (more rows spill registers there; bench/compile_sm90.py)."""
    return 16 if head_dim > 64 and method_kind(kv) else MAX_BLOCK_M.get(head_dim, 16)


def _levels(q: QuantizedTensor) -> torch.Tensor:
    """The codebook the kernel reads: fp16, as stored (QuantizedTensor's contract; the quantizer picks codes
    with the fp16 levels), so looked-up codes are exact fp16 dot operands."""
    return q.levels.half()


def _arg(t: torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    """(tensor, stride_b, stride_h, stride_t) for the kernel; empty or missing tensors become a dummy."""
    if t is None or t.numel() == 0:
        return dummy, 0, 0, 0
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.shape[2] * t.stride(2) >= 2**31:  # the kernel's offsets within one (batch, head) are int32
        raise ValueError(f"a cache tensor of shape {tuple(t.shape)} is too long for one head's int32 offsets")
    return t, t.stride(0), t.stride(1), t.stride(2)


def past_attention(
    query: torch.Tensor,
    kv,
    scaling: float,
    mask: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = NUM_STAGES,
):
    """Fused decode attention of `query` over one layer's packed past (twin of `reference.past_attention`).

    query: [B, Hq, n, D] (any float dtype, any strides); kv: `kvdemo.cache.PackedKV`, kv.length > 0.
    num_splits: programs per (batch, kv head) the sequence is split over, before rounding to whole tiles:
    the quantized region and the full-precision residual get tiles of the same count each (default:
    about PROGRAMS_PER_SM programs per SM). The partial results are merged by log-sum-exp.
    block_n (tokens per tile, a power of two, capped by the key group), num_warps (defaults: `launch_config`)
    and num_stages are launch settings: only speed depends on them (the GPU benchmark sweeps them). The
    default tile is halved, once per shape, on a GPU whose shared memory per block cannot hold it.
    Returns (out fp32 [B, Hq, n, D], lse fp32 [B, Hq, n]). A `mask`, or a shape outside
    `supports_attention`, is handed to the reference (the decode path never passes a mask).
    """
    if mask is not None or not supports_attention(query, kv):
        return reference.past_attention(query, kv, scaling, mask)
    if kv.length <= 0:
        raise ValueError("past_attention needs a non-empty past (kv.length > 0)")
    _, hq, n, d = query.shape
    block_m = _block_m((hq // kv.kv_heads) * n)
    cc = capability(query.device)
    default_n, default_warps = launch_config(d, block_m, cc, method_kind(kv))
    explicit_block_n = block_n is not None
    # a GPU with less shared memory per block than sm_90 (a T4 has 64 KiB) cannot run the default tile:
    # halve it until it launches, once per shape, and remember what fits (a block_n given is not changed)
    spec = kv.spec
    methods = (spec.outliers, spec.pre_rope, spec.hadamard)
    fits_key = (query.device, d, block_m, spec.key_format, spec.value_format, spec.key_axis, methods, query.dtype)
    fits_key += (num_stages,)
    block_n = block_n or _FITTING_BLOCK_N.get(fits_key, default_n)
    while True:
        try:
            warps = num_warps or default_warps
            out, lse = _launch_decode(
                query, kv, scaling, block_n, block_m, num_splits, warps, num_stages, fold_once(d, cc)
            )
            break
        except triton.runtime.errors.OutOfResources:
            if explicit_block_n or block_n <= 16:
                raise
            block_n //= 2
    if not explicit_block_n:
        _FITTING_BLOCK_N[fits_key] = block_n
    return out, lse


_FITTING_BLOCK_N: dict[tuple, int] = {}  # default tiles halved to fit a GPU's shared memory, per shape


def _launch_decode(query, kv, scaling, block_n, block_m, num_splits, num_warps, num_stages, keep_fold):
    """The two launches of `past_attention` for one tile size: the split kernel, then the merge."""
    b, hq, n, d = query.shape
    hkv, r = kv.kv_heads, kv.regions
    m = (hq // hkv) * n
    s_len, q_len, r_len = r.sinks, r.quantized, r.residual
    quant = r.has_codes
    keys, values = kv.keys.quantized, kv.values.quantized  # QuantizedTensor, or None without codes
    block_n = min(block_n, MAX_BLOCK_N)
    if quant and keys.axis == "channel":
        block_n = min(block_n, keys.group)
    if not (_pow2(block_n) and block_n >= 16):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    n_tiles = triton.cdiv(q_len, block_n) if quant else 0  # quantized tiles (positions [0, Q), aligned)
    r_tiles = triton.cdiv(r_len, block_n)
    if num_splits is None:
        num_splits = _default_splits(n_tiles + r_tiles, b * hkv, query.device)
    tiles_per_split = max(1, triton.cdiv(n_tiles + r_tiles, max(1, int(num_splits))))
    q_splits = triton.cdiv(n_tiles, tiles_per_split)
    parts = q_splits + max(1, triton.cdiv(r_tiles, tiles_per_split))  # the first residual split has the sinks
    o_part = torch.empty((b * hkv, parts, block_m, d), dtype=torch.float32, device=query.device)
    lse_part = torch.empty((b * hkv, parts, block_m), dtype=torch.float32, device=query.device)
    out = torch.empty((b, hq, n, d), dtype=torch.float32, device=query.device)
    lse = torch.empty((b, hq, n), dtype=torch.float32, device=query.device)
    # stand-ins for absent tensors, of the dtypes the kernel reads there (it is compiled for both branches:
    # a float pointer where codes belong would give the PTX unpacking blocks fp32 inputs)
    dummy = query
    no_codes, no_meta = query.new_empty(1, dtype=torch.uint8), query.new_empty(1, dtype=torch.float16)
    q_arg = query if query.stride(-1) == 1 else query.contiguous()
    k_fmt = keys.fmt if quant else "int8"
    v_fmt = values.fmt if quant else "int8"
    # the methods beyond uniform codes (see the kernel's docstring); absent ones get stand-ins of their dtypes
    no_fp32 = query.new_empty(1, dtype=torch.float32)
    k_rot = quant and keys.rotation is not None
    v_rot = quant and values.rotation is not None
    if k_rot:  # the codes see q @ R: both contiguous, so one set of strides serves q and q @ R
        q_arg = q_arg.contiguous()
        q_rot = (q_arg.float() @ keys.rotation.to(device=query.device, dtype=torch.float32)).contiguous()
    k_rope = quant and keys.rope is not None
    if k_rope:
        cos, sin = keys.rope.tables(keys.start, keys.start + keys.codes.shape[-2], query.device)  # [rows, rd]
    k_cap = keys.outlier_index.shape[-1] if quant and keys.outlier_index is not None else 0
    v_cap = values.outlier_index.shape[-1] if quant and values.outlier_index is not None else 0
    _decode_split_kernel[(parts, b * hkv)](
        q_arg,
        *q_arg.stride()[:3],
        *_arg(kv.keys.sinks, dummy),
        *_arg(kv.values.sinks, dummy),
        *_arg(kv.keys.residual, dummy),
        *_arg(kv.values.residual, dummy),
        *_arg(keys.codes if quant else None, no_codes),
        *_arg(keys.scale if quant else None, no_meta),
        *_arg(keys.zero if quant else None, no_meta),
        *_arg(values.codes if quant else None, no_codes),
        *_arg(values.scale if quant else None, no_meta),
        *_arg(values.zero if quant else None, no_meta),
        q_rot if k_rot else q_arg,
        _levels(keys) if quant and keys.levels is not None else no_meta,
        _levels(values) if quant and values.levels is not None else no_meta,
        *_arg(keys.tensor_scale if quant else None, no_fp32)[:3],
        *_arg(values.tensor_scale if quant else None, no_fp32)[:3],
        keys.start if quant else 0,
        max(1, keys.block) if quant else 1,
        max(1, values.block) if quant else 1,
        *_arg(keys.outlier_delta if k_cap else None, no_meta),
        *_arg(keys.outlier_index if k_cap else None, no_codes),
        *_arg(values.outlier_delta if v_cap else None, no_meta),
        *_arg(values.outlier_index if v_cap else None, no_codes),
        cos if k_rope else no_fp32,
        sin if k_rope else no_fp32,
        cos.stride(0) if k_rope else 0,
        o_part,
        lse_part,
        hkv,
        n,
        m,
        s_len,
        q_len if quant else 0,
        r_len,
        tiles_per_split,
        q_splits,
        float(scaling) * LOG2E,
        parts,
        D=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        K_BITS=reference.code_bits(k_fmt),
        K_FP8=FP8_CODE.get(k_fmt, 0),
        K_CHANNEL=kv.spec.key_axis == "channel",
        K_GROUP=keys.group if quant else block_n,
        V_BITS=reference.code_bits(v_fmt),
        V_FP8=FP8_CODE.get(v_fmt, 0),
        V_GROUP=values.group if quant else d,
        PTX=ptx_unpacking(),
        FOLD_ONCE=keep_fold,
        K_CODE=_code_kind(keys) if quant else 0,
        V_CODE=_code_kind(values) if quant else 0,
        K_OUTLIERS=k_cap,
        V_OUTLIERS=v_cap,
        K_ROTATED=k_rot,
        K_ROPE=cos.shape[-1] if k_rope else 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if v_rot:  # the quantized splits' outputs are in the values' rotated space: turn them back (out @ R.T)
        rot = values.rotation.to(device=query.device, dtype=torch.float32)
        o_part[:, :q_splits] = o_part[:, :q_splits] @ rot.T
    _merge_kernel[(b * hkv,)](o_part, lse_part, out, lse, parts, m, BLOCK_M=block_m, D=d, num_warps=4)
    return out, lse


def kv_bytes_read(kv) -> int:
    """Bytes of K/V the decode kernel reads for one call (codes, metadata, sparse outliers, codebooks, sinks,
    residual; not pre-RoPE keys' cos/sin tables): for benchmarks."""
    total = 0
    for part in (kv.keys, kv.values):
        tensors = [part.sinks, part.residual]
        if kv.regions.has_codes:
            q = part.quantized
            tensors += [q.codes, q.scale, q.zero, q.tensor_scale, q.outlier_delta, q.outlier_index, q.levels]
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total
