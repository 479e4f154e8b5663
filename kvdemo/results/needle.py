"""Needle grids, as data and numbers: the rows and the grid `kvdemo.needle.run_grid` returns, what the tables,
verdicts and figures read from them, and a grid's files (needle.json, needle.csv).

A grid is a found count: one cell is one needle, so between settings alike in every other measure its count
moves by cells. `summarize` gives each precision's found rate over all its runs (cells x seeds) with a 95%
Wilson interval, `found_check` judges a bar against that interval, and `paired_difference` compares two
precisions on the same needles (same length, depth and seed) with a paired bootstrap. docs/needle.md and
docs/methods-passkey.md print these lines and tables from the shipped reports in assets/reports/.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..engines import baseline_of


@dataclass
class NeedleRow:
    """One run: a (length, depth, seed) cell at one precision."""

    length: int  # target prompt length, tokens
    depth: float  # requested needle depth, percent
    precision: str
    answer: str  # the generated reply (after the answer prefix)
    correct: bool
    answer_logprob: float  # teacher-forced log p(true answer | prompt), natural log, summed
    expected: str
    kind: str
    key: str
    prompt_tokens: int
    depth_actual: float
    needle_position: int
    answer_tokens: int
    generated_tokens: int
    stopped: str  # "eos" | "length" | "answer_end"
    prefill_s: float  # the cell's one shared full-precision prefill
    seconds: float  # this precision's own work: suffix, answer log-prob, greedy answer
    seed: int | None = None  # the needle's seed (`kvdemo.needle.cell_rng`); None in reports before repeats

    def to_json(self) -> dict:
        out = asdict(self)
        if self.seed is None:
            del out["seed"]
        return out

    @classmethod
    def from_json(cls, d: dict) -> NeedleRow:
        return cls(**d)


def cell_key(row: NeedleRow) -> tuple[int, float, int]:
    """(length, depth, seed) of a row: the needle it was asked, whatever its precision (reports written before
    repeats carry no seed: one seed per grid)."""
    return row.length, row.depth, 0 if row.seed is None else row.seed


@dataclass
class NeedleGrid:
    """A needle grid: every (length, depth) cell at full precision and each quantized precision on the same
    tokens, `repeats` times with new needles (seeds seed, seed + 1, ...)."""

    model: str
    kind: str  # "passkey" | "multikey" | "custom"
    haystack: str  # "filler", "prose" or the document's name
    seed: int
    lengths: list[int]
    depths: list[float]
    precisions: list[str]
    rows: list[NeedleRow]
    seconds: float
    stopped: str = "done"  # "done" | "cancelled" (the rows a cancelled run finished)
    notes: list[str] = field(default_factory=list)
    prefill_mode: str = "exact"
    codebooks: str | None = None  # what the nuq precisions' levels were fitted on (None: no nuq precision)
    repeats: int | None = 1  # runs per cell (seeds); None in reports written before repeats: one per cell
    summary: list[dict] | None = None  # `summarize(rows)` as the report was written (None: computed now)
    provenance: dict | None = None  # the command that reproduces the grid, its date and machine (CLI)
    files: dict | None = None  # {"json": path, "csv": path} once `save_grid` wrote them

    def __post_init__(self) -> None:
        if self.summary is None:
            self.summary = summarize(self.rows)

    @property
    def runs_per_cell(self) -> int:
        return self.repeats or 1

    @property
    def planned_runs(self) -> int:
        """Rows the whole grid has: cells x precisions x repeats (a cancelled grid holds fewer)."""
        return len(self.lengths) * len(self.depths) * len(self.precisions) * self.runs_per_cell

    def to_json(self) -> dict:
        out = {
            "model": self.model,
            "kind": self.kind,
            "prefill_mode": self.prefill_mode,
            "haystack": self.haystack,
            "seed": self.seed,
        }
        if self.repeats is not None:
            out["repeats"] = self.repeats
        out |= {
            "lengths": self.lengths,
            "depths": self.depths,
            "precisions": self.precisions,
            "rows": [r.to_json() for r in self.rows],
            "summary": self.summary,
            "seconds": round(self.seconds, 2),
            "stopped": self.stopped,
            "notes": self.notes,
        }
        optional = {"codebooks": self.codebooks, "provenance": self.provenance, "files": self.files}
        return out | {k: v for k, v in optional.items() if v is not None}

    @classmethod
    def from_json(cls, d: dict) -> NeedleGrid:
        return cls(
            model=d["model"],
            kind=d["kind"],
            haystack=d["haystack"],
            seed=d["seed"],
            lengths=d["lengths"],
            depths=d["depths"],
            precisions=d["precisions"],
            rows=[NeedleRow.from_json(r) for r in d["rows"]],
            seconds=d["seconds"],
            stopped=d["stopped"],
            notes=d["notes"],
            prefill_mode=d["prefill_mode"],
            codebooks=d.get("codebooks"),
            repeats=d.get("repeats"),
            summary=d["summary"],
            provenance=d.get("provenance"),
            files=d.get("files"),
        )


def partial_grid(planned: NeedleGrid, rows: Sequence[NeedleRow], seconds: float) -> NeedleGrid:
    """The rows a cancelled run finished, as a grid with the settings of `planned` (its summary from them)."""
    return replace(planned, rows=list(rows), seconds=seconds, stopped="cancelled", summary=None)


# --- found rates ----------------------------------------------------------------------------------------


def wilson_interval(found: int, runs: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95% at z = 1.96) of a found rate `found / runs`, each run taken as an
    independent trial: it stays inside [0, 1] and is not empty at 0 or `runs` found, unlike the normal one."""
    if runs <= 0:
        raise ValueError("no runs")
    p, z2 = found / runs, z * z
    centre = (p + z2 / (2 * runs)) / (1 + z2 / runs)
    half = z * math.sqrt(p * (1 - p) / runs + z2 / (4 * runs * runs)) / (1 + z2 / runs)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(rows: Sequence[NeedleRow], baseline: str = "full") -> list[dict]:
    """Per precision: cells (runs: a cell per seed), correct, accuracy with its 95% Wilson interval
    (`found_low`, `found_high`), mean answer log-prob, runs that agree with the baseline on the same
    (length, depth, seed), and `full_missed`: its runs where the baseline itself missed (a miss there says
    nothing about quantization)."""
    out = []
    for label in dict.fromkeys(r.precision for r in rows):
        own = baseline_of(label) if baseline == "full" else baseline  # a llama.cpp row: llama.cpp's f16 row
        base = {cell_key(r): r for r in rows if r.precision == own}
        mine = [r for r in rows if r.precision == label]
        paired = [(r, base[cell_key(r)]) for r in mine if cell_key(r) in base]
        found = sum(r.correct for r in mine)
        low, high = wilson_interval(found, len(mine))
        out.append(
            {
                "precision": label,
                "cells": len(mine),
                "correct": found,
                "accuracy": round(found / len(mine), 4),
                "found_low": round(low, 4),
                "found_high": round(high, 4),
                "mean_answer_logprob": round(sum(r.answer_logprob for r in mine) / len(mine), 4),
                "agree_with_full": sum(r.correct == b.correct for r, b in paired) if paired else None,
                "full_missed": sum(not b.correct for _, b in paired) if paired else None,
                "mean_logprob_change": round(
                    sum(r.answer_logprob - b.answer_logprob for r, b in paired) / len(paired), 4
                )
                if paired
                else None,
            }
        )
    return out


