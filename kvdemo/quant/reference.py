"""PyTorch reference for every KV format: the ground truth the Triton kernels are tested against.

Layouts (B batch, H kv heads, T tokens, D head_dim, P = 8 // bits codes per byte):

- codes: uint8 ``[B, H, T, D // P]``, packed *planar* along head_dim: byte ``c`` of a row holds the
  codes of channels ``c, c + D/P, c + 2D/P, ...`` (lowest bits first). Plane ``p`` (a contiguous run
  of D/P channels) is one shift-and-mask away, which suits both a matmul on CPU and a Triton tile.
  fp8 codes are the raw float8 bytes (P = 1).
- groups along tokens (``axis="channel"``, keys): ``scale``/``zero`` fp16 ``[B, H, T // G, D]``;
- groups along channels (``axis="token"``, values, or keys per token): fp16 ``[B, H, T, D // G]``.
- 3-bit codes (int3, nuq3) are *bit-sliced*: three planes of 1-bit codes (8 per byte, planar as above),
  ``[B, H, T, 3 * D // 8]`` with plane j holding bit j: no bit wasted.

Integer formats are asymmetric, ``x ~ scale * code + zero`` with ``zero = min`` and
``scale = (max - min) / (2^bits - 1)``; fp8 is ``x ~ scale * fp8(x / scale)`` with
``scale = absmax / fp8_max``. Scales are clamped away from zero (no division by zero on constant
groups) and metadata is clamped to the fp16 range (finite inputs never give NaN).

Methods beyond uniform codes (kvdemo/precision.py says what each costs):
- nuq: ``x ~ scale * levels[code] + zero`` with a per-layer codebook ``levels`` in [-1, 1]; along tokens
  (keys per channel) ``zero = (max + min) / 2``, ``scale = (max - min) / 2``; along channels (values)
  ``scale = absmax``, no zero. The nearest level is taken (KVQuant's "nuq").
- nvfp4: ``x ~ e2m1(code) * e4m3(scale) * tensor_scale``: E2M1 codes (sign bit 3, magnitude index
  0..7 of 0, .5, 1, 1.5, 2, 3, 4, 6), one E4M3 scale byte per 16 channels, one fp32 ``tensor_scale``
  per ``block`` tokens and head (amax / (448 * 6)).
- outliers (dense-and-sparse): each token picks ``cap`` channels (`outlier_picks`: keys by distance from
  their channel's mean over the block in standard deviations, values by magnitude), the codes cover the
  range of the rest, and the token stores ``cap`` fp16 corrections ``outlier_delta`` (exact value minus
  dequantized code) at channels ``outlier_index`` (uint8).
- rotation R (Hadamard): the stored tensor is ``x @ R``; dequantize turns back with ``R.T``.
- rope (pre-RoPE keys): the stored tensor is the keys before RoPE; dequantize applies RoPE at positions
  ``start + row``.
Order on quantize: undo RoPE, rotate, narrow + code, corrections; dequantize runs it backwards.
References: KIVI (arXiv 2402.02750), KVQuant (arXiv 2401.18079), QuaRot (arXiv 2404.00456), NVFP4 (NVIDIA).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..precision import outlier_cap

FP16_MAX = 65504.0
MIN_SCALE = 1e-6  # fp16-representable, keeps (x - zero) / scale finite for constant groups
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
INT_BITS = {"int8": 8, "int4": 4, "int2": 2}  # uniform integer codes the Triton kernels read
CODE_BITS = {**INT_BITS, "int3": 3, "nuq4": 4, "nuq3": 3, "nuq2": 2, "nvfp4": 4}  # every indexed format
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # NVFP4 magnitudes
E4M3_MAX, E2M1_MAX = 448.0, 6.0


@dataclass
class QuantizedTensor:
    """Packed codes plus their metadata; `zero` is None for fp8, nvfp4 and absmax-scaled nuq.

    The optional fields belong to the methods beyond uniform codes (module docstring); a tensor without
    them is `plain` (what the Triton kernels read)."""

    codes: torch.Tensor  # uint8 [B, H, T, D * bits // 8]
    scale: (
        torch.Tensor
    )  # fp16, [B, H, T // G, D] (axis="channel") or [B, H, T, D // G] (axis="token"); nvfp4: uint8 E4M3
    zero: torch.Tensor | None
    fmt: str
    axis: str
    group: int
    head_dim: int
    levels: torch.Tensor | None = None  # nuq: fp16 [2^bits] codebook in [-1, 1], ascending
    tensor_scale: torch.Tensor | None = None  # nvfp4: fp32 [B, H, ceil((start + T) / block) - start // block]
    block: int = 0  # nvfp4: tokens per tensor_scale
    outlier_delta: torch.Tensor | None = None  # fp16 [B, H, T, cap] sparse corrections
    outlier_index: torch.Tensor | None = None  # uint8 [B, H, T, cap] their channels
    rotation: torch.Tensor | None = None  # fp32 [D, D]: stored = x @ rotation
    rope: object = None  # rotations.Rope: stored keys are before RoPE
    start: int = 0  # absolute position of row 0 (RoPE, nvfp4 blocks)

    @property
    def plain(self) -> bool:
        """Uniform int / fp8 codes with nothing else: the fast paths and the Triton kernels read these."""
        extras = (self.levels, self.outlier_delta, self.rotation, self.rope)
        return all(e is None for e in extras) and (self.fmt in INT_BITS or self.fmt in FP8_DTYPES)

    def nbytes(self) -> dict:
        def size(t):
            return 0 if t is None else t.numel() * t.element_size()

        return {
            "codes": size(self.codes),
            "scales": size(self.scale) + size(self.zero) + size(self.tensor_scale),
            "outliers": size(self.outlier_delta) + size(self.outlier_index),
        }


def code_bits(fmt: str) -> int:
    return CODE_BITS.get(fmt, 8)


def packed_width(fmt: str, head_dim: int) -> int:
    """Bytes of one stored row of `head_dim` codes (ValueError when head_dim cannot be packed)."""
    bits = code_bits(fmt)
    unit = 8 if bits == 3 else 8 // bits  # 3-bit: 1-bit planes of 8 channels per byte
    if head_dim % unit:
        raise ValueError(f"head_dim {head_dim} cannot be packed {bits} bits per code (needs a multiple of {unit})")
    return head_dim * bits // 8


def codes_per_byte(fmt: str) -> int:
    return 8 // INT_BITS[fmt] if fmt in INT_BITS else 1


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] (each < 2^bits) -> planar packed uint8 [..., D * bits // 8] (3 bits: bit-sliced)."""
    if bits == 3:
        return torch.cat([pack((codes >> j) & 1, 1) for j in range(3)], dim=-1)
    per_byte = 8 // bits
    if per_byte == 1:
        return codes.to(torch.uint8)
    d = codes.shape[-1]
    if d % per_byte:
        raise ValueError(f"head_dim {d} is not a multiple of {per_byte} ({bits}-bit packing)")
    planes = codes.to(torch.uint8).unflatten(-1, (per_byte, d // per_byte))  # [..., P, D/P]
    packed = planes[..., 0, :].clone()
    for p in range(1, per_byte):
        packed |= planes[..., p, :] << (bits * p)
    return packed


def unpack_planes(packed: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """Planar packed uint8 [..., D/P] -> P planes of uint8 codes [..., D/P] (channels p*D/P ...)."""
    per_byte = 8 // bits
    if per_byte == 1:
        return [packed]
    mask = (1 << bits) - 1
    return [(packed >> (bits * p)) & mask for p in range(per_byte)]


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: uint8 [..., D * bits // 8] -> uint8 codes [..., D]."""
    if bits == 3:
        sliced = packed.unflatten(-1, (3, packed.shape[-1] // 3))
        return sum(unpack(sliced[..., j, :], 1) << j for j in range(3))
    return torch.cat(unpack_planes(packed, bits), dim=-1)


def _grouped(x: torch.Tensor, axis: str, group: int) -> torch.Tensor:
    """x [B, H, T, D] -> view whose dim -2 (token axis) or -1 (channel axis) runs inside one group."""
    b, h, t, d = x.shape
    if axis == "channel":
        if t % group:
            raise ValueError(f"{t} tokens is not a whole number of {group}-token groups")
        return x.view(b, h, t // group, group, d)  # reduce over dim -2
    if d % group:
        raise ValueError(f"head_dim {d} is not a multiple of group size {group}")
    return x.view(b, h, t, d // group, group)  # reduce over dim -1


def quantize(
    x: torch.Tensor,
    fmt: str,
    axis: str,
    group: int,
    *,
    levels: torch.Tensor | None = None,
    outliers: float = 0.0,
    rotation: torch.Tensor | None = None,
    rope=None,
    start: int = 0,
    block: int = 0,
) -> QuantizedTensor:
    """x [B, H, T, D] float -> QuantizedTensor. axis="channel": groups of `group` tokens per channel.

    Keywords (the methods; module docstring): levels: nuq codebook (required for nuq formats); outliers:
    percent kept as sparse corrections; rotation [D, D]; rope: keys are turned back before RoPE from positions
    start + row; block: nvfp4 tokens per tensor scale (default: all T rows)."""
    if x.dim() != 4:
        raise ValueError(f"expected [B, H, T, D], got shape {tuple(x.shape)}")
    d = x.shape[-1]
    xf = turned(x, rotation, rope, start)
    extras = {"rotation": rotation, "rope": rope, "start": start}
    if fmt == "nvfp4":
        return _quantize_nvfp4(xf, block or x.shape[-2], extras)
    g = _grouped(xf, axis, group)
    red = -2 if axis == "channel" else -1
    cap = outlier_cap(outliers, d)
    picks = outlier_picks(xf, axis, group, cap) if cap else None  # [B, H, T, cap] channels kept exact
    if fmt in FP8_DTYPES:
        amax = g.abs().amax(dim=red, keepdim=True)
        scale = (amax / FP8_MAX[fmt]).clamp(min=MIN_SCALE).half().float()
        codes = (g / scale).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(FP8_DTYPES[fmt]).view(torch.uint8)
        zero = None
    elif fmt in CODE_BITS:
        lo, hi = _ranges(g, red, None if picks is None else _grouped(_mask(xf, picks), axis, group))
        if fmt.startswith("nuq"):
            if levels is None or levels.numel() != 1 << CODE_BITS[fmt]:
                raise ValueError(f"{fmt} needs a codebook of {1 << CODE_BITS[fmt]} levels")
            scale, zero = _nuq_scale(lo, hi, axis)
            lv = levels.to(xf.device).half().float()  # the fp16 levels stored and read back
            norm = (g - (0.0 if zero is None else zero)) / scale
            codes = torch.bucketize(norm.clamp_(-1, 1), (lv[1:] + lv[:-1]) / 2).to(torch.uint8)
        else:
            top = (1 << CODE_BITS[fmt]) - 1
            zero = lo.half().float()
            scale = ((hi - zero) / top).clamp(min=MIN_SCALE, max=FP16_MAX).half().float()
            codes = ((g - zero) / scale).round_().clamp_(0, top).to(torch.uint8)
        zero = None if zero is None else zero.squeeze(red).half()
    else:
        raise ValueError(f"cannot quantize to {fmt!r}")
    codes = codes.view(x.shape)
    q = QuantizedTensor(
        pack(codes, code_bits(fmt)),
        scale.squeeze(red).half(),
        zero,
        fmt,
        axis,
        group,
        d,
        levels=None if levels is None else levels.half().to(x.device),
        **extras,
    )
    if picks is not None:  # exact fp16 corrections at the picked channels (rotated / pre-RoPE space)
        q.outlier_index = picks.to(torch.uint8)
        q.outlier_delta = (xf - _dense(q)).gather(-1, picks).half()
    return q


def turned(x: torch.Tensor, rotation: torch.Tensor | None = None, rope=None, start: int = 0) -> torch.Tensor:
    """x cleaned up (NaN -> 0, clamped to the fp16 range) in fp32, then turned into the stored space: RoPE undone
    (pre-RoPE keys, positions start + row), then rotated (x @ rotation)."""
    xf = torch.nan_to_num(x.float(), nan=0.0, posinf=FP16_MAX, neginf=-FP16_MAX).clamp(-FP16_MAX, FP16_MAX)
    if rope is not None:
        xf = rope.undo(xf, start)
    if rotation is not None:
        xf = xf @ rotation.to(xf.device)
    return xf


def outlier_picks(x: torch.Tensor, axis: str, group: int, cap: int) -> torch.Tensor:
    """The `cap` channels of each token kept exact, long [B, H, T, cap]: per channel (axis="channel", keys) the
    elements farthest from their channel's mean over the block, in the channel's standard deviations (a
    per-channel threshold, capped per token); per token (values) the largest magnitudes. The codes' ranges
    are then taken over the rest, so no element is clipped without its correction."""
    if axis == "channel":
        g = _grouped(x, "channel", group)  # [B, H, NB, G, D]
        mean, std = g.mean(-2, keepdim=True), g.std(-2, keepdim=True) if group > 1 else torch.ones_like(g[..., :1, :])
        score = ((g - mean).abs() / (std + 1e-12)).view(x.shape)
    else:
        score = x.abs()
    return score.topk(cap, dim=-1).indices


def _mask(x: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    return torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter_(-1, picks, True)


def _ranges(g: torch.Tensor, red: int, picked: torch.Tensor | None = None):
    """[lo, hi] of each group over its elements that are not `picked` (bool, g's shape; None: all of them)."""
    if picked is None:
        return g.amin(dim=red, keepdim=True), g.amax(dim=red, keepdim=True)
    lo = torch.where(picked, torch.inf, g).amin(dim=red, keepdim=True)
    hi = torch.where(picked, -torch.inf, g).amax(dim=red, keepdim=True)
    empty = torch.isinf(lo)  # every element picked (tiny groups): the whole range
    return torch.where(empty, g.amin(dim=red, keepdim=True), lo), torch.where(empty, g.amax(dim=red, keepdim=True), hi)


def _nuq_scale(lo: torch.Tensor, hi: torch.Tensor, axis: str):
    """nuq's (scale, zero) in fp16-rounded fp32: [min, max] -> [-1, 1] along tokens, absmax along channels."""
    if axis == "channel":
        zero = ((hi + lo) / 2).clamp(-FP16_MAX, FP16_MAX).half().float()
        half = torch.maximum(hi - zero, zero - lo)  # covers both ends after zero's rounding
        return half.clamp(min=MIN_SCALE, max=FP16_MAX).half().float(), zero
    absmax = torch.maximum(hi.abs(), lo.abs())
    return absmax.clamp(min=MIN_SCALE, max=FP16_MAX).half().float(), None


def _row_blocks(start: int, rows: int, block: int, device) -> torch.Tensor:
    """nvfp4: index of each of `rows` rows starting at position `start` among the tensor scales, long [rows]
    (blocks of `block` positions, counted from the one holding `start`)."""
    return (start + torch.arange(rows, device=device)) // block - start // block


def _quantize_nvfp4(xf: torch.Tensor, block: int, extras: dict) -> QuantizedTensor:
    """NVFP4: per block of `block` rows and head an fp32 tensor scale, per 16 channels an E4M3 scale, E2M1 codes."""
    b, h, t, d = xf.shape
    start = extras["start"]
    if d % 16:
        raise ValueError(f"nvfp4 needs head_dim a multiple of 16, not {d}")
    rows_block = _row_blocks(start, t, block, xf.device)  # [T] block of each row
    n_blocks = int(rows_block[-1]) + 1 if t else 0
    amax = torch.zeros(b, h, n_blocks, device=xf.device).scatter_reduce_(
        2, rows_block.view(1, 1, t).expand(b, h, t), xf.abs().amax(-1), "amax"
    )
    tensor_scale = (amax / (E4M3_MAX * E2M1_MAX)).clamp(min=1e-12)  # fp32 [B, H, NB]
    ts = tensor_scale[:, :, rows_block].unsqueeze(-1).unsqueeze(-1)  # [B, H, T, 1, 1]
    g = xf.view(b, h, t, d // 16, 16)
    s = (g.abs().amax(-1, keepdim=True) / E2M1_MAX / ts).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    s_dec = (s.float() * ts).clamp(min=1e-30)
    mags = torch.tensor(E2M1, device=xf.device)
    y = g / s_dec
    idx = torch.bucketize(y.abs().clamp(max=E2M1_MAX), (mags[1:] + mags[:-1]) / 2)
    codes = (idx | ((y < 0) & (idx > 0)).to(idx.dtype) << 3).to(torch.uint8).view(b, h, t, d)
    return QuantizedTensor(
        pack(codes, 4),
        s.view(torch.uint8).view(b, h, t, d // 16),
        None,
        "nvfp4",
        "token",
        16,
        d,
        tensor_scale=tensor_scale,
        block=block,
        **extras,
    )


def decode_codes(packed: torch.Tensor, fmt: str) -> torch.Tensor:
    """Packed uint8 [..., D/P] -> code values as float32 [..., D] (integer levels or fp8 values)."""
    if fmt in FP8_DTYPES:
        return packed.view(FP8_DTYPES[fmt]).float()
    return unpack(packed, code_bits(fmt)).float()


def code_values(q: QuantizedTensor) -> torch.Tensor:
    """The codes' values before scaling, fp32 [B, H, T, D]: integer levels, fp8 values, codebook levels (nuq)
    or signed E2M1 magnitudes (nvfp4)."""
    vals, order = looked_up(q)
    return vals if order is None else vals.index_select(-1, _inverse(order))


def looked_up(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`code_values` in the order the lookup leaves them: (values fp32 [B, H, T, D], order [D] or None) with
    values[..., j] the value of channel order[j] (None: channel order). Codebook formats at 2 and 4 bits are
    looked up a byte at a time (`_byte_words`, one int64 word per byte, which beats gathering rows of a
    [256, P] float table ~3x on CPU); 3-bit codes come out of their bit planes a byte at a time
    (`_three_bit_codes`). That leaves a byte's channels side by side; callers that can permute the query (or
    the output) instead skip the copy."""
    bits = code_bits(q.fmt)
    if bits == 3:
        codes, order = _three_bit_codes(q.codes)
        return (codes.float() if q.levels is None else _lookup(q.levels.float(), codes)), order
    if q.fmt == "nvfp4" or q.levels is not None:
        table = _E2M1_SIGNED.to(q.codes.device) if q.fmt == "nvfp4" else q.levels
        per_byte = 8 // bits
        words, dtype = _byte_words(table, bits)
        *lead, width = q.codes.shape
        vals = _lookup(words, q.codes).view(dtype).float()
        return vals.view(*lead, width * per_byte), _byte_order(width, per_byte, q.codes.device)
    return codes_to_float(q.codes, q.fmt), None


def _three_bit_codes(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """3-bit planar codes uint8 [..., 3W] (`pack`: bit j of channel p*W + c is bit p of plane j's byte c) ->
    (codes uint8 [..., 8W] with position c*8 + p holding channel p*W + c, that order [8W]).

    Each plane's bytes are looked up in `_bit_bytes` (byte -> its 8 bits spread one per byte of an int64),
    and the three planes' words are shifted into place: 3 gathers of W bytes instead of 24 mask-and-shift
    passes over D channels (~6x faster on CPU)."""
    w = packed.shape[-1] // 3
    planes = packed.unflatten(-1, (3, w))  # [..., 3, W]
    spread = _bit_bytes(packed.device)
    word = _lookup(spread, planes[..., 0, :])  # [..., W] int64
    word |= _lookup(spread, planes[..., 1, :]) << 1
    word |= _lookup(spread, planes[..., 2, :]) << 2
    return word.view(torch.uint8), _byte_order(w, 8, packed.device)  # int64 -> 8 bytes, little-endian


@functools.lru_cache(maxsize=8)
def _bit_bytes(device) -> torch.Tensor:
    """int64 [256]: entry b holds bit p of b in byte p (the low bit of each byte; little-endian bytes)."""
    byte, p = torch.arange(256).unsqueeze(1), torch.arange(8)
    return (((byte >> p) & 1) << (8 * p)).sum(-1).to(device)


def _lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table [L] at each of index [..., W] (any integer dtype) -> [..., W]: a gather on the table broadcast
    over the index's rows (stride 0, no copy). On CPU the gather splits rows across threads, where a 1-D
    `index_select` runs on one (~1.5x faster here at 4096 tokens x 3 heads; same values, bit for bit)."""
    rows = index.long().view(-1, index.shape[-1])  # [R, W]
    return table.view(1, -1).expand(len(rows), -1).gather(1, rows).view(index.shape)


_WORDS = WeakIdKeyDictionary()  # levels tensor -> (words, dtype): built once per codebook, not per call


def _byte_words(table: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.dtype]:
    """A 256-entry int64 table whose entry b holds the levels of byte b's P = 8 // bits codes as bit patterns
    (4 bits: 2 fp32 levels; 2 bits: 4 fp16 levels, exact as the levels are fp16), and the dtype to view the
    gathered words as. Cached per levels tensor (its 2^bits entries fix `bits`; a cache's codebooks live as
    long as the cache)."""
    hit = _WORDS.get(table)
    if hit is None:
        byte = torch.arange(256, device=table.device)
        levels = table.float()
        per_byte = 8 // bits
        levels = torch.stack([levels[(byte >> (bits * p)) & ((1 << bits) - 1)] for p in range(per_byte)], -1)
        word = levels if per_byte == 2 else levels.half()
        hit = _WORDS[table] = (word.contiguous().view(torch.int64).view(256), word.dtype)
    return hit


@functools.lru_cache(maxsize=64)
def _byte_order(width: int, per_byte: int, device) -> torch.Tensor:
    """Channel of each position of a byte-wise lookup: position c * P + p holds channel p * width + c (cached:
    callers only read it)."""
    j = torch.arange(width * per_byte, device=device)
    return (j % per_byte) * width + j // per_byte


_INVERSES = WeakIdKeyDictionary()  # order -> its inverse permutation (orders come from the cached `_byte_order`)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inverse = _INVERSES.get(order)
    if inverse is None:
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
        _INVERSES[order] = inverse
    return inverse


_E2M1_SIGNED = torch.tensor(E2M1 + tuple(-m for m in E2M1))  # code -> value: bit 3 is the sign


def group_scale(q: QuantizedTensor) -> torch.Tensor:
    """Each group's scale as fp32, shaped like `q.scale` (nvfp4: E4M3 scale x the row's tensor scale)."""
    if q.fmt != "nvfp4":
        return q.scale.float()
    t = q.codes.shape[-2]
    rows_block = _row_blocks(q.start, t, q.block, q.codes.device)
    return q.scale.view(torch.float8_e4m3fn).float() * q.tensor_scale[:, :, rows_block].unsqueeze(-1)


def _dense(q: QuantizedTensor) -> torch.Tensor:
    """The codes and their scales alone, fp32 [B, H, T, D] in the stored space (rotated / pre-RoPE, no
    sparse corrections)."""
    codes = code_values(q)  # [B, H, T, D]
    g = _grouped(codes, q.axis, q.group)
    red = -2 if q.axis == "channel" else -1
    x = g * group_scale(q).unsqueeze(red)
    if q.zero is not None:
        x = x + q.zero.float().unsqueeze(red)
    return x.view(codes.shape)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """QuantizedTensor -> [B, H, T, D] in `dtype`: codes, sparse corrections, rotation back, RoPE."""
    x = _dense(q)
    if q.outlier_delta is not None:
        x.scatter_add_(-1, q.outlier_index.long(), q.outlier_delta.float())
    if q.rotation is not None:
        x = x @ q.rotation.to(x.device).T
    if q.rope is not None:
        x = q.rope.apply(x, q.start)
    # inputs were clamped to the fp16 range; metadata rounding can overshoot it by a step, which
    # would round to inf in an fp16 cache: clamp back
    return x.clamp_(-FP16_MAX, FP16_MAX).to(dtype)


def max_abs_error_bound(x: torch.Tensor, fmt: str, axis: str, group: int) -> torch.Tensor:
    """Per-element worst-case round-trip error for `x` [B, H, T, D] (used by the tests).

    int: half a quantization step (+ fp16 rounding of the zero point); fp8: half an ulp at the
    element's magnitude (2^-4 relative for e4m3, 2^-3 for e5m2) plus the subnormal floor.
    """
    xf = x.float()
    g = _grouped(xf, axis, group)
    red = -2 if axis == "channel" else -1
    if fmt in INT_BITS:
        levels = (1 << INT_BITS[fmt]) - 1
        span = g.amax(dim=red, keepdim=True) - g.amin(dim=red, keepdim=True)
        step = (span / levels).clamp(min=MIN_SCALE)
        absmax = g.abs().amax(dim=red, keepdim=True)
        bound = step * 0.5 * (1 + 2e-3) + absmax * 1e-3
        # exact terms with the fp16 metadata quantize() stores (they dominate for tiny groups, where
        # scale and zero are fp16 subnormals): half a stored step, or the clamp error at either end
        lo, hi = g.amin(dim=red, keepdim=True), g.amax(dim=red, keepdim=True)
        lo_h = lo.half().float()
        scale_h = (span / levels).clamp(min=MIN_SCALE, max=FP16_MAX).half().float()
        exact = torch.maximum(torch.maximum(0.5 * scale_h, hi - lo_h - levels * scale_h), lo_h - lo)
        bound = torch.maximum(bound, exact * (1 + 1e-5) + absmax * 1e-6)
        return bound.expand_as(g).reshape(x.shape)
    rel = {"fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}[fmt]
    scale = (g.abs().amax(dim=red, keepdim=True) / FP8_MAX[fmt]).clamp(min=MIN_SCALE)
    floor = scale * {"fp8_e4m3": 2.0**-9, "fp8_e5m2": 2.0**-16}[fmt] * 2
    return (g.abs() * rel * (1 + 2e-3) + floor + scale * 1e-3).reshape(x.shape)


# --- attention over the packed cache: the PyTorch twin of triton_decode.past_attention ----------


def codes_to_float(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Packed codes [..., D/P] -> code values as float32 [..., D] (integer levels at 2, 4 and 8 bits, or fp8
    values; 3-bit codes come out of their bit planes in `looked_up`, `_three_bit_codes`).

    The fast CPU route: integer planes are masked and converted straight into one float buffer;
    fp8 bytes are turned into fp16 bit patterns (e5m2 is the top byte of an fp16; e4m3fn shifted
    into fp16 is exact up to a factor 2^8), since torch's float8 -> float32 cast is slow on CPU.
    """
    if fmt == "fp8_e5m2":
        return (codes.to(torch.int16) << 8).view(torch.float16).float()
    if fmt == "fp8_e4m3":
        wide = codes.to(torch.int16)
        bits = ((wide & 0x80) << 8) | ((wide & 0x7F) << 7)
        return bits.view(torch.float16).float().mul_(256.0)
    bits = code_bits(fmt)
    per_byte = 8 // bits
    if per_byte == 1:
        return codes.float()
    dp = codes.shape[-1]
    out = torch.empty(*codes.shape[:-1], dp * per_byte, dtype=torch.float32, device=codes.device)
    mask = (1 << bits) - 1
    for p in range(per_byte):
        plane = codes if p == 0 else codes >> (bits * p)
        out[..., p * dp : (p + 1) * dp].copy_(plane & mask if p < per_byte - 1 else plane)
    return out


CPU_BLOCK = 4096  # stored positions turned into floats at a time: a multiple of every group size


def _rows(q: QuantizedTensor, start: int, stop: int) -> QuantizedTensor:
    """Rows [start, stop) of a stored QuantizedTensor (channel axis: whole groups, start % group == 0)."""
    if q.axis == "channel":
        meta = slice(start // q.group, -(-stop // q.group))
    else:
        meta = slice(start, stop)
    zero = None if q.zero is None else q.zero[:, :, meta]
    out = replace(q, codes=q.codes[:, :, start:stop], scale=q.scale[:, :, meta], zero=zero, start=q.start + start)
    if q.outlier_delta is not None:
        out.outlier_delta, out.outlier_index = q.outlier_delta[:, :, start:stop], q.outlier_index[:, :, start:stop]
    if q.tensor_scale is not None:
        first = q.start // q.block
        out.tensor_scale = q.tensor_scale[
            :, :, (q.start + start) // q.block - first : (q.start + stop - 1) // q.block - first + 1
        ]
    return out


def _channel_key_scores(qg: torch.Tensor, keys: QuantizedTensor) -> torch.Tensor:
    """Scores of qg [B, H, M, D] against per-channel-quantized keys (whole groups), from the codes.

    k[t, c] = scale[b(t), c] * code[t, c] + zero[b(t), c]  =>
    q . k_t = q . (scale_b * code_t) + q . zero_b   (codes scaled in their float buffer, one matmul)
    """
    b, h, m, d = qg.shape
    scale = keys.scale.float()  # [B, H, NB, D]
    nb, g = scale.shape[-2], keys.group
    vals, order = looked_up(keys)
    codes = vals.view(b, h, nb, g, d)  # [B, H, NB, G, D]
    q_ordered = qg if order is None else qg.index_select(-1, order)  # q . k is the same in any channel order
    codes.mul_((scale if order is None else scale.index_select(-1, order)).unsqueeze(3))
    scores = (q_ordered @ codes.view(b, h, nb * g, d).transpose(-1, -2)).view(b, h, m, nb, g)  # [B, H, M, NB, G]
    if keys.zero is not None:
        scores = scores + (qg @ keys.zero.float().transpose(-1, -2)).unsqueeze(-1)  # + [B, H, M, NB, 1]
    return scores.view(b, h, m, nb * g)


def _key_scores(qg: torch.Tensor, keys: QuantizedTensor) -> torch.Tensor:
    """Scores qg [B, H, M, D] . k_t for every stored row of `keys` (channel axis: whole groups) -> [B, H, M, T].

    From the codes, never a dequantized copy in the original space: a Hadamard turns the query instead
    of the keys ((q R) . (k R) = q . k), sparse outliers add q[idx] * delta. Pre-RoPE keys are turned per
    position, so they are dequantized (and RoPE applied) first."""
    if keys.rope is not None:
        return qg @ dequantize(keys).transpose(-1, -2)
    qk = qg if keys.rotation is None else qg @ keys.rotation
    if keys.axis == "channel":
        scores = _channel_key_scores(qk, keys)
    else:
        scores = qk @ _dense(keys).transpose(-1, -2)
    if keys.outlier_delta is not None:  # sum_j q[idx_tj] delta_tj
        b, h, m, _ = qk.shape
        t, cap = keys.outlier_index.shape[-2:]
        idx = keys.outlier_index.long().view(b, h, 1, t * cap).expand(b, h, m, t * cap)
        picked = qk.gather(-1, idx).mul_(keys.outlier_delta.float().view(b, h, 1, t * cap))
        scores += picked if cap == 1 else picked.view(b, h, m, t, cap).sum(-1)  # scores: this call's own buffer
    return scores


def _token_value_output(p: torch.Tensor, values: QuantizedTensor) -> torch.Tensor:
    """sum_t p[m, t] v_t for stored values (any format and method): the codes' output in the stored space,
    sparse outliers scattered in, a Hadamard undone on the output [M, D] rather than on every value."""
    out = _plain_value_output(p, values)
    if values.outlier_delta is not None:
        b, h, m, t = p.shape
        cap = values.outlier_index.shape[-1]
        src = (p.unsqueeze(-1) * values.outlier_delta.float().unsqueeze(2)).view(b, h, m, t * cap)
        idx = values.outlier_index.long().view(b, h, 1, t * cap).expand(b, h, m, t * cap)
        out = out.scatter_add_(-1, idx, src)  # out: this call's own buffer
    if values.rotation is not None:
        out = out @ values.rotation.T
    return out


def _plain_value_output(p: torch.Tensor, values: QuantizedTensor) -> torch.Tensor:
    """sum_t p[m, t] v_t for per-token-quantized values, from the codes.

    p [B, H, M, T]; values: codes [B, H, T, D/P], scale/zero [B, H, T, D/G]; v_tc = s_tj code_tc + z_tj (j = c // G).
    One group per token (G = D): out = (p * s) @ code + (p @ z); else the scales go into the codes.
    """
    b, h, m, t = p.shape
    codes, order = looked_up(values)  # [B, H, T, D]
    d, group, scale, zero = codes.shape[-1], values.group, group_scale(values), values.zero
    if group == d:
        out = (p * scale.float()[..., 0].unsqueeze(2)) @ codes  # [B, H, M, D]
        if order is not None:  # back to channel order: [M, D], not the [T, D] values
            out = out.index_select(-1, _inverse(order))
    else:
        if order is not None:
            codes = codes.index_select(-1, _inverse(order))
        codes.view(b, h, t, d // group, group).mul_(scale.float().unsqueeze(-1))
        out = p @ codes
    if zero is not None and group == d:  # sum_t p_t z_t: a reduction (a [M, T] @ [T, 1] matmul is ~7x slower on CPU)
        out = out + (p * zero.float()[..., 0].unsqueeze(2)).sum(-1, keepdim=True)
    elif zero is not None:
        out = out + (p @ zero.float()).repeat_interleave(group, dim=-1)
    return out


def _coded_key_logits(qg: torch.Tensor, keys: QuantizedTensor, start: int, stop: int, out: torch.Tensor) -> None:
    """Write qg's scores against coded positions [start, stop) into out [B, H, M, stop - start], CPU_BLOCK
    positions at a time (channel-axis blocks aligned to whole groups)."""
    for a in range((start // CPU_BLOCK) * CPU_BLOCK, stop, CPU_BLOCK):
        e = min(a + CPU_BLOCK, keys.codes.shape[-2])
        lo, hi = max(a, start), min(e, stop)
        if keys.axis == "channel":
            scores = _key_scores(qg, _rows(keys, a, e))[..., lo - a : hi - a]
        else:
            scores = _key_scores(qg, _rows(keys, lo, hi))
        out[..., lo - start : hi - start] = scores


def _past_logits(
    query: torch.Tensor, kv, scaling: float, mask: torch.Tensor | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Scaled scores of query [B, Hq, n, D] over the packed past -> fp32 [B, Hkv, M, length] (M = Hq/Hkv * n).

    Rows are (head in group, query), so `.reshape(B, Hq, n, length)` is the per-query-head layout.
    Masked positions are -inf. softcap (Gemma-2): scores -> tanh(s / softcap) * softcap, before the mask.
    """
    b, hq, n, d = query.shape
    r, hkv = kv.regions, kv.kv_heads
    grp = hq // hkv
    qg = query.float().reshape(b, hkv, grp * n, d)  # [B, Hkv, M, D], rows = (head in group, query)
    logits = torch.empty(b, hkv, grp * n, r.tokens, dtype=torch.float32, device=query.device)
    logits[..., : r.sinks] = qg @ kv.keys.sinks.float().transpose(-1, -2)
    if r.has_codes:
        _coded_key_logits(qg, kv.keys.quantized, r.sinks, r.quantized, logits[..., r.sinks : r.quantized])
    logits[..., r.residual_start :] = qg @ kv.keys.residual.float().transpose(-1, -2)
    logits *= scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if mask is not None:
        m = mask.expand(b, hq, n, r.tokens).reshape(b, hkv, grp * n, r.tokens)
        logits = logits.masked_fill(~m, float("-inf"))
    return logits


def past_attention(
    query: torch.Tensor, kv, scaling: float, mask: torch.Tensor | None = None, softcap: float | None = None
):
    """Attention of every query over the stored past of one layer (no causal mask is needed: every
    stored position precedes every query). Grouped-query: one K/V read serves each group of heads.

    query: [B, Hq, n, D]; kv: cache.PackedKV with kv.length > 0, Hkv heads dividing Hq;
    mask: optional bool [B, 1 or Hq, n, length], True = attend; softcap: optional logit cap (Gemma-2).
    Returns (out fp32 [B, Hq, n, D], lse fp32 [B, Hq, n]) for a log-sum-exp merge with other parts.

    Memory: besides the scores (M x length fp32, the attention weights themselves), codes are turned into
    floats CPU_BLOCK positions at a time, so the extra memory is bounded by the block, not the past.
    """
    b, hq, n, d = query.shape
    r = kv.regions
    logits = _past_logits(query, kv, scaling, mask, softcap)  # [B, Hkv, M, length]
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [B, Hkv, M, 1]
    probs = torch.exp(logits - lse).nan_to_num_(0.0)
    out = probs[..., : r.sinks] @ kv.values.sinks.float()
    for lo in range(r.sinks, r.quantized if r.has_codes else r.sinks, CPU_BLOCK):
        hi = min(lo + CPU_BLOCK, r.quantized)
        out = out + _token_value_output(probs[..., lo:hi], _rows(kv.values.quantized, lo, hi))
    if r.residual:
        out = out + probs[..., r.residual_start :] @ kv.values.residual.float()
    return out.reshape(b, hq, n, d), lse.reshape(b, hq, n)


SCORE_ELEMENTS = 1 << 21  # streamed attention: scores held at once (query rows x piece, fp32: 8 MiB)


def flash_attention(query, keys, values, scaling: float, causal: bool = False):
    """(out fp32, lse fp32 [B, H, M]) of query [B, H, M, D] over keys/values [B, H, L, D] with PyTorch's fused
    CPU flash-attention kernel (tiled: no M x L scores), or None where it is missing or not on the CPU.
    causal: query i sees keys [0, i] (M == L). The kernel is private API of the pinned torch, probed once."""
    if query.device.type != "cpu" or not _FLASH:
        return None
    q, k, v = (t.float().contiguous() for t in (query, keys, values))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scaling)
    return out, lse


_FLASH = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _segment_tensors(kv, part: str, kind: str, lo: int, hi: int) -> torch.Tensor:
    """Keys or values of positions [lo, hi) of one piece of the past, as fp32 [B, H, hi - lo, D]."""
    stored = getattr(kv, part)
    r = kv.regions
    if kind != "coded":
        offset = 0 if kind == "sinks" else r.residual_start
        return (stored.sinks if kind == "sinks" else stored.residual)[:, :, lo - offset : hi - offset].float()
    q = stored.quantized
    if q.axis == "channel":  # whole groups of tokens, sliced to [lo, hi)
        a, e = (lo // q.group) * q.group, -(-hi // q.group) * q.group
        return dequantize(_rows(q, a, e))[:, :, lo - a : hi - a]
    return dequantize(_rows(q, lo, hi))


def merge(out_a, lse_a, out_b, lse_b):
    """Combine two partial softmax attentions over disjoint key sets (log-sum-exp weights)."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.exp(lse_a - lse).nan_to_num_(0.0).unsqueeze(-1)
    wb = torch.exp(lse_b - lse).nan_to_num_(0.0).unsqueeze(-1)
    return out_a * wa + out_b * wb, lse


def _segments(r, block: int):
    """Pieces (kind, start, stop) of the stored past [0, r.tokens): the sinks, the coded positions in
    `block`-aligned pieces, the residual in pieces of at most `block`."""
    if r.sinks:
        yield "sinks", 0, r.sinks
    if r.has_codes:
        for a in range((r.sinks // block) * block, r.quantized, block):
            yield "coded", max(a, r.sinks), min(a + block, r.quantized)
    for a in range(r.residual_start, r.tokens, block):
        yield "residual", a, min(a + block, r.tokens)


def _segment_keys_values(kv, kind: str, lo: int, hi: int, qg: torch.Tensor):
    """Scores of qg [B, H, M, D] against positions [lo, hi) (unscaled, fp32) and a function p -> p @ V."""
    r = kv.regions
    if kind != "coded":
        offset = 0 if kind == "sinks" else r.residual_start
        part_k = kv.keys.sinks if kind == "sinks" else kv.keys.residual
        part_v = kv.values.sinks if kind == "sinks" else kv.values.residual
        v = part_v[:, :, lo - offset : hi - offset].float()
        return qg @ part_k[:, :, lo - offset : hi - offset].float().transpose(-1, -2), lambda p: p @ v
    keys = kv.keys.quantized
    if keys.axis == "channel":  # whole groups of tokens, sliced to [lo, hi)
        a, e = (lo // keys.group) * keys.group, -(-hi // keys.group) * keys.group
        scores = _key_scores(qg, _rows(keys, a, e))[..., lo - a : hi - a]
    else:
        scores = _key_scores(qg, _rows(keys, lo, hi))
    values = _rows(kv.values.quantized, lo, hi)
    return scores, lambda p: _token_value_output(p, values)


def past_attention_streamed(
    query: torch.Tensor,
    kv,
    scaling: float,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
):
    """`past_attention` for many queries (a prefill chunk over a long stored past), in bounded memory.

    The past is read piece by piece (sinks, coded blocks, residual) with an online softmax: at any time
    one piece's scores (query rows x piece, at most SCORE_ELEMENTS fp32) and one piece of codes turned
    into floats are held, never scores over the whole past nor a float copy of it. Without a mask, softcap
    or window, on the CPU, each piece (CPU_BLOCK positions, dequantized) goes through PyTorch's fused
    flash-attention kernel instead, which holds no scores at all.
    query: [B, Hq, n, D], the queries at positions kv.length + i (they follow the whole stored past);
    mask: optional bool [B, 1 or Hq, n, length]; softcap as in `past_attention`; window: a sliding
    window (query at p sees keys k > p - window). Returns (out fp32 [B, Hq, n, D], lse fp32 [B, Hq, n]).
    """
    b, hq, n, d = query.shape
    r, hkv = kv.regions, kv.kv_heads
    grp = hq // hkv
    rows = grp * n
    qg = query.float().reshape(b, hkv, rows, d)  # [B, Hkv, M, D], rows = (head in group, query)
    block = max(256, (SCORE_ELEMENTS // rows) // 256 * 256)  # a multiple of every group size
    q_pos = (kv.length + torch.arange(n, device=query.device)).repeat(grp)  # [M] the row's position
    out = torch.zeros(b, hkv, rows, d, dtype=torch.float32, device=query.device)
    lse = torch.full((b, hkv, rows), float("-inf"), dtype=torch.float32, device=query.device)
    if mask is None and softcap is None and window is None and query.device.type == "cpu" and _FLASH:
        for kind, lo, hi in _segments(r, CPU_BLOCK):  # the fused kernel over dequantized pieces of the past
            k, v = _segment_tensors(kv, "keys", kind, lo, hi), _segment_tensors(kv, "values", kind, lo, hi)
            out, lse = merge(out, lse, *flash_attention(qg, k, v, scaling))
        return out.reshape(b, hq, n, d), lse.reshape(b, hq, n)
    for kind, lo, hi in _segments(r, block):
        if window is not None and hi <= int(q_pos.min()) - window + 1:
            continue  # every query's window starts after this piece
        scores, weighted_values = _segment_keys_values(kv, kind, lo, hi, qg)
        logits = scores * scaling  # [B, Hkv, M, hi - lo]
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if mask is not None:
            logits = logits.masked_fill(~mask[..., lo:hi].expand(b, hq, n, hi - lo).reshape(logits.shape), -torch.inf)
        if window is not None:
            k_pos = torch.arange(lo, hi, device=query.device)
            logits = logits.masked_fill(k_pos <= (q_pos[:, None] - window), -torch.inf)
        seg_lse = torch.logsumexp(logits, dim=-1)  # [B, Hkv, M]
        probs = torch.exp(logits - seg_lse.unsqueeze(-1)).nan_to_num_(0.0)
        out, lse = merge(out, lse, weighted_values(probs), seg_lse)
    return out.reshape(b, hq, n, d), lse.reshape(b, hq, n)


def past_probabilities(
    query: torch.Tensor,
    kv,
    scaling: float,
    mask: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention probabilities of every query over the packed past (the weights `past_attention` uses).

    query: [B, Hq, n, D]; kv: cache.PackedKV; mask as in `past_attention`; lse: optional fp32
    [B, Hq, n], the log-sum-exp to normalize by (e.g. over past + new tokens, so these probabilities
    are the past's slice of the whole distribution); default: the past's own, so each row sums to 1.
    Returns fp32 [B, Hq, n, length] (masked positions are 0).
    """
    b, hq, n, _ = query.shape
    logits = _past_logits(query, kv, scaling, mask, softcap).reshape(b, hq, n, kv.length)  # [B, Hq, n, length]
    norm = torch.logsumexp(logits, dim=-1) if lse is None else lse.float()  # [B, Hq, n]
    return torch.exp(logits - norm.unsqueeze(-1)).nan_to_num_(0.0)
