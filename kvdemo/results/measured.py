"""Memory measured on live caches (`kvdemo.measured`), as data: a prefilled cache's bytes beside the formulas,
long prefills' peak memory, and sequences admitted into a budget; with the tables docs/ and the pages show.

`MemoryReport` is what `measure_memory` / `compare_measured` return (assets/reports/memory.json, the ablation's
live-memory part), `ScaleReport` what `python -m kvdemo scale` writes (scale.json, docs/long-contexts.md),
`MeasuredHeadroom` what `measure_headroom` returns (headroom_measured.json, docs/memory.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 2**20


# --- a prefilled cache's live bytes --------------------------------------------------------------------


@dataclass
class CacheMeasurement:
    """One precision's live cache after a prefill, beside a 16-bit cache and (from `compare_measured`) the
    layout's formula."""

    precision: str
    bytes: int  # live bytes, as stored
    bytes_fp16: int  # a 16-bit cache of the same tokens
    ratio_vs_fp16: float
    bits_per_element: float
    bytes_per_token: float
    breakdown: dict[
        str, int
    ]  # QuantizedKVCache.nbytes(): codes, scales, outliers, codebooks, residual, sinks, allocated
    spec: dict  # PrecisionSpec.to_dict()
    layout: dict | None = None  # Regions.to_dict(): tokens, sinks, quantized, residual (compare_measured)
    formula_bytes: int | None = None  # layout.region_bytes of those regions
    formula_plain_bytes: int | None = None  # bytes/token x tokens (ignores sinks and residual)
    error_vs_formula: float | None = None  # bytes / formula_bytes - 1
    error_vs_plain: float | None = None

    def to_json(self) -> dict:
        d = {
            "precision": self.precision,
            "bytes": self.bytes,
            "bytes_fp16": self.bytes_fp16,
            "ratio_vs_fp16": self.ratio_vs_fp16,
            "bits_per_element": self.bits_per_element,
            "bytes_per_token": self.bytes_per_token,
            "breakdown": dict(self.breakdown),
            "spec": dict(self.spec),
        }
        formula = ("layout", "formula_bytes", "formula_plain_bytes", "error_vs_formula", "error_vs_plain")
        return d | {k: getattr(self, k) for k in formula if getattr(self, k) is not None}

    @classmethod
    def from_json(cls, d: dict) -> CacheMeasurement:
        return cls(**d)


@dataclass
class MemoryReport:
    """Live caches of one prompt at each precision (`python -m kvdemo memory`, the ablation's memory part)."""

    model: str
    tokens: int
    results: list[CacheMeasurement]
    dtype: str | None = None  # the model's dtype (compare_measured)
    provenance: dict | None = None  # how the shipped report was made: command, machine, date, load averages

    def to_json(self) -> dict:
        d = {"model": self.model, "tokens": self.tokens, "results": [r.to_json() for r in self.results]}
        if self.dtype is not None:
            d["dtype"] = self.dtype
        if self.provenance is not None:
            d["provenance"] = dict(self.provenance)
        return d

    @classmethod
    def from_json(cls, d: dict) -> MemoryReport:
        return cls(
            model=d["model"],
            tokens=d["tokens"],
            results=[CacheMeasurement.from_json(r) for r in d["results"]],
            dtype=d.get("dtype"),
            provenance=d.get("provenance"),
        )

    def markdown(self) -> str:
        """docs/methods.md's live-memory table: the cache holding the prompt beside the layout formula."""
        lines = [
            f"| precision | live bytes @{self.tokens} | formula bytes | ratio vs fp16 | bits/element |",
            "|---|---|---|---|---|",
        ]
        for r in self.results:
            lines.append(
                f"| {r.precision} | {r.bytes:,} | {r.formula_bytes:,} | {r.ratio_vs_fp16:.2f}x | "
                f"{r.bits_per_element:.3f} |"
            )
        return "\n".join(lines)

    def lines(self, width: int) -> list[str]:
        """The measured live cache beside both formulas, one line per precision (the `headroom` CLI's text)."""
        out = [f"measured live cache ({self.tokens:,} tokens, {self.dtype}) vs formula:"]
        for r in self.results:
            out.append(
                f"  {r.precision:<{width}}{r.bytes:>14,} B measured  {r.formula_bytes:>14,} B formula "
                f"({r.error_vs_formula:+.2%})  {r.formula_plain_bytes:>14,} B bytes/token x tokens "
                f"({r.error_vs_plain:+.2%})"
            )
        return out


