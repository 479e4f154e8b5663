"""Inline PTX that unpacks packed K/V codes in registers, for the decode kernel compiled for NVIDIA.

The decode kernel (`kvdemo.quant.triton_decode`) keeps K/V packed in memory: a tile of packed bytes is
loaded as stored and unpacked in registers to fp16 codes (exact: the fp16 with bits 0x6400 | c is
1024 + c). Compiled for NVIDIA it does so with the PTX blocks built here (`_PTX_*`); in Triton's
interpreter (and on ROCm) the same arithmetic runs as Triton ops (`kvdemo.quant.triton_codes`).

The blocks work over 4 packed bytes (bytes 0-3 of the input register are elements 0-3; an output
register holds elements 2i, 2i + 1 as fp16x2), the same arithmetic as `_unpack`'s Triton ops, 1-2.5
instructions per code instead of 3-4. `prmt` with 0x64 high bytes makes the fp16 1024 + x (exact for
x < 1024); an fma that takes off 1024 and undoes the field's bit position leaves x. The blocks are
marked side-effecting on purpose: that stops Triton from tracing the dots' operands back to the 8-bit
loads and laying both dots out for 8-bit data (register moves for the query on every tile, softmax
weights through shared memory). The direct-keys form of the plane-split loop wants that tracing for its key
codes (no trip through shared memory between unpacking and the dot): `_ptx_traced` runs one-output blocks
(`_PTX_INT4_LOW_BIASED`, `_PTX_INT4_HIGH_BIASED`, `_PTX_INT8_BIASED`) marked pure.

nuq codebooks: the fp16 levels are picked in registers by byte permutes (`_PTX_NUQ4`, `_PTX_NUQ3`,
`_PTX_NUQ2`, which int3 shares with the codebook 0..7: `_INT3_HI0`, `_INT3_HI1`) from words of the
levels' bytes (`_codebook_word`); the interpreter picks them by a select tree over the code's bits.
`_ptx`, `_ptx_nuq4`, `_ptx_nuq2` and `_ptx_bit_sliced` run the blocks (`tl.inline_asm_elementwise`).
tests/test_triton_ptx.py runs each block on every byte.
"""

from __future__ import annotations

import struct

import triton
import triton.language as tl


def _fp16x2(x: float) -> str:
    """The fp16x2 register value holding x in both halves, as PTX hex."""
    (half,) = struct.unpack("<H", struct.pack("<e", x))
    return f"0x{half:04X}{half:04X}"


def _int_fields_ptx(bits: int, biased: bool = False, only: int | None = None) -> str:
    """The PTX block for an integer format: the 8 // bits bit fields of each of 4 bytes as fp16 codes, field p
    (bits [p * bits, (p + 1) * bits)) in outputs 2p, 2p + 1. The masked field c sits at c * 2^(p * bits), so
    prmt makes 1024 + c * 2^(p * bits), and an fma by 2^-(p * bits) minus 1024 * 2^-(p * bits) leaves c
    (field 0: minus 1024). biased: the prmt's 1024 + c * 2^(p * bits) as it is (the caller folds the offset
    and the field's scale into the other operand: 2 prmt per 4 codes and a mask per field, nothing more).
    only: field `only` alone, in outputs 0 and 1 (a block of one output, which Triton can trace through)."""
    fields = [only] if only is not None else list(range(8 // bits))
    src = f"${2 * len(fields)}"
    lines = ["{", ".reg .b32 a, b, t, s, z;"]
    for out, p in enumerate(fields):
        unit = 2.0 ** -(p * bits)
        field = src
        if bits < 8:
            lines.append(f"and.b32 t, {src}, 0x{(((1 << bits) - 1) << (p * bits)) * 0x01010101:08X};")
            field = "t"
        if biased:
            lines += [f"prmt.b32 ${2 * out}, {field}, 0x64646464, 0x5150;"]
            lines += [f"prmt.b32 ${2 * out + 1}, {field}, 0x64646464, 0x5352;"]
            continue
        assert only is None, "a single field comes biased"
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
_PTX_INT8_BIASED = tl.constexpr(_int_fields_ptx(8, biased=True))  # 1024 + c
_PTX_INT4_BIASED = tl.constexpr(_int_fields_ptx(4, biased=True))  # 1024 + c (low nibbles), 1024 + 16 c (high)
_PTX_INT4_LOW_BIASED = tl.constexpr(_int_fields_ptx(4, biased=True, only=0))  # 1024 + c of the low nibbles
_PTX_INT4_HIGH_BIASED = tl.constexpr(_int_fields_ptx(4, biased=True, only=1))  # 1024 + 16 c of the high nibbles
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
def _ptx_traced(byte, ASM: tl.constexpr):
    """A one-output _PTX_* block over uint8 `byte`, marked pure: Triton then traces a dot operand made by it
    back to the bytes' load and reads them from the asynchronous copy's buffer straight into the tensor
    cores' layout, with no second trip through shared memory (it lays the dot out for 8-bit data)."""
    return tl.inline_asm_elementwise(ASM, "=r,=r,r", [byte], dtype=tl.float16, is_pure=True, pack=4)


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
