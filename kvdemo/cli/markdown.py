"""Markdown tables shared by several commands (each command's own tables live beside it)."""

from __future__ import annotations


def paired_markdown(own_rows, other_rows, measures, own_name: str, other_name: str) -> str:
    """README's table of `other_rows` beside the rows of the same precision in `own_rows` (two runs of one grid,
    e.g. with two codebook files; full precision left out, it takes no codebook): each measure (title,
    format of a row) under each run."""
    by_name = {r["precision"]: r for r in own_rows}
    head = [f"{title}, {name}" for title, _ in measures for name in (own_name, other_name)]
    lines = ["| precision | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for r in other_rows:
        if r["precision"] != "full":
            pair = (by_name[r["precision"]], r)
            lines.append(f"| {r['precision']} | " + " | ".join(fmt(x) for _, fmt in measures for x in pair) + " |")
    return "\n".join(lines)
