"""`python -m kvdemo drift`: attention-score drift (kvdemo.drift.run_drift) from flags, and its text report."""

from __future__ import annotations

from pathlib import Path

from ..drift import document_prompt, document_text, run_drift
from ..precision import parse_precision_list
from ..results.drift import DriftReport


def run_cli(args) -> DriftReport:
    """`python -m kvdemo drift --precision int8,int4,int2 --tokens 2048 [--document F] [--new-tokens N]
    [--prefill-mode exact|chunked]`."""
    from ..models import load_model

    specs = parse_precision_list(args.precision)
    if args.document and not Path(args.document).is_file():
        raise ValueError(f"document not found: {args.document}")
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    if args.tokens > lm.max_context:
        raise ValueError(f"--tokens {args.tokens} exceeds the model's context ({lm.max_context})")
    text, n = document_text(lm, args.tokens, args.document)
    prompt = document_prompt(lm, text)
    report = run_drift(lm, prompt, specs, args.new_tokens, prefill_mode=getattr(args, "prefill_mode", "chunked"))
    report.tokens = n
    return report


def format_text(report: DriftReport) -> str:
    """A human-readable summary of a drift report."""
    lines = [
        f"model: {report.model}  document: {report.tokens} tokens  prompt: {report.prompt_tokens} tokens  "
        f"queries: {report.new_tokens} (last prompt token + teacher-forced continuation)  "
        f"prefill: {report.prefill_mode}",
        f"full-precision continuation: {report.generated!r}",
        "",
        f"{'precision':<14}{'bits':>6}{'mean JS':>11}{'mean KL':>11}{'top-' + str(report.top_k):>8}"
        f"{'out cos':>10}{'logit KL':>11}{'max':>10}{'top-1':>7}",
    ]
    for r in report.results:
        lines.append(
            f"{r.precision:<14}{r.bits_per_element:>6.2f}{r.mean_js:>11.2e}{r.mean_kl:>11.2e}"
            f"{r.topk_overlap:>8.3f}{r.output_cosine:>10.5f}{r.logit_kl_mean:>11.2e}{max(r.logit_kl):>10.2e}"
            f"{r.top1_agreement:>7.2f}"
        )
    for r in report.results:
        worst = sorted(r.per_layer, key=lambda row: row["js"], reverse=True)[:3]
        bins = ", ".join(f"{b['bin']} [{b['start']}, {b['end']}) {100 * b['js_share']:.0f}%" for b in r.by_position)
        lines.append(
            f"\n{r.precision}: worst layers "
            + ", ".join(f"{w['layer']} (JS {w['js']:.2e})" for w in worst)
            + f"\n  share of JS by key position: {bins}"
        )
    return "\n".join(lines)
