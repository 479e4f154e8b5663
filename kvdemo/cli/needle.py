"""`python -m kvdemo needle`: the needle grid (kvdemo.needle.run_grid) from flags, and its text report."""

from __future__ import annotations

import datetime
from pathlib import Path

from ..needle import (
    MAX_REPEATS,
    NeedleError,
    _specs_with_full,
    cell_rng,
    difference_line,
    differences_from_full,
    make_task,
    parse_numbers,
    run_grid,
    save_results,
)
from ..results.markdown import paired_markdown


def read_document(path: str) -> tuple[str, str]:
    """(name, text) of a haystack file, read as the app reads uploads (kvdemo.documents)."""
    p = Path(path)
    if not p.is_file():
        raise NeedleError(f"haystack file not found: {path}")
    from ..documents import extract_bytes

    doc = extract_bytes(p.read_bytes(), p.name)
    return doc.name, doc.text


def run_cli(args) -> dict:
    """`python -m kvdemo needle --precision ... --lengths ... --depths ... --kind ... [--haystack-file F]
    [--needle T --question T --answer T] [--seed N] [--repeats R] [--out DIR] [--prefill-mode exact|chunked]`."""
    from ..machine import machine_info
    from ..models import load_model

    specs = _specs_with_full(args.precision)
    lengths = parse_numbers(args.lengths, "--lengths", int)
    depths = parse_numbers(args.depths, "--depths", float)
    for d in depths:
        if not 0 <= d <= 100:
            raise NeedleError(f"--depths: {d:g} is outside 0..100 (percent of the haystack)")
    if not 1 <= args.repeats <= MAX_REPEATS:
        raise NeedleError(f"--repeats must be 1..{MAX_REPEATS}, not {args.repeats}")
    make_task(args.kind, cell_rng(args.seed, 0, 0.0), args.needle, args.question, args.answer)  # fail fast
    document, name = None, "document"
    if args.haystack_file:
        name, document = read_document(args.haystack_file)
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    books = None
    if args.codebooks:
        from ..codebooks import from_file

        books = from_file(lm, args.codebooks)
    result = run_grid(
        lm,
        lengths,
        depths,
        specs,
        kind=args.kind,
        document=document,
        document_name=name,
        needle=args.needle,
        question=args.question,
        answer=args.answer,
        seed=args.seed,
        prefill_mode=getattr(args, "prefill_mode", "exact"),
        codebooks=books,
        repeats=args.repeats,
    )
    out = result.to_dict()
    out["provenance"] = {
        "command": _command(args),
        "date": datetime.date.today().isoformat(),
        "machine": machine_info(lm),
    }
    if args.out:
        out["files"] = save_results(out, args.out)  # with its provenance
    return out


def _command(args) -> str:
    """The command line that reproduces this grid (options at their defaults left out)."""
    parts = [f"python -m kvdemo needle --model {args.model} --precision {args.precision}"]
    for flag, value, default in (
        ("--lengths", args.lengths, "1024,2048,4096"),
        ("--depths", args.depths, "0,25,50,75,100"),
        ("--kind", args.kind, "passkey"),
        ("--seed", args.seed, 0),
        ("--repeats", args.repeats, 1),
        ("--haystack-file", args.haystack_file, ""),
        ("--prefill-mode", getattr(args, "prefill_mode", "exact"), "exact"),
        ("--codebooks", args.codebooks, ""),
    ):
        if value != default:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def codebooks_markdown(own: dict, other: dict, own_name: str = "own", other_name: str = "other") -> str:
    """The quantized precisions of `other` (a `needle --codebooks FILE` report) beside the same precisions in
    `own` (the same grid with the model's own codebooks): cells found and mean answer log-prob under each."""
    measures = [
        ("found", lambda s: f"{s['correct']}/{s['cells']}"),
        ("mean log p", lambda s: f"{s['mean_answer_logprob']:.3f}"),
    ]
    return paired_markdown(own["summary"], other["summary"], measures, own_name, other_name)


def _depth_label(d: float) -> str:
    return f"{d:g}%"


