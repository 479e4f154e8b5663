"""`python -m kvdemo findings`: every claim measured on the model (kvdemo.findings.run), written as
findings.json, findings.html and findings.pdf (kvdemo.findings.render), with progress on stderr."""

from __future__ import annotations

import sys
from dataclasses import replace

from ..findings.render import write_report
from ..findings.run import QUICK, SIZES, parse_shard, plan, run_plan
from ..findings.verdicts import judged
from ..precision import parse_precision_list
from ..progress import Progress
from ..results.findings import Claim, capacity_config, load


def run_cli(args) -> dict:
    """`python -m kvdemo findings [--model M] [--precision LIST] [--quick] --out DIR`: the report's JSON and
    the files written ("files"). Without --shard the report is written to DIR after every measurement (a
    stopped run keeps what finished); a shard's measurements go to the cache only."""
    from ..models import load_model

    if args.rejudge:  # the measurements as written, the claims judged again: no model, no measuring
        found = load(args.rejudge)
        if found is None:
            raise SystemExit(f"no findings.json at {args.rejudge}")
        config = capacity_config(args.model_config, args.gpu, args.gpus, args.context)
        found = judged(found, config)
        return found.to_json() | {"files": write_report(found, args.out, pdf=not args.no_pdf)}
    precisions = [s.label for s in parse_precision_list(args.precision)] if args.precision else None
    config = capacity_config(args.model_config, args.gpu, args.gpus, args.context)
    sizes = QUICK if args.quick else SIZES[args.sizes]
    if args.tokens:
        sizes = replace(
            sizes,
            tokens=args.tokens,
            needle_lengths=tuple(n for n in sizes.needle_lengths if n < args.tokens) + (args.tokens - 96,),
        )
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    shard = parse_shard(args.shard)
    the_plan = plan(lm, precisions, sizes, config, quick=args.quick)
    so_far = replace(the_plan.findings, measurements={})

    def progress(p: Progress) -> None:
        print(p.text(), file=sys.stderr, flush=True)
        if p.row is not None and shard == (0, 1):
            so_far.add(p.row)
            so_far.seconds = round(p.elapsed_s, 1)
            write_report(so_far, args.out, pdf=False)

    found = run_plan(
        lm,
        the_plan,
        on_progress=progress,
        use_cache=not args.no_cache,
        shard=shard,
        reverse=args.reverse,
        cached_only=args.from_cache,
    )
    if shard != (0, 1):  # a shard's results are in the cache; a run without --shard writes the report
        return {"model": found.model, "seconds": found.seconds, "stopped": found.stopped, "claims": [], "files": {}}
    return found.to_json() | {"files": write_report(found, args.out, pdf=not args.no_pdf)}


def format_text(out: dict) -> str:
    lines = [f"model: {out['model']}  ({out['seconds']:.0f} s, {out['stopped']})", ""]
    for c in (Claim.from_json(c) for c in out["claims"]):
        lines.append(f"{c.title}: {c.verdict.word}\n    {c.verdict.text}")
    if out.get("files"):
        lines.append("\nwritten: " + ", ".join(out["files"].values()))
    return "\n".join(lines)
