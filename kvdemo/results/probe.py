"""API probes, as data and numbers: the cells `kvdemo.probe.run_probe` returns (one needle asked of one endpoint),
the report that holds them, found rates with 95% Wilson intervals per endpoint by length and by depth, the
difference between two endpoints on the same needles, and the report's files (probe.json, probe.csv).

A cell that failed (the endpoint refused it, timed out, answered without the fields expected) is kept with its
error and left out of the found rates: a rate counts the answered cells only, and says how many failed.
`needle_grid` turns the answered cells into a `NeedleGrid` (endpoints in place of precisions), so the needle
heatmaps and difference maps (kvdemo/figures/needle.py) draw a probe as they draw a grid.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .needle import NeedleGrid, NeedleRow, paired_difference, wilson_interval


@dataclass
class ProbeCell:
    """One needle (length, depth, seed) asked of one endpoint, and what came back."""

    endpoint: str
    length: int  # requested prompt length, approximate tokens (the probe's estimate, not the endpoint's tokenizer)
    depth: float  # requested needle depth, percent
    seed: int
    expected: str
    found: bool | None  # None: the request failed (see `error`)
    answer: str = ""
    latency_s: float | None = None  # the successful request's seconds
    prompt_tokens: int | None = None  # `usage.prompt_tokens`: the tokens the endpoint counted (billed)
    completion_tokens: int | None = None  # `usage.completion_tokens`
    answer_logprob: float | None = None  # the answer's summed log-prob, read as `logprob_source` says
    reply_logprob: float | None = None  # summed log-prob of the whole reply (None: no log-probs returned)
    estimated_tokens: int = 0  # the prompt's length by the probe's estimate
    depth_actual: float = 0.0  # the needle's depth on the estimated tokens, percent
    attempts: int = 0  # requests made (retries included; 0: not sent)
    error: str = ""  # one line: what failed
    error_kind: str = ""  # kvdemo.probe.client's kinds: "context too long", "wrong key", ...
    # where `answer_logprob` was read: "chat" (the reply's tokens that spell the answer: found cells only), "echo"
    # (the true answer teacher-forced after the prompt, echoed by the completions API: hit or miss), "" (none; and
    # in reports written before the echo path, whose log-probs are chat's: the field is left out of the JSON then)
    logprob_source: str = ""

    @property
    def answered(self) -> bool:
        return self.found is not None

    @property
    def has_logprobs(self) -> bool:
        """Log-probs came back for this cell: the reply's (chat) or the echoed prompt's."""
        return self.reply_logprob is not None or self.answer_logprob is not None

    def to_json(self) -> dict:
        d = asdict(self)
        if not d["logprob_source"]:
            del d["logprob_source"]
        return d

    @classmethod
    def from_json(cls, d: dict) -> ProbeCell:
        return cls(**d)


@dataclass
class ProbeReport:
    """A probe: the needle grid (lengths x depths x seeds) asked of every endpoint, the same prompts to each."""

    endpoints: list[dict]  # `Endpoint.to_json()`: name, base_url, model, key_env (the variable's name only)
    kind: str  # "passkey" | "multikey" | "custom"
    haystack: str
    lengths: list[int]
    depths: list[float]
    seed: int
    repeats: int
    cells: list[ProbeCell]
    seconds: float
    settings: dict = field(default_factory=dict)  # concurrency, timeout_s, retries, max_tokens
    stopped: str = "done"  # "done" | "cancelled"
    notes: list[str] = field(default_factory=list)
    provenance: dict | None = None  # the command that made it, its date and machine (CLI)
    checks: list[dict] = field(default_factory=list)  # local llama.cpp servers' answers beside in-process ones

    @property
    def names(self) -> list[str]:
        return [e["name"] for e in self.endpoints]

    @property
    def planned_cells(self) -> int:
        return len(self.lengths) * len(self.depths) * self.repeats * len(self.endpoints)

    def to_json(self) -> dict:
        out = {
            "endpoints": self.endpoints,
            "kind": self.kind,
            "haystack": self.haystack,
            "lengths": self.lengths,
            "depths": self.depths,
            "seed": self.seed,
            "repeats": self.repeats,
            "settings": self.settings,
            "cells": [c.to_json() for c in self.cells],
            "summary": found_rates(self.cells),
            "seconds": round(self.seconds, 2),
            "stopped": self.stopped,
            "notes": self.notes,
        }
        out |= {"in_process_checks": self.checks} if self.checks else {}
        return out | ({"provenance": self.provenance} if self.provenance is not None else {})

    @classmethod
    def from_json(cls, d: dict) -> ProbeReport:
        return cls(
            endpoints=d["endpoints"],
            kind=d["kind"],
            haystack=d["haystack"],
            lengths=d["lengths"],
            depths=d["depths"],
            seed=d["seed"],
            repeats=d["repeats"],
            cells=[ProbeCell.from_json(c) for c in d["cells"]],
            seconds=d["seconds"],
            settings=d.get("settings", {}),
            stopped=d.get("stopped", "done"),
            notes=d.get("notes", []),
            provenance=d.get("provenance"),
            checks=d.get("in_process_checks", []),
        )


def partial_report(planned: ProbeReport, cells: Sequence[ProbeCell], seconds: float) -> ProbeReport:
    """The cells a cancelled probe finished, as a report with the settings of `planned`."""
    return replace(planned, cells=list(cells), seconds=seconds, stopped="cancelled")


# --- found rates and differences ----------------------------------------------------------------------------

BY = ("all", "length", "depth")


def found_rates(cells: Sequence[ProbeCell], by: str = "all") -> list[dict]:
    """Per endpoint (and per length or depth with `by`): cells, answered, found, the found rate over the answered
    cells with its 95% Wilson interval (None when none answered), failed cells, mean latency, the answered cells
    that came with log-probs and the mean answer log-prob of those that have one (by chat: the found ones; by
    echo: every answered cell the endpoint scored), tokens sent (`usage.prompt_tokens`
    summed) and completion tokens, as the endpoint reported them."""
    if by not in BY:
        raise ValueError(f"unknown grouping {by!r}; allowed: {', '.join(BY)}")
    groups: dict[tuple, list[ProbeCell]] = {}
    for c in cells:
        groups.setdefault((c.endpoint,) + (() if by == "all" else (getattr(c, by),)), []).append(c)
    out = []
    for key in sorted(groups, key=lambda k: (list(dict.fromkeys(c.endpoint for c in cells)).index(k[0]), *k[1:])):
        mine = groups[key]
        answered = [c for c in mine if c.answered]
        found = sum(bool(c.found) for c in answered)
        low, high = wilson_interval(found, len(answered)) if answered else (None, None)
        latencies = [c.latency_s for c in answered if c.latency_s is not None]
        scored = [c.answer_logprob for c in answered if c.answer_logprob is not None]  # chat: found ones; echo: all
        row = {"endpoint": key[0]} | ({} if by == "all" else {by: key[1]})
        out.append(
            row
            | {
                "cells": len(mine),
                "answered": len(answered),
                "found": found,
                "rate": round(found / len(answered), 4) if answered else None,
                "low": None if low is None else round(low, 4),
                "high": None if high is None else round(high, 4),
                "failed": len(mine) - len(answered),
                "mean_latency_s": round(sum(latencies) / len(latencies), 3) if latencies else None,
                "with_logprobs": sum(c.has_logprobs for c in answered),  # the rest came without
                "mean_answer_logprob": round(sum(scored) / len(scored), 4) if scored else None,
                "prompt_tokens": sum(c.prompt_tokens or 0 for c in mine),
                "completion_tokens": sum(c.completion_tokens or 0 for c in mine),
            }
        )
    return out


def failure_line(failure: dict) -> str:
    """One `errors` entry as a line: the message and how many cells it took."""
    return f"{failure['error']} ({failure['cells']} cell{'' if failure['cells'] == 1 else 's'})"


def errors(cells: Sequence[ProbeCell]) -> list[dict]:
    """Each distinct failure per endpoint, with how many cells it took: {"endpoint", "kind", "error", "cells"}."""
    seen: dict[tuple[str, str], dict] = {}
    for c in cells:
        if c.error:
            entry = seen.setdefault((c.endpoint, c.error), {"endpoint": c.endpoint, "kind": c.error_kind,
                                                            "error": c.error, "cells": 0})  # fmt: skip
            entry["cells"] += 1
    return list(seen.values())


def needle_rows(cells: Sequence[ProbeCell]) -> list[NeedleRow]:
    """The answered cells as needle rows (endpoint in place of precision; NaN log-prob where none came back)."""
    return [
        NeedleRow(
            length=c.length,
            depth=c.depth,
            precision=c.endpoint,
            answer=c.answer,
            correct=bool(c.found),
            answer_logprob=c.answer_logprob if c.answer_logprob is not None else math.nan,
            expected=c.expected,
            kind="",
            key="",
            prompt_tokens=c.prompt_tokens or c.estimated_tokens,
            depth_actual=c.depth_actual,
            needle_position=0,
            answer_tokens=0,
            generated_tokens=c.completion_tokens or 0,
            stopped="",
            prefill_s=0.0,
            seconds=c.latency_s or 0.0,
            seed=c.seed,
        )
        for c in cells
        if c.answered
    ]


def needle_grid(report: ProbeReport) -> NeedleGrid:
    """The answered cells as a `NeedleGrid` with the endpoints as its precisions: what the needle heatmaps and
    difference maps draw."""
    return NeedleGrid(
        model=", ".join(f"{e['name']}: {e['model']}" for e in report.endpoints),
        kind=report.kind,
        haystack=report.haystack,
        seed=report.seed,
        lengths=report.lengths,
        depths=report.depths,
        precisions=report.names,
        rows=needle_rows(report.cells),
        seconds=report.seconds,
        stopped=report.stopped,
        repeats=report.repeats,
        summary=[],
    )


def endpoint_difference(cells: Sequence[ProbeCell], a: str, b: str) -> dict:
    """Endpoint `a` minus `b` in found rate on the needles both answered (same length, depth and seed), with a
    95% paired-bootstrap interval (`results.needle.paired_difference`). ValueError when they share none."""
    return paired_difference(needle_rows(cells), a, b, "correct")


def endpoint_differences(report: ProbeReport) -> list[dict]:
    """`endpoint_difference` of every later endpoint against the first, where they share answered needles."""
    out = []
    for b in report.names[1:]:
        try:
            out.append(endpoint_difference(report.cells, b, report.names[0]))
        except ValueError:
            continue
    return out


def rate_line(r: dict) -> str:
    """One `found_rates` row as a sentence."""
    where = "".join(f" at {k} {r[k]:g}" for k in ("length", "depth") if k in r)
    failed = f", {r['failed']} failed" if r["failed"] else ""
    if not r["answered"]:
        return f"{r['endpoint']}{where}: no answered cells{failed}"
    return (
        f"{r['endpoint']}{where}: found {r['found']}/{r['answered']} ({r['rate']:.0%}, 95% {r['low']:.0%}..{r['high']:.0%})"
        f"{failed}; mean latency {r['mean_latency_s']:.2f} s; log-probs with {r['with_logprobs']}/{r['answered']}; "
        f"{r['prompt_tokens']:,} prompt + "
        f"{r['completion_tokens']:,} completion tokens by usage"
    )


# --- files --------------------------------------------------------------------------------------------------

CSV_COLUMNS = list(ProbeCell.__dataclass_fields__)


def report_json(report: ProbeReport) -> str:
    """probe.json's text."""
    return json.dumps(report.to_json(), indent=2) + "\n"


