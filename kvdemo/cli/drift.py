"""`python -m kvdemo drift`: attention-score drift (kvdemo.drift.run_drift) from flags, and its text report."""

from __future__ import annotations

from pathlib import Path

from ..drift import document_prompt, document_text, run_drift
from ..precision import parse_precision_list


def run_cli(args) -> dict:
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
    return {"model": lm.name, "tokens": n} | run_drift(
        lm, prompt, specs, args.new_tokens, prefill_mode=getattr(args, "prefill_mode", "chunked")
    )


def format_text(out: dict) -> str:
    """A human-readable summary of `run_cli`'s dict."""
    lines = [
        f"model: {out['model']}  document: {out['tokens']} tokens  prompt: {out['prompt_tokens']} tokens  "
        f"queries: {out['new_tokens']} (last prompt token + teacher-forced continuation)  "
        f"prefill: {out.get('prefill_mode', 'chunked')}",
        f"full-precision continuation: {out['generated']!r}",
        "",
        f"{'precision':<14}{'bits':>6}{'mean JS':>11}{'mean KL':>11}{'top-' + str(out['top_k']):>8}"
        f"{'out cos':>10}{'logit KL':>11}{'max':>10}{'top-1':>7}",
    ]
    for r in out["results"]:
        kls = r["logit_kl"]
        lines.append(
            f"{r['precision']:<14}{r['bits_per_element']:>6.2f}{r['mean_js']:>11.2e}{r['mean_kl']:>11.2e}"
            f"{r['topk_overlap']:>8.3f}{r['output_cosine']:>10.5f}{sum(kls) / len(kls):>11.2e}{max(kls):>10.2e}"
            f"{r['top1_agreement']:>7.2f}"
        )
    for r in out["results"]:
        worst = sorted(r["per_layer"], key=lambda row: row["js"], reverse=True)[:3]
        bins = ", ".join(f"{b['bin']} [{b['start']}, {b['end']}) {100 * b['js_share']:.0f}%" for b in r["by_position"])
        lines.append(
            f"\n{r['precision']}: worst layers "
            + ", ".join(f"{w['layer']} (JS {w['js']:.2e})" for w in worst)
            + f"\n  share of JS by key position: {bins}"
        )
    return "\n".join(lines)
