"""Attention drift, as data and numbers: what `kvdemo.drift.run_drift` returns (a `DriftReport` with one
`PrecisionDrift` per quantized precision) and what the page's table and notes read from it.

JS: Jensen-Shannon divergence of the attention distributions (nats, in [0, ln 2]); KL: KL(full || quantized);
logit KL: of the next-token distributions, one per generated (teacher-forced) token.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class PrecisionDrift:
    """Drift of one precision against full precision on the same prompt and query tokens."""

    precision: str
    spec: dict  # PrecisionSpec.to_dict()
    bits_per_element: float
    mean_js: float
    mean_kl: float
    topk_overlap: float  # share of full precision's top-k attended keys among the quantized run's top-k
    output_cosine: float  # cosine of the attention outputs
    top1_agreement: float  # fraction of steps whose next-token argmax matches full precision
    coded_keys: int = 0  # keys the last query read from quantized codes (0: the cache held all exactly)
    per_layer: list[dict] = field(default_factory=list)  # {"layer", "js", "kl", "topk_overlap", ..., "js_per_head"}
    by_position: list[dict] = field(default_factory=list)  # {"bin": sinks|early|middle|late|recent, "start", ...}
    position_profile: list[dict] = field(default_factory=list)  # the same numbers in fine equal bins
    logit_kl: list[float] = field(default_factory=list)  # per generated token
    per_query: list[dict] = field(default_factory=list)  # per query step: its means over layers and heads
    seconds: float = 0.0

    @property
    def logit_kl_mean(self) -> float:
        return statistics.fmean(self.logit_kl)

    def to_json(self) -> dict:
        return {
            "precision": self.precision,
            "mean_js": self.mean_js,
            "mean_kl": self.mean_kl,
            "topk_overlap": self.topk_overlap,
            "output_cosine": self.output_cosine,
            "top1_agreement": self.top1_agreement,
            "coded_keys": self.coded_keys,
            "bits_per_element": self.bits_per_element,
            "per_layer": self.per_layer,
            "by_position": self.by_position,
            "position_profile": self.position_profile,
            "logit_kl": self.logit_kl,
            "per_query": self.per_query,
            "spec": self.spec,
            "seconds": round(self.seconds, 3),
        }

    @classmethod
    def from_json(cls, d: dict) -> PrecisionDrift:
        return cls(**d)


@dataclass
class DriftReport:
    """A drift run: full precision once on a prompt, then each quantized precision on the same prompt and the
    same (teacher-forced) tokens."""

    model: str
    prompt_tokens: int  # the chat-templated prompt: the document and the question
    new_tokens: int  # query steps: the prompt's last token, then the generated tokens fed back
    top_k: int
    prefill_mode: str  # how each quantized cache stored the prompt (runner.PREFILL_MODES)
    generated: str  # full precision's greedy continuation, the tokens every precision is fed
    reference_seconds: float
    results: list[PrecisionDrift]
    tokens: int | None = None  # the document's tokens, when the caller cut one to a length
    document: str | None = None  # the document's name (the page)
    provenance: dict | None = None  # the command, machine and date of a shipped report

    @property
    def seconds(self) -> float:
        """The run's model time: the reference, then every precision."""
        return self.reference_seconds + sum(r.seconds for r in self.results)

    def to_json(self) -> dict:
        out = {"model": self.model}
        if self.tokens is not None:
            out["tokens"] = self.tokens
        out |= {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "top_k": self.top_k,
            "prefill_mode": self.prefill_mode,
            "generated": self.generated,
            "reference_seconds": round(self.reference_seconds, 3),
            "results": [r.to_json() for r in self.results],
        }
        optional = {"document": self.document, "provenance": self.provenance}
        return out | {k: v for k, v in optional.items() if v is not None}

    @classmethod
    def from_json(cls, d: dict) -> DriftReport:
        return cls(
            model=d["model"],
            prompt_tokens=d["prompt_tokens"],
            new_tokens=d["new_tokens"],
            top_k=d["top_k"],
            prefill_mode=d["prefill_mode"],
            generated=d["generated"],
            reference_seconds=d["reference_seconds"],
            results=[PrecisionDrift.from_json(r) for r in d["results"]],
            tokens=d.get("tokens"),
            document=d.get("document"),
            provenance=d.get("provenance"),
        )

    def result(self, precision: str) -> PrecisionDrift:
        """The drift of `precision` (a KeyError names the ones the report has)."""
        for r in self.results:
            if r.precision == precision:
                return r
        raise KeyError(f"no {precision!r} in this report; it has {', '.join(r.precision for r in self.results)}")


def unquantized(report: DriftReport) -> list[str]:
    """Precisions whose queries read no key from codes: everything was still held exactly (nothing to see)."""
    return [r.precision for r in report.results if not r.coded_keys]


def table_rows(report: DriftReport) -> list[dict]:
    """The drift page's table: one row per precision, its bits and mean drift measures."""
    return [
        {
            "precision": r.precision,
            "bits/element": r.bits_per_element,
            "mean JS": r.mean_js,
            "mean KL": r.mean_kl,
            f"top-{report.top_k} overlap": r.topk_overlap,
            "output cosine": r.output_cosine,
            "top-1 agreement": r.top1_agreement,
        }
        for r in report.results
    ]