def report_csv(report: ProbeReport) -> str:
    """probe.csv's text: one line per cell, the columns of `ProbeCell`."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    writer.writerows(c.to_json() for c in report.cells)
    return buf.getvalue()


def save_report(report: ProbeReport, path: str | Path) -> dict:
    """Write the report to `path` (a .json file; probe.csv beside it) or into the folder `path` as probe.json and
    probe.csv; return their paths {"json", "csv"}."""
    path = Path(path)
    if path.suffix.lower() == ".json":
        json_path, csv_path = path, path.with_suffix(".csv")
    else:
        json_path, csv_path = path / "probe.json", path / "probe.csv"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(report_json(report), encoding="utf-8")
    csv_path.write_text(report_csv(report), encoding="utf-8", newline="")
    return {"json": str(json_path), "csv": str(csv_path)}


def load_report(path: str | Path) -> ProbeReport:
    return ProbeReport.from_json(json.loads(Path(path).read_text(encoding="utf-8")))


def rates_markdown(report: ProbeReport) -> str:
    """Per endpoint: found over answered with its 95% interval, mean latency, prompt tokens by usage, and, where the
    report checked a local llama.cpp server against llama.cpp in-process, how many answers agreed (docs/)."""
    checks: dict[str, list[dict]] = {}
    for c in report.checks:
        checks.setdefault(c["endpoint"], []).append(c)
    lines = ["| endpoint | found | 95% interval | mean latency | prompt tokens (usage) | in-process agrees |"]
    lines.append("|---|---|---|---|---|---|")
    for r in found_rates(report.cells):
        mine = checks.get(r["endpoint"], [])
        agree = f"{sum(c['same'] for c in mine)}/{len(mine)}" if mine else ""
        interval = f"{r['low']:.0%}..{r['high']:.0%}" if r["answered"] else ""
        latency = f"{r['mean_latency_s']:.2f} s" if r["mean_latency_s"] is not None else ""
        lines.append(
            f"| {r['endpoint']} | {r['found']}/{r['answered']} | {interval} | {latency} | {r['prompt_tokens']:,} | "
            f"{agree} |"
        )
    return "\n".join(lines)
