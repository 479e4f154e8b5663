"""`python -m kvdemo findings`: every claim measured on the model (kvdemo.findings.run_findings), written as
findings.json, findings.html and findings.pdf (kvdemo.report), with progress on stderr."""

from __future__ import annotations

import sys
import time
from dataclasses import replace

from ..findings import DEFAULT_CONFIG, QUICK, SIZES, parse_shard, run_findings
from ..precision import parse_precision_list
from ..report import write_report


def run_cli(args) -> dict:
    """`python -m kvdemo findings [--model M] [--precision LIST] [--quick] --out DIR`: the findings dict,
    written to DIR after every measurement (a stopped run keeps what finished)."""
    from ..models import load_model

    precisions = [s.label for s in parse_precision_list(args.precision)] if args.precision else None
    config = {
        "model_config": args.model_config or DEFAULT_CONFIG["model_config"],
        "gpu": args.gpu or DEFAULT_CONFIG["gpu"],
        "gpus": args.gpus or DEFAULT_CONFIG["gpus"],
        "context": args.context or DEFAULT_CONFIG["context"],
    }
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    start = time.perf_counter()

    def progress(done: int, total: int, message: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f} s] {done}/{total} {message}", file=sys.stderr, flush=True)

    sizes = QUICK if args.quick else SIZES[args.sizes]
    if args.tokens:
        sizes = replace(
            sizes,
            tokens=args.tokens,
            needle_lengths=tuple(n for n in sizes.needle_lengths if n < args.tokens) + (args.tokens - 96,),
        )
    found = run_findings(
        lm,
        precisions,
        quick=args.quick,
        sizes=sizes,
        shard=parse_shard(args.shard),
        reverse=args.reverse,
        cached_only=args.from_cache,
        config=config,
        on_progress=progress,
        on_partial=(lambda f: write_report(f, args.out, pdf=False)) if args.shard == "0/1" else None,
        use_cache=not args.no_cache,
    )
    if args.shard != "0/1":  # a shard's results are in the cache; a run without --shard writes the report
        return {k: found[k] for k in ("model", "seconds", "stopped")} | {"claims": [], "files": {}}
    found["files"] = write_report(found, args.out, pdf=not args.no_pdf)
    return found


def format_text(out: dict) -> str:
    lines = [f"model: {out['model']}  ({out['seconds']:.0f} s, {out['stopped']})", ""]
    for c in out["claims"]:
        lines.append(f"{c['title']}: {c['verdict']['word']}\n    {c['verdict']['text']}")
    if out.get("files"):
        lines.append("\nwritten: " + ", ".join(out["files"].values()))
    return "\n".join(lines)
