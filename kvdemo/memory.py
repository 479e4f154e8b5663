"""KV-cache bytes: measured on a live cache, by formula, and as concurrency headroom on a GPU budget.

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

Units: bytes internally; GB = 10^9 bytes in every option and printout. GPU presets
(assets/gpus.json) carry the total memory the driver reports in MiB (2^20 bytes): an "H100 80 GB"
has 81,559 MiB = 85.5 GB. Reference model configs (assets/model_configs/*.json) are typed from the
public Hugging Face model cards and config.json files named in their `source` field.
vLLM prints the same quantity as "Maximum concurrency for N tokens per request" (our `concurrency`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from . import layout
from .precision import PrecisionSpec, parse_precision
from .production import production_settings

if TYPE_CHECKING:  # torch is imported only where a model runs: headroom math stays light
    from .models import LoadedModel

ASSETS = Path(__file__).resolve().parent.parent / "assets"
MODEL_CONFIG_DIR = ASSETS / "model_configs"
GPU_FILE = ASSETS / "gpus.json"
GB = 10**9
MIB = 2**20
SERVE_BITS = 16  # full precision when planning a deployment: fp16 / bf16
WEIGHT_BITS = (16, 8, 4)
DEFAULT_RESERVE_FRACTION = 0.10
MEASURE_TOKENS = 2048  # `--model-config loaded`: prefill at most this many tokens for the measured column
CURVE_POINTS = 41
MODEL_ALIASES = {
    "mistral-7b": "mistral-7b-v0.3",
    "smollm2": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
    "embedded": "smollm2-135m",
    "llama-3-8b": "llama-3.1-8b",
    "llama-3-70b": "llama-3.1-70b",
}
GPU_ALIASES = {
    "l4": "l4-24gb",
    "rtx4090": "rtx4090-24gb",
    "rtx-4090": "rtx4090-24gb",
    "4090": "rtx4090-24gb",
    "rtx-4090-24gb": "rtx4090-24gb",
    "a100-40": "a100-40gb",
    "a100-80": "a100-80gb",
    "h100": "h100-80gb",
    "h100-80": "h100-80gb",
    "h200": "h200-141gb",
    "h200-141": "h200-141gb",
}


class HeadroomError(ValueError):
    """A headroom question that cannot be answered (unknown config or GPU, bad size), said in one line."""


def fp16_cache_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int) -> int:
    """A 16-bit cache of `tokens` tokens: the reference every ratio is quoted against."""
    return round(layout.bytes_per_token(layers, kv_heads, head_dim, "full", 16) * tokens)


def measure_memory(lm: LoadedModel, ids: Sequence[int], specs: Sequence[PrecisionSpec | str]) -> dict:
    """Prefill `ids` into a cache at each precision; report its live bytes next to a 16-bit cache."""
    from .runner import new_cache, prefill

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
                "breakdown": {
                    k: nb[k] for k in ("codes", "scales", "outliers", "codebooks", "residual", "sinks", "allocated")
                },
                "spec": spec.to_dict(),
            }
        )
        del cache
    return {"model": lm.name, "tokens": tokens, "results": results}


# --- model configs and GPUs ------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """What KV bytes and weight bytes depend on, for one model (typed from its public model card)."""

    name: str
    display_name: str
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    params: int
    max_context: int
    source: str
    notes: str = ""

    def __post_init__(self):
        for field in ("layers", "attention_heads", "kv_heads", "head_dim", "hidden_size", "params", "max_context"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise HeadroomError(f"model config {self.name!r}: {field} must be a positive integer, got {value!r}")
        if self.attention_heads % self.kv_heads:
            raise HeadroomError(
                f"model config {self.name!r}: attention_heads ({self.attention_heads}) must be a multiple of "
                f"kv_heads ({self.kv_heads})"
            )

    def weight_bytes(self, weight_bits: int = 16) -> int:
        """Parameters x bits / 8 (quantization scales not counted)."""
        _check_weight_bits(weight_bits)
        return self.params * weight_bits // 8

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        names = {f for f in cls.__dataclass_fields__}
        missing = sorted(names - set(d) - {"notes"})
        if missing:
            raise HeadroomError(f"model config {d.get('name', '?')!r} lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class GPU:
    """One accelerator's memory (bytes), and its name."""

    name: str
    display_name: str
    memory_bytes: int
    notes: str = ""

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / GB

    def to_dict(self) -> dict:
        return asdict(self) | {"memory_gb": round(self.memory_gb, 3)}


@cache
def model_configs() -> dict[str, ModelConfig]:
    """Reference configs shipped in assets/model_configs/*.json, by name (e.g. "llama-3.1-70b")."""
    configs = {}
    for path in sorted(MODEL_CONFIG_DIR.glob("*.json")):
        cfg = ModelConfig.from_dict(json.loads(path.read_text()))
        configs[cfg.name] = cfg
    if not configs:
        raise FileNotFoundError(f"no model configs in {MODEL_CONFIG_DIR} (reinstall kvdemo with its assets/ folder)")
    return configs


