"""Markdown tables shared by several reports (each report's own tables live beside its result)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def paired_markdown(
    own_rows: Sequence,
    other_rows: Sequence,
    measures: Sequence[tuple[str, Callable]],
    own_name: str,
    other_name: str,
    precision: Callable = lambda row: row["precision"],
) -> str:
    """A docs table of `other_rows` beside the rows of the same precision in `own_rows` (two runs of one grid,
    e.g. with two codebook files; full precision left out, it takes no codebook): each measure (title, format of
    a row) under each run. `precision` reads a row's precision (rows may be dicts or result dataclasses)."""
    by_name = {precision(r): r for r in own_rows}
    head = [f"{title}, {name}" for title, _ in measures for name in (own_name, other_name)]
    lines = ["| precision | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for r in other_rows:
        if precision(r) != "full":
            pair = (by_name[precision(r)], r)
            lines.append(f"| {precision(r)} | " + " | ".join(fmt(x) for _, fmt in measures for x in pair) + " |")
    return "\n".join(lines)
