"""`python -m kvdemo probe`: the needle grid asked of OpenAI-compatible endpoints (kvdemo.probe.run_probe), its
files and its text report."""

from __future__ import annotations

import contextlib
import datetime
import shlex
from pathlib import Path

from ..engines import PREFIX, parse_kv
from ..models import embedded_gguf
from ..needle import parse_numbers
from ..probe import parse_endpoint, questions, resolve_template, run_probe
from ..probe.local import in_process_checks, start_servers
from ..results.needle import difference_line
from ..results.probe import (
    ProbeReport,
    endpoint_differences,
    errors,
    failure_line,
    found_rates,
    partial_report,
    rate_line,
    save_report,
)
from .needle import read_document
from .progress import printer


def run_cli(args) -> ProbeReport:
    """`python -m kvdemo probe --endpoint NAME=BASE_URL,MODEL[,KEY_ENV] ... [--lengths ...] [--depths ...]
    [--kind ...] [--out probe.json]`; Ctrl-C keeps and writes the cells it finished."""
    local = [parse_kv(PREFIX + t.strip()) for t in args.llamacpp.split(",") if t.strip()]
    if not args.endpoint and not local:
        raise ValueError("give at least one --endpoint NAME=BASE_URL,MODEL[,KEY_ENV] (or --llamacpp TYPES)")
    endpoints = [parse_endpoint(e) for e in args.endpoint]
    if args.logprobs == "echo":
        resolve_template(args.echo_template)  # a bad template fails before any server starts
    lengths = parse_numbers(args.lengths, "--lengths", int)
    depths = parse_numbers(args.depths, "--depths", float)
    document, name = None, "document"
    if args.document:
        name, document = read_document(args.document)
    with contextlib.ExitStack() as stack:
        if local:
            path = Path(args.llamacpp_model) if args.llamacpp_model else embedded_gguf()
            n_ctx = server_context(max(lengths), args.max_tokens)
            endpoints += start_servers(stack, path, local, n_ctx)
        report = _probe(args, endpoints, lengths, depths, document, name)
        if local and report.cells:
            cells = (args.kind, lengths, depths, args.seed, args.repeats, document, name)
            _, asked, _ = questions(*cells, args.needle, args.question, args.answer)
            report.checks = in_process_checks(report, asked, path, local, n_ctx, args.max_tokens)
    report.provenance = {"command": _command(args), "date": datetime.date.today().isoformat()}
    if args.out:
        save_report(report, args.out)
    return report


def server_context(longest: int, max_tokens: int) -> int:
    """Context for the local servers: the longest prompt by the probe's estimate with room for a tokenizer that
    counts half again as many tokens, and the answer; whole 256-token blocks."""
    need = int(longest * 1.5) + max_tokens + 64
    return -(-need // 256) * 256


def _probe(args, endpoints, lengths, depths, document, name) -> ProbeReport:
    """The probe itself; Ctrl-C keeps the cells it finished."""
    settings = dict(
        kind=args.kind,
        document=document,
        document_name=name,
        needle=args.needle,
        question=args.question,
        answer=args.answer,
        seed=args.seed,
        repeats=args.repeats,
        concurrency=args.concurrency,
        timeout_s=args.timeout_s,
        retries=args.retries,
        backoff_s=args.backoff_s,
        max_tokens=args.max_tokens,
        logprobs=args.logprobs,
        echo_template=args.echo_template,
    )
    seen: list = []
    show = printer()

    def on_progress(p) -> None:
        if p.row is not None:
            seen.append(p.row)
        show(p)

    try:
        report = run_probe(endpoints, lengths, depths, on_progress=on_progress,
                           **settings)  # fmt: skip
    except KeyboardInterrupt:  # Ctrl-C: keep what finished
        report = partial_report(_empty(endpoints, lengths, depths, args), seen, 0.0)
    return report


def _empty(endpoints, lengths, depths, args) -> ProbeReport:
    return ProbeReport(
        endpoints=[e.to_json() for e in endpoints],
        kind=args.kind,
        haystack="",
        lengths=sorted(lengths),
        depths=depths,
        seed=args.seed,
        repeats=args.repeats,
        cells=[],
        seconds=0.0,
    )


def _command(args) -> str:
    """The command line that reproduces the probe (key variables by name; the keys are never on it)."""
    parts = ["python -m kvdemo probe"] + [f"--endpoint {shlex.quote(e)}" for e in args.endpoint]
    if args.llamacpp:
        parts.append(f"--llamacpp {args.llamacpp}")
        parts += [f"--llamacpp-model {shlex.quote(args.llamacpp_model)}"] if args.llamacpp_model else []
    parts += [f"--lengths {args.lengths}", f"--depths {args.depths}", f"--kind {args.kind}"]
    for flag, value in (("--document", args.document), ("--needle", args.needle), ("--question", args.question),
                        ("--answer", args.answer)):  # fmt: skip
        if value:
            parts.append(f"{flag} {shlex.quote(value)}")
    parts += [f"--seed {args.seed}", f"--repeats {args.repeats}", f"--concurrency {args.concurrency}"]
    parts += [f"--max-tokens {args.max_tokens}", f"--timeout-s {args.timeout_s:g}", f"--retries {args.retries}"]
    if args.logprobs != "chat":  # the default is left off, so commands recorded before the option read the same
        parts.append(f"--logprobs {args.logprobs}")
    if args.logprobs == "echo":
        parts.append(f"--echo-template {shlex.quote(args.echo_template)}")
    return " ".join(parts)


def format_text(report: ProbeReport) -> str:
    lines = [f"probe: {report.kind}, {len(report.cells)} of {report.planned_cells} cells ({report.stopped}), answer "
             f"log-probs: {report.settings.get('logprobs', 'chat')}"]  # fmt: skip
    lines += [f"  {e['name']}: {e['base_url']} model {e['model']}" for e in report.endpoints]
    lines += [rate_line(r) for r in found_rates(report.cells)]
    lines += ["", "by length:"] + [rate_line(r) for r in found_rates(report.cells, "length")]
    lines += ["", "by depth:"] + [rate_line(r) for r in found_rates(report.cells, "depth")]
    diffs = endpoint_differences(report)
    if diffs:
        lines += ["", *[difference_line(d) for d in diffs]]
    if report.checks:
        same = sum(c["same"] for c in report.checks)
        lines += ["", f"llama.cpp served vs in-process, same prompts: {same} of {len(report.checks)} answers agree"]
        lines += [f"  differs: {c['endpoint']} {c['length']} tokens, depth {c['depth']:g}%: served "
                  f"{c['served']!r}, in-process {c['in_process']!r}" for c in report.checks if not c["same"]]  # fmt: skip
    failures = errors(report.cells)
    if failures:
        lines += ["", "failures:"] + [f"  {failure_line(f)}" for f in failures]
    lines += ["", *report.notes]
    return "\n".join(lines)
