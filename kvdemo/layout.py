"""Where each cached position lives, and what it costs: the one storage-layout policy of the cache.

A quantized layer splits positions [0, T) into three regions (s sinks, Q quantized, G group size):

    [0, s)          sinks: the first tokens, full precision (StreamingLLM, KVQuant)
    [s, Q)          read from codes; Q is 0 or a multiple of G. Blocks are aligned to absolute
                    positions, so block 0 also covers the sink slots (their codes are dummies)
    [max(Q, s), T)  residual: the newest tokens, full precision (KIVI's residual window)

The flush rule: after an append, when the residual holds `spec.residual` tokens or more
(T - Q >= residual), every whole block of G tokens is quantized (Q = floor(T / G) * G).

`Layout(spec)` states that rule once; the cache (kvdemo/cache.py), the memory formulas
(kvdemo/memory.py), the needle's decode replay (kvdemo/needle/run.py) and the pages read regions from it.
`bytes_per_token` is the one formula for the bytes a token costs (K and V, every layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .precision import PrecisionSpec, parse_precision


@dataclass(frozen=True)
class Regions:
    """The regions of positions [0, tokens) of one layer (every layer of a cache has the same)."""

    tokens: int  # T
    sinks: int  # positions [0, sinks) are full-precision sinks
    quantized: int  # positions [sinks, quantized) are read from codes; 0 when no position is

    @property
    def residual_start(self) -> int:
        return max(self.quantized, self.sinks)

    @property
    def residual(self) -> int:
        """Tokens in the full-precision residual window."""
        return self.tokens - self.residual_start

    @property
    def has_codes(self) -> bool:
        """Whether any position is read from quantized codes."""
        return self.quantized > self.sinks

    @property
    def coded(self) -> int:
        """Positions read from codes (quantized - sinks, or 0)."""
        return self.quantized - self.sinks if self.has_codes else 0

    @property
    def exact(self) -> int:
        """Positions held in full precision (sinks + residual)."""
        return self.tokens - self.coded

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "sinks": self.sinks, "quantized": self.coded, "residual": self.residual}


class Layout:
    """The storage-layout policy of a `PrecisionSpec`: regions after appends, flushes, views of the past."""

    def __init__(self, spec: PrecisionSpec | str):
        self.spec = parse_precision(spec)
        self.num_sinks = self.spec.sinks if self.spec.is_quantized else 0

    def _flushed(self, tokens: int, quantized: int) -> int:
        """Q after an append left `tokens` tokens with `quantized` of them already coded."""
        spec = self.spec
        if spec.is_quantized and tokens - quantized >= spec.residual:
            return max(quantized, (tokens // spec.group_size) * spec.group_size)
        return quantized

    def after_append(self, before: Regions, n: int) -> Regions:
        """Regions after appending n tokens in one call (one `Cache.update`)."""
        tokens = before.tokens + int(n)
        return Regions(tokens, min(self.num_sinks, tokens), self._flushed(tokens, before.quantized))

    def regions(self, updates: int | Sequence[int]) -> Regions:
        """Regions after appending `updates` tokens per call, from an empty cache (an int: one call)."""
        r = Regions(0, 0, 0)
        for n in [updates] if isinstance(updates, int) else updates:
            r = self.after_append(r, n)
        return r

    def flushes(self, now: Regions, n: int) -> list[int]:
        """Indices i < n of the tokens whose one-by-one append from `now` would quantize a block."""
        out, r = [], now
        for i in range(n):
            nxt = self.after_append(r, 1)
            if nxt.quantized > r.quantized:
                out.append(i)
            r = nxt
        return out

    @staticmethod
    def view(now: Regions, length: int) -> Regions:
        """What positions [0, length) of a layer in state `now` are read from (length <= now.tokens)."""
        sinks = min(now.sinks, length)
        quantized = min(now.quantized, length)
        return Regions(length, sinks, quantized if quantized > sinks else 0)

    @staticmethod
    def holds_exactly(now: Regions, start: int, stop: int) -> bool:
        """Whether positions [start, stop) are all stored in full precision (sinks or residual) in `now`."""
        return start >= now.quantized or stop <= now.sinks

    @staticmethod
    def one_more_exact(before: Regions, after: Regions) -> bool:
        """Whether `after` is `before` plus one token in the residual window: no sink, no flush (the append a
        decode step makes between flushes, whose buffers and kernel arguments stay where they were)."""
        same = (after.sinks, after.quantized) == (before.sinks, before.quantized)
        return same and after.tokens == before.tokens + 1 and after.tokens > after.sinks

    @staticmethod
    def newly_coded(before: Regions, after: Regions) -> tuple[int, int]:
        """Positions [start, stop) that one append moved from the residual into codes (sinks fill first)."""
        return max(before.quantized, after.sinks), after.quantized


# --- bytes ---------------------------------------------------------------------------------------


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, spec: PrecisionSpec | str, full_bits: int = 16) -> float:
    """K + V bytes of one token, all layers: 2 x layers x kv_heads x head_dim x bits / 8, where bits are
    the spec's bits per element in the quantized region (codes + metadata / group; `full_bits` for full)."""
    bits = parse_precision(spec).bits_per_element(head_dim, full_bits=full_bits)
    return layers * kv_heads * head_dim * (bits["key"] + bits["value"]) / 8


def region_bytes(
    regions: Regions, layers: int, kv_heads: int, head_dim: int, spec: PrecisionSpec | str, full_bits: int
) -> dict:
    """Bytes of a cache in state `regions` (whole model): {"quantized", "codebooks", "sinks", "residual", "total"}.

    Codes count whole rows from position 0 (the sink slots of block 0 hold dummy codes), as stored;
    "quantized" holds codes, scales and sparse outliers; "codebooks" the nuq levels (fp16, per layer).
    """
    spec = parse_precision(spec)
    full = bytes_per_token(layers, kv_heads, head_dim, "full", full_bits)
    quant = bytes_per_token(layers, kv_heads, head_dim, spec, full_bits)
    out = {
        "quantized": round(quant * regions.quantized) if regions.has_codes else 0,
        "codebooks": layers * 2 * sum(spec.codebook_levels().values()) if regions.has_codes else 0,
        "sinks": round(full * regions.sinks),
        "residual": round(full * regions.residual),
    }
    out["total"] = out["quantized"] + out["codebooks"] + out["sinks"] + out["residual"]
    return out
