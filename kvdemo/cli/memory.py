"""`python -m kvdemo headroom`: the deployment headroom (kvdemo.memory.headroom) from flags, and its text report.

(`python -m kvdemo memory` is `cmd_memory` in kvdemo/cli/__init__.py: its dict prints as JSON.)
"""

from __future__ import annotations

from datetime import date

from ..configs import GB, WEIGHT_BITS, get_gpu, get_model_config
from ..measured import compare_measured
from ..memory import MEASURE_TOKENS, headroom
from ..models import config_from_model
from ..precision import parse_precision_list
from ..production import ENGINES


def run_headroom_cli(args) -> dict:
    """`python -m kvdemo headroom ...`: `headroom` for a reference config or the loaded model ("loaded").

    With `--model-config loaded` the embedded model is loaded and its live cache measured at
    min(context, model context, MEASURE_TOKENS) tokens of real prose, beside the formulas.
    """
    specs = parse_precision_list(getattr(args, "precision", "full,int8,int4"))
    if getattr(args, "measure", False):
        return _measured_headroom(args, specs)
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


def _measured_headroom(args, specs) -> dict:
    """`headroom --measure --budget-gb G --context N`: real caches admitted into the budget (kvdemo.measured)."""
    from ..measured import load_scale_model, measure_headroom
    from ..needle import parse_numbers

    if not args.budget_gb or args.budget_gb <= 0:
        raise ValueError("--measure needs --budget-gb G (a memory budget in GB, e.g. 1)")
    batch_sizes = parse_numbers(args.batch_sizes, "--batch-sizes", int)
    lm = load_scale_model(args.measure_model)
    budget = round(args.budget_gb * GB)
    if lm.weight_bytes() >= budget:
        raise ValueError(
            f"the model's weights ({lm.weight_bytes() / GB:.2f} GB) do not fit --budget-gb {args.budget_gb}"
        )
    rows = measure_headroom(lm, specs, args.context, budget, batch_sizes)
    return {
        "command": f"python -m kvdemo headroom --measure --budget-gb {args.budget_gb:g} --context {args.context} "
        f"--precision {','.join(s.label for s in specs)} --measure-model {args.measure_model} "
        f"--batch-sizes {args.batch_sizes}",
        "machine": machine_line(),
        "date": date.today().isoformat(),
        "model": lm.name,
        "dtype": str(lm.dtype).replace("torch.", ""),
        "budget_bytes": budget,
        "context": args.context,
        "max_sequences": {r["precision"]: r["max_sequences"] for r in rows},
        "measured_max_sequences": {r["precision"]: r["measured_max_sequences"] for r in rows},
        "tokens_per_s": {r["precision"]: r["tokens_per_s"] for r in rows},
        "results": rows,
        "method": "each admitted sequence is a real QuantizedKVCache at the fullest point of a sequence decoding "
        "to the context (its residual window full); admitted while weights + the caches' allocated bytes fit the "
        "budget; the formula is kvdemo.memory.sequence_bytes at the model's dtype",
    }


def _gb(x: float) -> str:
    return f"{x / GB:,.2f} GB"


def _label_width(labels, least: int = 14) -> int:
    """A column wide enough for every precision label (options make them long: nuq3:o1:prerope)."""
    return max([least - 2, *(len(label) for label in labels)]) + 2


