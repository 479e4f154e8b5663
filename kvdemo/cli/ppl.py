"""`python -m kvdemo ppl`: perplexity of held-out text at each KV precision (kvdemo.ppl.run_ppl), the methods
ablation (`--ablation`) and the keys/values split (`--kv-split`); the report file and its text."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from ..engines import split_contenders
from ..ppl import run_ablation, run_kv_split, run_ppl
from ..precision import parse_precision_list
from ..results import ablation
from ..results.ablation import AblationReport
from ..results.bench import DecodeSpeed
from ..results.kv_split import KvSplitReport
from ..results.measured import MemoryReport
from ..results.ppl import PplReport, report_text
from .progress import printer

# the memory and decode-speed rows of the ablation report: the new formats beside int4 (and int3)
ABLATION_MEMORY = ("int4", "nuq4:o1", "nuq3:o1", "nuq2:o1", "nuq2:o1:s1", "int3", "nvfp4")
ABLATION_SPEED = ("int4", "nuq4:o1", "nuq4", "int4:hadamard", "nvfp4")


def run_cli(args) -> PplReport | AblationReport | KvSplitReport:
    from ..models import load_model

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
        out = run_ablation(lm, args.tokens, args.prefix, codebooks=books, on_progress=printer())
        out.memory = ablation_memory(lm, args.tokens)
        out.decode = ablation_speed(lm, args.tokens)
        options, name = f"--ablation --tokens {args.tokens} --prefix {args.prefix}", "ablation.json"
    else:
        ours, theirs = split_contenders(args.precision)
        if theirs and args.kv_split:
            raise ValueError("--kv-split splits kvdemo's precisions; llama.cpp contenders go with --precision")
        precisions = parse_precision_list(",".join(ours) or "full") + [kv.label for kv in theirs]
        run = run_kv_split if args.kv_split else run_ppl
        out = run(lm, precisions, args.tokens, args.prefix, codebooks=books, text=text, on_progress=printer())
        options = f"--precision {args.precision} --tokens {args.tokens} --prefix {args.prefix}"
        options += f" --document {args.document}" if args.document else ""
        options, name = ("--kv-split " + options, "ppl_kv_split.json") if args.kv_split else (options, "ppl.json")
    if args.codebooks:
        options += f" --codebooks {args.codebooks}"
    scores = out if isinstance(out, PplReport) else out.ppl
    scores.command = f"python -m kvdemo ppl --model {args.model} {options}"
    scores.date = datetime.date.today().isoformat()
    if args.out:  # a folder (the report under its usual name) or a .json file
        target = Path(args.out) if args.out.endswith(".json") else Path(args.out) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(out.to_json(), indent=2) + "\n")
    return out


def ablation_memory(lm, tokens: int) -> MemoryReport:
    """The live cache holding `tokens` tokens of held-out text at each ABLATION_MEMORY precision, beside the
    layout formula (`measured.compare_measured`: bytes to the byte) and a 16-bit cache."""
    from ..measured import compare_measured
    from ..texts import held_out_ids

    return compare_measured(lm, held_out_ids(lm, tokens), ABLATION_MEMORY)


def ablation_speed(lm, tokens: int) -> DecodeSpeed:
    """Greedy decode tokens/s after a `tokens`-token prompt, ABLATION_SPEED side by side
    (`kvdemo.contest.decode.decode_speed`)."""
    from ..contest.decode import decode_speed

    return decode_speed(lm, ABLATION_SPEED, context=tokens, on_progress=printer())


def format_text(out: PplReport | AblationReport | KvSplitReport) -> str:
    if isinstance(out, AblationReport):
        return report_text(out.ppl) + "\n\n" + ablation.text(out)
    if isinstance(out, KvSplitReport):
        return report_text(out.ppl) + "\n\n" + out.markdown() + "\n\n" + "\n".join(out.lines())
    return report_text(out)
