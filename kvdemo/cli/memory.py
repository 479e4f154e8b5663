"""`python -m kvdemo headroom`: the deployment headroom (kvdemo.memory.headroom) from flags, or sequences of real
caches admitted into a budget (`--measure`, kvdemo.measured.measure_headroom); and their text.

(`python -m kvdemo memory` is `cmd_memory` in kvdemo/cli/__init__.py: its report prints as JSON.)
"""

from __future__ import annotations

from dataclasses import replace
from datetime import date

from ..configs import GB, get_gpu, get_model_config
from ..machine import machine_line
from ..measured import compare_measured
from ..memory import MEASURE_TOKENS, headroom
from ..models import config_from_model
from ..precision import parse_precision_list
from ..results.headroom import Headroom
from ..results.measured import MeasuredHeadroom


def run_headroom_cli(args) -> Headroom | MeasuredHeadroom:
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
        out.measured = compare_measured(lm, prose_ids(lm, n), specs)
    return out


def _measured_headroom(args, specs) -> MeasuredHeadroom:
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
    out = measure_headroom(lm, specs, args.context, budget, batch_sizes)
    return replace(
        out,
        command=f"python -m kvdemo headroom --measure --budget-gb {args.budget_gb:g} --context {args.context} "
        f"--precision {','.join(s.label for s in specs)} --measure-model {args.measure_model} "
        f"--batch-sizes {args.batch_sizes}",
        machine=machine_line(),
        date=date.today().isoformat(),
    )


def format_headroom(out: Headroom | MeasuredHeadroom) -> str:
    """Human-readable headroom report (what `python -m kvdemo headroom` prints without --json)."""
    return out.text()
