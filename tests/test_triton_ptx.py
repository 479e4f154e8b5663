"""The decode kernel's PTX unpacking blocks, run on every byte value by a small PTX evaluator.

Compiled on NVIDIA GPUs the decode kernel unpacks codes with inline PTX (`kvdemo.quant.ptx`: `_PTX_*`),
which neither Triton's interpreter nor this CPU machine can execute. Each block is a few integer and
fp16x2 instructions, so this file evaluates them from their text, with the PTX ISA's semantics for
those instructions, and compares every output with an independent decoding of the byte (integer bit
fields; fp8 through torch's float8 dtypes). The GPU tests (bench/device_check.sh) run them for real.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from kvdemo.quant import ptx  # noqa: E402

pytestmark = pytest.mark.triton

BYTES = np.arange(256, dtype=np.uint32)


def _prmt(a: np.ndarray, b: np.ndarray, selector) -> np.ndarray:
    """prmt.b32 (default mode): byte i of the result is byte selector[4i:4i+4] of {b, a} (0-3: a, 4-7: b);
    a set top bit of the selector nibble replicates that byte's sign bit instead. `selector`: an immediate, or a
    register (an array, one selector per element; only its low 16 bits count)."""
    pool = np.stack([(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)])
    selector = np.broadcast_to(np.asarray(selector, dtype=np.uint32), a.shape)
    out = np.zeros_like(a)
    for i in range(4):
        nib = (selector >> (4 * i)) & 0xF
        byte = np.take_along_axis(pool, (nib & 7)[None].astype(np.intp), 0)[0]
        byte = np.where(nib & 8, np.where(byte & 0x80, 0xFF, 0), byte).astype(np.uint32)
        out |= byte << (8 * i)
    return out


def _halves(x: np.ndarray) -> np.ndarray:
    """fp16x2 register -> [..., 2] float64 (low half first)."""
    pair = np.stack([x & 0xFFFF, x >> 16], axis=-1).astype(np.uint16)
    return pair.view(np.float16).astype(np.float64)


def _pack(v: np.ndarray) -> np.ndarray:
    """[..., 2] float64 -> fp16x2 register, each half rounded to nearest even (PTX .rn)."""
    bits = v.astype(np.float16).view(np.uint16).astype(np.uint32)
    return bits[..., 0] | (bits[..., 1] << 16)


def run_ptx(asm: str, inputs: list[np.ndarray], n_outputs: int) -> list[np.ndarray]:
    """Evaluate one PTX block: `$i` are the outputs then the inputs (uint32 arrays), named registers
    are the block's own; the instructions are those the _PTX_* blocks use, anything else fails."""
    regs = {f"${n_outputs + i}": x.astype(np.uint32) for i, x in enumerate(inputs)}

    def val(token: str) -> np.ndarray:
        if token in regs:
            return regs[token]
        return np.full_like(inputs[0], int(token, 0), dtype=np.uint32)

    for line in asm.split(";"):
        line = line.strip().strip("{}").strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        args = [t.strip() for t in rest.split(",")]
        dst, src = args[0], [val(t) for t in args[1:]]
        if op in ("mov.b32", "mov.u32"):
            res = src[0]
        elif op == "and.b32":
            res = src[0] & src[1]
        elif op == "or.b32":
            res = src[0] | src[1]
        elif op == "shr.b32":
            res = src[0] >> src[1]
        elif op == "shl.b32":
            res = (src[0].astype(np.uint64) << src[1]) & 0xFFFFFFFF
        elif op == "mad.lo.u32":
            res = (src[0].astype(np.uint64) * src[1] + src[2]) & 0xFFFFFFFF  # the low 32 bits
        elif op == "prmt.b32":
            res = _prmt(src[0], src[1], src[2])
        elif op in ("sub.f16x2", "sub.rn.f16x2"):
            res = _pack(_halves(src[0]) - _halves(src[1]))
        elif op in ("mul.f16x2", "mul.rn.f16x2"):
            with np.errstate(invalid="ignore"):  # e5m2's inf/nan bytes stay inf/nan (never compared)
                res = _pack(_halves(src[0]) * _halves(src[1]))  # fp16 x fp16 is exact in float64
        elif op == "fma.rn.f16x2":
            res = _pack(_halves(src[0]) * _halves(src[1]) + _halves(src[2]))  # one rounding, as fma
        else:
            raise AssertionError(f"the evaluator does not know {op!r}")
        regs[dst] = res.astype(np.uint32)
    return [regs[f"${i}"] for i in range(n_outputs)]


