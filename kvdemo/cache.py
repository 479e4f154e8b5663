"""`QuantizedKVCache`: a transformers `Cache` that stores keys and values as packed low-bit codes.

Per layer, token positions are split into three regions (T tokens so far, s sinks, Q quantized):

    [0, s)          sinks: the first tokens, full precision (model dtype)
    [s, Q)          quantized blocks; Q is a multiple of the group size G, blocks are aligned to
                    absolute positions, so block 0 also covers the sink slots (their codes are
                    dummies, excluded from the block's statistics)
    [max(Q, s), T)  residual: the newest tokens, full precision, until `residual` of them
                    have collected; then every whole block is quantized (KIVI)

`update()` appends and returns a `CacheView` (the layer plus this call's exact keys/values) that
the registered attention function (kvdemo/attention.py) reads: prefill attends over the exact
states, decoding over the packed cache. Storage grows by doubling; `nbytes()` counts the bytes of
the live data, tensor by tensor, and the bytes allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .precision import PrecisionSpec, parse_precision
from .quant import quantize, reference
from .quant.reference import QuantizedTensor


@dataclass
class PackedKV:
    """What attention reads of one layer: the stored past, positions [0, length)."""

    key_format: str
    value_format: str
    key_axis: str
    key_group: int
    value_group: int
    sink_keys: torch.Tensor  # [B, H, S, D] model dtype, positions [0, S)
    sink_values: torch.Tensor
    quant_len: int  # Q: positions [S, Q) are read from codes (codes rows [0, S) are dummies)
    key_codes: torch.Tensor | None  # uint8 [B, H, Q rounded up to whole blocks (channel axis), D // P]
    key_scale: torch.Tensor | None  # fp16 [B, H, Q // G, D] (channel) or [B, H, Q, D // G] (token)
    key_zero: torch.Tensor | None
    value_codes: torch.Tensor | None  # uint8 [B, H, Q, D // P]
    value_scale: torch.Tensor | None  # fp16 [B, H, Q, D // Gv]
    value_zero: torch.Tensor | None
    residual_keys: torch.Tensor  # [B, H, R, D], positions [max(Q, S), length)
    residual_values: torch.Tensor
    length: int

    @property
    def num_sinks(self) -> int:
        return self.sink_keys.shape[-2]

    def quantized_keys(self) -> QuantizedTensor:
        d = self.sink_keys.shape[-1]
        return QuantizedTensor(
            self.key_codes, self.key_scale, self.key_zero, self.key_format, self.key_axis, self.key_group, d
        )

    def quantized_values(self) -> QuantizedTensor:
        d = self.sink_keys.shape[-1]
        return QuantizedTensor(
            self.value_codes, self.value_scale, self.value_zero, self.value_format, "token", self.value_group, d
        )

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, length) as full tensors [B, H, length, D] (slow path)."""
        dtype = self.sink_keys.dtype
        ks, vs = [self.sink_keys], [self.sink_values]
        s, q = self.num_sinks, self.quant_len
        if q > s:
            ks.append(reference.dequantize(self.quantized_keys(), dtype)[:, :, s:q])
            vs.append(reference.dequantize(self.quantized_values(), dtype)[:, :, s:q])
        ks.append(self.residual_keys)
        vs.append(self.residual_values)
        return torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)


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
        layer = self.layer
        return self.past_len >= layer.quant_len or self.past_len + self.keys.shape[-2] <= layer.sinks