def get_model_config(name: str) -> ModelConfig:
    """A reference config by name or alias (case-insensitive); `loaded` is `config_from_model`."""
    key = MODEL_ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    configs = model_configs()
    if key not in configs:
        raise HeadroomError(f"unknown model config {name!r}; choose one of: {', '.join(configs)}, loaded")
    return configs[key]


def config_from_model(lm: LoadedModel) -> ModelConfig:
    """The same config for a loaded model ("loaded"), with its real parameter count."""
    params = sum(p.numel() for p in lm.unique_parameters())  # tied embeddings count once
    return ModelConfig(
        name="loaded",
        display_name=lm.name,
        layers=lm.num_layers,
        attention_heads=lm.config.num_attention_heads,
        kv_heads=lm.kv_heads,
        head_dim=lm.head_dim,
        hidden_size=lm.config.hidden_size,
        params=params,
        max_context=lm.max_context,
        source=lm.source,
        notes=f"read from the loaded model ({lm.dtype} on {lm.device})",
    )


@cache
def gpu_presets() -> dict[str, GPU]:
    """GPU presets from assets/gpus.json (memory as the driver reports it, MiB -> bytes)."""
    data = json.loads(GPU_FILE.read_text())
    return {
        g["name"]: GPU(g["name"], g["display_name"], int(g["memory_mib"]) * MIB, g.get("notes", ""))
        for g in data["gpus"]
    }


def get_gpu(name: str = "h100-80gb", memory_gb: float | None = None) -> GPU:
    """A preset by name or alias, or a custom GPU of `memory_gb` GB (10^9 bytes) when given."""
    if memory_gb is not None:
        if not math.isfinite(memory_gb) or memory_gb <= 0:
            raise HeadroomError(f"--gpu-memory-gb must be a positive number of GB, got {memory_gb}")
        return GPU(f"custom-{memory_gb:g}gb", f"custom {memory_gb:g} GB", round(memory_gb * GB), "custom size")
    key = GPU_ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    presets = gpu_presets()
    if key not in presets:
        raise HeadroomError(f"unknown GPU {name!r}; choose one of: {', '.join(presets)} (or --gpu-memory-gb N)")
    return presets[key]


# --- formulas ----------------------------------------------------------------------------------------


def _check_weight_bits(weight_bits: int) -> None:
    if weight_bits not in WEIGHT_BITS:
        raise HeadroomError(f"weight bits {weight_bits} not supported; allowed: {', '.join(map(str, WEIGHT_BITS))}")


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


def prefill_updates(tokens: int, chunk: int | None = None) -> list[int]:
    """Tokens per cache update when `runner.prefill` appends `tokens` tokens (chunks of `chunk`)."""
    if chunk is None:
        from .runner import PREFILL_CHUNK as chunk
    return [min(chunk, tokens - start) for start in range(0, tokens, chunk)]


