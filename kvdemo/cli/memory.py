"""`python -m kvdemo headroom`: the deployment headroom (kvdemo.memory.headroom) from flags, and its text report.

(`python -m kvdemo memory` is `cmd_memory` in kvdemo/cli/__init__.py: its dict prints as JSON.)
"""

from __future__ import annotations

from ..memory import (
    GB,
    MEASURE_TOKENS,
    WEIGHT_BITS,
    compare_measured,
    config_from_model,
    get_gpu,
    get_model_config,
    headroom,
)
from ..precision import parse_precision_list


def run_headroom_cli(args) -> dict:
    """`python -m kvdemo headroom ...`: `headroom` for a reference config or the loaded model ("loaded").

    With `--model-config loaded` the embedded model is loaded and its live cache measured at
    min(context, model context, MEASURE_TOKENS) tokens of real prose, beside the formulas.
    """
    specs = parse_precision_list(getattr(args, "precision", "full,int8,int4"))
    gpu = get_gpu(getattr(args, "gpu", "h100-80gb"), getattr(args, "gpu_memory_gb", None))
    name = str(getattr(args, "model_config", "llama-3.1-8b")).strip().lower()
    lm = None
    if name == "loaded":
        from ..models import load_model

        lm = load_model()
        cfg = config_from_model(lm)
    else:
        cfg = get_model_config(name)
    users = getattr(args, "users", None) or 1
    out = headroom(
        cfg,
        gpu,
        specs,
        context=args.context,
        gpus=getattr(args, "gpus", 1),
        users=users,
        weight_bits=getattr(args, "weight_bits", 16),
        reserve_gb=getattr(args, "reserve_gb", None),
    )
    if lm is not None:
        from ..texts import prose_ids

        n = min(args.context, lm.max_context, MEASURE_TOKENS)
        out["measured"] = compare_measured(lm, prose_ids(lm, n), specs)
    return out


def _gb(x: float) -> str:
    return f"{x / GB:,.2f} GB"


def format_headroom(out: dict) -> str:
    """Human-readable headroom report (what `python -m kvdemo headroom` prints without --json)."""
    m, g = out["model"], out["gpu_info"]
    lines = [
        f"{m['display_name']}: {m['layers']} layers, {m['kv_heads']} KV heads x {m['head_dim']}, "
        f"{m['params'] / 1e9:.2f}B params at {out['weight_bits']}-bit = {_gb(out['weights_bytes'])}",
        f"{out['gpus']} x {g['display_name']} ({g['memory_gb']:.1f} GB each), reserve {_gb(out['reserve_bytes'])}, "
        f"KV room {_gb(out['free_kv_bytes'])}; context {out['context']:,} tokens, "
        f"{out['users']} user(s) for the max-context column",
        "",
        f"{'precision':<16}{'bits K/V':>12}{'B/token':>11}{'KV/seq':>12}{'max seqs':>10}{'vs 16-bit':>10}"
        f"{'max ctx':>12}",
    ]
    for label, n in out["max_sequences"].items():
        bits = out["bits_per_element"][label]
        ratio = out["sequences_vs_16bit"][label]
        ctx = out["max_context_for_users"][label]
        limit = " (model)" if out["max_context_limited_by"][label] == "model" else ""
        lines.append(
            f"{label:<16}{bits['key']:>6.3g}/{bits['value']:<5.3g}{out['bytes_per_token'][label]:>11,}"
            f"{_gb(out['sequence_bytes'][label]):>12}{n:>10,}{'-' if ratio is None else f'{ratio:.2f}x':>10}"
            f"{ctx:>12,}{limit}"
        )
    lines.append("\nmemory split at max sequences (all GPUs): weights / KV / reserve / free")
    for label, s in out["split"].items():
        lines.append(
            f"  {label:<14}{_gb(s['weights'])} / {_gb(s['kv'])} / {_gb(s['reserve'])} / {_gb(s['free'])}"
            + (f"  (over by {_gb(s['over'])})" if s["over"] else "")
        )
    lines.append("\nstacking: max sequences by weight bits x KV precision")
    lines.append("  " + f"{'':<14}" + "".join(f"{wb + '-bit W':>11}" for wb in map(str, WEIGHT_BITS)))
    for label, row in out["stacking"].items():
        lines.append(f"  {label:<14}" + "".join(f"{row[str(wb)]:>11,}" for wb in WEIGHT_BITS))
    reasons = [(k, r) for k, r in out["reason"].items() if r]
    if reasons:
        lines.append("")
        lines += [f"{k}: {r}" for k, r in reasons]
    lines.append("\ntake it to production (nearest settings):")
    for label, p in out["production"].items():
        lines.append(f"  {label}:")
        for engine in ("vllm", "llama.cpp", "transformers"):
            e = p[engine]
            lines.append(f"    {engine:<13}{e['setting']}  [{e['match']}]")
            for gap in e["cannot_express"]:
                lines.append(f"    {'':<13}- cannot: {gap}")
    if "measured" in out:
        meas = out["measured"]
        lines.append(f"\nmeasured live cache ({meas['tokens']:,} tokens, {meas['dtype']}) vs formula:")
        for r in meas["results"]:
            lines.append(
                f"  {r['precision']:<14}{r['bytes']:>14,} B measured  {r['formula_bytes']:>14,} B formula "
                f"({r['error_vs_formula']:+.2%})  {r['formula_plain_bytes']:>14,} B bytes/token x tokens "
                f"({r['error_vs_plain']:+.2%})"
            )
    if out["warnings"]:
        lines.append("")
        lines += [f"warning: {w}" for w in out["warnings"]]
    return "\n".join(lines)
