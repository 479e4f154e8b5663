"""Perplexity reports, as numbers: what the tables and figures of a `kvdemo.ppl.run_ppl` report read."""

from __future__ import annotations

HELD_OUT_NAME = "Held-out prose (Sense and Sensibility)"  # the text run_ppl scores unless given one


def interval_text(ci: list | None, spec: str = "+.3f") -> str:
    """An interval [low, high] as "low .. high" ("" for None: a report written before the intervals)."""
    return "" if ci is None else f"{ci[0]:{spec}} .. {ci[1]:{spec}}"
