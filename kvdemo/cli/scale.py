"""`python -m kvdemo scale`: long prompts prefilled at each precision, peak memory and time (kvdemo.measured)."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path

from ..machine import machine_line
from ..measured import SCALE_MODEL, prefill_rows
from ..needle import parse_numbers
from ..precision import parse_precision_list
from ..results.measured import ScaleReport
from .progress import printer


def run_cli(args) -> ScaleReport:
    tokens = parse_numbers(args.tokens, "--tokens", int)
    if any(n < 2 for n in tokens):
        raise ValueError("--tokens: every length must be at least 2")
    specs = parse_precision_list(args.precision)
    rows = prefill_rows(tokens, specs, model=args.model, mode=args.mode, device=args.device, on_progress=printer())
    out = ScaleReport(
        command=f"python -m kvdemo scale --tokens {args.tokens} --precision {args.precision} --model {args.model} "
        f"--mode {args.mode} --device {args.device}",
        model=SCALE_MODEL["display_name"] if args.model == "random" else args.model,
        machine=machine_line(args.device),
        mode=args.mode,
        date=date.today().isoformat(),
        rows=rows,
    )
    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "scale.json").write_text(json.dumps(out.to_json(), indent=2) + "\n")
    return out


def format_text(out: ScaleReport) -> str:
    return out.text()
