"""`python -m kvdemo bench`: kvdemo vs transformers' QuantizedCache (kvdemo.bench.run_bench), and its text report."""

from __future__ import annotations

import sys

from ..bench import SIZES, markdown_table, run_bench


def run_cli(args) -> dict:
    """`python -m kvdemo bench [--quick | --sizes full|1k|quick] [--only NAMES] [--out reports] [--json]`:
    progress on stderr, the report returned."""
    from ..models import load_model

    name = "quick" if args.quick else getattr(args, "sizes", "full")
    only = [n.strip() for n in getattr(args, "only", "").split(",") if n.strip()] or None
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    return run_bench(
        lm,
        quick=name == "quick",
        out_dir=args.out,
        on_progress=lambda m: print(m, file=sys.stderr, flush=True),
        sizes=SIZES[name],
        only=only,
    )


def format_text(out: dict) -> str:
    lines = [f"model: {out['model']}{'  (quick sizes)' if out['quick'] else ''}", "", markdown_table(out)]
    if out.get("files"):
        lines.append("written: " + ", ".join(out["files"].values()))
    return "\n".join(lines)