def compare_measured(lm: LoadedModel, ids: Sequence[int], specs: Sequence[PrecisionSpec | str]) -> dict:
    """`measure_memory` beside the formulas: exact regions (`layout.region_bytes`) and plain bytes/token x tokens.

    The plain formula ignores the full-precision sinks and residual, so it matches the live cache only
    when those are empty (sinks 0, tokens a multiple of the group size); the region formula always does.
    """
    specs = [parse_precision(s) for s in specs]
    out = measure_memory(lm, ids, specs)
    cfg = config_from_model(lm)
    full_bits = 8 * lm.dtype.itemsize
    updates = prefill_updates(len(ids))
    out["dtype"] = str(lm.dtype).replace("torch.", "")
    for row, spec in zip(out["results"], specs, strict=True):
        regions = layout.Layout(spec).regions(updates)
        exact = layout.region_bytes(regions, cfg.layers, cfg.kv_heads, cfg.head_dim, spec, full_bits)
        plain = bytes_per_token(cfg, spec, full_bits=full_bits) * len(ids)
        row["layout"] = regions.to_dict()
        row["formula_bytes"] = exact["total"]
        row["formula_plain_bytes"] = round(plain)
        row["error_vs_formula"] = round(row["bytes"] / exact["total"] - 1, 6)
        row["error_vs_plain"] = round(row["bytes"] / plain - 1, 6)
    return out


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
) -> dict:
    """Bytes/token, max concurrent sequences at `context`, max context for `users`, memory split and the
    weight x KV "stacking", for every precision in `specs` at once (see the module docstring)."""
    specs = [parse_precision(s) for s in specs]
    _check_weight_bits(weight_bits)
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
    full16 = parse_precision("full")
    n16 = _sequences(free, sequence_bytes(cfg, full16, context, kv_heads=heads))

    out = {
        "model_config": cfg.name,
        "model": cfg.to_dict(),
        "gpu": gpu.name,
        "gpu_info": gpu.to_dict(),
        "gpus": gpus,
        "context": context,
        "users": users,
        "weight_bits": weight_bits,
        "kv_heads_per_gpu": heads,
        "budget_bytes": per_gpu * gpus,
        "weights_bytes": weights,
        "reserve_bytes": reserve * gpus,
        "free_kv_bytes": round(max(free, 0) * gpus),
        "fits": free > 0,
        "context_exceeds_model": context > cfg.max_context,
        "bits_per_element": {},
        "bytes_per_token": {},
        "bytes_per_token_per_gpu": {},
        "sequence_bytes": {},
        "max_sequences": {},
        "max_sequences_16bit": n16,
        "sequences_vs_16bit": {},
        "concurrency": {},
        "kv_token_capacity": {},
        "max_context_for_users": {},
        "max_context_memory": {},
        "max_context_limited_by": {},
        "split": {},
        "reason": {},
        "stacking": {},
        "production": {},
        "warnings": _warnings(cfg, specs, context, gpus),
    }
    for spec in specs:
        label = spec.label
        seq = sequence_bytes(cfg, spec, context, kv_heads=heads)  # per GPU
        bpt = bytes_per_token(cfg, spec)
        n = _sequences(free, seq)
        mem_ctx = max_tokens(cfg, spec, free / users, kv_heads=heads)
        bits = spec.bits_per_element(cfg.head_dim, full_bits=SERVE_BITS)
        out["bits_per_element"][label] = {"key": bits["key"], "value": bits["value"]}
        out["bytes_per_token"][label] = _num(bpt)
        out["bytes_per_token_per_gpu"][label] = _num(bytes_per_token(cfg, spec, kv_heads=heads))
        out["sequence_bytes"][label] = _num(seq * gpus)
        out["max_sequences"][label] = n
        out["sequences_vs_16bit"][label] = round(n / n16, 3) if n16 else None
        out["concurrency"][label] = round(max(free, 0) / seq, 3)
        out["kv_token_capacity"][label] = int(max(free, 0) // bytes_per_token(cfg, spec, kv_heads=heads))
        out["max_context_memory"][label] = mem_ctx
        out["max_context_for_users"][label] = min(mem_ctx, cfg.max_context)
        out["max_context_limited_by"][label] = "model" if mem_ctx >= cfg.max_context else "memory"
        out["split"][label] = _split(per_gpu, gpus, weights, reserve, n * seq * gpus)
        out["reason"][label] = _reason(cfg, free, seq, per_gpu, reserve, gpus, weight_bits, context)
        out["stacking"][label] = {
            str(wb): _sequences(_free_per_gpu(cfg, per_gpu, reserve, gpus, wb), seq) for wb in WEIGHT_BITS
        }
        out["production"][label] = production_settings(spec, cfg.head_dim)
    out["curve"] = _curve(cfg, specs, per_gpu, gpus, weights, reserve, users, heads, context)
    return out


def _free_per_gpu(cfg: ModelConfig, per_gpu: int, reserve: int, gpus: int, weight_bits: int) -> float:
    return per_gpu - reserve - cfg.weight_bytes(weight_bits) / gpus


def _sequences(free: float, seq: float) -> int:
    return int(free // seq) if free > 0 else 0


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else round(x, 3)


def _split(per_gpu: int, gpus: int, weights: int, reserve: int, kv: float) -> dict:
    """Whole budget (all GPUs), bytes: weights / KV of the max sequences / reserve / unused."""
    total = per_gpu * gpus
    left = total - weights - reserve * gpus - kv
    return {
        "weights": weights,
        "kv": round(kv),
        "reserve": reserve * gpus,
        "free": round(max(left, 0)),
        "over": round(max(-left, 0)),
        "total": total,
    }


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
) -> dict:
    """Total memory (GB, all GPUs) of weights + reserve + `users` sequences, vs context length."""
    top = max(cfg.max_context, context)
    xs = sorted({round(top * i / (CURVE_POINTS - 1)) for i in range(CURVE_POINTS)} | {context})
    base = weights + reserve * gpus
    gb = {
        s.label: [round((base + users * gpus * sequence_bytes(cfg, s, x, kv_heads=heads)) / GB, 4) for x in xs]
        for s in specs
    }
    return {
        "users": users,
        "context": xs,
        "gb": gb,
        "budget_gb": round(per_gpu * gpus / GB, 4),
        "weights_gb": round(weights / GB, 4),
        "reserve_gb": round(reserve * gpus / GB, 4),
        "max_context": cfg.max_context,
    }