# --- long prefills: peak memory and time -----------------------------------------------------------------


@dataclass
class PrefillRow:
    """One prefill of `tokens` tokens at `precision`, in a fresh process: its peak memory, split into parts."""

    tokens: int
    precision: str
    mode: str  # "chunked" | "exact"
    chunk: int  # runner.PREFILL_CHUNK
    peak_bytes: int  # weights + what the prefill added at its peak
    cache_bytes: int  # the cache's allocated bytes
    weights_bytes: int
    workspace_bytes: int  # peak - weights - cache: activations, one piece of the past in floats, scores
    prefill_s: float
    peak_measured_by: str  # torch.cuda.max_memory_allocated, or VmHWM with the glibc setting it ran under

    def to_json(self) -> dict:
        return dict(vars(self))

    @classmethod
    def from_json(cls, d: dict) -> PrefillRow:
        return cls(**d)


@dataclass
class ScaleReport:
    """`python -m kvdemo scale`: long prompts prefilled at each precision (scale.json)."""

    command: str
    model: str
    machine: str
    mode: str
    date: str
    rows: list[PrefillRow]

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in ("command", "model", "machine", "mode", "date")}
        return d | {"rows": [r.to_json() for r in self.rows]}

    @classmethod
    def from_json(cls, d: dict) -> ScaleReport:
        return cls(**(d | {"rows": [PrefillRow.from_json(r) for r in d["rows"]]}))

    def markdown(self) -> str:
        """docs/long-contexts.md's table."""
        lines = [
            "| tokens | precision | peak MiB | cache MiB | weights MiB | workspace MiB | prefill s |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            mib = [r.peak_bytes / MIB, r.cache_bytes / MIB, r.weights_bytes / MIB, r.workspace_bytes / MIB]
            lines.append(
                f"| {r.tokens:,} | {r.precision} | " + " | ".join(f"{x:,.1f}" for x in mib) + f" | {r.prefill_s:.1f} |"
            )
        return "\n".join(lines)

    def text(self) -> str:
        """What `python -m kvdemo scale` prints."""
        lines = [
            f"{self.model} on {self.machine}",
            f"{'tokens':>8} {'precision':<10}{'peak MiB':>10}{'cache MiB':>11}{'weights MiB':>13}{'workspace MiB':>15}"
            f"{'prefill s':>11}",
        ]
        for r in self.rows:
            lines.append(
                f"{r.tokens:>8} {r.precision:<10}{r.peak_bytes / MIB:>10,.1f}{r.cache_bytes / MIB:>11,.1f}"
                f"{r.weights_bytes / MIB:>13,.1f}{r.workspace_bytes / MIB:>15,.1f}{r.prefill_s:>11,.2f}"
            )
        return "\n".join(lines)


# --- sequences admitted into a memory budget ---------------------------------------------------------------


@dataclass
class BatchSpeed:
    """Decode speed of `batch` admitted sequences decoding together."""

    batch: int
    tokens_per_s: float  # all sequences of the batch together
    seconds: float

    def to_json(self) -> dict:
        return {"batch": self.batch, "tokens_per_s": self.tokens_per_s, "seconds": self.seconds}

    @classmethod
    def from_json(cls, d: dict) -> BatchSpeed:
        return cls(**d)


@dataclass
class HeadroomRow:
    """One precision: sequences of `context` tokens admitted into the budget (real caches) beside the formula's
    count, and decode tokens/s by batch size."""

    precision: str
    context: int
    budget_bytes: int
    weights_bytes: int
    sequence_bytes_measured: int  # one admitted cache's allocated bytes, at its fullest
    sequence_bytes_formula: int  # kvdemo.memory.sequence_bytes at the model's dtype
    measured_max_sequences: int
    max_sequences: int  # the formula's count
    measured_vs_formula: float | None  # None when the formula admits none
    held_bytes: int  # weights + every admitted cache
    tokens_per_s: list[BatchSpeed] = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(vars(self)) | {"tokens_per_s": [s.to_json() for s in self.tokens_per_s]}

    @classmethod
    def from_json(cls, d: dict) -> HeadroomRow:
        return cls(**(d | {"tokens_per_s": [BatchSpeed.from_json(s) for s in d["tokens_per_s"]]}))


MEASURED_HEADROOM_METHOD = (
    "each admitted sequence is a real QuantizedKVCache at the fullest point of a sequence decoding to the context "
    "(its residual window full); admitted while weights + the caches' allocated bytes fit the budget; the formula "
    "is kvdemo.memory.sequence_bytes at the model's dtype"
)


@dataclass
class MeasuredHeadroom:
    """`measure_headroom`'s report (headroom_measured.json): the model, budget and context, one row per precision.
    `command`, `machine` and `date` are set by `python -m kvdemo headroom --measure`."""

    model: str
    dtype: str
    budget_bytes: int
    context: int
    results: list[HeadroomRow]
    method: str = MEASURED_HEADROOM_METHOD
    command: str = ""
    machine: str = ""
    date: str = ""

    def to_json(self) -> dict:
        return {
            "command": self.command,
            "machine": self.machine,
            "date": self.date,
            "model": self.model,
            "dtype": self.dtype,
            "budget_bytes": self.budget_bytes,
            "context": self.context,
            "max_sequences": {r.precision: r.max_sequences for r in self.results},
            "measured_max_sequences": {r.precision: r.measured_max_sequences for r in self.results},
            "tokens_per_s": {r.precision: [s.to_json() for s in r.tokens_per_s] for r in self.results},
            "results": [r.to_json() for r in self.results],
            "method": self.method,
        }

    @classmethod
    def from_json(cls, d: dict) -> MeasuredHeadroom:
        """The per-precision maps (max_sequences, measured_max_sequences, tokens_per_s) are read from the rows."""
        keep = ("model", "dtype", "budget_bytes", "context", "method", "command", "machine", "date")
        return cls(**{k: d[k] for k in keep}, results=[HeadroomRow.from_json(r) for r in d["results"]])

    def markdown(self) -> str:
        """docs/memory.md's table."""
        sizes = [s.batch for s in self.results[0].tokens_per_s]
        lines = [
            "| precision | admitted (measured) | formula | measured / formula | bytes per sequence (measured / "
            "formula) | " + " | ".join(f"tok/s, batch {b}" for b in sizes) + " |",
            "|---|---|---|---|---|" + "---|" * len(sizes),
        ]
        for r in self.results:
            speeds = " | ".join(f"{s.tokens_per_s:.2f}" for s in r.tokens_per_s)
            lines.append(
                f"| {r.precision} | {r.measured_max_sequences} | {r.max_sequences} | {r.measured_vs_formula:.3f} | "
                f"{r.sequence_bytes_measured:,} / {r.sequence_bytes_formula:,} | {speeds} |"
            )
        return "\n".join(lines)

    def text(self) -> str:
        """What `python -m kvdemo headroom --measure` prints."""
        w = max([10, *(len(r.precision) for r in self.results)]) + 2
        lines = [
            f"{self.model} ({self.dtype}), budget {self.budget_bytes / 1e9:,.2f} GB, context {self.context:,} tokens",
            f"{'precision':<{w}}{'measured':>10}{'formula':>9}{'ratio':>8}  decode tokens/s by batch size",
        ]
        for r in self.results:
            speeds = ", ".join(f"{s.batch}: {s.tokens_per_s:.1f}" for s in r.tokens_per_s)
            ratio = "" if r.measured_vs_formula is None else f"{r.measured_vs_formula:.3f}"
            lines.append(f"{r.precision:<{w}}{r.measured_max_sequences:>10}{r.max_sequences:>9}{ratio:>8}  {speeds}")
        return "\n".join(lines)

    def table_rows(self) -> list[dict]:
        """The Memory page's table: counts, the ratio, MiB per sequence and tokens/s by batch size."""
        return [
            {
                "precision": r.precision,
                "measured sequences": r.measured_max_sequences,
                "formula sequences": r.max_sequences,
                "measured / formula": r.measured_vs_formula,
                "MiB per sequence (measured)": r.sequence_bytes_measured / MIB,
                "MiB per sequence (formula)": r.sequence_bytes_formula / MIB,
                "tokens/s by batch": ", ".join(f"{s.batch}: {s.tokens_per_s:,.0f}" for s in r.tokens_per_s),
            }
            for r in self.results
        ]
