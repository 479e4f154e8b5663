"""`python -m kvdemo scale`: long prompts prefilled at each precision, peak memory and time (kvdemo.measured)."""

from __future__ import annotations

import json
import platform
import sys
from datetime import date
from pathlib import Path

from ..measured import SCALE_MODEL, prefill_rows
from ..needle import parse_numbers
from ..precision import parse_precision_list


def run_cli(args) -> dict:
    tokens = parse_numbers(args.tokens, "--tokens", int)
    if any(n < 2 for n in tokens):
        raise ValueError("--tokens: every length must be at least 2")
    specs = parse_precision_list(args.precision)

    def progress(row: dict) -> None:
        print(
            f"{row['tokens']:>8} tokens {row['precision']:<8} peak {row['peak_bytes'] / 2**20:,.0f} MiB",
            file=sys.stderr,
        )

    rows = prefill_rows(tokens, specs, model=args.model, mode=args.mode, device=args.device, on_row=progress)
    out = {
        "command": f"python -m kvdemo scale --tokens {args.tokens} --precision {args.precision} --model {args.model} "
        f"--mode {args.mode} --device {args.device}",
        "model": SCALE_MODEL["display_name"] if args.model == "random" else args.model,
        "machine": f"{platform.machine()}, {_cores()} cores, {args.device}",
        "mode": args.mode,
        "date": date.today().isoformat(),
        "rows": rows,
    }
    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "scale.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def markdown_table(out: dict) -> str:
    """README's table of a `scale` report."""
    lines = [
        "| tokens | precision | peak MiB | cache MiB | weights MiB | workspace MiB | prefill s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        mib = [r[k] / 2**20 for k in ("peak_bytes", "cache_bytes", "weights_bytes", "workspace_bytes")]
        lines.append(
            f"| {r['tokens']:,} | {r['precision']} | "
            + " | ".join(f"{x:,.1f}" for x in mib)
            + f" | {r['prefill_s']:.1f} |"
        )
    return "\n".join(lines)


def format_text(out: dict) -> str:
    lines = [
        f"{out['model']} on {out['machine']}",
        f"{'tokens':>8} {'precision':<10}{'peak MiB':>10}{'cache MiB':>11}{'weights MiB':>13}{'workspace MiB':>15}"
        f"{'prefill s':>11}",
    ]
    for r in out["rows"]:
        lines.append(
            f"{r['tokens']:>8} {r['precision']:<10}{r['peak_bytes'] / 2**20:>10,.1f}{r['cache_bytes'] / 2**20:>11,.1f}"
            f"{r['weights_bytes'] / 2**20:>13,.1f}{r['workspace_bytes'] / 2**20:>15,.1f}{r['prefill_s']:>11,.2f}"
        )
    return "\n".join(lines)
