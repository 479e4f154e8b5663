"""`python -m kvdemo prefill-modes`: one needle cell and one drift run with the prompt stored exact and
chunked (kvdemo.prefill_modes.compare_prefill_modes), and its text report."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path

from ..precision import parse_precision_list
from ..prefill_modes import compare_prefill_modes
from ..progress import Progress
from ..results.prefill_modes import PrefillModesReport, save_report


def _say(p: Progress) -> None:
    print(f"running {p.text()}", file=sys.stderr)


def run_cli(args) -> PrefillModesReport:
    """`python -m kvdemo prefill-modes --tokens N --precision int4,int2 [--kind K] [--depth D] [--out F]`."""
    from ..machine import machine_info
    from ..models import load_model

    specs = parse_precision_list(args.precision)
    if args.document and not Path(args.document).is_file():
        raise ValueError(f"document not found: {args.document}")
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    if args.tokens + args.new_tokens > lm.max_context:
        raise ValueError(
            f"--tokens {args.tokens} + --new-tokens {args.new_tokens} exceed the model's context ({lm.max_context})"
        )
    command = f"python -m kvdemo prefill-modes --tokens {args.tokens} --precision {args.precision} --kind {args.kind}"
    command += f" --depth {args.depth:g} --seed {args.seed} --new-tokens {args.new_tokens}"
    machine = machine_info(lm)
    report = compare_prefill_modes(
        lm,
        args.tokens,
        specs,
        kind=args.kind,
        depth=args.depth,
        seed=args.seed,
        new_tokens=args.new_tokens,
        document=args.document,
        on_progress=_say,
    )
    report.provenance = {
        "command": command + (f" --document {args.document}" if args.document else ""),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine,
    }
    if args.out:
        save_report(report, args.out)
    return report


def format_text(report: PrefillModesReport) -> str:
    cell, drift = report.needle, report.drift
    lines = [
        f"model: {report.model} ({report.device}, {report.dtype})  prefill chunk: {report.chunk} tokens",
        *(f"  {mode}: {text}" for mode, text in report.modes.items()),
        f"\nneedle: {cell.kind} in {cell.haystack}, {cell.prompt_tokens} tokens ({cell.chunks} chunks), "
        f"depth {cell.depth:g}%, answer {cell.expected!r}",
        f"{'precision':<14}{'log p full':>11}{'exact':>10}{'chunked':>10}{'chunked-exact':>15}  found full/exact/chunked",
    ]
    for r in cell.results:
        found = "/".join("yes" if r[m]["correct"] else "no" for m in ("full", "exact", "chunked"))
        lines.append(
            f"{r['precision']:<14}{r['full']['answer_logprob']:>11.4f}{r['exact']['answer_logprob']:>10.4f}"
            f"{r['chunked']['answer_logprob']:>10.4f}{r['chunked_vs_exact']:>+15.4f}  {found}"
        )
    lines += [
        f"\ndrift: {drift.prompt_tokens}-token prompt ({drift.chunks} chunks), {drift.new_tokens} queries",
        f"{'precision':<14}{'JS exact':>11}{'chunked':>11}{'ratio':>8}{'KL exact':>11}{'chunked':>11}{'ratio':>8}",
    ]
    for r in drift.results:
        e, c, q = r["exact"], r["chunked"], r["chunked_over_exact"]

        def ratio(x):
            return "" if x is None else f"{x:.2f}"

        lines.append(
            f"{r['precision']:<14}{e['mean_js']:>11.2e}{c['mean_js']:>11.2e}{ratio(q['mean_js']):>8}"
            f"{e['logit_kl_mean']:>11.2e}{c['logit_kl_mean']:>11.2e}{ratio(q['logit_kl_mean']):>8}"
        )
    if cell.chunks == 1:
        lines.append("note: the prompt fits one prefill chunk: both modes store it the same way")
    return "\n".join(lines)
