"""`QuantizedKVCache`: a transformers `Cache` that stores keys and values as packed low-bit codes.

Per layer, positions sit in three regions (sinks, quantized blocks, full-precision residual); which
position is where, and when a block is quantized, is `kvdemo.layout.Layout`'s rule, stated once there.
Keys and values are stored alike: each is a `_PartBuffers` (sinks, packed codes with their fp16
scales/zeros, residual), and attention reads each as a `StoredPart`. The values' scales and zeros share
rows (`reference.paired`): with one group a token, a token's scale and zero are one 4-byte word, which the
decode kernel copies asynchronously with the codes.

`update()` appends and returns a `CacheView` (the layer plus this call's exact keys/values) that
the registered attention function (kvdemo/attention.py) reads: prefill attends over the exact
states, decoding over the packed cache. Buffers grow by 1/32 at a time (`_Growable`); `nbytes()`
counts the bytes of the live data, tensor by tensor, and the bytes allocated.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .layout import Layout, Regions
from .precision import PrecisionSpec, parse_precision
from .quant import quantize, reference
from .quant.backend import backend_for
from .quant.reference import QuantizedTensor
from .quant.rotations import hadamard


@dataclass
class StoredPart:
    """One layer's stored keys (or values), positions [0, regions.tokens) of its `PackedKV`."""

    sinks: torch.Tensor  # [B, H, S, D] model dtype, positions [0, S)
    quantized: QuantizedTensor | None  # codes rows from position 0 (rows [0, S) are dummies); None: no codes
    residual: torch.Tensor  # [B, H, R, D] model dtype, positions [max(Q, S), T)


@dataclass
class PackedKV:
    """What attention reads of one layer: the stored past, positions [0, length)."""

    spec: PrecisionSpec
    regions: Regions
    keys: StoredPart
    values: StoredPart
    # int32 [sinks, coded up to, residual rows] on the device, when the layer keeps them there (its whole past,
    # on the Triton backend): the decode kernel reads them, so a step launches with the same arguments as the last
    lengths: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.regions.tokens

    @property
    def num_sinks(self) -> int:
        return self.regions.sinks

    @property
    def quant_len(self) -> int:
        """Q: positions [num_sinks, Q) are read from codes (0: none)."""
        return self.regions.quantized

    @property
    def kv_heads(self) -> int:
        return self.keys.sinks.shape[1]

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, length) as full tensors [B, H, length, D] (slow path)."""
        return _whole(self.keys, self.regions), _whole(self.values, self.regions)


def _whole(part: StoredPart, r: Regions) -> torch.Tensor:
    pieces = [part.sinks]
    if r.has_codes:
        pieces.append(reference.dequantize(part.quantized, part.sinks.dtype)[:, :, r.sinks : r.quantized])
    pieces.append(part.residual)
    return torch.cat(pieces, dim=-2)


@dataclass
class CacheView:
    """What `update()` hands to attention: the layer (its stored past) and this call's exact states."""

    layer: QuantizedLayer
    past_len: int  # tokens stored before this call
    keys: torch.Tensor  # [B, H, n, D] exact keys of this call's tokens
    values: torch.Tensor

    @property
    def shape(self):  # lets generic code that peeks at key.shape keep working
        b, h, n, d = self.keys.shape
        return torch.Size((b, h, self.past_len + n, d))

    def packed(self) -> PackedKV:
        return self.layer.packed(self.past_len)

    def stored_exactly(self) -> bool:
        """True when the layer holds this call's tokens in full precision (sinks or residual, not codes)."""
        return Layout.holds_exactly(self.layer.regions, self.past_len, self.past_len + self.keys.shape[-2])


@dataclass
class BatchView:
    """What a batched layer's `update()` hands to attention (kvdemo/batch.py): one `CacheView` per sequence."""

    views: list[CacheView]

    @property
    def shape(self):  # generic code that peeks at key.shape: the longest sequence
        _, h, _, d = self.views[0].keys.shape
        return torch.Size((len(self.views), h, max(v.shape[-2] for v in self.views), d))


