"""The methods ablation (`python -m kvdemo ppl --ablation`), as data: KVQuant's table on this model, the claims
about it checked, and what the new formats cost in memory and decode speed; with the tables docs/methods.md
carries and the Findings page shows.

The grid's cells are `run_ppl` rows (`kvdemo.results.ppl.PplRow`), one method per column at 4, 3 and 2 bits.
Each claim is checked on this text's figures and, where the report has them, over resampled text: the 95%
interval of its difference (figure minus its bar) from `kvdemo.ppl`'s paired block bootstrap settles it when it
excludes zero.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .bench import DecodeSpeed
from .measured import MemoryReport
from .ppl import PplReport, PplRow, bracketed, interval_text

ABLATION_REPORT = Path(__file__).resolve().parents[2] / "assets" / "reports" / "ablation.json"  # the shipped run

# the perplexity claims: (precision, the one it is held to, share of that one's figure it may reach). Fewer bits
# no worse (nuq3 with 1% outliers against int4), and 2 bits made usable (nuq2 within 20% of int2's loss, with
# KVQuant's fp16 first token added, against uniform codes given the same sink, and with KVQuant's whole recipe)
CLAIMS = (
    ("nuq3:o1", "int4", 1.0),
    ("nuq3:o1:prerope:s1", "int4", 1.0),
    ("nuq2:o1", "int2", 0.2),
    ("nuq2:o1:s1", "int2", 0.2),
    ("nuq2:o1:s1", "int2:s1", 0.2),
    ("nuq2:o1:prerope:s1", "int2", 0.2),
)
# each claim is checked on the perplexity delta and again on the logit KL vs full precision: the delta of one text
# moves with small changes of the codes, the KL (every kept position's whole next-token distribution) less so
MEASURES = (("delta_vs_full", "delta"), ("logit_kl", "logit KL"))

# difference_ci95(measure, precision, bar precision, share) -> [low, high]: the 95% interval of
# figure(precision) - share x figure(bar precision) over resampled text
DifferenceInterval = Callable[[str, str, str, float], list[float]]


@dataclass
class Check:
    """One claim on this model: the figures it compares, whether it holds on them, and over resampled text."""

    claim: str  # e.g. "nuq2:o1:s1 delta <= 20% of int2 delta"
    values: list[float]  # [the precision's figure, its bar's]
    holds: bool  # on this text's figures
    difference_ci95: list[float] | None = None  # figure - share x bar, over resampled text
    verdict: str | None = None  # "holds" | "does not hold" | "not settled by this text"

    def to_json(self) -> dict:
        d = {"claim": self.claim, "values": list(self.values), "holds": self.holds}
        if self.difference_ci95 is not None:
            d |= {"difference_ci95": list(self.difference_ci95), "verdict": self.verdict}
        return d

    @classmethod
    def from_json(cls, d: dict) -> Check:
        return cls(**d)

    def line(self) -> str:
        """The claim as docs/methods.md states it: the verdict on this text's figures, then (when the check has
        them) the 95% interval of the difference over resampled text and the verdict that leaves."""
        figure, signed = ("{:.3g}", "{:+.3g}") if "logit KL" in self.claim else ("{:+.3f}", "{:+.3f}")
        a, b = (figure.format(x) for x in self.values)
        line = f"{self.claim}: {'holds' if self.holds else 'does not hold'} ({a} vs {b})"
        if self.verdict is not None:
            low, high = (signed.format(x) for x in self.difference_ci95)
            line += f"; over resampled text: {self.verdict} (difference in [{low}, {high}], 95%)"
        return line


def verdict(low: float, high: float) -> str:
    """What an interval of (figure - bar) says of "figure <= bar"."""
    return "holds" if high < 0 else "does not hold" if low > 0 else "not settled by this text"


def checks(rows: Sequence[PplRow], difference_ci95: DifferenceInterval | None = None) -> list[Check]:
    """`CLAIMS` on each of `MEASURES`, for every claim whose two precisions are among `rows`; with
    `difference_ci95` (kvdemo.ppl.ablation_checks draws it from a report's blocks) each gets its verdict over
    resampled text."""
    by_name = {r.precision: r for r in rows}
    out = []
    for measure, word in MEASURES:
        for nuq, uniform, share in CLAIMS:
            if nuq not in by_name or uniform not in by_name:
                continue
            a, b = getattr(by_name[nuq], measure), getattr(by_name[uniform], measure)
            bar = f"{uniform} {word}" if share == 1.0 else f"{share:.0%} of {uniform} {word}"
            check = Check(f"{nuq} {word} <= {bar}", [a, b], a <= share * b)
            if difference_ci95 is not None:
                check.difference_ci95 = difference_ci95(measure, nuq, uniform, share)
                check.verdict = verdict(*check.difference_ci95)
            out.append(check)
    return out


@dataclass
class AblationRow:
    bits: int
    cells: dict[str, PplRow | None]  # column -> its cell's row (None: the column has no format at these bits)

    def to_json(self) -> dict:
        return {"bits": self.bits, "cells": {c: None if r is None else r.to_json() for c, r in self.cells.items()}}

    @classmethod
    def from_json(cls, d: dict) -> AblationRow:
        return cls(d["bits"], {c: None if r is None else PplRow.from_json(r) for c, r in d["cells"].items()})


@dataclass
class AblationReport:
    """`run_ablation`'s report (ablation.json): every cell scored in one `run_ppl` (`ppl`), the grid, the checks,
    and, from `python -m kvdemo ppl --ablation`, the live memory and decode speed of the new formats."""

    ppl: PplReport  # every cell's row, full precision first; its command and date are the report's
    columns: list[str]
    rows: list[AblationRow]  # 4, 3 and 2 bits
    checks: list[Check]
    memory: MemoryReport | None = None  # the live cache at `tokens` beside the layout formula
    decode: DecodeSpeed | None = None  # decode tokens/s side by side

    def to_json(self) -> dict:
        scores = self.ppl.to_json()
        tail = {k: scores.pop(k) for k in ("command", "date") if k in scores}
        d = scores | {
            "columns": list(self.columns),
            "rows": [r.to_json() for r in self.rows],
            "checks": [c.to_json() for c in self.checks],
        }
        if self.memory is not None:
            d["memory"] = self.memory.to_json()
        if self.decode is not None:
            d["decode"] = self.decode.to_json()
        return d | tail

    @classmethod
    def from_json(cls, d: dict) -> AblationReport:
        return cls(
            ppl=PplReport.from_json(d),
            columns=list(d["columns"]),
            rows=[AblationRow.from_json(r) for r in d["rows"]],
            checks=[Check.from_json(c) for c in d["checks"]],
            memory=MemoryReport.from_json(d["memory"]) if "memory" in d else None,
            decode=DecodeSpeed.from_json(d["decode"]) if "decode" in d else None,
        )


def load_ablation(path: Path = ABLATION_REPORT) -> AblationReport | None:
    """The ablation report at `path` (the shipped one by default), or None when there is none."""
    return AblationReport.from_json(json.loads(path.read_text())) if path.is_file() else None


# --- tables ---------------------------------------------------------------------------------------------


def cell_rows(report: AblationReport) -> list[dict]:
    """One row per cell, for a table: bits, column, precision and its figures."""
    rows = []
    for row in report.rows:
        for col in report.columns:
            r = row.cells[col]
            if r is not None:
                rows.append(
                    {
                        "bits": row.bits,
                        "method": col,
                        "precision": r.precision,
                        "ppl delta": f"{r.delta_vs_full:+.3f}",
                        "delta 95%": interval_text(r.delta_vs_full_ci95),
                        "logit KL": f"{r.logit_kl:.2e}",
                        "bits/element": r.bits_per_element,
                        "x smaller than fp16": r.ratio_vs_fp16,
                    }
                )
    return rows


def cost_rows(report: AblationReport) -> list[dict]:
    """What each measured format costs and buys, from the `memory` (the live cache at `tokens`, to the byte) and
    `decode` (tok/s in one interleaved run) parts: one row per precision in either, first-seen order; a figure
    the report did not measure is None."""
    memory = {r.precision: r for r in report.memory.results}
    decode = {r.precision: r for r in report.decode.results}
    base = report.decode.results[0].precision
    rows = []
    for name in dict.fromkeys([*memory, *decode]):
        m, d = memory.get(name), decode.get(name)
        rows.append(
            {
                "precision": name,
                f"x smaller than fp16 @{report.memory.tokens}": None if m is None else round(m.ratio_vs_fp16, 2),
                "bits/element": None if m is None else m.bits_per_element,
                f"decode tok/s @{report.decode.context}": None if d is None else d.tokens_per_s,
                f"decode vs {base}": None if d is None else d.vs_first,
            }
        )
    return rows


def claim_rows(report: AblationReport) -> list[dict]:
    """One row per claim: the verdict on this text's figures and over resampled text."""
    return [
        {
            "claim": c.claim,
            "figures": f"{c.values[0]:.4g} vs {c.values[1]:.4g}",
            "on this text": "holds" if c.holds else "does not hold",
            "over resampled text": c.verdict or "",
            "difference 95%": interval_text(c.difference_ci95, "+.3g"),
        }
        for c in report.checks
    ]


def markdown(report: AblationReport) -> str:
    """docs/methods.md's ablation table: perplexity delta vs full precision at `tokens` (and its 95% interval over
    resampled text when the report has one), the logit KL vs full precision, bits/element and ratio vs 16-bit
    under each (as stored after scoring: the residual window's full-precision tokens included)."""
    cols = report.columns
    lines = ["| bits | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for row in report.rows:
        cells = []
        for col in cols:
            r = row.cells[col]
            if r is None:
                cells.append("-")
                continue
            interval = "" if r.delta_vs_full_ci95 is None else f"<br>{bracketed(r.delta_vs_full_ci95)}"
            cells.append(
                f"{r.delta_vs_full:+.3f}{interval}<br>KL {r.logit_kl:.2e}<br>"
                f"{r.bits_per_element:.2f} b, {r.ratio_vs_fp16:.2f}x"
            )
        lines.append(f"| {row.bits} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def text(report: AblationReport) -> str:
    """The grid, the checks, the live memory and the decode speed, as `python -m kvdemo ppl --ablation` prints
    them after the scores."""
    parts = [markdown(report), *(c.line() for c in report.checks)]
    if report.memory is not None:
        parts.append(report.memory.markdown())
    if report.decode is not None:
        parts.append(report.decode.markdown())
    return "\n\n".join(parts)
