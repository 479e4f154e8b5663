"""Findings, as numbers: what the claims' verdicts and figures read from a findings report.

A findings report (`kvdemo.findings.run_findings`) holds per (weights, text) and precision the measured
windows (NLL, logit KL) and needles (answer log-prob, found); here those become deltas against
(loaded weights, full precision), capacity on a GPU config, and the quality / capacity trade-off.
Nothing here runs a model.
"""

from __future__ import annotations

from .. import layout
from ..configs import get_gpu, get_model_config
from ..memory import headroom
from ..precision import parse_precision

# Every threshold a verdict uses, in one place (units in the names).
THRESHOLDS = {
    "nll_ok_nats": 0.01,  # NLL delta vs full (nats/token, ~1% perplexity) at or below which an eval "passes"
    "needle_ok_nats": 0.5,  # answer log-prob loss vs full (nats) at or below which a needle read "passes"
    "short_tokens": 512,  # the short end of claim 2: windows ending and prompts at or below this length
    "noise_nll_nats": 0.002,  # differences in mean NLL smaller than this are noise
    "noise_kl_nats": 0.0005,  # ... in mean logit KL
    "noise_needle_nats": 0.1,  # ... in mean answer log-prob
    "key_value_measures_needed": 2,  # of the 3 measures, how many must show keys as the sensitive half
    "matters_fraction": 0.10,  # sinks / residual "matter" when they cut the loss by at least this share
    "stack_ratio_range": (0.5, 2.0),  # combined loss / (weights' loss + KV's loss) within this: the losses add up
    "stack_min_loss_nats": 0.005,  # cells whose summed loss is below this are not judged for additivity
    "capacity_formula_tolerance": 0.02,  # live cache bytes vs the layout formula
    "budget_nll_nats": 0.01,  # claim 7's default quality budget (NLL delta, nats/token)
}

DEFAULT_CONFIG = {"model_config": "llama-3.1-8b", "gpu": "h100-80gb", "gpus": 1, "context": 32768}


# --- deltas against (loaded, full) ---------------------------------------------------------------------------


def runs(found: dict, text: str = "main", weights: str = "loaded") -> dict:
    return found.get("measurements", {}).get(f"{weights}:{text}", {})


def run_of(found: dict, label: str, weights: str = "loaded") -> dict | None:
    """A precision's measurement: loaded weights on the main text, quantized weights on the stack text
    (its first `stack_tokens` tokens: the same ids, so the same windows and prompts)."""
    return runs(found, "main" if weights == "loaded" else "stack", weights).get(label)


def nll_delta(found: dict, label: str, weights: str = "loaded", max_end: int | None = None) -> float | None:
    """Mean NLL (nats/token) of (`weights`, `label`) minus (loaded, full)'s over the same windows (ending by
    `max_end` when given)."""
    run, base = run_of(found, label, weights), run_of(found, "full")
    if run is None or base is None:
        return None
    ref = {w["start"]: w["nll"] for w in base["windows"]}
    mine = [
        w for w in run["windows"] if w["start"] in ref and (max_end is None or w["start"] + w["tokens"] + 1 <= max_end)
    ]
    if not mine:
        return None
    return sum(w["nll"] - ref[w["start"]] for w in mine) / len(mine)


def window_deltas(found: dict, label: str) -> list[dict]:
    """Per window of the main text: {"start", "end", "delta"} (NLL vs full, nats/token)."""
    run, base = run_of(found, label), run_of(found, "full")
    if run is None or base is None:
        return []
    ref = {w["start"]: w["nll"] for w in base["windows"]}
    return [
        {"start": w["start"], "end": w["start"] + w["tokens"], "delta": w["nll"] - ref[w["start"]]}
        for w in run["windows"]
        if w["start"] in ref
    ]


def mean_kl(found: dict, label: str) -> float | None:
    kls = [w["kl"] for w in (run_of(found, label) or {}).get("windows", []) if "kl" in w]
    return sum(kls) / len(kls) if kls else None


