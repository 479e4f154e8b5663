"""KV-cache bytes: measured on a live cache, and by formula.

Formula: bytes/token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element.
"""

from __future__ import annotations

from collections.abc import Sequence

from .models import LoadedModel
from .precision import PrecisionSpec, parse_precision
from .runner import new_cache, prefill


def fp16_cache_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int) -> int:
    """A 16-bit cache of `tokens` tokens: the reference every ratio is quoted against."""
    return 2 * layers * kv_heads * head_dim * 2 * tokens


def measure_memory(lm: LoadedModel, ids: Sequence[int], specs: Sequence[PrecisionSpec | str]) -> dict:
    """Prefill `ids` into a cache at each precision; report its live bytes next to a 16-bit cache."""
    tokens = len(ids)
    fp16 = fp16_cache_bytes(lm.num_layers, lm.kv_heads, lm.head_dim, tokens)
    results = []
    for spec in specs:
        spec = parse_precision(spec)
        cache = new_cache(lm, spec)
        prefill(lm, ids, cache)
        nb = cache.nbytes()
        bits = spec.bits_per_element(lm.head_dim, full_bits=8 * lm.dtype.itemsize)
        results.append(
            {
                "precision": spec.label,
                "bytes": nb["total"],
                "bytes_fp16": fp16,
                "ratio_vs_fp16": round(fp16 / nb["total"], 4),
                "bits_per_element": round(bits["mean"], 4),
                "bytes_per_token": round(nb["total"] / tokens, 1),
                "breakdown": {k: nb[k] for k in ("codes", "scales", "residual", "sinks", "allocated")},
                "spec": spec.to_dict(),
            }
        )
        del cache
    return {"model": lm.name, "tokens": tokens, "results": results}