def unpack_bytes(asm: str, n_outputs: int) -> tuple[np.ndarray, np.ndarray]:
    """Every byte value through the block at each of the 4 byte positions (word i holds bytes i, i + 1,
    i + 2, i + 3 mod 256) -> (bytes [256, 4], code values [256, 4, n_outputs / 2])."""
    elems = (BYTES[:, None] + np.arange(4, dtype=np.uint32)[None, :]) % 256  # [256 words, 4 positions]
    packed = elems[:, 0] | (elems[:, 1] << 8) | (elems[:, 2] << 16) | (elems[:, 3] << 24)
    regs = run_ptx(asm, [packed], n_outputs)
    planes = []
    for p in range(n_outputs // 2):  # output pair (2p, 2p + 1) holds elements 0-1 and 2-3 of plane p
        planes.append(np.concatenate([_halves(regs[2 * p]), _halves(regs[2 * p + 1])], axis=-1))  # [256, 4]
    return elems, np.stack(planes, axis=-1)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_integer_blocks_give_each_bit_field(bits):
    asm = {8: ptx._PTX_INT8, 4: ptx._PTX_INT4, 2: ptx._PTX_INT2}[bits].value
    per_byte = 8 // bits
    elems, got = unpack_bytes(asm, 2 * per_byte)
    want = np.stack([(elems >> (bits * p)) & ((1 << bits) - 1) for p in range(per_byte)], axis=-1)
    np.testing.assert_array_equal(got, want.astype(np.float64))


@pytest.mark.parametrize("bits", [8, 4])
def test_biased_integer_blocks_give_1024_plus_the_field_at_its_bit_position(bits):
    """The plane-split loop's blocks: field p of each byte as the fp16 1024 + c * 2^(p * bits), nothing taken off."""
    asm = {8: ptx._PTX_INT8_BIASED, 4: ptx._PTX_INT4_BIASED}[bits].value
    per_byte = 8 // bits
    elems, got = unpack_bytes(asm, 2 * per_byte)
    fields = [((elems >> (bits * p)) & ((1 << bits) - 1)) << (bits * p) for p in range(per_byte)]
    np.testing.assert_array_equal(got, 1024.0 + np.stack(fields, axis=-1).astype(np.float64))


def test_one_field_blocks_give_their_plane_of_the_biased_block():
    """The direct-keys loop's one-output blocks: the low and high nibbles' plane of _PTX_INT4_BIASED, each alone."""
    _, both = unpack_bytes(ptx._PTX_INT4_BIASED.value, 4)
    for plane, block in enumerate((ptx._PTX_INT4_LOW_BIASED, ptx._PTX_INT4_HIGH_BIASED)):
        _, got = unpack_bytes(block.value, 2)
        np.testing.assert_array_equal(got[..., 0], both[..., plane])


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_blocks_give_the_value_over_256(fmt):
    asm = {"fp8_e4m3": ptx._PTX_E4M3, "fp8_e5m2": ptx._PTX_E5M2}[fmt].value
    dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fmt]
    elems, got = unpack_bytes(asm, 2)
    got = got[..., 0]
    values = torch.from_numpy(elems.astype(np.uint8)).view(dtype).double().numpy() / 256.0
    finite = np.isfinite(values)  # e4m3fn 0x7F/0xFF and e5m2's inf/nan bytes are never stored
    assert finite.sum() >= 248 * 4
    np.testing.assert_array_equal(got[finite], values[finite])
    assert np.all(np.signbit(got[finite]) == np.signbit(values[finite]))  # -0.0 stays -0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nuq4_block_looks_up_every_code_in_the_codebook(seed):
    """_PTX_NUQ4 on every byte at every position, with codebooks of 16 fp16 levels (random, both signs, fp16
    extremes and -0.0): each nibble's level exactly, in _PTX_INT4's layout (plane 0 = low nibbles)."""
    rng = np.random.default_rng(seed)
    levels = np.sort(rng.uniform(-1, 1, 16)).astype(np.float16)
    levels[0], levels[-1] = (-1.0, 1.0) if seed == 0 else (-65504.0, 65504.0)
    levels[7] = -0.0 if seed == 2 else levels[7]
    bits = levels.view(np.uint16).astype(np.uint32)
    words = [
        sum(((bits[4 * w + k] >> (8 * high)) & 0xFF) << (8 * k) for k in range(4)) for high in (0, 1) for w in range(4)
    ]
    elems = (BYTES[:, None] + np.arange(4, dtype=np.uint32)[None, :]) % 256  # [256 words, 4 positions]
    packed = elems[:, 0] | (elems[:, 1] << 8) | (elems[:, 2] << 16) | (elems[:, 3] << 24)
    regs = run_ptx(ptx._PTX_NUQ4.value, [packed] + [np.full_like(packed, w) for w in words for _ in range(4)], 4)
    for plane, (first, second) in enumerate(((0, 1), (2, 3))):
        got = np.concatenate([_halves(regs[first]), _halves(regs[second])], axis=-1)  # [256, 4]
        want = levels[(elems >> (4 * plane)) & 15].astype(np.float64)
        np.testing.assert_array_equal(got, want)
        assert np.all(np.signbit(got) == np.signbit(want))


