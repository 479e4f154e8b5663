"""`python -m kvdemo ppl`: perplexity of held-out text at each KV precision (kvdemo.ppl.run_ppl), and its text."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

from ..ppl import HELD_OUT_NAME, run_ablation, run_kv_split, run_ppl, split_rows, split_sentence
from ..precision import parse_precision_list
from .markdown import paired_markdown

# the memory and decode-speed rows of the ablation report (issue 17's acceptance)
ABLATION_MEMORY = ("int4", "nuq4:o1", "nuq3:o1", "nuq2:o1", "nuq2:o1:s1", "int3", "nvfp4")
ABLATION_SPEED = ("int4", "nuq4:o1", "nuq4", "int4:hadamard", "nvfp4")


def run_cli(args) -> dict:
    from ..models import load_model

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    if args.document and args.ablation:
        raise ValueError("--document goes with --precision or --kv-split; --ablation scores the held-out prose")
    if args.document and not Path(args.document).is_file():
        raise ValueError(f"document not found: {args.document}")
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    text = None
    if args.document:
        from ..documents import extract_file, token_ids

        doc = extract_file(Path(args.document))
        text = (doc.name, token_ids(doc.text, lm.tokenizer))
    books = None
    if args.codebooks:
        from ..codebooks import from_file

        books = from_file(lm, args.codebooks)
    if args.ablation:
        out = run_ablation(lm, args.tokens, args.prefix, on_progress=progress, codebooks=books)
        out["memory"] = ablation_memory(lm, args.tokens)
        out["decode"] = ablation_speed(lm, args.tokens, progress)
        options, name = f"--ablation --tokens {args.tokens} --prefix {args.prefix}", "ablation.json"
    else:
        precisions = parse_precision_list(args.precision)
        run = run_kv_split if args.kv_split else run_ppl
        out = run(lm, precisions, args.tokens, args.prefix, on_progress=progress, codebooks=books, text=text)
        options = f"--precision {args.precision} --tokens {args.tokens} --prefix {args.prefix}"
        options += f" --document {args.document}" if args.document else ""
        options, name = ("--kv-split " + options, "ppl_kv_split.json") if args.kv_split else (options, "ppl.json")
    if args.codebooks:
        options += f" --codebooks {args.codebooks}"
    out["command"] = f"python -m kvdemo ppl --model {args.model} {options}"
    out["date"] = datetime.date.today().isoformat()
    if args.out:  # a folder (the report under its usual name) or a .json file
        target = Path(args.out) if args.out.endswith(".json") else Path(args.out) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(out, indent=2) + "\n")
    return out


def ablation_memory(lm, tokens: int) -> dict:
    """The live cache holding `tokens` tokens of held-out text at each ABLATION_MEMORY precision, beside the
    layout formula (`measured.compare_measured`: bytes to the byte) and a 16-bit cache."""
    from ..measured import compare_measured
    from ..texts import held_out_ids

    return compare_measured(lm, held_out_ids(lm, tokens), ABLATION_MEMORY)


def ablation_speed(lm, tokens: int, progress) -> dict:
    """Greedy decode tokens/s after a `tokens`-token prompt, ABLATION_SPEED side by side (`bench.decode_speed`)."""
    from ..bench import decode_speed

    return decode_speed(lm, ABLATION_SPEED, context=tokens, on_progress=progress)


def format_text(out: dict) -> str:
    text = _ppl_text(out)
    if "rows" in out:
        checks = [check_line(c) for c in out["checks"]]
        parts = [ablation_markdown(out), *checks, memory_markdown(out), speed_markdown(out)]
        text += "\n\n" + "\n\n".join(parts)
    if "splits" in out:
        text += "\n\n" + split_markdown(out) + "\n\n" + "\n".join(split_lines(out))
    return text


def split_markdown(out: dict) -> str:
    """README's table of a `ppl --kv-split` report (kvdemo.ppl.split_rows), verdicts left to the lines under it."""
    rows = split_rows(out)
    heads = [h for h in rows[0] if h != "verdict"]
    lines = ["| " + " | ".join(heads) + " |", "|---" * len(heads) + "|"]
    lines += ["| " + " | ".join(row[h] for h in heads) + " |" for row in rows]
    return "\n".join(lines)


def split_lines(out: dict) -> list[str]:
    """README's lines under the table: each precision's `split_sentence`."""
    return [f"- {split_sentence(split)}" for split in out["splits"]]


def check_line(check: dict) -> str:
    """One claim of an ablation report as README states it: the verdict on this text's figures, then (when the
    report has them) the 95% interval of the difference over resampled text and the verdict that leaves."""
    kl = "logit KL" in check["claim"]
    figure, signed = ("{:.3g}", "{:+.3g}") if kl else ("{:+.3f}", "{:+.3f}")
    a, b = (figure.format(x) for x in check["values"])
    line = f"{check['claim']}: {'holds' if check['holds'] else 'does not hold'} ({a} vs {b})"
    if "verdict" in check:
        low, high = (signed.format(x) for x in check["difference_ci95"])
        line += f"; over resampled text: {check['verdict']} (difference in [{low}, {high}], 95%)"
    return line


