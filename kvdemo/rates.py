"""Measured speeds for time hints: seconds per token of work, from the last runs of this process.

A page records each finished run (`record`: the tokens it processed and the seconds it took) and
estimates the next one from the median of the last few runs of the same task on the same model and
device (`estimate`, `hint`). Before any run the estimate uses a cautious default rate, and says so.
What counts as a token of work is the task's choice, the same in `record` and `estimate`:
drift: (prompt + new tokens) x (quantized precisions + 1); needle: the prompt tokens of every run; ppl: the
exact prefix once and the decoded tokens of every cache (`kvdemo.ppl.work_tokens`).
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

KEEP = 5  # runs remembered per (model, device, task)
DEFAULT_S_PER_TOKEN = {"cpu": 0.008, "cuda": 0.0005}  # cautious: ~3x the embedded model on 2 busy CPU cores
_runs: dict[tuple[str, str, str], deque[float]] = {}
_lock = threading.Lock()


def _key(lm, task: str) -> tuple[str, str, str]:
    return (lm.name, lm.device.type, task)


def record(lm, task: str, tokens: int, seconds: float) -> None:
    """Remember one finished run of `task`: `tokens` of work in `seconds`."""
    if tokens > 0 and seconds > 0:
        with _lock:
            _runs.setdefault(_key(lm, task), deque(maxlen=KEEP)).append(seconds / tokens)


def clear() -> None:
    with _lock:
        _runs.clear()


def rate(lm, task: str) -> tuple[float, int]:
    """(seconds per token, how many runs it comes from); 0 runs: the cautious default for the device."""
    with _lock:
        runs = list(_runs.get(_key(lm, task), ()))
    if runs:
        return statistics.median(runs), len(runs)
    return DEFAULT_S_PER_TOKEN.get(lm.device.type, DEFAULT_S_PER_TOKEN["cpu"]), 0


def estimate(lm, task: str, tokens: int) -> float:
    """Seconds `tokens` of work of `task` should take."""
    return rate(lm, task)[0] * max(tokens, 0)


def duration(seconds: float) -> str:
    if seconds < 1:
        return "under a second"
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def hint(lm, task: str, tokens: int, what: str) -> str:
    """E.g. "About 12 s for <what> (from the last 2 runs here: 340 tokens/s).", or a stated guess before any run."""
    per_token, runs = rate(lm, task)
    seconds = per_token * max(tokens, 0)
    if runs:
        source = "the last run here" if runs == 1 else f"the last {runs} runs here"
        return f"About {duration(seconds)} for {what} (from {source}: {1 / per_token:,.0f} tokens/s)."
    return (
        f"Up to about {duration(seconds)} for {what} on {lm.device.type.upper()} (no run measured yet: a cautious "
        "guess; the hint follows your runs)."
    )