def format_headroom(out: dict) -> str:
    """Human-readable headroom report (what `python -m kvdemo headroom` prints without --json)."""
    if "measured_max_sequences" in out:
        return _format_measured(out)
    m, g = out["model"], out["gpu_info"]
    w = _label_width(out["max_sequences"])
    lines = [
        f"{m['display_name']}: {m['layers']} layers, {m['kv_heads']} KV heads x {m['head_dim']}, "
        f"{m['params'] / 1e9:.2f}B params at {out['weight_bits']}-bit = {_gb(out['weights_bytes'])}",
        f"{out['gpus']} x {g['display_name']} ({g['memory_gb']:.1f} GB each), reserve {_gb(out['reserve_bytes'])}, "
        f"KV room {_gb(out['free_kv_bytes'])}; context {out['context']:,} tokens, "
        f"{out['users']} user(s) for the max-context column",
        "",
        f"{'precision':<{w + 2}}{'bits K/V':>12}{'B/token':>11}{'KV/seq':>12}{'max seqs':>10}{'vs 16-bit':>10}"
        f"{'max ctx':>12}",
    ]
    for label, n in out["max_sequences"].items():
        bits = out["bits_per_element"][label]
        ratio = out["sequences_vs_16bit"][label]
        ctx = out["max_context_for_users"][label]
        limit = " (model)" if out["max_context_limited_by"][label] == "model" else ""
        lines.append(
            f"{label:<{w + 2}}{bits['key']:>6.3g}/{bits['value']:<5.3g}{out['bytes_per_token'][label]:>11,}"
            f"{_gb(out['sequence_bytes'][label]):>12}{n:>10,}{'-' if ratio is None else f'{ratio:.2f}x':>10}"
            f"{ctx:>12,}{limit}"
        )
    lines.append("\nmemory split at max sequences (all GPUs): weights / KV / reserve / free")
    for label, s in out["split"].items():
        lines.append(
            f"  {label:<{w}}{_gb(s['weights'])} / {_gb(s['kv'])} / {_gb(s['reserve'])} / {_gb(s['free'])}"
            + (f"  (over by {_gb(s['over'])})" if s["over"] else "")
        )
    lines.append("\nstacking: max sequences by weight bits x KV precision")
    lines.append("  " + f"{'':<{w}}" + "".join(f"{wb + '-bit W':>11}" for wb in map(str, WEIGHT_BITS)))
    for label, row in out["stacking"].items():
        lines.append(f"  {label:<{w}}" + "".join(f"{row[str(wb)]:>11,}" for wb in WEIGHT_BITS))
    reasons = [(k, r) for k, r in out["reason"].items() if r]
    if reasons:
        lines.append("")
        lines += [f"{k}: {r}" for k, r in reasons]
    lines.append("\ntake it to production (nearest settings):")
    for label, p in out["production"].items():
        lines.append(f"  {label}:")
        for engine in [e for e in ENGINES if e in p]:
            e = p[engine]
            lines.append(f"    {engine:<13}{e['setting']}  [{e['match']}]")
            for gap in e["cannot_express"]:
                lines.append(f"    {'':<13}- cannot: {gap}")
            for alt in e.get("alternatives", []):
                lines.append(f"    {'':<13}- also: {alt['setting']} ({alt['when']})")
    if "measured" in out:
        meas = out["measured"]
        lines.append(f"\nmeasured live cache ({meas['tokens']:,} tokens, {meas['dtype']}) vs formula:")
        for r in meas["results"]:
            lines.append(
                f"  {r['precision']:<{w}}{r['bytes']:>14,} B measured  {r['formula_bytes']:>14,} B formula "
                f"({r['error_vs_formula']:+.2%})  {r['formula_plain_bytes']:>14,} B bytes/token x tokens "
                f"({r['error_vs_plain']:+.2%})"
            )
    if out["warnings"]:
        lines.append("")
        lines += [f"warning: {w}" for w in out["warnings"]]
    return "\n".join(lines)


def machine_line() -> str:
    """What a measured report says about where it ran."""
    import os
    import platform

    return f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, cpu"


def measured_markdown(out: dict) -> str:
    """README's table of a `headroom --measure` report."""
    sizes = [s["batch"] for s in out["results"][0]["tokens_per_s"]]
    lines = [
        "| precision | admitted (measured) | formula | measured / formula | bytes per sequence (measured / formula) | "
        + " | ".join(f"tok/s, batch {b}" for b in sizes)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(sizes),
    ]
    for r in out["results"]:
        speeds = " | ".join(f"{s['tokens_per_s']:.2f}" for s in r["tokens_per_s"])
        lines.append(
            f"| {r['precision']} | {r['measured_max_sequences']} | {r['max_sequences']} | {r['measured_vs_formula']:.3f} | "
            f"{r['sequence_bytes_measured']:,} / {r['sequence_bytes_formula']:,} | {speeds} |"
        )
    return "\n".join(lines)


def _format_measured(out: dict) -> str:
    w = _label_width([r["precision"] for r in out["results"]], 12)
    lines = [
        f"{out['model']} ({out['dtype']}), budget {_gb(out['budget_bytes'])}, context {out['context']:,} tokens",
        f"{'precision':<{w}}{'measured':>10}{'formula':>9}{'ratio':>8}  decode tokens/s by batch size",
    ]
    for r in out["results"]:
        speeds = ", ".join(f"{s['batch']}: {s['tokens_per_s']:.1f}" for s in r["tokens_per_s"])
        ratio = "" if r["measured_vs_formula"] is None else f"{r['measured_vs_formula']:.3f}"
        lines.append(
            f"{r['precision']:<{w}}{r['measured_max_sequences']:>10}{r['max_sequences']:>9}{ratio:>8}  {speeds}"
        )
    return "\n".join(lines)
