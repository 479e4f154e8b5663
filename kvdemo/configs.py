"""Data the rest of kvdemo looks up: reference model configs, GPU presets, units and where files live.

Nothing here runs a model or imports torch. Reference model configs (assets/model_configs/*.json) are
typed from the public Hugging Face model cards and config.json files named in their `source` field; GPU
presets (assets/gpus.json) carry the total memory the driver reports in MiB (2^20 bytes): an "H100 80 GB"
has 81,559 MiB = 85.5 GB. Units: bytes internally; GB = 10^9 bytes in every option and printout.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
MODEL_CONFIG_DIR = ASSETS / "model_configs"
GPU_FILE = ASSETS / "gpus.json"
GB = 10**9
MIB = 2**20
SERVE_BITS = 16  # full precision when planning a deployment: fp16 / bf16
WEIGHT_BITS = (16, 8, 4)  # weight precisions a deployment may use
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


def cache_dir() -> Path:
    """Where kvdemo keeps converted models, fitted codebooks and measurement caches (KVDEMO_CACHE_DIR)."""
    return Path(os.environ.get("KVDEMO_CACHE_DIR") or Path.home() / ".cache" / "kvdemo")


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
        check_weight_bits(weight_bits)
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
    """A reference config by name or alias (case-insensitive); `loaded` is `models.config_from_model`."""
    key = MODEL_ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    configs = model_configs()
    if key not in configs:
        raise HeadroomError(f"unknown model config {name!r}; choose one of: {', '.join(configs)}, loaded")
    return configs[key]


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


def check_weight_bits(weight_bits: int) -> None:
    if weight_bits not in WEIGHT_BITS:
        raise HeadroomError(f"weight bits {weight_bits} not supported; allowed: {', '.join(map(str, WEIGHT_BITS))}")
