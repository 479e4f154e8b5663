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

from .. import formats
from ..precision import outlier_cap

FP16_MAX = 65504.0
MIN_SCALE = 1e-6  # fp16-representable, keeps (x - zero) / scale finite for constant groups
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
    paired: bool = False  # scale and zero are the halves of one tensor's rows (`paired`)

    @property
    def plain(self) -> bool:
        """Uniform int / fp8 codes with nothing else: the fast paths and the Triton kernels read these."""
        extras = (self.levels, self.outlier_delta, self.rotation, self.rope)
        return all(e is None for e in extras) and formats.get(self.fmt).planar

    def nbytes(self) -> dict:
        def size(t):
            return 0 if t is None else t.numel() * t.element_size()

        return {
            "codes": size(self.codes),
            "scales": size(self.scale) + size(self.zero) + size(self.tensor_scale),
            "outliers": size(self.outlier_delta) + size(self.outlier_index),
        }


def values_paired(spec) -> bool:
    """Whether a cache at `spec` stores its values' scales and zeros in shared rows (`paired`): values of a
    format with zero points. The cache lays them out so, and the decode launcher passes their strides so."""
    return spec.is_quantized and spec.value.has_zero("token")


def pair_rows(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Scale and zero [..., W] as one tensor's rows [..., 2W]: W scales, then W zeros (`unpair_rows` splits them)."""
    return torch.cat([scale, zero], dim=-1)


def unpair_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (scale, zero) halves [..., W] of `pair_rows`' rows [..., 2W], as views."""
    w = rows.shape[-1] // 2
    return rows[..., :w], rows[..., w:]


def paired(q: QuantizedTensor) -> QuantizedTensor:
    """q with its scale and zero [..., W] as the two halves of one [..., 2W] tensor's rows (`pair_rows`), how
    the cache stores values' metadata (`q.paired` says so): a token's scale and zero of one group are then one
    4-byte word, which the decode kernel copies asynchronously (a 2-byte load it would wait on). One copy,
    unless q is paired already."""
    if q.paired or q.zero is None:
        return q
    scale, zero = unpair_rows(pair_rows(q.scale, q.zero))
    return replace(q, scale=scale, zero=zero, paired=True)


def code_bits(fmt: str) -> int:
    return formats.get(fmt).bits


def _fp8_dtype(f: formats.Format) -> torch.dtype:
    return getattr(torch, f.fp8_dtype)


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
    f = formats.get(fmt)
    xf = turned(x, rotation, rope, start)
    extras = {"rotation": rotation, "rope": rope, "start": start}
    if f.family == "nvfp4":
        return _quantize_nvfp4(xf, block or x.shape[-2], extras)
    g = _grouped(xf, axis, group)
    red = -2 if axis == "channel" else -1
    cap = outlier_cap(outliers, d)
    picks = outlier_picks(xf, axis, group, cap) if cap else None  # [B, H, T, cap] channels kept exact
    if f.family == "fp8":
        amax = g.abs().amax(dim=red, keepdim=True)
        scale = (amax / f.fp8_max).clamp(min=MIN_SCALE).half().float()
        codes = (g / scale).clamp(-f.fp8_max, f.fp8_max).to(_fp8_dtype(f)).view(torch.uint8)
        zero = None
    elif f.family in ("int", "nuq"):
        lo, hi = _ranges(g, red, None if picks is None else _grouped(_mask(xf, picks), axis, group))
        if f.codebook:
            if levels is None or levels.numel() != f.levels:
                raise ValueError(f"{fmt} needs a codebook of {f.levels} levels")
            scale, zero = _nuq_scale(lo, hi, axis)
            lv = levels.to(xf.device).half().float()  # the fp16 levels stored and read back
            norm = (g - (0.0 if zero is None else zero)) / scale
            codes = torch.bucketize(norm.clamp_(-1, 1), (lv[1:] + lv[:-1]) / 2).to(torch.uint8)
        else:
            top = (1 << f.bits) - 1
            zero = lo.half().float()
            scale = ((hi - zero) / top).clamp(min=MIN_SCALE, max=FP16_MAX).half().float()
            codes = ((g - zero) / scale).round_().clamp_(0, top).to(torch.uint8)
        zero = None if zero is None else zero.squeeze(red).half()
    else:
        raise ValueError(f"cannot quantize to {fmt!r}")
    codes = codes.view(x.shape)
    q = QuantizedTensor(
        pack(codes, f.bits),
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
        q.outlier_delta = (xf - scaled_codes(q)).gather(-1, picks).half()
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
    f = formats.get(fmt)
    if f.family == "fp8":
        return packed.view(_fp8_dtype(f)).float()
    return unpack(packed, f.bits).float()


def code_values(q: QuantizedTensor) -> torch.Tensor:
    """The codes' values before scaling, fp32 [B, H, T, D]: integer levels, fp8 values, codebook levels (nuq)
    or signed E2M1 magnitudes (nvfp4)."""
    vals, order = looked_up(q)
    return vals if order is None else vals.index_select(-1, inverse_order(order))


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
    nvfp4 = formats.get(q.fmt).family == "nvfp4"
    if nvfp4 or q.levels is not None:
        table = _E2M1_SIGNED.to(q.codes.device) if nvfp4 else q.levels
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


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    inverse = _INVERSES.get(order)
    if inverse is None:
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
        _INVERSES[order] = inverse
    return inverse


_E2M1_SIGNED = torch.tensor(E2M1 + tuple(-m for m in E2M1))  # code -> value: bit 3 is the sign


def group_scale(q: QuantizedTensor) -> torch.Tensor:
    """Each group's scale as fp32, shaped like `q.scale` (nvfp4: E4M3 scale x the row's tensor scale)."""
    if formats.get(q.fmt).family != "nvfp4":
        return q.scale.float()
    t = q.codes.shape[-2]
    rows_block = _row_blocks(q.start, t, q.block, q.codes.device)
    return q.scale.view(torch.float8_e4m3fn).float() * q.tensor_scale[:, :, rows_block].unsqueeze(-1)


def scaled_codes(q: QuantizedTensor) -> torch.Tensor:
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
    x = scaled_codes(q)
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
    f = formats.get(fmt)
    if f.family == "int":
        levels = (1 << f.bits) - 1
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
    finfo = torch.finfo(_fp8_dtype(f))  # half an ulp: 2^-(mantissa bits + 1) relative; the subnormal floor
    rel = finfo.eps / 2
    scale = (g.abs().amax(dim=red, keepdim=True) / f.fp8_max).clamp(min=MIN_SCALE)
    floor = scale * finfo.smallest_normal * finfo.eps * 2
    return (g.abs() * rel * (1 + 2e-3) + floor + scale * 1e-3).reshape(x.shape)


def codes_to_float(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Packed codes [..., D/P] -> code values as float32 [..., D] (integer levels at 2, 4 and 8 bits, or fp8
    values; 3-bit codes come out of their bit planes in `looked_up`, `_three_bit_codes`).

    The fast CPU route: integer planes are masked and converted straight into one float buffer;
    fp8 bytes are turned into fp16 bit patterns (e5m2 is the top byte of an fp16; e4m3fn shifted
    into fp16 is exact up to a factor 2^8), since torch's float8 -> float32 cast is slow on CPU.
    """
    f = formats.get(fmt)
    if f.fp8_dtype == "float8_e5m2":
        return (codes.to(torch.int16) << 8).view(torch.float16).float()
    if f.fp8_dtype == "float8_e4m3fn":
        wide = codes.to(torch.int16)
        bits = ((wide & 0x80) << 8) | ((wide & 0x7F) << 7)
        return bits.view(torch.float16).float().mul_(256.0)
    bits = f.bits
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