def _interval(ci: list | None) -> str:
    return "" if ci is None else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"


def _cell_interval(row: dict) -> str:
    return f"<br>{_interval(row['delta_vs_full_ci95'])}" if "delta_vs_full_ci95" in row else ""


def _ppl_text(out: dict) -> str:
    lo, hi = out["scored_positions"]
    lines = [
        f"model: {out['model']}  perplexity of {out.get('text', HELD_OUT_NAME)}, tokens [{lo}, {hi}) (first "
        f"{out['prefix']} stored exactly, "
        f"then {out['chunk']} at a time through the cache)",
        f"{'precision':<20}{'ppl':>10}{'delta':>10}{'delta 95%':>20}{'logit KL':>11}{'bits/elem':>11}{'vs 16-bit':>11}",
    ]
    for r in out["results"]:
        lines.append(
            f"{r['precision']:<20}{r['ppl']:>10.3f}{r['delta_vs_full']:>+10.3f}{_interval(r.get('delta_vs_full_ci95')):>20}"
            f"{r['logit_kl']:>11.4f}{r['bits_per_element']:>11.2f}{r['ratio_vs_fp16']:>10.2f}x"
        )
    lines.append(out["basis"])
    if "blocks" in out:
        b = out["blocks"]
        lines.append(
            f"delta 95%: the middle 95% of {b['resamples']} resamples of the scored text in blocks of {b['size']} "
            "tokens (the spread over text like this one)"
        )
    if "codebooks" in out:
        lines.append(f"nuq codebooks: {out['codebooks']}")
    return "\n".join(lines)


def markdown_table(out: dict) -> str:
    """README's table of a `ppl` report (with the delta's 95% interval over resampled text when it has one)."""
    ci = "delta_vs_full_ci95" in out["results"][0]
    lines = [
        f"| precision | ppl @{out['tokens']} | delta vs full |{' delta 95% |' if ci else ''} logit KL | bits/element | "
        "ratio vs fp16 |",
        "|---|---|---|---|---|---|" + ("---|" if ci else ""),
    ]
    for r in out["results"]:
        interval = f" {_interval(r['delta_vs_full_ci95'])} |" if ci else ""
        lines.append(
            f"| {r['precision']} | {r['ppl']:.3f} | {r['delta_vs_full']:+.3f} |{interval} {r['logit_kl']:.2e} | "
            f"{r['bits_per_element']:.3f} | {r['ratio_vs_fp16']:.2f}x |"
        )
    return "\n".join(lines)


def codebooks_markdown(own: dict, other: dict, own_name: str = "own", other_name: str = "other") -> str:
    """The precisions of `other` (a `ppl --codebooks FILE` report) beside the same precisions in `own` (a report
    with the model's own codebooks, e.g. the ablation's): delta and logit KL under each."""
    measures = [("delta", lambda r: f"{r['delta_vs_full']:+.3f}"), ("logit KL", lambda r: f"{r['logit_kl']:.2e}")]
    return paired_markdown(own["results"], other["results"], measures, own_name, other_name)


def ablation_markdown(out: dict) -> str:
    """README's ablation table: perplexity delta vs full precision at `tokens` (and its 95% interval over
    resampled text when the report has one), the logit KL vs full precision,
    bits/element and ratio vs 16-bit under each (as stored after scoring: the residual window's full-precision
    tokens included)."""
    cols = out["columns"]
    lines = ["| bits | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for row in out["rows"]:
        cells = []
        for col in cols:
            r = row["cells"][col]
            cells.append(
                "-"
                if r is None
                else f"{r['delta_vs_full']:+.3f}{_cell_interval(r)}<br>KL {r['logit_kl']:.2e}<br>"
                f"{r['bits_per_element']:.2f} b, {r['ratio_vs_fp16']:.2f}x"
            )
        lines.append(f"| {row['bits']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_markdown(out: dict) -> str:
    """README's live-memory table of an ablation report: the cache holding the prompt vs the layout formula."""
    m = out["memory"]
    lines = [
        f"| precision | live bytes @{m['tokens']} | formula bytes | ratio vs fp16 | bits/element |",
        "|---|---|---|---|---|",
    ]
    for r in m["results"]:
        lines.append(
            f"| {r['precision']} | {r['bytes']:,} | {r['formula_bytes']:,} | {r['ratio_vs_fp16']:.2f}x | "
            f"{r['bits_per_element']:.3f} |"
        )
    return "\n".join(lines)


def speed_markdown(out: dict) -> str:
    """README's decode-speed table of an ablation report (side by side in one run)."""
    d = out["decode"]
    lines = [f"| precision | decode tok/s @{d['context']} | vs {d['results'][0]['precision']} |", "|---|---|---|"]
    for r in d["results"]:
        lines.append(f"| {r['precision']} | {r['tokens_per_s']:.2f} | {r['vs_first']:.2f}x |")
    return "\n".join(lines)
