"""The two prefill modes side by side, as data and numbers: what `kvdemo.prefill_modes` returns (a needle cell
and a drift run, each with the prompt stored `exact` and `chunked`), and the lines and table the pages and
the CLI show of it.

A prompt of one prefill chunk or less is stored the same way in both modes, so `chunks` (of the prompt) says
whether the two can differ at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .needle import NeedleRow


@dataclass
class NeedleModes:
    """One needle cell (length, depth, seed): full precision, then each quantized precision with the haystack
    stored exact and chunked."""

    kind: str
    haystack: str
    seed: int
    length: int  # target prompt length
    depth: float
    prompt_tokens: int
    context_tokens: int  # the part prefilled (the haystack); the question runs after it
    chunks: int  # prefill chunks of the context
    expected: str
    # per precision: {"precision", "full"|"exact"|"chunked": {"answer", "correct", "answer_logprob"},
    # "exact_vs_full", "chunked_vs_full", "chunked_vs_exact"} (log-prob differences, nats)
    results: list[dict]
    rows: dict[str, list[NeedleRow]]  # mode -> the cell's rows (full precision under "exact")
    seconds: float

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "haystack": self.haystack,
            "seed": self.seed,
            "length": self.length,
            "depth": self.depth,
            "prompt_tokens": self.prompt_tokens,
            "context_tokens": self.context_tokens,
            "chunks": self.chunks,
            "expected": self.expected,
            "results": self.results,
            "rows": {mode: [r.to_json() for r in rows] for mode, rows in self.rows.items()},
            "seconds": round(self.seconds, 2),
        }

    @classmethod
    def from_json(cls, d: dict) -> NeedleModes:
        rows = {mode: [NeedleRow.from_json(r) for r in rs] for mode, rs in d["rows"].items()}
        return cls(**(d | {"rows": rows}))

    def title(self) -> str:
        return (
            f"{self.kind} in {self.haystack}, {self.prompt_tokens:,} tokens ({self.chunks} prefill chunks), "
            f"depth {self.depth:g}%, seed {self.seed}"
        )


@dataclass
class DriftModes:
    """One drift run per mode against one full-precision reference."""

    prompt_tokens: int
    new_tokens: int
    chunks: int  # prefill chunks of the prompt
    generated: str  # the reference's continuation
    # per precision: {"precision", "exact"|"chunked": {"mean_js", "mean_kl", "top1_agreement", "coded_keys",
    # "logit_kl_mean", "logit_kl_max"}, "chunked_over_exact": {"mean_js", "mean_kl", "logit_kl_mean"}}
    results: list[dict]
    seconds: float
    document_tokens: int | None = None  # the document's tokens before the question and template

    def to_json(self) -> dict:
        out = {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "chunks": self.chunks,
            "generated": self.generated,
            "results": self.results,
            "seconds": round(self.seconds, 2),
        }
        return out | ({} if self.document_tokens is None else {"document_tokens": self.document_tokens})

    @classmethod
    def from_json(cls, d: dict) -> DriftModes:
        return cls(**d)

    def title(self) -> str:
        return f"{self.prompt_tokens:,}-token prompt ({self.chunks} prefill chunks), {self.new_tokens} queries"


@dataclass
class PrefillModesReport:
    """`python -m kvdemo prefill-modes`: a needle cell and a drift run of about `tokens` tokens, both modes."""

    model: str
    device: str
    dtype: str
    tokens: int
    chunk: int  # runner.PREFILL_CHUNK
    modes: dict[str, str]  # mode -> what it does
    needle: NeedleModes
    drift: DriftModes
    seconds: float
    provenance: dict | None = None  # the command, date and machine

    def to_json(self) -> dict:
        out = {
            "model": self.model,
            "device": self.device,
            "dtype": self.dtype,
            "tokens": self.tokens,
            "chunk": self.chunk,
            "modes": self.modes,
            "needle": self.needle.to_json(),
            "drift": self.drift.to_json(),
            "summary": summary_rows(self.needle, self.drift),
            "seconds": round(self.seconds, 2),
        }
        return out | ({} if self.provenance is None else {"provenance": self.provenance})

    @classmethod
    def from_json(cls, d: dict) -> PrefillModesReport:
        fields = {k: v for k, v in d.items() if k != "summary"}  # the summary follows from the two parts
        return cls(
            **(fields | {"needle": NeedleModes.from_json(d["needle"]), "drift": DriftModes.from_json(d["drift"])})
        )


def summary_rows(cell: NeedleModes | None = None, drift: DriftModes | None = None) -> list[dict]:
    """One row per precision: the needle's answer log-prob at full precision, exact and chunked and
    chunked minus exact; the drift's mean attention JS and mean logit KL per mode and chunked over exact."""
    labels = [r["precision"] for r in (cell or drift).results]
    needles = {r["precision"]: r for r in cell.results} if cell else {}
    drifts = {r["precision"]: r for r in drift.results} if drift else {}
    rows = []
    for label in labels:
        row, n, d = {"precision": label}, needles.get(label), drifts.get(label)
        if n:
            row |= {
                "log p full": n["full"]["answer_logprob"],
                "log p exact": n["exact"]["answer_logprob"],
                "log p chunked": n["chunked"]["answer_logprob"],
                "log p chunked - exact": n["chunked_vs_exact"],
                "found (full/exact/chunked)": "/".join(
                    "yes" if n[m]["correct"] else "no" for m in ("full", "exact", "chunked")
                ),
            }
        if d:
            for name, field in (("JS", "mean_js"), ("logit KL", "logit_kl_mean")):
                ratio = d["chunked_over_exact"][field]
                row |= {
                    f"{name} exact": d["exact"][field],
                    f"{name} chunked": d["chunked"][field],
                    f"{name} chunked/exact": None if ratio is None else round(ratio, 3),
                }
        rows.append(row)
    return rows


def headlines(comparison: NeedleModes | DriftModes, chunk: int) -> list[str]:
    """One sentence per precision: the two modes' numbers and their difference (pages); a note when the prompt
    fits one prefill chunk of `chunk` tokens (runner.PREFILL_CHUNK): then the two modes are one."""
    out = []
    for r in comparison.results:
        if isinstance(comparison, NeedleModes):
            out.append(
                f"{r['precision']}: log p(true answer) full {r['full']['answer_logprob']:.4f}, exact "
                f"{r['exact']['answer_logprob']:.4f}, chunked {r['chunked']['answer_logprob']:.4f}: chunked minus "
                f"exact {r['chunked_vs_exact']:+.4f} nats"
            )
        else:
            e, c, q = r["exact"], r["chunked"], r["chunked_over_exact"]
            times = "" if q["logit_kl_mean"] is None else f" ({q['logit_kl_mean']:.2f}x)"
            out.append(
                f"{r['precision']}: mean attention JS exact {e['mean_js']:.3g}, chunked {c['mean_js']:.3g}; mean "
                f"logit KL exact {e['logit_kl_mean']:.3g}, chunked {c['logit_kl_mean']:.3g}{times}"
            )
    if comparison.chunks == 1:
        out.append(
            f"The prompt fits one prefill chunk ({chunk:,} tokens): both modes store it the same way. Use a longer "
            "prompt to see them differ."
        )
    return out


def save_report(report: PrefillModesReport, path: str | Path) -> None:
    """Write the report's JSON to `path` (prefill_modes.json), making its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")


def load_report(path: str | Path) -> PrefillModesReport:
    return PrefillModesReport.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
