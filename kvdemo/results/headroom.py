"""A headroom plan (`kvdemo.memory.headroom`), as data: how many sequences of a context fit a GPU budget at each KV
precision, the memory split, weight x KV stacking, the memory curve against context and the nearest production
settings; with the table the Memory page shows and the text `python -m kvdemo headroom` prints.

Bytes throughout; GB = 10^9 bytes. The JSON keeps one map per figure (precision -> value), as the CLI has always
printed it; the dataclass keeps one `PrecisionHeadroom` per precision.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..configs import GB, WEIGHT_BITS
from ..production import ENGINES
from .measured import MemoryReport


@dataclass
class MemorySplit:
    """The whole budget (all GPUs) at the max sequence count, bytes: weights / KV / reserve / unused / over."""

    weights: int
    kv: int
    reserve: int
    free: int
    over: int  # by how much weights + reserve exceed the budget
    total: int

    def to_json(self) -> dict:
        return dict(vars(self))


@dataclass
class PrecisionHeadroom:
    """One KV precision's figures in a plan."""

    label: str
    bits_per_element: dict[str, float]  # {"key", "value"}, scales and zero points included
    bytes_per_token: int | float  # the whole model, all GPUs
    bytes_per_token_per_gpu: int | float
    sequence_bytes: int | float  # one sequence of the context, all GPUs (sinks + residual at 16 bits)
    max_sequences: int
    sequences_vs_16bit: float | None  # None when 16-bit fits none
    concurrency: float  # free KV bytes / sequence bytes (vLLM's "maximum concurrency")
    kv_token_capacity: int
    max_context_for_users: int  # the longest context each of `users` sequences gets, capped at the model's
    max_context_memory: int  # the same, memory alone
    max_context_limited_by: str  # "model" | "memory"
    split: MemorySplit
    reason: str | None  # why no sequence fits (None when one does)
    stacking: dict[str, int]  # weight bits ("16", "8", "4") -> max sequences
    production: dict  # kvdemo.production.production_settings: engine -> setting


# the per-precision maps of the JSON, in their order (split and production are converted apart)
_MAPS = (
    "bits_per_element",
    "bytes_per_token",
    "bytes_per_token_per_gpu",
    "sequence_bytes",
    "max_sequences",
    "max_sequences_16bit",  # not a map: the 16-bit count, placed here in the JSON
    "sequences_vs_16bit",
    "concurrency",
    "kv_token_capacity",
    "max_context_for_users",
    "max_context_memory",
    "max_context_limited_by",
    "split",
    "reason",
    "stacking",
    "production",
)


@dataclass
class HeadroomCurve:
    """Total memory (GB, all GPUs) of weights + reserve + `users` sequences against context, per precision."""

    users: int
    context: list[int]  # x: tokens per sequence
    gb: dict[str, list[float]]  # precision -> [len(context)] GB
    budget_gb: float
    weights_gb: float
    reserve_gb: float
    max_context: int  # the model's

    def to_json(self) -> dict:
        return dict(vars(self))