def full_missed(rows: Sequence[NeedleRow], baseline: str = "full") -> tuple[int, int]:
    """(runs `baseline` missed, its runs): where it missed, a quantized miss says nothing about quantization."""
    base = [r for r in rows if r.precision == baseline]
    return sum(not r.correct for r in base), len(base)


def found_check(summary: dict, found: int, cells: int) -> dict:
    """A precision's found rate against a bar of `found` of `cells` (e.g. 13 of 15 cells, a bar set on one
    15-cell passkey grid), on the runs its summary row counts: holds when the 95% Wilson interval lies at or
    above the bar, does not hold when it lies below, not settled when it straddles it."""
    bar = found / cells
    low, high = summary["found_low"], summary["found_high"]
    verdict = "holds" if low >= bar else "does not hold" if high < bar else "not settled by these runs"
    return {
        "precision": summary["precision"],
        "found": summary["correct"],
        "runs": summary["cells"],
        "bar": f"{found}/{cells}",
        "low": low,
        "high": high,
        "verdict": verdict,
    }


PAIRED_VALUES = {"correct": "found rate", "answer_logprob": "answer log p"}  # what paired_difference compares


def paired_difference(
    rows: Sequence[NeedleRow], a: str, b: str, value: str = "correct", draws: int = 2000, seed: int = 0
) -> dict:
    """Precision `a` minus `b` on the runs both have (same length, depth and seed: the same needle), in found
    rate (value="correct") or in the answer's log-prob ("answer_logprob"), with a 95% interval from a paired
    bootstrap over those runs (`draws` seeded resamples). Verdict: which does better when the interval
    excludes zero, else not settled by these runs."""
    if value not in PAIRED_VALUES:
        raise ValueError(f"unknown value {value!r}; allowed: {', '.join(PAIRED_VALUES)}")
    of_b = {cell_key(r): float(getattr(r, value)) for r in rows if r.precision == b}
    diffs = [float(getattr(r, value)) - of_b[cell_key(r)] for r in rows if r.precision == a and cell_key(r) in of_b]
    if not diffs:
        raise ValueError(f"{a} and {b} share no runs")
    rng = random.Random(f"kvdemo-paired-difference:{seed}")
    n = len(diffs)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(draws))
    low, high = means[int(0.025 * draws)], means[int(0.975 * draws) - 1]
    better = "finds more" if value == "correct" else "gives the answer a higher log p"
    verdict = f"{a} {better}" if low > 0 else f"{b} {better}" if high < 0 else "not settled by these runs"
    return {
        "a": a,
        "b": b,
        "value": value,
        "runs": n,
        "difference": round(sum(diffs) / n, 4),
        "low": round(low, 4),
        "high": round(high, 4),
        "verdict": verdict,
    }