@pytest.mark.parametrize("seed", [0, 1])
def test_nuq2_block_looks_up_every_code_in_the_codebook(seed):
    """_PTX_NUQ2 on every byte at every position: each 2-bit field's level exactly, in _PTX_INT2's layout."""
    levels = np.array([-1.0, -0.3, 0.2, 1.0] if seed == 0 else [-65504.0, -0.0, 0.0078125, 3.5], dtype=np.float16)
    bits = levels.view(np.uint16).astype(np.uint32)
    words = [sum(((bits[k] >> (8 * high)) & 0xFF) << (8 * k) for k in range(4)) for high in (0, 1)]
    elems = (BYTES[:, None] + np.arange(4, dtype=np.uint32)[None, :]) % 256  # [256 words, 4 positions]
    packed = elems[:, 0] | (elems[:, 1] << 8) | (elems[:, 2] << 16) | (elems[:, 3] << 24)
    regs = run_ptx(ptx._PTX_NUQ2.value, [packed] + [np.full_like(packed, w) for w in words for _ in range(4)], 8)
    for plane in range(4):
        got = np.concatenate([_halves(regs[2 * plane]), _halves(regs[2 * plane + 1])], axis=-1)  # [256, 4]
        want = levels[(elems >> (2 * plane)) & 3].astype(np.float64)
        np.testing.assert_array_equal(got, want)
        assert np.all(np.signbit(got) == np.signbit(want))


@pytest.mark.parametrize("seed", [0, 1])
def test_nuq3_block_looks_up_every_code_of_bit_sliced_rows(seed):
    """_PTX_NUQ3 on bit-sliced rows: every combination of the three planes' bits at each of 4 columns (random
    plane bytes, all 8 codes in every channel group), each channel's level exactly."""
    rng = np.random.default_rng(seed)
    levels = np.sort(rng.uniform(-1, 1, 8)).astype(np.float16)
    levels[0], levels[3] = (-1.0, -0.0) if seed == 0 else (-65504.0, 0.0)
    bits = levels.view(np.uint16).astype(np.uint32)
    words = [
        sum(((bits[4 * w + k] >> (8 * high)) & 0xFF) << (8 * k) for k in range(4)) for high in (0, 1) for w in range(2)
    ]
    planes = rng.integers(0, 256, size=(3, 4096, 4), dtype=np.uint32)  # [plane, word, column]
    planes[:, :256, 0] = np.arange(256)[None, :] * np.array([1, 7, 13])[:, None] % 256  # every byte at column 0
    packed = [p[:, 0] | (p[:, 1] << 8) | (p[:, 2] << 16) | (p[:, 3] << 24) for p in planes]
    regs = run_ptx(ptx._PTX_NUQ3.value, packed + [np.full_like(packed[0], w) for w in words for _ in range(4)], 16)
    for group in range(8):
        got = np.concatenate([_halves(regs[2 * group]), _halves(regs[2 * group + 1])], axis=-1)  # [words, 4 columns]
        codes = sum(((planes[j] >> group) & 1) << j for j in range(3))
        want = levels[codes].astype(np.float64)
        np.testing.assert_array_equal(got, want)
        assert np.all(np.signbit(got) == np.signbit(want))
        assert set(np.unique(codes)) == set(range(8))


def test_int3_words_make_the_nuq3_block_give_the_codes_themselves():
    """int3 compiled for NVIDIA runs _PTX_NUQ3 with the codebook 0..7 (low bytes 0, high bytes _INT3_HI0/1)."""
    planes = np.stack([np.arange(256, dtype=np.uint32) * m % 256 for m in (1, 7, 13)])[:, :, None].repeat(4, 2)
    packed = [p[:, 0] | (p[:, 1] << 8) | (p[:, 2] << 16) | (p[:, 3] << 24) for p in planes]
    words = [0, 0, ptx._INT3_HI0.value, ptx._INT3_HI1.value]
    regs = run_ptx(ptx._PTX_NUQ3.value, packed + [np.full_like(packed[0], w) for w in words for _ in range(4)], 16)
    for group in range(8):
        got = np.concatenate([_halves(regs[2 * group]), _halves(regs[2 * group + 1])], axis=-1)
        np.testing.assert_array_equal(got, sum(((planes[j] >> group) & 1) << j for j in range(3)).astype(np.float64))


def test_evaluator_follows_the_isa_examples():
    """prmt and the fp16x2 ops as the PTX ISA defines them, on hand-checked values: the evaluator is
    the only thing between the blocks and the bytes, so it is tested on its own too."""
    a, b = np.array([0x33221100], dtype=np.uint32), np.array([0x77665544], dtype=np.uint32)
    assert _prmt(a, b, 0x3210)[0] == 0x33221100  # identity
    assert _prmt(a, b, 0x7654)[0] == 0x77665544  # all from b
    assert _prmt(a, b, 0x5140)[0] == 0x55114400  # interleave
    assert _prmt(np.array([0x80], dtype=np.uint32), b, 0x8888)[0] == 0xFFFFFFFF  # sign replication
    per_element = _prmt(np.repeat(a, 2), np.repeat(b, 2), np.array([0x3210, 0xFFFF7654], dtype=np.uint32))
    assert list(per_element) == [0x33221100, 0x77665544]  # a register selector: its low 16 bits, per element
    one_two = np.array([0x40003C00], dtype=np.uint32)  # fp16x2 (1.0, 2.0)
    (out,) = run_ptx("fma.rn.f16x2 $0, $1, $1, $1;", [one_two], 1)
    np.testing.assert_array_equal(_halves(out), [[2.0, 6.0]])
