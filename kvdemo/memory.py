"""KV-cache bytes by formula, and as concurrency headroom on a GPU budget.

Formula: bytes/token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element. For a quantized
`PrecisionSpec` the bytes per element are `spec.bits_per_element(head_dim)` / 8: code bits plus the
16-bit scale (and zero point) of each group spread over its elements, so metadata counts (int4 at group
128: 4.25 bits, 3.76x smaller than 16-bit). Keys and values are counted separately (k8v4: 8.25 + 4.5).

Full-precision parts of a quantized cache. A sequence of T tokens keeps its first `sinks` tokens and
its newest tokens (the residual window: up to `residual` - 1 between decode steps) at full precision:

    sequence bytes(T) = L x H x D x [ n_full x 2 x full_bytes + (T - n_full) x (key_bits + value_bits) / 8 ]
    n_full = min(T, sinks + residual)            (full precision: n_full = T)

For capacity planning (`sequence_bytes`) `n_full` is the largest the full-precision part gets (sinks
plus a full residual window), with full precision = 16 bits (the serving dtype; every ratio is quoted
against a 16-bit cache). For a live cache the regions come from `kvdemo.layout.Layout` (the rule the
cache itself follows) and `kvdemo.layout.region_bytes` prices them: quantized rows Q (whole blocks of
group_size, including the dummy rows of the sink slots of block 0), sinks, and residual rows T - Q,
at the model's own dtype (fp32 on CPU). Bytes per token come from one formula, `layout.bytes_per_token`.

Headroom (`headroom`): on G GPUs of M bytes each, tensor parallel, every GPU holds weights / G and
ceil(kv_heads / G) KV heads of every sequence (heads are replicated when G > kv_heads, as vLLM does);
free = M - reserve - weights / G; max sequences = floor(free / per-GPU sequence bytes). The reserve
(default 10% of each GPU, what vLLM's `--gpu-memory-utilization 0.9` leaves) stands for activations,
CUDA graphs and the runtime. Weights = parameters x weight bits / 8 (scales of quantized checkpoints
and layers kept in 16 bits are not counted: raise the reserve for them).

Units: bytes internally; GB = 10^9 bytes in every option and printout (kvdemo/configs.py holds the model
configs and GPU presets). Nothing here imports torch: headroom math stays light. The plan is a
`kvdemo.results.headroom.Headroom` (this module sits in the results layer to return it). Live caches are measured
beside these formulas in kvdemo/measured.py.
vLLM prints the same quantity as "Maximum concurrency for N tokens per request" (our `concurrency`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from . import layout
from .configs import GB, GPU, SERVE_BITS, WEIGHT_BITS, HeadroomError, ModelConfig, check_weight_bits
from .precision import PrecisionSpec, parse_precision
from .production import production_settings
from .results.headroom import Headroom, HeadroomCurve, MemorySplit, PrecisionHeadroom

DEFAULT_RESERVE_FRACTION = 0.10
MEASURE_TOKENS = 2048  # `--model-config loaded`: prefill at most this many tokens for the measured column
CURVE_POINTS = 41


def fp16_cache_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int) -> int:
    """A 16-bit cache of `tokens` tokens: the reference every ratio is quoted against."""
    return round(layout.bytes_per_token(layers, kv_heads, head_dim, "full", 16) * tokens)


# --- formulas ----------------------------------------------------------------------------------------


def full_window(spec: PrecisionSpec) -> int:
    """Tokens a quantized sequence may hold at full precision, at most: sinks + residual window."""
    return spec.sinks + spec.residual if spec.is_quantized else 0


def bytes_per_token(
    cfg: ModelConfig, spec: PrecisionSpec | str, full_bits: int = SERVE_BITS, kv_heads: int | None = None
) -> float:
    """`layout.bytes_per_token` of a model config (the quantized region; kv_heads: per GPU under TP)."""
    heads = cfg.kv_heads if kv_heads is None else kv_heads
    return layout.bytes_per_token(cfg.layers, heads, cfg.head_dim, spec, full_bits)


def sequence_bytes(
    cfg: ModelConfig, spec: PrecisionSpec | str, tokens: int, full_bits: int = SERVE_BITS, kv_heads: int | None = None
) -> float:
    """KV bytes of one sequence of `tokens` tokens (planning: sinks + residual window at full precision)."""
    spec = parse_precision(spec)
    full = bytes_per_token(cfg, "full", full_bits, kv_heads)
    quant = bytes_per_token(cfg, spec, full_bits, kv_heads)
    n_full = tokens if not spec.is_quantized else min(tokens, full_window(spec))
    return n_full * full + (tokens - n_full) * quant


def max_tokens(
    cfg: ModelConfig, spec: PrecisionSpec | str, budget: float, full_bits: int = SERVE_BITS, kv_heads: int | None = None
) -> int:
    """The longest sequence whose `sequence_bytes` fits in `budget` bytes (the inverse of `sequence_bytes`)."""
    spec = parse_precision(spec)
    if budget <= 0:
        return 0
    full = bytes_per_token(cfg, "full", full_bits, kv_heads)
    quant = bytes_per_token(cfg, spec, full_bits, kv_heads)
    window = full_window(spec)
    if not spec.is_quantized or budget < window * full:
        return int(budget // full)
    return window + int((budget - window * full) // quant)


def kv_heads_per_gpu(kv_heads: int, gpus: int) -> int:
    """KV heads each GPU holds under tensor parallelism (the most loaded one; replicated when gpus > heads)."""
    return max(1, -(-kv_heads // gpus))


# --- headroom ----------------------------------------------------------------------------------------


def headroom(
    cfg: ModelConfig,
    gpu: GPU,
    specs: Sequence[PrecisionSpec | str],
    context: int,
    gpus: int = 1,
    users: int = 1,
    weight_bits: int = 16,
    reserve_gb: float | None = None,
) -> Headroom:
    """Bytes/token, max concurrent sequences at `context`, max context for `users`, memory split and the
    weight x KV "stacking", for every precision in `specs` at once (see the module docstring)."""
    specs = [parse_precision(s) for s in specs]
    check_weight_bits(weight_bits)
    for what, value in (("context", context), ("gpus", gpus), ("users", users)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise HeadroomError(f"{what} must be a positive integer, got {value!r}")
    if reserve_gb is not None and (not math.isfinite(reserve_gb) or reserve_gb < 0):
        raise HeadroomError(f"--reserve-gb must be a number of GB >= 0, got {reserve_gb}")
    per_gpu = gpu.memory_bytes
    reserve = round(reserve_gb * GB) if reserve_gb is not None else round(DEFAULT_RESERVE_FRACTION * per_gpu)
    heads = kv_heads_per_gpu(cfg.kv_heads, gpus)
    weights = cfg.weight_bytes(weight_bits)
    free = _free_per_gpu(cfg, per_gpu, reserve, gpus, weight_bits)
    n16 = _sequences(free, sequence_bytes(cfg, parse_precision("full"), context, kv_heads=heads))
    rows = []
    for spec in specs:
        seq = sequence_bytes(cfg, spec, context, kv_heads=heads)  # per GPU
        n = _sequences(free, seq)
        mem_ctx = max_tokens(cfg, spec, free / users, kv_heads=heads)
        bits = spec.bits_per_element(cfg.head_dim, full_bits=SERVE_BITS)
        rows.append(
            PrecisionHeadroom(
                label=spec.label,
                bits_per_element={"key": bits["key"], "value": bits["value"]},
                bytes_per_token=_num(bytes_per_token(cfg, spec)),
                bytes_per_token_per_gpu=_num(bytes_per_token(cfg, spec, kv_heads=heads)),
                sequence_bytes=_num(seq * gpus),
                max_sequences=n,
                sequences_vs_16bit=round(n / n16, 3) if n16 else None,
                concurrency=round(max(free, 0) / seq, 3),
                kv_token_capacity=int(max(free, 0) // bytes_per_token(cfg, spec, kv_heads=heads)),
                max_context_for_users=min(mem_ctx, cfg.max_context),
                max_context_memory=mem_ctx,
                max_context_limited_by="model" if mem_ctx >= cfg.max_context else "memory",
                split=_split(per_gpu, gpus, weights, reserve, n * seq * gpus),
                reason=_reason(cfg, free, seq, per_gpu, reserve, gpus, weight_bits, context),
                stacking={
                    str(wb): _sequences(_free_per_gpu(cfg, per_gpu, reserve, gpus, wb), seq) for wb in WEIGHT_BITS
                },
                production=production_settings(spec, cfg.head_dim),
            )
        )
    return Headroom(
        model_config=cfg.name,
        model=cfg.to_dict(),
        gpu=gpu.name,
        gpu_info=gpu.to_dict(),
        gpus=gpus,
        context=context,
        users=users,
        weight_bits=weight_bits,
        kv_heads_per_gpu=heads,
        budget_bytes=per_gpu * gpus,
        weights_bytes=weights,
        reserve_bytes=reserve * gpus,
        free_kv_bytes=round(max(free, 0) * gpus),
        fits=free > 0,
        context_exceeds_model=context > cfg.max_context,
        max_sequences_16bit=n16,
        precisions=rows,
        warnings=_warnings(cfg, specs, context, gpus),
        curve=_curve(cfg, specs, per_gpu, gpus, weights, reserve, users, heads, context),
    )


def _free_per_gpu(cfg: ModelConfig, per_gpu: int, reserve: int, gpus: int, weight_bits: int) -> float:
    return per_gpu - reserve - cfg.weight_bytes(weight_bits) / gpus


def _sequences(free: float, seq: float) -> int:
    return int(free // seq) if free > 0 else 0


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else round(x, 3)


def _split(per_gpu: int, gpus: int, weights: int, reserve: int, kv: float) -> MemorySplit:
    """Whole budget (all GPUs), bytes: weights / KV of the max sequences / reserve / unused."""
    total = per_gpu * gpus
    left = total - weights - reserve * gpus - kv
    return MemorySplit(weights, round(kv), reserve * gpus, round(max(left, 0)), round(max(-left, 0)), total)


def _reason(
    cfg: ModelConfig, free: float, seq: float, per_gpu: int, reserve: int, gpus: int, weight_bits: int, context: int
) -> str | None:
    """Why no sequence fits (None when at least one does)."""
    if free <= 0:
        w = cfg.weight_bytes(weight_bits) / gpus
        return (
            f"weights ({w / GB:.1f} GB per GPU at {weight_bits}-bit over {gpus} GPU(s)) + reserve ({reserve / GB:.1f} GB) "
            f"exceed the GPU's {per_gpu / GB:.1f} GB: no room for a KV cache "
            "(add GPUs, lower --weight-bits or --reserve-gb)"
        )
    if free < seq:
        return (
            f"one {context:,}-token sequence needs {seq / GB:.2f} GB of KV per GPU, only {free / GB:.2f} GB is free "
            "(shorter context, lower KV precision, or more GPUs)"
        )
    return None


def _warnings(cfg: ModelConfig, specs: Sequence[PrecisionSpec], context: int, gpus: int) -> list[str]:
    out = []
    if context > cfg.max_context:
        out.append(
            f"context {context:,} exceeds {cfg.display_name}'s max context ({cfg.max_context:,} tokens): "
            "figures are for a length the model does not support"
        )
    if gpus > cfg.kv_heads:
        out.append(
            f"{gpus} GPUs > {cfg.kv_heads} KV heads: each GPU holds a replicated KV head, so more GPUs add no KV room"
        )
    elif cfg.kv_heads % gpus:
        out.append(
            f"{cfg.kv_heads} KV heads do not split evenly over {gpus} GPUs: the most loaded GPU holds "
            f"{kv_heads_per_gpu(cfg.kv_heads, gpus)} (vLLM refuses uneven splits)"
        )
    if cfg.attention_heads % gpus:
        out.append(f"vLLM needs the {cfg.attention_heads} attention heads to divide evenly over --gpus {gpus}")
    tiny = [s.label for s in specs if s.is_quantized and context <= full_window(s)]
    if tiny:
        out.append(
            f"context {context:,} fits inside the full-precision window (sinks + residual) of {', '.join(tiny)}: "
            "quantization saves nothing at this length"
        )
    return out


def _curve(
    cfg: ModelConfig,
    specs: Sequence[PrecisionSpec],
    per_gpu: int,
    gpus: int,
    weights: int,
    reserve: int,
    users: int,
    heads: int,
    context: int,
) -> HeadroomCurve:
    """Total memory (GB, all GPUs) of weights + reserve + `users` sequences, vs context length."""
    top = max(cfg.max_context, context)
    xs = sorted({round(top * i / (CURVE_POINTS - 1)) for i in range(CURVE_POINTS)} | {context})
    base = weights + reserve * gpus
    gb = {
        s.label: [round((base + users * gpus * sequence_bytes(cfg, s, x, kv_heads=heads)) / GB, 4) for x in xs]
        for s in specs
    }
    return HeadroomCurve(
        users=users,
        context=xs,
        gb=gb,
        budget_gb=round(per_gpu * gpus / GB, 4),
        weights_gb=round(weights / GB, 4),
        reserve_gb=round(reserve * gpus / GB, 4),
        max_context=cfg.max_context,
    )
