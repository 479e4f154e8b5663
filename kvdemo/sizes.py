"""Cache sizes on one stated basis, and which models fit this machine.

Sizes: the live bytes, as the cache stores them (codes and 16-bit scales for the quantized region, every
full-precision part: a full cache, sinks, the residual window, in the model's own dtype, float32 on CPU),
labelled with that dtype, beside their 16-bit equivalent (the same cache with its full-precision parts at
16 bits, as a GPU serves it). Ratios: one basis everywhere, a 16-bit cache of the same tokens: "x smaller"
is a full-precision 16-bit cache over this cache at 16 bits (`CacheSize.times_smaller`), so the sidebar,
Home, Memory, the headroom planner and the reports' "vs fp16" columns say the same thing, on CPU as on GPU.

`machine_memory` and `models_that_fit` answer "which reference models (assets/model_configs) fit here,
at each KV precision" with `kvdemo.memory.headroom` on this machine's memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from .layout import bytes_per_token
from .precision import PrecisionSpec, parse_precision
from .results.measured import MemoryReport

MIB = 2**20
GB = 10**9
SERVE_BITS = 16
FIT_PRECISIONS = ("full", "int8", "int4", "int2")
FIT_CONTEXT = 8192  # tokens: the context a model must hold to count as fitting (capped at its own context)
RANGE_PRECISIONS = ("int8", "int4", "int2")  # Home's "8, 4 or 2 bits instead of 16"


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).replace("torch.", "")


def dtype_bits(dtype: torch.dtype) -> int:
    return 8 * torch.empty((), dtype=dtype).element_size()


def mib(n: float) -> str:
    return f"{n / MIB:,.1f} MiB"


@dataclass(frozen=True)
class CacheSize:
    """One cache (or one token of it): its live bytes and the same at 16 bits."""

    live: float  # bytes as stored: codes + scales, full-precision parts in `dtype`
    at16: float  # the same with its full-precision parts at 16 bits
    dtype: str  # the model's dtype, e.g. "float32"

    def text(self, fmt=mib) -> str:
        """E.g. "48.9 MiB live (float32) = 24.5 MiB at 16 bits", or one size when both are the same."""
        if round(self.live) != round(self.at16):
            return f"{fmt(self.live)} live ({self.dtype}) = {fmt(self.at16)} at 16 bits"
        if self.dtype in ("float16", "bfloat16"):
            return f"{fmt(self.live)} live ({self.dtype})"
        return f"{fmt(self.live)} live (the same at 16 bits)"  # codes and 16-bit scales only

    def times_smaller(self, full: CacheSize) -> float:
        """How many times smaller than a 16-bit cache of the same tokens this cache is: `full` (the same tokens
        at full precision) at 16 bits over this cache at 16 bits, whatever dtype the model runs in."""
        return full.at16 / self.at16 if self.at16 else float("inf")


def from_nbytes(nbytes: dict, dtype: torch.dtype) -> CacheSize:
    """From a `QuantizedKVCache.nbytes()` breakdown (or `measure_memory`'s "breakdown")."""
    exact = nbytes["residual"] + nbytes["sinks"]  # the full-precision parts, in the model's dtype
    coded = nbytes["codes"] + nbytes["scales"] + nbytes.get("outliers", 0) + nbytes.get("codebooks", 0)
    return CacheSize(coded + exact, coded + exact * SERVE_BITS / dtype_bits(dtype), dtype_name(dtype))


def _token_bytes(lm, spec: PrecisionSpec | str, full_bits: int) -> float:
    """`layout.bytes_per_token` of anything with num_layers, kv_heads and head_dim (a LoadedModel)."""
    return bytes_per_token(lm.num_layers, lm.kv_heads, lm.head_dim, spec, full_bits)


def per_token(lm, spec: PrecisionSpec | str) -> CacheSize:
    """K + V bytes of one token, all layers, in the quantized region of `spec` (a full cache: every token)."""
    spec = parse_precision(spec)
    return CacheSize(
        _token_bytes(lm, spec, dtype_bits(lm.dtype)), _token_bytes(lm, spec, SERVE_BITS), dtype_name(lm.dtype)
    )


def of_cache(lm, spec: PrecisionSpec | str, live_bytes: int, tokens: int) -> CacheSize:
    """A live cache of `tokens` tokens that takes `live_bytes` (a chat answer's `cache_bytes`).

    Its full-precision positions follow from the bytes: with Q rows read from codes (whole groups, sink
    slots included) and s sinks, live = q Q + f (T - Q + s) for per-token bytes q (codes) and f (full),
    so Q = (f (T + s) - live) / (f - q); nothing coded: live = f T."""
    spec = parse_precision(spec)
    full, q = _token_bytes(lm, "full", dtype_bits(lm.dtype)), _token_bytes(lm, spec, SERVE_BITS)
    full16 = _token_bytes(lm, "full", SERVE_BITS)
    exact = tokens
    if spec.is_quantized and full > q and live_bytes < full * tokens - q / 2:
        sinks = min(spec.sinks, tokens)
        coded_rows = round((full * (tokens + sinks) - live_bytes) / (full - q) / spec.group_size) * spec.group_size
        exact = min(max(tokens + sinks - coded_rows, 0), tokens)
    return CacheSize(live_bytes, live_bytes - exact * (full - full16), dtype_name(lm.dtype))


def prefilled(lm, spec: PrecisionSpec | str, tokens: int) -> CacheSize:
    """A cache of `tokens` tokens read in one prefill: every whole group quantized once the residual
    window is full (Q = floor(T / G) G when T >= residual), sinks and the rest at full precision."""
    spec = parse_precision(spec)
    full = per_token(lm, "full")
    if not spec.is_quantized or tokens < spec.residual:
        return CacheSize(full.live * tokens, full.at16 * tokens, full.dtype)
    q = per_token(lm, spec)
    coded = tokens // spec.group_size * spec.group_size
    exact = tokens - coded + min(spec.sinks, tokens) if coded > spec.sinks else tokens
    coded = coded if coded > spec.sinks else 0
    return CacheSize(q.live * coded + full.live * exact, q.at16 * coded + full.at16 * exact, full.dtype)


def ratios(lm, precisions: tuple[str, ...] = RANGE_PRECISIONS) -> dict[str, float]:
    """Per precision, how many times smaller one token's K + V is than at 16 bits, in the quantized region
    (codes and their 16-bit scales): e.g. {"int8": 1.91, "int4": 3.66, "int2": 6.74} for the embedded model."""
    full = per_token(lm, "full")
    return {p: per_token(lm, p).times_smaller(full) for p in precisions}


def range_text(lm, precisions: tuple[str, ...] = RANGE_PRECISIONS) -> str:
    """Home's promise, from `ratios`: e.g. "1.9x (int8), 3.7x (int4) or 6.7x (int2) smaller"."""
    r = ratios(lm, precisions)
    parts = [f"{r[p]:.1f}x ({p})" for p in precisions]
    return (", ".join(parts[:-1]) + " or " + parts[-1] if len(parts) > 1 else parts[0]) + " smaller"


def cache_caption(lm, precision: str, live_bytes: int, tokens: int) -> str:
    """E.g. "cache 48.9 MiB live (float32) = 24.5 MiB at 16 bits for 1,113 tokens": a chat answer's cache."""
    return f"cache {of_cache(lm, precision, live_bytes, tokens).text()} for {tokens:,} tokens"


def live_table(lm, report: MemoryReport) -> tuple[str, list[dict]]:
    """The Memory page's measured caches (`kvdemo.measured.compare_measured`'s report): a caption naming the basis
    and the 16-bit cache they are compared with, and one row per precision: live MiB, at 16 bits, x smaller than
    a 16-bit cache of the same tokens, the formula, live vs formula, bytes/token, bits/element and the residual
    window."""
    dtype = getattr(torch, report.dtype)
    live = {r.precision: from_nbytes(r.breakdown, dtype) for r in report.results}
    full = prefilled(lm, "full", report.tokens)
    caption = (
        f"{report.tokens:,} tokens. Live bytes in {report.dtype} (full-precision parts: a full cache, "
        "sinks, the residual window), beside the same cache with those parts at 16 bits; "
        f"x smaller: against a 16-bit cache of the same tokens ({mib(full.at16)}), each cache at 16 bits."
    )
    rows = [
        {
            "precision": r.precision,
            f"live MiB ({report.dtype})": r.bytes / MIB,
            "at 16 bits, MiB": live[r.precision].at16 / MIB,
            "x smaller than 16-bit": round(live[r.precision].times_smaller(full), 2),
            "formula MiB": r.formula_bytes / MIB,
            "live vs formula": f"{100 * r.error_vs_formula:+.3f}%",
            "bytes/token": r.bytes_per_token,
            "bits/element": r.bits_per_element,
            "residual MiB": r.breakdown["residual"] / MIB,
        }
        for r in report.results
    ]
    return caption, rows


def basis_note(lm) -> str:
    """One line naming the basis, for captions."""
    name = dtype_name(lm.dtype)
    ratio = 'Every "x smaller" is against a 16-bit cache of the same tokens.'
    if dtype_bits(lm.dtype) == SERVE_BITS:
        return f"Sizes are live bytes: this model runs in {name}, so they are also the 16-bit sizes. {ratio}"
    return (
        f"Sizes are live bytes: this model runs in {name} on {lm.device.type}, so full-precision parts (a full "
        f"cache, sinks, the residual window) take {dtype_bits(lm.dtype)} bits; each size also gives its 16-bit "
        f"equivalent. {ratio}"
    )


# --- which models fit this machine ------------------------------------------------------------------


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name] = int(parts[0]) * 1024
    return out