class _Growable:
    """A tensor with spare capacity along one dim: appends write in place until it is full.

    Capacity grows to what is needed plus 1/32 (at least 4 rows), so the memory a cache holds stays
    within ~3% of its live bytes (doubling would hold up to 2x and halve the saving quantization buys),
    rounded up so that capacity x row width is a multiple of 16 elements: the buffer's batch and head
    strides are then divisible by 16 whatever its length, so a kernel specialized on them (Triton
    specializes integers divisible by 16) stays the same variant after every growth. Rows as wide as a
    head (residual, per-channel scales) need no rounding; narrow rows (per-token scales, 3-bit codes) take a
    few spare rows of a few bytes each.
    A growth copies the buffer once; a quantized buffer grows at most once per flushed block, while
    decoding reads the whole cache every token, so the copies are a small fraction of the work.
    `reserve(rows)` sizes the buffer for a known length up front (a prompt being prefilled): appends up
    to there never regrow, so no old and new buffer are held at once and no freed ones pile up.
    """

    SPARE = 32  # spare capacity = needed // SPARE rows, at least MIN_ROWS
    MIN_ROWS = 4
    STRIDE_MULTIPLE = 16  # capacity x row width is a multiple of this

    def __init__(self, dim: int = -2):
        self.dim, self.data, self.length, self.reserved = dim, None, 0, 0
        self.unit = 1  # capacity is a multiple of this many rows (set from the row width at the first append)

    def reserve(self, rows: int) -> None:
        """Keep room for `rows` rows: a buffer that exists grows to it now (a copy before the appends, not during
        them), one not made yet is made that size at the first append."""
        self.reserved = max(self.reserved, int(rows))
        if self.data is not None and self.data.shape[self.dim] < self.reserved:
            self._resize(self.capacity(self.length))

    def _resize(self, rows: int) -> None:
        shape = list(self.data.shape)
        shape[self.dim] = rows
        bigger = torch.empty(shape, dtype=self.data.dtype, device=self.data.device)
        bigger.narrow(self.dim, 0, self.length).copy_(self.view())
        self.data = bigger

    def capacity(self, needed: int, reserved: bool = True) -> int:
        """Rows to allocate for `needed` rows: 1/32 spare (at least MIN_ROWS), at least what `reserve` asked
        (unless `reserved` is False), rounded up to whole units."""
        rows = needed + max(self.MIN_ROWS, needed // self.SPARE)
        rows = max(rows, self.reserved) if reserved else rows
        return -(-rows // self.unit) * self.unit

    def append(self, x: torch.Tensor) -> None:
        n = x.shape[self.dim]
        if self.data is None:
            width = math.prod(x.shape[self.dim :][1:])  # elements from one row to the next
            self.unit = self.STRIDE_MULTIPLE // math.gcd(width, self.STRIDE_MULTIPLE)
            shape = list(x.shape)
            shape[self.dim] = self.capacity(n)
            self.data = torch.empty(shape, dtype=x.dtype, device=x.device)
        elif self.length + n > self.data.shape[self.dim]:
            self._resize(self.capacity(self.length + n))
        self.data.narrow(self.dim, self.length, n).copy_(x)
        self.length += n

    def has_room(self, n: int) -> bool:
        """Whether `n` more rows fit without growing (a growth moves the buffer)."""
        return self.data is not None and self.length + n <= self.data.shape[self.dim]

    def append_at(self, x: torch.Tensor, at: torch.Tensor) -> None:
        """Append one row `x` (size 1 along dim) at row `at`: an int64 [1] tensor on the device holding the
        current length. The write's address comes from the device, not from the host's length, so a captured
        decode step replayed later writes the row after the one it wrote when captured. Needs `has_room(1)`."""
        self.data.index_copy_(self.dim % self.data.dim(), at, x)
        self.length += 1

    def view(self, length: int | None = None) -> torch.Tensor | None:
        if self.data is None:
            return None
        return self.data.narrow(self.dim, 0, self.length if length is None else length)

    def drop_front(self, n: int) -> None:
        """Remove the first n entries (the remainder moves to the front)."""
        keep = self.length - n
        rest = self.data.narrow(self.dim, n, keep).clone()
        if self.data.shape[self.dim] > 2 * self.capacity(keep):  # a long prefill passed: give it back (not below
            shape = list(self.data.shape)  # what `reserve` asked: a decode's residual window stays where it is)
            shape[self.dim] = self.capacity(keep)
            self.data = torch.empty(shape, dtype=self.data.dtype, device=self.data.device)
        self.data.narrow(self.dim, 0, keep).copy_(rest)
        self.length = keep

    def live_bytes(self) -> int:
        return 0 if self.data is None else self.view().numel() * self.data.element_size()

    def allocated_bytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()


@dataclass
class Method:
    """How one part (keys or values) is coded beyond its format: `reference.quantize`'s keywords."""

    levels: torch.Tensor | None = None  # nuq codebook: fp16 levels in [-1, 1]
    outliers: float = 0.0  # percent kept as sparse corrections
    rotation: torch.Tensor | None = None  # Hadamard [D, D]
    rope: object = None  # rotations.Rope (pre-RoPE keys)
    block: int = 0  # nvfp4: tokens per tensor scale (the group size)


class _PartBuffers:
    """Storage of one of a layer's keys / values: sinks, packed codes + metadata (+ sparse outliers, nvfp4
    tensor scales), residual."""

    def __init__(self, fmt: str, axis: str, method: Method | None = None, paired: bool = False):
        self.fmt, self.axis, self.method = fmt, axis, method or Method()
        # paired: scales and zeros share `scale`'s rows (W scales, then W zeros: `reference.paired`; `zero`
        # stays empty), as `reference.values_paired` says for the values
        self.paired = paired
        self.group = 0  # set by `configure` once head_dim is known
        self.sinks: torch.Tensor | None = None  # [B, H, S, D]
        self.codes, self.scale, self.zero = _Growable(), _Growable(), _Growable()
        self.tensor_scale = _Growable(dim=-1)  # nvfp4: fp32 [B, H, blocks]
        self.outlier_delta, self.outlier_index = _Growable(), _Growable()  # [B, H, rows, cap]
        self.residual = _Growable()  # [B, H, R, D]

    def configure(self, x: torch.Tensor, group: int) -> None:
        """x: the first states appended [B, H, n, D] (for dtype/device/shape); group: this part's group."""
        self.group, self.head_dim = group, x.shape[-1]
        self.sinks = x[:, :, :0].clone()
        if self.method.rotation is not None:
            self.method.rotation = self.method.rotation.to(x.device)
        if self.method.levels is not None:
            self.method.levels = self.method.levels.to(x.device)

    def reserve(self, code_rows: int, meta_rows: int, residual_rows: int) -> None:
        self.codes.reserve(code_rows)
        self.scale.reserve(meta_rows)
        self.zero.reserve(meta_rows)
        if self.method.outliers:
            self.outlier_delta.reserve(code_rows)
            self.outlier_index.reserve(code_rows)
        self.residual.reserve(residual_rows)

    def append(self, x: torch.Tensor, to_sinks: int) -> None:
        """x [B, H, n, D]: the first `to_sinks` rows go to the sinks, the rest to the residual."""
        if to_sinks:
            self.sinks = torch.cat([self.sinks, x[:, :, :to_sinks]], dim=-2)
        if x.shape[-2] > to_sinks:
            self.residual.append(x[:, :, to_sinks:])

    def warm_up(self, rows: int) -> None:
        """Quantize `rows` rows of zeros as a flush of that many rows would, and drop the result: on a GPU this
        compiles the kernel variant a flush launches (the same arguments' classes: contiguous inputs and
        outputs whose strides are multiples of 16), so the first flush inside a timed decode compiles nothing."""
        b, h, _, d = self.sinks.shape
        x = torch.zeros(b, h, rows, d, dtype=self.sinks.dtype, device=self.sinks.device)
        m = self.method
        quantize(
            x, self.fmt, self.axis, self.group, levels=m.levels, outliers=m.outliers, rotation=m.rotation,
            rope=m.rope, start=0, block=m.block,
        )  # fmt: skip

    def flush(self, take: int, pad_front: int) -> None:
        """Quantize the residual's first `take` rows into codes; `pad_front` dummy rows (copies of the first
        row) go before them when block 0 also covers the sink slots (excluded from the block's statistics)."""
        x = self.residual.view(take)
        start = self.codes.length  # absolute position of the first row (code rows start at position 0)
        m = self.method
        if pad_front:
            first = x[:, :, :1]
            if m.rope is not None:  # a dummy row at position p is the first key moved there (same pre-RoPE key)
                moved = m.rope.undo(first, start + pad_front).expand(-1, -1, pad_front, -1)
                pad = m.rope.apply(moved, start).to(x.dtype)
            else:
                pad = first.expand(-1, -1, pad_front, -1)
            x = torch.cat([pad, x], dim=-2)
        q = quantize(
            x, self.fmt, self.axis, self.group, levels=m.levels, outliers=m.outliers, rotation=m.rotation,
            rope=m.rope, start=start, block=m.block,
        )  # fmt: skip
        self.codes.append(q.codes)
        if self.paired:
            self.scale.append(reference.pair_rows(q.scale, q.zero))
        else:
            self.scale.append(q.scale)
            if q.zero is not None:
                self.zero.append(q.zero)
        if q.tensor_scale is not None:
            self.tensor_scale.append(q.tensor_scale)
        if q.outlier_delta is not None:
            self.outlier_delta.append(q.outlier_delta)
            self.outlier_index.append(q.outlier_index)
        self.residual.drop_front(take)

    def stored(self, r: Regions, code_rows: int, meta_rows: int) -> StoredPart:
        """The part as attention reads it at regions `r` (restricted to [0, r.tokens))."""
        quantized = None
        if r.has_codes:
            m = self.method
            scale, zero = self.scale.view(meta_rows), self.zero.view(meta_rows)
            if self.paired:
                scale, zero = reference.unpair_rows(scale)
            quantized = QuantizedTensor(
                self.codes.view(code_rows),
                scale,
                zero,
                self.fmt,
                self.axis,
                self.group,
                self.head_dim,
                levels=m.levels,
                rotation=m.rotation,
                rope=m.rope,
                block=m.block,
                paired=self.paired,
            )
            if m.block:  # nvfp4: the blocks of code rows [0, code_rows)
                quantized.tensor_scale = self.tensor_scale.view(-(-code_rows // m.block))
            if self.outlier_delta.data is not None:
                quantized.outlier_delta = self.outlier_delta.view(code_rows)
                quantized.outlier_index = self.outlier_index.view(code_rows)
        residual = self.residual.view(r.residual) if r.residual > 0 else None
        return StoredPart(
            self.sinks[:, :, : r.sinks], quantized, self.sinks[:, :, :0] if residual is None else residual
        )

    def nbytes(self) -> dict:
        sinks = 0 if self.sinks is None else self.sinks.numel() * self.sinks.element_size()
        bufs = (self.codes, self.scale, self.zero, self.tensor_scale, self.outlier_delta, self.outlier_index)
        levels = self.method.levels
        codebook = levels.numel() * 2 if levels is not None and self.codes.length else 0  # fp16 levels
        return {
            "codes": self.codes.live_bytes(),
            "scales": self.scale.live_bytes() + self.zero.live_bytes() + self.tensor_scale.live_bytes(),
            "outliers": self.outlier_delta.live_bytes() + self.outlier_index.live_bytes(),
            "codebooks": codebook,
            "residual": self.residual.live_bytes(),
            "sinks": sinks,
            "allocated": sum(b.allocated_bytes() for b in (*bufs, self.residual)) + sinks + codebook,
        }


class QuantizedLayer(CacheLayerMixin):
    """One layer's packed keys and values; `regions` says where each position is (kvdemo.layout)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, spec: PrecisionSpec, key_method: Method | None = None, value_method: Method | None = None):
        super().__init__()
        self.spec = spec
        self.layout = Layout(spec)
        self.regions = Regions(0, 0, 0)
        self._methods = (key_method, value_method)
        self._warm = False  # `warm_up` ran
        self.lengths: torch.Tensor | None = None  # int32 [S, Q, R] on the device where a kernel reads them
        self._device_lengths = False  # set at the first append: whether kernels read `lengths`
        self.keys = _PartBuffers(spec.key_format, spec.key_axis, copy.copy(key_method))
        values_paired = reference.values_paired(spec)
        self.values = _PartBuffers(spec.value_format, "token", copy.copy(value_method), paired=values_paired)

    @property
    def length(self) -> int:  # T
        return self.regions.tokens

    @property
    def quant_len(self) -> int:  # Q
        return self.regions.quantized

    @property
    def sinks(self) -> int:  # the sink count this layer keeps (0 when full precision)
        return self.layout.num_sinks

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.head_dim = d = key_states.shape[-1]
        spec = self.spec
        if value_states.shape[-1] != d:
            raise ValueError(f"value head_dim {value_states.shape[-1]} differs from key head_dim {d}")
        if spec.is_quantized:
            for fmt in (spec.key, spec.value):
                fmt.packed_width(d)  # ValueError when d cannot be packed
            if d % spec.value_group(d) or d % spec.key_group(d) and spec.key_axis == "token":
                raise ValueError(f"head_dim {d} is not a multiple of the group size")
            if spec.hadamard:
                rotation = hadamard(d)  # ValueError unless d is a power of two
                self.keys.method.rotation = self.values.method.rotation = rotation
        self.keys.configure(key_states, spec.key_group(d))
        self.values.configure(value_states, spec.value_group(d))
        self._device_lengths = backend_for(self.device) == "triton"
        self.is_initialized = True

    # --- transformers CacheLayerMixin API --------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple:
        """key_states, value_states: [B, H, n, D]. Returns (view, view) for the attention function."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        before = self.regions
        after = self.layout.after_append(before, key_states.shape[-2])
        if self.can_advance() and Layout.one_more_exact(before, after):
            # one token into the residual, written at the residual length the device holds: a captured decode
            # step replays this append at the right row (`advance` then does the host's part)
            at = self.lengths[2:].long()
            self.keys.residual.append_at(key_states, at)
            self.values.residual.append_at(value_states, at)
            self.regions = after
            self.lengths[2:].add_(1)
            return self._view(before, key_states, value_states)
        to_sinks = after.sinks - before.sinks
        self.keys.append(key_states, to_sinks)
        self.values.append(value_states, to_sinks)
        if after.quantized > before.quantized:
            start, stop = Layout.newly_coded(before, after)
            pad = after.sinks if before.quantized == 0 else 0  # block 0: the sink slots' dummy rows
            self.keys.flush(stop - start, pad)
            self.values.flush(stop - start, pad)
        self.regions = after
        if self._device_lengths:
            self._copy_lengths(after)
        return self._view(before, key_states, value_states)

    def _view(self, before: Regions, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple:
        view = CacheView(self, before.tokens, key_states, value_states)
        return view, view

    def _copy_lengths(self, now: Regions) -> None:
        """Copy the regions' lengths [S, Q, R] to `lengths` on the device (after anything but a one-token
        residual append, which adds one there: see `update`)."""
        host = torch.tensor([now.sinks, now.quantized if now.has_codes else 0, now.residual], dtype=torch.int32)
        if self.lengths is None:
            self.lengths = host.to(self.device)
        else:
            self.lengths.copy_(host)

    def can_advance(self) -> bool:
        """Whether the next one-token append can be a static step: the lengths live on the device and both
        residual buffers have room for it (it does not say whether the append would flush: `next_is_static`)."""
        return self.lengths is not None and self.keys.residual.has_room(1) and self.values.residual.has_room(1)

    def next_is_static(self) -> bool:
        """Whether appending one token now would be a static step: written in place at a device-held row, with
        no sink, no flush and no buffer growth, so every pointer and integer a decode step launches stays."""
        return self.can_advance() and Layout.one_more_exact(self.regions, self.layout.after_append(self.regions, 1))

    def advance(self) -> None:
        """The host's part of a static one-token append whose device part (the row's write, the lengths' add)
        was replayed from a captured step: the same bookkeeping `update` does for it."""
        if not self.next_is_static():
            raise RuntimeError("advance() needs a static next step (next_is_static)")
        self.keys.residual.length += 1
        self.values.residual.length += 1
        self.regions = self.layout.after_append(self.regions, 1)

    def buffers(self) -> tuple:
        """What a captured decode step of this layer depends on besides the lengths' values: each buffer's address
        (None for an absent one) and whether codes are read at all."""
        ptrs = []
        for part in (self.keys, self.values):
            grow = (part.codes, part.scale, part.zero, part.tensor_scale, part.outlier_delta, part.outlier_index)
            ptrs += [None if g.data is None else g.data.data_ptr() for g in (*grow, part.residual)]
            ptrs.append(None if part.sinks is None else part.sinks.data_ptr())
        return (*ptrs, self.regions.has_codes, self.regions.sinks, self.lengths is not None and self.lengths.data_ptr())

    def reserve(self, tokens: int) -> None:
        """Size the buffers for `tokens` positions (a prompt of known length): appends up to there write in
        place. Codes and metadata get the rows one append of `tokens` would code (no chunking codes more);
        a full-precision layer's residual gets all of them."""
        if not self.spec.is_quantized:
            self.keys.reserve(0, 0, tokens)
            self.values.reserve(0, 0, tokens)
            return
        coded = self.layout.regions(tokens).quantized  # code rows include block 0's sink slots
        key_meta = coded // self.spec.group_size if self.spec.key_axis == "channel" else coded
        for part in (self.keys, self.values):
            if part.method.block:
                part.tensor_scale.reserve(coded // part.method.block)
        # where kernels read the lengths on the device, the residual keeps room for its whole window (a decode
        # step's append then never moves it, and a captured step stays valid across flushes)
        window = self.spec.residual + self.spec.group_size if self._device_lengths else 0
        self.keys.reserve(coded, key_meta, window)
        self.values.reserve(coded, coded, window)

    def warm_up(self) -> None:
        """Compile, where kernels compile (CUDA), what this layer's flushes will launch: once, after the first
        append, so that the first flush of a decode compiles nothing (`_PartBuffers.warm_up`)."""
        if self.is_initialized and self.spec.is_quantized and not self._warm:
            self.keys.warm_up(self.spec.group_size)
            self.values.warm_up(self.spec.group_size)
            self._warm = True

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.spec, *self._methods)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("QuantizedKVCache supports greedy / sampling, not beam search")

    # --- reading ----------------------------------------------------------------------------------
    def packed(self, length: int | None = None) -> PackedKV:
        """The stored past restricted to positions [0, length) (default: everything)."""
        if not self.is_initialized:
            raise ValueError("the layer holds no tokens yet")
        r = Layout.view(self.regions, self.length if length is None else length)
        g = self.spec.group_size
        if self.spec.key_axis == "channel":  # whole key blocks (the kernels slice rows within a block)
            key_meta = -(-r.quantized // g)
            key_rows = key_meta * g
        else:
            key_meta = key_rows = r.quantized
        return PackedKV(
            self.spec,
            r,
            self.keys.stored(r, key_rows, key_meta),
            self.values.stored(r, r.quantized, r.quantized),
            self.lengths if r.tokens == self.length else None,  # the layer's lengths describe its whole past
        )

    def nbytes(self) -> dict:
        """Bytes of live data in this layer, by kind, and bytes allocated (incl. spare capacity)."""
        k, v = self.keys.nbytes(), self.values.nbytes()
        return {kind: k[kind] + v[kind] for kind in k}


class QuantizedKVCache(Cache):
    """A transformers Cache holding every layer's keys/values at `spec` precision.

    Works with `model.generate(past_key_values=cache)` and with a manual forward loop, as long as the
    model runs with the "kvdemo" attention (`kvdemo.attention.use_kvdemo_attention(model)`).
    """

    def __init__(self, spec: PrecisionSpec | str, num_layers: int | None = None, rope=None, codebooks=None):
        """rope: the model's `rotations.Rope` (needed by pre-RoPE keys: `runner.new_cache` passes it);
        codebooks: a `codebooks.Codebooks` for nuq formats (default: NormalFloat levels)."""
        self.spec = spec = parse_precision(spec)
        if spec.pre_rope and rope is None:
            raise ValueError("prerope keys need the model's rotary embedding: make the cache with runner.new_cache")
        if any(spec.codebook_levels().values()) and codebooks is None:
            from .codebooks import Codebooks

            codebooks = Codebooks.normal_float()
        self.rope, self.codebooks = rope, codebooks
        if num_layers is None:
            made = iter(range(1 << 30))
            super().__init__(layer_class_to_replicate=lambda: self._layer(next(made)))
        else:
            super().__init__(layers=[self._layer(i) for i in range(num_layers)])

    def _layer(self, index: int) -> QuantizedLayer:
        spec = self.spec
        if not spec.is_quantized:
            return QuantizedLayer(spec)
        methods = []
        for part, fmt in (("key", spec.key), ("value", spec.value)):
            levels = self.codebooks.levels(index, part, spec) if fmt.codebook else None
            rope = self.rope if part == "key" and spec.pre_rope else None
            block = spec.group_size if fmt.block_scale_bits else 0  # tokens per second-level scale
            methods.append(Method(levels, spec.outliers, None, rope, block))
        return QuantizedLayer(spec, *methods)

    def warm_up(self) -> None:
        """`QuantizedLayer.warm_up` on every layer that holds tokens (a no-op once done)."""
        for layer in self.layers:
            layer.warm_up()

    def reserve(self, tokens: int) -> None:
        """`QuantizedLayer.reserve` on every layer (layers not created yet are not reserved)."""
        for layer in self.layers:
            layer.reserve(tokens)

    def nbytes(self) -> dict:
        """Live bytes of the whole cache: {"total", "codes", "scales", "outliers", "codebooks", "residual", "sinks",
        "allocated"}."""
        out = dict.fromkeys(("codes", "scales", "outliers", "codebooks", "residual", "sinks", "allocated"), 0)
        for layer in self.layers:
            for key, val in layer.nbytes().items():
                out[key] += val
        out["total"] = sum(out[k] for k in ("codes", "scales", "outliers", "codebooks", "residual", "sinks"))
        return out
