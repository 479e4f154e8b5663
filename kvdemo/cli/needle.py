"""`python -m kvdemo needle`: the needle grid (kvdemo.needle.run_grid) from flags, and its text report."""

from __future__ import annotations

import datetime
from pathlib import Path

from ..needle import MAX_REPEATS, NeedleError, cell_rng, make_task, parse_numbers, run_grid, specs_with_full
from ..results.markdown import paired_markdown
from ..results.needle import NeedleGrid, NeedleRow, difference_line, differences_from_full, full_missed, save_grid
from .progress import printer


def read_document(path: str) -> tuple[str, str]:
    """(name, text) of a haystack file, read as the app reads uploads (kvdemo.documents)."""
    p = Path(path)
    if not p.is_file():
        raise NeedleError(f"haystack file not found: {path}")
    from ..documents import extract_bytes

    doc = extract_bytes(p.read_bytes(), p.name)
    return doc.name, doc.text


def run_cli(args) -> NeedleGrid:
    """`python -m kvdemo needle --precision ... --lengths ... --depths ... --kind ... [--haystack-file F]
    [--needle T --question T --answer T] [--seed N] [--repeats R] [--out DIR] [--prefill-mode exact|chunked]`."""
    from ..machine import machine_info
    from ..models import load_model

    specs_with_full(args.precision)  # a bad precision fails before the model loads
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
    grid = run_grid(
        lm,
        lengths,
        depths,
        args.precision,
        kind=args.kind,
        document=document,
        document_name=name,
        needle=args.needle,
        question=args.question,
        answer=args.answer,
        seed=args.seed,
        prefill_mode=getattr(args, "prefill_mode", "chunked"),
        codebooks=books,
        repeats=args.repeats,
        on_progress=printer(),  # a line per finished row, on stderr
    )
    grid.provenance = {
        "command": _command(args),
        "date": datetime.date.today().isoformat(),
        "machine": machine_info(lm),
    }
    if args.out:
        grid.files = save_grid(grid, args.out)  # the files hold the provenance
    return grid


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
        ("--prefill-mode", getattr(args, "prefill_mode", "chunked"), "chunked"),
        ("--codebooks", args.codebooks, ""),
    ):
        if value != default:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def codebooks_markdown(own: NeedleGrid, other: NeedleGrid, own_name: str = "own", other_name: str = "other") -> str:
    """The quantized precisions of `other` (a `needle --codebooks FILE` grid) beside the same precisions in
    `own` (the same grid with the model's own codebooks): cells found and mean answer log-prob under each."""
    measures = [
        ("found", lambda s: f"{s['correct']}/{s['cells']}"),
        ("mean log p", lambda s: f"{s['mean_answer_logprob']:.3f}"),
    ]
    return paired_markdown(own.summary, other.summary, measures, own_name, other_name)


def _depth_label(d: float) -> str:
    return f"{d:g}%"


def _cell_text(runs: list[NeedleRow]) -> str:
    """A grid cell: ok/MISS and log p for one run; found/runs and the mean log p for repeats."""
    logp = sum(r.answer_logprob for r in runs) / len(runs)
    if len(runs) == 1:
        return f"{'ok' if runs[0].correct else 'MISS':>6} {logp:>9.3f}"
    return f"{sum(r.correct for r in runs):>3}/{len(runs):<3}{logp:>9.3f}"


def format_text(grid: NeedleGrid) -> str:
    """Per precision, a depth x length grid of pass/fail (found/runs with repeats) and answer log-prob (the
    mean with repeats), then the summary with each found rate's 95% interval."""
    repeats = grid.runs_per_cell
    seeds = f"seed: {grid.seed}" if repeats == 1 else f"seeds: {grid.seed}..{grid.seed + repeats - 1}"
    lines = [
        f"model: {grid.model}  needle: {grid.kind}  haystack: {grid.haystack}  {seeds}  "
        f"prefill: {grid.prefill_mode}  "
        f"({len(grid.rows)} runs, {grid.seconds:.1f} s{', cancelled' if grid.stopped == 'cancelled' else ''})",
        "cells: ok/MISS (found/runs with repeats) and log p(true answer); depth down, prompt length in tokens across",
    ]
    cells: dict[tuple, list[NeedleRow]] = {}
    for r in grid.rows:
        cells.setdefault((r.precision, r.length, r.depth), []).append(r)
    for label in grid.precisions:
        lines.append(f"\n== {label}")
        lines.append(f"{'depth':>7}" + "".join(f"{n:>16}" for n in grid.lengths))
        for d in grid.depths:
            runs = [cells.get((label, n, d)) for n in grid.lengths]
            lines.append(f"{_depth_label(d):>7}" + "".join(f"{'' if r is None else _cell_text(r):>16}" for r in runs))
    lines.append(f"\n{'precision':<18}{'found':>9}{'95% interval':>16}{'mean logp':>11}{'vs full':>10}{'agree':>10}")
    for s in grid.summary:
        change = "" if s["mean_logprob_change"] is None else f"{s['mean_logprob_change']:+.3f}"
        agree = "" if s["agree_with_full"] is None else f"{s['agree_with_full']}/{s['cells']}"
        interval = f"[{s['found_low']:.0%}, {s['found_high']:.0%}]" if "found_low" in s else ""
        found = f"{s['correct']}/{s['cells']}"
        lines.append(
            f"{s['precision']:<18}{found:>9}{interval:>16}{s['mean_answer_logprob']:>11.3f}{change:>10}{agree:>10}"
        )
    if repeats > 1:
        lines += [f"vs full, same needles: {difference_line(d)}" for d in differences_from_full(grid.rows)]
    missed, runs = full_missed(grid.rows)
    if missed:
        lines.append(
            f"note: full precision itself missed {missed} of {runs} {'cells' if repeats == 1 else 'runs'}: "
            "there a quantized miss says "
            "nothing about quantization (compare log p instead, or use a stronger --model)"
        )
    for note in grid.notes:
        lines.append(f"note: {note}")
    if grid.files:
        lines.append(f"saved: {grid.files['json']}, {grid.files['csv']}")
    return "\n".join(lines)