def differences_from_full(rows: Sequence[NeedleRow], baseline: str = "full") -> list[dict]:
    """`paired_difference` of every other precision against `baseline`, found rate then answer log-prob, in
    the rows' order (none without a baseline)."""
    labels = list(dict.fromkeys(r.precision for r in rows))
    pairs = [(x, baseline_of(x) if baseline == "full" else baseline) for x in labels]  # llama.cpp: its own f16
    return [paired_difference(rows, x, b, value) for x, b in pairs if x != b and b in labels for value in PAIRED_VALUES]


# --- lines and tables (pages, CLI, docs/) -----------------------------------------------------------------


def found_line(check: dict) -> str:
    """One `found_check` as a sentence (docs/needle.md's and docs/methods-passkey.md's verdict lines)."""
    return (
        f"{check['precision']} finds the needle in >= {check['bar']} of cells: {check['verdict']} "
        f"(found {check['found']}/{check['runs']} runs, 95% [{check['low']:.1%}, {check['high']:.1%}])"
    )


def difference_line(d: dict) -> str:
    """One `paired_difference` as a sentence."""
    if d["value"] == "correct":
        amount = f"{d['difference']:+.1%} (95% {d['low']:+.1%}..{d['high']:+.1%}"
    else:
        amount = f"{d['difference']:+.3f} nats (95% {d['low']:+.3f}..{d['high']:+.3f}"
    return (
        f"{d['a']} against {d['b']}: {PAIRED_VALUES[d['value']]} {amount}, paired over {d['runs']} runs): "
        f"{d['verdict']}"
    )


def repeats_markdown(rows: Sequence[NeedleRow], repeats: int) -> str:
    """The runs of a `needle --repeats R` grid as docs/ prints them: per precision its found count over all runs
    with the 95% Wilson interval, the fewest and most found in one seed's grid, the mean answer log-prob and its
    change vs full precision."""
    lines = [
        f"| precision | found, {repeats} grids | 95% interval | one grid: fewest..most | mean log p | vs full |",
        "|---|---|---|---|---|---|",
    ]
    per_grid: dict[tuple[str, int], int] = {}
    for r in rows:
        key = (r.precision, cell_key(r)[2])
        per_grid[key] = per_grid.get(key, 0) + r.correct
    for s in summarize(rows):
        counts = [n for (p, _), n in per_grid.items() if p == s["precision"]]
        cells = s["cells"] // repeats
        change = "" if s["precision"] == "full" else f"{s['mean_logprob_change']:+.3f}"
        lines.append(
            f"| {s['precision']} | {s['correct']}/{s['cells']} | {s['found_low']:.1%}..{s['found_high']:.1%} | "
            f"{min(counts)}/{cells}..{max(counts)}/{cells} | {s['mean_answer_logprob']:.3f} | {change} |"
        )
    return "\n".join(lines)


# --- files ------------------------------------------------------------------------------------------------

CSV_COLUMNS = list(NeedleRow.__dataclass_fields__)


def grid_json(grid: NeedleGrid) -> str:
    """needle.json's text: everything the grid holds."""
    return json.dumps(grid.to_json(), indent=2) + "\n"


def grid_csv(grid: NeedleGrid) -> str:
    """needle.csv's text: one line per row, the columns of `NeedleRow` (CSV line ends, \\r\\n)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    writer.writerows(r.to_json() for r in grid.rows)
    return buf.getvalue()


def save_grid(grid: NeedleGrid, folder: str | Path) -> dict:
    """Write needle.json and needle.csv into `folder`; return their paths {"json", "csv"}."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = folder / "needle.json", folder / "needle.csv"
    json_path.write_text(grid_json(grid), encoding="utf-8")
    csv_path.write_text(grid_csv(grid), encoding="utf-8", newline="")
    return {"json": str(json_path), "csv": str(csv_path)}


def load_grid(path: str | Path) -> NeedleGrid:
    """A needle.json (a `save_grid` file or a shipped report in assets/reports/)."""
    return NeedleGrid.from_json(json.loads(Path(path).read_text(encoding="utf-8")))


def summary_markdown(rows: Sequence[NeedleRow]) -> str:
    """`summarize` as docs/ prints one grid: per precision its found count, mean answer log-prob, and its change and
    agreement against its own engine's full row (`engines.baseline_of`: llama.cpp's rows against llama.cpp:f16)."""
    lines = ["| precision | read against | found | mean log p | change vs its full | agree with its full |"]
    lines.append("|---|---|---|---|---|---|")
    for s in summarize(rows):
        base = baseline_of(s["precision"])
        if s["precision"] == base:
            change = agree = against = ""
        else:
            change, agree, against = f"{s['mean_logprob_change']:+.3f}", f"{s['agree_with_full']}/{s['cells']}", base
        lines.append(
            f"| {s['precision']} | {against} | {s['correct']}/{s['cells']} | {s['mean_answer_logprob']:.3f} | "
            f"{change} | {agree} |"
        )
    return "\n".join(lines)
