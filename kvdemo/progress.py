"""One protocol for long runs: how far they are, how long they have left, and how to stop them.

Every long run (needle grid, perplexity, drift, findings, calibration, the benchmark, prefill measurements)
takes the same two keywords:

- ``on_progress``: a callable given a `Progress` after each unit of work (a cell, a precision, a chunk of
  tokens), with the finished result row when the unit finished one. Its units are what the run counts
  (``"tokens"`` of model work where the runs differ in size, ``"cells"``, ``"measurements"``); the time left
  is extrapolated from the speed measured in this run so far.
- ``should_stop``: polled between units; when it returns True the run raises `Cancelled`, which carries the
  rows finished so far, so a caller keeps them.

Producers build both from a `Tracker`. An exception raised by ``on_progress`` (Streamlit stops a script that
way when the user clicks a button) ends the run where it is; the caller keeps the rows it was given.

Before a run, `kvdemo.rates.hint` says how long it should take from the speed this machine measured on
its last runs of the same task (kept in the cache folder across restarts); a `Tracker` given that estimate
(``expected_s``) shows it as the time left until the run's own first unit is done. What counts as a token of
work is the task's choice, the same for the hint and the progress: drift: (prompt + new tokens) x
(quantized precisions + 1); needle: the prompt tokens of every run; ppl: the exact prefix once and the
decoded tokens of every cache (`kvdemo.ppl.work_tokens`); a chat turn: the prompt tokens its lanes read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


class Cancelled(Exception):
    """A run stopped on request (`should_stop` returned True); `partial` holds the rows finished before."""

    def __init__(self, message: str = "stopped on request", partial: list | None = None):
        super().__init__(message)
        self.partial = list(partial or [])


def duration(seconds: float) -> str:
    """``45 s``, ``3 min 5 s``, ``1 h 2 min``: a time span as people read it."""
    if seconds < 1:
        return "under a second"
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s" if s % 60 else f"{s // 60} min"
    return f"{s // 3600} h {s % 3600 // 60} min"


@dataclass(frozen=True)
class Progress:
    """Where a run stands after a unit of work."""

    done: float  # units finished
    total: float  # units planned (>= done)
    unit: str  # what the units are: "tokens", "cells", "precisions", "measurements"
    what: str  # what runs now (or just finished), in words
    elapsed_s: float  # since the run started
    row: object = None  # the result row this unit finished, when it finished one
    expected_s: float | None = None  # the whole run's duration estimated before it started (`kvdemo.rates`)

    @property
    def fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total > 0 else 1.0

    @property
    def remaining_s(self) -> float | None:
        """Seconds left at the speed measured in this run so far; before its first unit, what the estimate made
        before the run leaves (None without one)."""
        if self.done <= 0 or self.elapsed_s <= 0:
            return None if self.expected_s is None else max(0.0, self.expected_s - self.elapsed_s)
        return max(0.0, self.total - self.done) * self.elapsed_s / self.done

    def text(self) -> str:
        """``12/40 cells: int4 at 2,048 tokens (1 min 3 s so far, about 2 min left)``."""
        left = self.remaining_s
        timing = duration(self.elapsed_s) + " so far" + ("" if left is None else f", about {duration(left)} left")
        return f"{self.done:,.0f}/{self.total:,.0f} {self.unit}: {self.what} ({timing})"


ProgressFn = Callable[[Progress], None]
StopFn = Callable[[], bool]


@dataclass
class Tracker:
    """A producer's side of the protocol: counts units, reports them, keeps finished rows, stops on request.

    ``track = Tracker(total, "cells", on_progress, should_stop)``; then per unit ``track.check()`` before it
    (raises `Cancelled` with the rows so far) and ``track.advance(what, row=row)`` after it.
    """

    total: float
    unit: str
    on_progress: ProgressFn | None = None
    should_stop: StopFn | None = None
    done: float = 0.0
    rows: list = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    expected_s: float | None = None  # the estimate made before the run, shown as time left until a unit is done

    def check(self, what: str = "the run") -> None:
        """Raise `Cancelled` (carrying the finished rows) when `should_stop` says so."""
        if self.should_stop is not None and self.should_stop():
            raise Cancelled(f"{what} was stopped", self.rows)

    def report(self, what: str, row: object = None) -> Progress:
        """Tell `on_progress` where the run stands without counting a unit (e.g. "starting full precision")."""
        elapsed = time.perf_counter() - self.started
        p = Progress(self.done, self.total, self.unit, what, elapsed, row, self.expected_s)
        if self.on_progress is not None:
            self.on_progress(p)
        return p

    def advance(self, what: str, units: float = 1.0, row: object = None) -> Progress:
        """Count `units` finished (keeping `row` when given) and report."""
        self.done = min(self.total, self.done + units) if self.total else self.done + units
        if row is not None:
            self.rows.append(row)
        return self.report(what, row)

    def part(self, units: float, what: str) -> ProgressFn | None:
        """A `ProgressFn` for a sub-run worth `units` of this run: its fraction moves this run's count
        (a precision's tokens inside a perplexity run, a layer inside a calibration)."""
        if self.on_progress is None:
            return None
        start = self.done

        def forward(p: Progress) -> None:
            self.done = start + units * p.fraction
            self.report(f"{what}: {p.what}" if p.what else what)

        return forward