def needle_deltas(found: dict, label: str, weights: str = "loaded", lengths=None) -> list[dict]:
    """Per prompt length: {"length", "delta" (mean answer log-prob minus (loaded, full)'s, nats), "found",
    "full_found", "asked"}."""
    run, base = run_of(found, label, weights), run_of(found, "full")
    if run is None or base is None:
        return []
    ref = {(n["length"], n["key"]): n for n in base["needles"]}
    out = {}
    for n in run["needles"]:
        r = ref.get((n["length"], n["key"]))
        if r is None or (lengths is not None and n["length"] not in lengths):
            continue
        d = out.setdefault(n["length"], {"deltas": [], "found": 0, "full_found": 0})
        d["deltas"].append(n["logprob"] - r["logprob"])
        d["found"] += n["found"]
        d["full_found"] += r["found"]
    return [
        {
            "length": length,
            "delta": sum(out[length]["deltas"]) / len(out[length]["deltas"]),
            "found": out[length]["found"],
            "full_found": out[length]["full_found"],
            "asked": len(out[length]["deltas"]),
        }
        for length in sorted(out)
    ]


def mean_needle_delta(found: dict, label: str, weights: str = "loaded", lengths=None) -> float | None:
    rows = needle_deltas(found, label, weights, lengths)
    return sum(r["delta"] for r in rows) / len(rows) if rows else None


# --- capacity --------------------------------------------------------------------------------------------


def capacity(found: dict, config: dict | None = None) -> dict:
    """Headroom of every measured precision for `config` (default: the findings' own), plus the weight x KV
    stacking sequences, plus the loaded model's live cache bytes beside the layout formula."""
    cfg = dict(found.get("config") or DEFAULT_CONFIG) | dict(config or {})
    labels = [lbl for lbl in found.get("precisions", []) if lbl in runs(found)] or ["full"]
    if "full" not in labels:
        labels = ["full", *labels]
    out = headroom(
        get_model_config(cfg["model_config"]), get_gpu(cfg["gpu"]), labels, int(cfg["context"]), gpus=int(cfg["gpus"])
    )
    plan = out.by_label()
    info = found.get("model_info", {})
    full_bits = 32 if info.get("dtype") == "float32" else 16
    live = []
    for label in labels:
        run = runs(found).get(label)
        if run is None or not info:
            continue
        regions = layout.Layout(parse_precision(label)).regions(run["updates"])
        formula = layout.region_bytes(regions, info["layers"], info["kv_heads"], info["head_dim"], label, full_bits)
        live.append(
            {
                "precision": label,
                "tokens": run["cache_tokens"],
                "bytes": run["cache_bytes"],
                "formula_bytes": formula["total"],
                "error_vs_formula": run["cache_bytes"] / formula["total"] - 1,
            }
        )
    return {
        "config": cfg,
        "multiplier": {lbl: plan[lbl].sequences_vs_16bit for lbl in labels},
        "sequences": {lbl: plan[lbl].max_sequences for lbl in labels},
        "sequences_16bit": out.max_sequences_16bit,
        "stacking": {p.label: p.stacking for p in out.precisions},
        "production": {p.label: p.production for p in out.precisions},
        "bits": {p.label: p.bits_per_element for p in out.precisions},
        "live": live,
        "warnings": out.warnings,
    }


def tradeoff(found: dict, budget: float | None = None, config: dict | None = None) -> dict:
    """Every measured precision as (capacity multiplier, NLL delta, needle delta), the Pareto front and
    the cheapest precision within `budget` (NLL delta, nats/token) that also passes the needle threshold."""
    th = found.get("thresholds", THRESHOLDS)
    budget = th["budget_nll_nats"] if budget is None else budget
    cap = capacity(found, config)
    points = []
    for label in found.get("precisions", []):
        if label not in runs(found):
            continue
        d = 0.0 if label == "full" else nll_delta(found, label)
        nd = 0.0 if label == "full" else mean_needle_delta(found, label)
        if d is None:
            continue
        points.append(
            {
                "precision": label,
                "multiplier": cap["multiplier"].get(label),
                "sequences": cap["sequences"].get(label),
                "nll_delta": d,
                "needle_delta": nd,
            }
        )
    for p in points:
        p["pareto"] = not any(
            q is not p
            and q["multiplier"] >= p["multiplier"]
            and q["nll_delta"] <= p["nll_delta"]
            and (q["multiplier"] > p["multiplier"] or q["nll_delta"] < p["nll_delta"])
            for q in points
        )
    ok = [
        p
        for p in points
        if p["nll_delta"] <= budget and (p["needle_delta"] is None or p["needle_delta"] >= -th["needle_ok_nats"])
    ]
    pick = max(ok, key=lambda p: (p["multiplier"] or 0, -p["nll_delta"])) if ok else None
    return {
        "budget": budget,
        "points": points,
        "pick": pick,
        "production": cap["production"].get(pick["precision"]) if pick else None,
        "config": cap["config"],
        "sequences_16bit": cap["sequences_16bit"],
    }