def repeats_markdown(out: dict) -> str:
    """A `needle --repeats R` report as a table: per precision its found count over all runs with the 95%
    Wilson interval, the fewest and most found in one seed's grid, the mean answer log-prob and its change
    vs full precision."""
    lines = [
        f"| precision | found, {out['repeats']} grids | 95% interval | one grid: fewest..most | mean log p | vs full |",
        "|---|---|---|---|---|---|",
    ]
    per_grid: dict[tuple[str, int], int] = {}
    for r in out["rows"]:
        key = (r["precision"], r.get("seed", 0))
        per_grid[key] = per_grid.get(key, 0) + r["correct"]
    for s in out["summary"]:
        counts = [n for (p, _), n in per_grid.items() if p == s["precision"]]
        cells = s["cells"] // out["repeats"]
        change = "" if s["precision"] == "full" else f"{s['mean_logprob_change']:+.3f}"
        lines.append(
            f"| {s['precision']} | {s['correct']}/{s['cells']} | {s['found_low']:.1%}..{s['found_high']:.1%} | "
            f"{min(counts)}/{cells}..{max(counts)}/{cells} | {s['mean_answer_logprob']:.3f} | {change} |"
        )
    return "\n".join(lines)


def _cell_text(runs: list[dict]) -> str:
    """A grid cell: ok/MISS and log p for one run; found/runs and the mean log p for repeats."""
    logp = sum(r["answer_logprob"] for r in runs) / len(runs)
    if len(runs) == 1:
        return f"{'ok' if runs[0]['correct'] else 'MISS':>6} {logp:>9.3f}"
    return f"{sum(r['correct'] for r in runs):>3}/{len(runs):<3}{logp:>9.3f}"


def format_text(out: dict) -> str:
    """Per precision, a depth x length grid of pass/fail (found/runs with repeats) and answer log-prob (the
    mean with repeats), then the summary with each found rate's 95% interval."""
    repeats = out.get("repeats", 1)
    seeds = f"seed: {out['seed']}" if repeats == 1 else f"seeds: {out['seed']}..{out['seed'] + repeats - 1}"
    lines = [
        f"model: {out['model']}  needle: {out['kind']}  haystack: {out['haystack']}  {seeds}  "
        f"prefill: {out.get('prefill_mode', 'exact')}  "
        f"({len(out['rows'])} runs, {out['seconds']:.1f} s{', cancelled' if out['stopped'] == 'cancelled' else ''})",
        "cells: ok/MISS (found/runs with repeats) and log p(true answer); depth down, prompt length in tokens across",
    ]
    cells: dict[tuple, list[dict]] = {}
    for r in out["rows"]:
        cells.setdefault((r["precision"], r["length"], r["depth"]), []).append(r)
    for label in out["precisions"]:
        lines.append(f"\n== {label}")
        lines.append(f"{'depth':>7}" + "".join(f"{n:>16}" for n in out["lengths"]))
        for d in out["depths"]:
            runs = [cells.get((label, n, d)) for n in out["lengths"]]
            lines.append(f"{_depth_label(d):>7}" + "".join(f"{'' if r is None else _cell_text(r):>16}" for r in runs))
    lines.append(f"\n{'precision':<14}{'found':>9}{'95% interval':>16}{'mean logp':>11}{'vs full':>10}{'agree':>10}")
    for s in out["summary"]:
        change = "" if s["mean_logprob_change"] is None else f"{s['mean_logprob_change']:+.3f}"
        agree = "" if s["agree_with_full"] is None else f"{s['agree_with_full']}/{s['cells']}"
        interval = f"[{s['found_low']:.0%}, {s['found_high']:.0%}]" if "found_low" in s else ""
        found = f"{s['correct']}/{s['cells']}"
        lines.append(
            f"{s['precision']:<14}{found:>9}{interval:>16}{s['mean_answer_logprob']:>11.3f}{change:>10}{agree:>10}"
        )
    if repeats > 1:
        lines += [f"vs full, same needles: {difference_line(d)}" for d in differences_from_full(out["rows"])]
    full = [r for r in out["rows"] if r["precision"] == "full"]
    missed = sum(not r["correct"] for r in full)
    if missed:
        lines.append(
            f"note: full precision itself missed {missed} of {len(full)} {'cells' if repeats == 1 else 'runs'}: "
            "there a quantized miss says "
            "nothing about quantization (compare log p instead, or use a stronger --model)"
        )
    for note in out.get("notes", []):
        lines.append(f"note: {note}")
    if out.get("files"):
        lines.append(f"saved: {out['files']['json']}, {out['files']['csv']}")
    return "\n".join(lines)