class _Growable:
    """A tensor with spare capacity along one dim: appends write in place until it is full.

    Capacity grows to what is needed plus 1/16 (at least 4 rows), so the memory a cache holds stays
    within ~6% of its live bytes (doubling would hold up to 2x and halve the saving quantization buys).
    A growth copies the buffer once; a quantized buffer grows at most once per flushed block, while
    decoding reads the whole cache every token, so the copies are a small fraction of the work.
    """

    SPARE = 16  # spare capacity = needed // SPARE rows, at least MIN_ROWS
    MIN_ROWS = 4

    def __init__(self, dim: int):
        self.dim, self.data, self.length = dim, None, 0

    @classmethod
    def capacity(cls, needed: int) -> int:
        return needed + max(cls.MIN_ROWS, needed // cls.SPARE)

    def append(self, x: torch.Tensor) -> None:
        n = x.shape[self.dim]
        if self.data is None:
            shape = list(x.shape)
            shape[self.dim] = self.capacity(n)
            self.data = torch.empty(shape, dtype=x.dtype, device=x.device)
        elif self.length + n > self.data.shape[self.dim]:
            shape = list(self.data.shape)
            shape[self.dim] = self.capacity(self.length + n)
            bigger = torch.empty(shape, dtype=self.data.dtype, device=self.data.device)
            bigger.narrow(self.dim, 0, self.length).copy_(self.view())
            self.data = bigger
        self.data.narrow(self.dim, self.length, n).copy_(x)
        self.length += n

    def view(self, length: int | None = None) -> torch.Tensor:
        return self.data.narrow(self.dim, 0, self.length if length is None else length)

    def drop_front(self, n: int) -> None:
        """Remove the first n entries (the remainder moves to the front)."""
        keep = self.length - n
        rest = self.data.narrow(self.dim, n, keep).clone()
        if self.data.shape[self.dim] > 2 * self.capacity(keep):  # e.g. a long prefill passed through: give it back
            shape = list(self.data.shape)
            shape[self.dim] = self.capacity(keep)
            self.data = torch.empty(shape, dtype=self.data.dtype, device=self.data.device)
        self.data.narrow(self.dim, 0, keep).copy_(rest)
        self.length = keep

    def live_bytes(self) -> int:
        return 0 if self.data is None else self.view().numel() * self.data.element_size()

    def allocated_bytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()


class QuantizedLayer(CacheLayerMixin):
    """One layer's packed keys/values (see the module docstring for the regions)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, spec: PrecisionSpec):
        super().__init__()
        self.spec = spec
        self.length = 0  # T
        self.quant_len = 0  # Q
        self.sinks = spec.sinks if spec.is_quantized else 0
        self.sink_keys = self.sink_values = None
        self.residual_keys, self.residual_values = _Growable(-2), _Growable(-2)
        self.key_codes, self.key_scale, self.key_zero = _Growable(-2), _Growable(-2), _Growable(-2)
        self.value_codes, self.value_scale, self.value_zero = _Growable(-2), _Growable(-2), _Growable(-2)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.head_dim = key_states.shape[-1]
        if self.spec.is_quantized:
            for fmt, axis_len in ((self.spec.key_format, self.head_dim), (self.spec.value_format, self.head_dim)):
                per_byte = reference.codes_per_byte(fmt)
                if axis_len % per_byte:
                    raise ValueError(f"head_dim {axis_len} cannot be packed {per_byte} codes per byte")
            if self.head_dim % self.spec.value_group(self.head_dim):
                raise ValueError(f"head_dim {self.head_dim} is not a multiple of the group size")
        empty = key_states[:, :, :0]
        self.sink_keys, self.sink_values = empty.clone(), empty.clone()
        self.is_initialized = True

    # --- transformers CacheLayerMixin API --------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple:
        """key_states, value_states: [B, H, n, D]. Returns (view, view) for the attention function."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        past = self.length
        n = key_states.shape[-2]
        k, v = key_states, value_states
        if self.sinks and past < self.sinks:  # the first tokens go to the sink buffers
            take = min(self.sinks - past, n)
            self.sink_keys = torch.cat([self.sink_keys, k[:, :, :take]], dim=-2)
            self.sink_values = torch.cat([self.sink_values, v[:, :, :take]], dim=-2)
            k, v = k[:, :, take:], v[:, :, take:]
        if k.shape[-2]:
            self.residual_keys.append(k)
            self.residual_values.append(v)
        self.length = past + n
        if self.spec.is_quantized and self.length - self.quant_len >= self.spec.residual:
            self._flush()
        view = CacheView(self, past, key_states, value_states)
        return view, view

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.spec)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("QuantizedKVCache supports greedy / sampling, not beam search")

    # --- quantization -----------------------------------------------------------------------------
    def _flush(self) -> None:
        """Quantize every whole block of G tokens in the residual (positions [Q, floor(T/G)*G))."""
        g = self.spec.group_size
        new_q = (self.length // g) * g
        if new_q <= self.quant_len:
            return
        start = max(self.quant_len, self.sinks)  # first position held by the residual buffer
        take = new_q - start
        k = self.residual_keys.view(take)
        v = self.residual_values.view(take)
        if self.quant_len == 0 and self.sinks:  # block 0: sink slots padded with the first regular token
            pad_k = k[:, :, :1].expand(-1, -1, self.sinks, -1)
            pad_v = v[:, :, :1].expand(-1, -1, self.sinks, -1)
            k, v = torch.cat([pad_k, k], dim=-2), torch.cat([pad_v, v], dim=-2)
        spec, d = self.spec, self.head_dim
        qk = quantize(k, spec.key_format, spec.key_axis, spec.key_group(d))
        qv = quantize(v, spec.value_format, "token", spec.value_group(d))
        self._store(qk, self.key_codes, self.key_scale, self.key_zero)
        self._store(qv, self.value_codes, self.value_scale, self.value_zero)
        self.residual_keys.drop_front(take)
        self.residual_values.drop_front(take)
        self.quant_len = new_q

    @staticmethod
    def _store(q: QuantizedTensor, codes: _Growable, scale: _Growable, zero: _Growable) -> None:
        codes.append(q.codes)
        scale.append(q.scale)
        if q.zero is not None:
            zero.append(q.zero)

    # --- reading ----------------------------------------------------------------------------------
    def packed(self, length: int | None = None) -> PackedKV:
        """The stored past restricted to positions [0, length) (default: everything)."""
        length = self.length if length is None else length
        spec, d = self.spec, getattr(self, "head_dim", 0)
        s = min(self.sinks, length)
        q = min(self.quant_len, length)
        q = q if q > s else 0
        res_len = max(length - max(self.quant_len, self.sinks), 0)
        g = spec.group_size
        blocks = -(-q // g) if spec.key_axis == "channel" else q  # channel axis: whole blocks, sliced later
        key_rows = blocks * g if spec.key_axis == "channel" else q

        def part(buf: _Growable, rows: int):
            return buf.view(rows) if buf.data is not None and rows else None

        return PackedKV(
            key_format=spec.key_format,
            value_format=spec.value_format,
            key_axis=spec.key_axis,
            key_group=spec.key_group(d) if d else spec.group_size,
            value_group=spec.value_group(d) if d else spec.group_size,
            sink_keys=self.sink_keys[:, :, :s],
            sink_values=self.sink_values[:, :, :s],
            quant_len=q,
            key_codes=part(self.key_codes, key_rows),
            key_scale=part(self.key_scale, blocks),
            key_zero=part(self.key_zero, blocks),
            value_codes=part(self.value_codes, q),
            value_scale=part(self.value_scale, q),
            value_zero=part(self.value_zero, q),
            residual_keys=self._residual(self.residual_keys, res_len),
            residual_values=self._residual(self.residual_values, res_len),
            length=length,
        )

    def _residual(self, buf: _Growable, rows: int) -> torch.Tensor:
        if buf.data is None or rows == 0:
            return self.sink_keys[:, :, :0]
        return buf.view(rows)

    def nbytes(self) -> dict:
        """Bytes of live data in this layer, by kind, and bytes allocated (incl. spare capacity)."""
        codes = self.key_codes.live_bytes() + self.value_codes.live_bytes()
        scales = sum(b.live_bytes() for b in (self.key_scale, self.key_zero, self.value_scale, self.value_zero))
        residual = self.residual_keys.live_bytes() + self.residual_values.live_bytes()
        sinks = 0
        if self.sink_keys is not None:
            sinks = (self.sink_keys.numel() + self.sink_values.numel()) * self.sink_keys.element_size()
        bufs = (self.key_codes, self.value_codes, self.key_scale, self.key_zero, self.value_scale, self.value_zero)
        allocated = sum(b.allocated_bytes() for b in (*bufs, self.residual_keys, self.residual_values)) + sinks
        return {"codes": codes, "scales": scales, "residual": residual, "sinks": sinks, "allocated": allocated}


class QuantizedKVCache(Cache):
    """A transformers Cache holding every layer's keys/values at `spec` precision.

    Works with `model.generate(past_key_values=cache)` and with a manual forward loop, as long as the
    model runs with the "kvdemo" attention (`kvdemo.attention.use_kvdemo_attention(model)`).
    """

    def __init__(self, spec: PrecisionSpec | str, num_layers: int | None = None):
        self.spec = parse_precision(spec)
        if num_layers is None:
            super().__init__(layer_class_to_replicate=lambda: QuantizedLayer(self.spec))
        else:
            super().__init__(layers=[QuantizedLayer(self.spec) for _ in range(num_layers)])

    def nbytes(self) -> dict:
        """Live bytes of the whole cache: {"total", "codes", "scales", "residual", "sinks", "allocated"}."""
        out = {"codes": 0, "scales": 0, "residual": 0, "sinks": 0, "allocated": 0}
        for layer in self.layers:
            for key, val in layer.nbytes().items():
                out[key] += val
        out["total"] = out["codes"] + out["scales"] + out["residual"] + out["sinks"]
        return out

    def tokens(self) -> int:
        return self.get_seq_length()
