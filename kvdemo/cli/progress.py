"""Progress of a long run on stderr, for the commands: one line each time the run moves to a new step."""

from __future__ import annotations

import sys

from ..progress import Progress, ProgressFn


def printer(stream=None) -> ProgressFn:
    """A `ProgressFn` that prints `Progress.text()` when `what` changes (a new cache, phase or row), not on every
    chunk of tokens."""
    last = {"what": None}

    def show(p: Progress) -> None:
        if p.what != last["what"]:
            last["what"] = p.what
            print(p.text(), file=stream or sys.stderr, flush=True)

    return show