@dataclass
class Headroom:
    """A plan for `context`-token sequences of one model config on `gpus` x one GPU (see kvdemo/memory.py)."""

    model_config: str
    model: dict  # ModelConfig.to_dict()
    gpu: str
    gpu_info: dict  # GPU.to_dict()
    gpus: int
    context: int
    users: int
    weight_bits: int
    kv_heads_per_gpu: int
    budget_bytes: int  # all GPUs
    weights_bytes: int
    reserve_bytes: int  # all GPUs
    free_kv_bytes: int  # all GPUs
    fits: bool  # weights + reserve leave room for a KV cache
    context_exceeds_model: bool
    max_sequences_16bit: int
    precisions: list[PrecisionHeadroom]
    warnings: list[str]
    curve: HeadroomCurve
    measured: MemoryReport | None = None  # `--model-config loaded`: the live cache beside the formulas

    def by_label(self) -> dict[str, PrecisionHeadroom]:
        return {p.label: p for p in self.precisions}

    def size_vs_16bit(self, p: PrecisionHeadroom) -> float:
        """How many times smaller one `context`-token sequence at `p` is than the same tokens in a 16-bit cache:
        from bytes (K + V, 2 bytes an element, all layers and KV heads), so defined even where memory holds no
        16-bit sequence (then `sequences_vs_16bit` is None)."""
        m = self.model  # KV heads as placed: each GPU holds `kv_heads_per_gpu` (replicated when GPUs > heads)
        return 2 * m["layers"] * self.kv_heads_per_gpu * self.gpus * m["head_dim"] * 2 * self.context / p.sequence_bytes

    def to_json(self) -> dict:
        head = (
            "model_config", "model", "gpu", "gpu_info", "gpus", "context", "users", "weight_bits", "kv_heads_per_gpu",
            "budget_bytes", "weights_bytes", "reserve_bytes", "free_kv_bytes", "fits", "context_exceeds_model",
        )  # fmt: skip
        d = {k: getattr(self, k) for k in head}
        for name in _MAPS:
            if name == "max_sequences_16bit":
                d[name] = self.max_sequences_16bit
            elif name == "split":
                d[name] = {p.label: p.split.to_json() for p in self.precisions}
            else:
                d[name] = {p.label: getattr(p, name) for p in self.precisions}
        d["warnings"] = list(self.warnings)
        d["curve"] = self.curve.to_json()
        if self.measured is not None:
            d["measured"] = self.measured.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict) -> Headroom:
        fields = [n for n in _MAPS if n != "max_sequences_16bit"]
        precisions = []
        for label in d["max_sequences"]:
            one = {n: d[n][label] for n in fields}
            precisions.append(PrecisionHeadroom(label, **(one | {"split": MemorySplit(**one["split"])})))
        head = {k: v for k, v in d.items() if k not in _MAPS and k not in ("warnings", "curve", "measured")}
        return cls(
            **head,
            max_sequences_16bit=d["max_sequences_16bit"],
            precisions=precisions,
            warnings=list(d["warnings"]),
            curve=HeadroomCurve(**d["curve"]),
            measured=MemoryReport.from_json(d["measured"]) if "measured" in d else None,
        )

    def table_rows(self) -> list[dict]:
        """The Memory page's table: bits, bytes/token, GB per sequence, max sequences, how many times smaller than
        a 16-bit cache a sequence is (`size_vs_16bit`) and max context."""
        return [
            {
                "precision": p.label,
                "bits K / V": "{key:.3g} / {value:.3g}".format(**p.bits_per_element),
                "bytes/token": p.bytes_per_token,
                "GB per sequence": p.sequence_bytes / GB,
                "max sequences": p.max_sequences,
                "x smaller than 16-bit": f"{self.size_vs_16bit(p):.2f}x",
                f"max context for {self.users} user(s)": p.max_context_for_users,
            }
            for p in self.precisions
        ]

    def text(self) -> str:
        """The plan as `python -m kvdemo headroom` prints it (without --json)."""
        m, g = self.model, self.gpu_info
        w = max([12, *(len(p.label) for p in self.precisions)]) + 2
        lines = [
            f"{m['display_name']}: {m['layers']} layers, {m['kv_heads']} KV heads x {m['head_dim']}, "
            f"{m['params'] / 1e9:.2f}B params at {self.weight_bits}-bit = {_gb(self.weights_bytes)}",
            f"{self.gpus} x {g['display_name']} ({g['memory_gb']:.1f} GB each), reserve {_gb(self.reserve_bytes)}, "
            f"KV room {_gb(self.free_kv_bytes)}; context {self.context:,} tokens, "
            f"{self.users} user(s) for the max-context column",
            "",
            f"{'precision':<{w + 2}}{'bits K/V':>12}{'B/token':>11}{'KV/seq':>12}{'max seqs':>10}{'vs 16-bit':>10}"
            f"{'max ctx':>12}",
        ]
        for p in self.precisions:
            bits, ratio = p.bits_per_element, self.size_vs_16bit(p)
            limit = " (model)" if p.max_context_limited_by == "model" else ""
            lines.append(
                f"{p.label:<{w + 2}}{bits['key']:>6.3g}/{bits['value']:<5.3g}{p.bytes_per_token:>11,}"
                f"{_gb(p.sequence_bytes):>12}{p.max_sequences:>10,}{f'{ratio:.2f}x':>10}"
                f"{p.max_context_for_users:>12,}{limit}"
            )
        lines.append("\nmemory split at max sequences (all GPUs): weights / KV / reserve / free")
        for p in self.precisions:
            s = p.split
            lines.append(
                f"  {p.label:<{w}}{_gb(s.weights)} / {_gb(s.kv)} / {_gb(s.reserve)} / {_gb(s.free)}"
                + (f"  (over by {_gb(s.over)})" if s.over else "")
            )
        lines.append("\nstacking: max sequences by weight bits x KV precision")
        lines.append("  " + f"{'':<{w}}" + "".join(f"{wb + '-bit W':>11}" for wb in map(str, WEIGHT_BITS)))
        for p in self.precisions:
            lines.append(f"  {p.label:<{w}}" + "".join(f"{p.stacking[str(wb)]:>11,}" for wb in WEIGHT_BITS))
        reasons = [(p.label, p.reason) for p in self.precisions if p.reason]
        if reasons:
            lines.append("")
            lines += [f"{k}: {r}" for k, r in reasons]
        lines.append("\ntake it to production (nearest settings):")
        for p in self.precisions:
            lines.append(f"  {p.label}:")
            for engine in [e for e in ENGINES if e in p.production]:
                e = p.production[engine]
                lines.append(f"    {engine:<13}{e['setting']}  [{e['match']}]")
                for gap in e["cannot_express"]:
                    lines.append(f"    {'':<13}- cannot: {gap}")
                for alt in e.get("alternatives", []):
                    lines.append(f"    {'':<13}- also: {alt['setting']} ({alt['when']})")
        if self.measured is not None:
            lines.append("")
            lines += self.measured.lines(w)
        if self.warnings:
            lines.append("")
            lines += [f"warning: {x}" for x in self.warnings]
        return "\n".join(lines)


def _gb(x: float) -> str:
    return f"{x / GB:,.2f} GB"
