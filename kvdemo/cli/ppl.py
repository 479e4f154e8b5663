"""`python -m kvdemo ppl`: perplexity of held-out text at each KV precision (kvdemo.ppl.run_ppl), and its text."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

from ..ppl import run_ppl
from ..precision import parse_precision_list


def run_cli(args) -> dict:
    from ..models import load_model

    specs = parse_precision_list(args.precision)
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    out = run_ppl(lm, specs, args.tokens, args.prefix, on_progress=lambda m: print(m, file=sys.stderr, flush=True))
    out["command"] = (
        f"python -m kvdemo ppl --model {args.model} --precision {args.precision} --tokens {args.tokens} "
        f"--prefix {args.prefix}"
    )
    out["date"] = datetime.date.today().isoformat()
    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "ppl.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


def format_text(out: dict) -> str:
    lo, hi = out["scored_positions"]
    lines = [
        f"model: {out['model']}  perplexity of held-out tokens [{lo}, {hi}) (first {out['prefix']} stored exactly, "
        f"then {out['chunk']} at a time through the cache)",
        f"{'precision':<16}{'ppl':>10}{'delta':>10}{'logit KL':>11}{'bits/elem':>11}{'vs 16-bit':>11}",
    ]
    for r in out["results"]:
        lines.append(
            f"{r['precision']:<16}{r['ppl']:>10.3f}{r['delta_vs_full']:>+10.3f}{r['logit_kl']:>11.4f}"
            f"{r['bits_per_element']:>11.2f}{r['ratio_vs_fp16']:>10.2f}x"
        )
    lines.append(out["basis"])
    return "\n".join(lines)


def markdown_table(out: dict) -> str:
    """README's table of a `ppl` report."""
    lines = [
        f"| precision | ppl @{out['tokens']} | delta vs full | logit KL | bits/element | ratio vs fp16 |",
        "|---|---|---|---|---|---|",
    ]
    for r in out["results"]:
        lines.append(
            f"| {r['precision']} | {r['ppl']:.3f} | {r['delta_vs_full']:+.3f} | {r['logit_kl']:.2e} | "
            f"{r['bits_per_element']:.3f} | {r['ratio_vs_fp16']:.2f}x |"
        )
    return "\n".join(lines)