def machine_memory(device: torch.device | str | None = None) -> dict:
    """{"kind": "GPU" | "RAM", "name", "total", "available"} (bytes) of the device the model runs on:
    the GPU's memory when it is CUDA, else the machine's RAM (psutil, or /proc/meminfo)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(device)
        return {"kind": "GPU", "name": torch.cuda.get_device_name(device), "total": total, "available": free}
    try:
        import psutil

        vm = psutil.virtual_memory()
        total, available = vm.total, vm.available
    except ImportError:
        info = _meminfo()
        total, available = info.get("MemTotal", 0), info.get("MemAvailable", info.get("MemFree", 0))
    return {"kind": "RAM", "name": "RAM", "total": total, "available": available}


@lru_cache(maxsize=8)
def _fits(memory_gb: float, context: int, precisions: tuple[str, ...]) -> tuple[dict, ...]:
    from .configs import get_gpu, model_configs
    from .memory import headroom

    budget = get_gpu(memory_gb=memory_gb)
    rows = []
    for cfg in sorted(model_configs().values(), key=lambda c: c.params):
        ctx = min(context, cfg.max_context)
        plan = headroom(cfg, budget, precisions, context=ctx, weight_bits=16)
        rows.append(
            {
                "model": cfg.display_name,
                "load as": cfg.source.removeprefix("https://huggingface.co/"),
                "params (B)": round(cfg.params / 1e9, 2),
                "weights (GB, 16-bit)": round(plan.weights_bytes / GB, 1),
                "context": ctx,
                **{p.label: p.max_context_for_users if plan.fits and p.max_sequences else 0 for p in plan.precisions},
            }
        )
    return tuple(rows)


def models_that_fit(
    memory_bytes: int, context: int = FIT_CONTEXT, precisions: tuple[str, ...] = FIT_PRECISIONS
) -> list[dict]:
    """Per reference model (smallest first): its Hugging Face id, weights at 16 bits, and per KV precision
    the longest context (tokens, up to the model's own) that fits in `memory_bytes` beside 16-bit weights
    and a 10% reserve, 0 where not even `context` tokens fit (`kvdemo.memory.headroom`, one sequence)."""
    memory_gb = float(max(round(memory_bytes / GB), 1))  # whole GB: free memory drifts, the answer is cached
    return [dict(r) for r in _fits(memory_gb, context, tuple(precisions))]


def fit_summary(memory_bytes: int, context: int = FIT_CONTEXT) -> str:
    """One line: per KV precision, the largest reference model that holds `context` tokens and the longest
    context it could hold, e.g. "full: Llama-3.1-8B (25k tokens) · int4: Llama-3.1-8B (94k tokens)"."""
    rows = models_that_fit(memory_bytes, context)
    parts = []
    for label in FIT_PRECISIONS:
        fitting = [r for r in rows if r[label] >= r["context"]]
        parts.append(
            f"{label}: {fitting[-1]['model']} ({fitting[-1][label] / 1000:,.0f}k tokens)"
            if fitting
            else f"{label}: none"
        )
    return " · ".join(parts)


def stronger_model_text(lm, memory: dict | None = None, context: int = FIT_CONTEXT) -> str:
    """How to load a stronger model and which sizes fit this machine's memory at each KV precision."""
    memory = memory or machine_memory(lm.device)
    cpu = memory["kind"] == "RAM"
    return (
        "For a stronger model, choose **Hugging Face id** (e.g. `Qwen/Qwen2.5-7B-Instruct`) or **Local folder** "
        "(safetensors weights) in the sidebar, then **Load model**"
        + (" and, on CPU, **Weights dtype** bfloat16 (float32 takes twice the memory)" if cpu else "")
        + f". With this machine's {memory['available'] / GB:,.1f} GB of free {memory['name']}, at 16-bit weights, "
        f"the largest reference model that holds {context:,} tokens: {fit_summary(memory['available'], context)}."
    )
