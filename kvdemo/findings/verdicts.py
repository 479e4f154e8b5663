"""The claims about KV-cache quantization and their verdicts, computed from a `Findings` report's numbers.

Each claim (`CLAIMS`) is a section of the report: the claim, its verdict on this model, a figure and how
it was measured. A `verdict_*` function reads the numbers (`kvdemo.results.findings`) against the report's
thresholds (`THRESHOLDS` when it was made): nothing is written by hand, and a claim that does not hold on
a model says so. Each returns (the `Verdict`, the numbers it read: what the claim's figures draw).

References: KIVI (arXiv 2402.02750; per-channel keys, residual window), KVQuant (arXiv 2401.18079;
per-channel pre-RoPE keys, sinks), StreamingLLM (arXiv 2309.17453; attention sinks), llama.cpp's
K/V perplexity tables (keys more sensitive), vLLM's "Maximum concurrency" (capacity).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..precision import PRESETS
from ..results.findings import (
    Claim,
    Findings,
    Verdict,
    capacity,
    jsonable,
    mean_kl,
    mean_needle_delta,
    needle_deltas,
    nll_delta,
    tradeoff,
    window_deltas,
)

KEY_VALUE = ("k4v8", "k8v4", "k8v2")  # 4-bit keys, 4-bit values, 2-bit values
AXIS = {4: ("int4", "int4:ktoken"), 2: ("int2", "int2:ktoken")}  # per channel vs per token keys
SINKS = ("int2", "int2:s4")
RESIDUAL = ("int2:g32:r32", "int2:g32")  # residual 32 vs 128 tokens (group 32 allows a 32-token window)
STACK_KV = ("full", "int8", "int4", "int2")  # the KV side of the weight x KV grid


def default_precisions(quick: bool = False) -> list[str]:
    """Every preset the build has (new formats appear here by themselves), then the claims' variants."""
    names = list(PRESETS)
    for extra in ("int4:ktoken", "int2:ktoken", "int2:s4", *RESIDUAL):
        if extra not in names:
            names.append(extra)
    return names


def claim_precisions() -> list[str]:
    """The precisions claims 3-6 need whatever the user asks for."""
    return list(dict.fromkeys(["full", *KEY_VALUE, *AXIS[4], *AXIS[2], *SINKS, *RESIDUAL, *STACK_KV]))


def _fmt(x: float | None, digits: int = 3, signed: bool = True) -> str:
    if x is None:
        return "n/a"
    return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"


def verdict_capacity(found: Findings, config: dict | None = None) -> tuple[Verdict, dict]:
    th = found.thresholds
    cap = capacity(found, config)
    mult = {k: v for k, v in cap["multiplier"].items() if k != "full" and v is not None}
    if not mult:
        return Verdict(None, "no quantized precision was measured"), {"capacity": cap}
    worst_live = max((abs(r["error_vs_formula"]) for r in cap["live"]), default=None)
    best = max(mult, key=mult.get)
    holds = min(mult.values()) > 1.0 and (worst_live is None or worst_live <= th["capacity_formula_tolerance"])
    c = cap["config"]
    text = (
        f"{c['model_config']} on {c['gpus']} x {c['gpu']} at {int(c['context']):,} tokens: {cap['sequences_16bit']} "
        f"sequences at 16 bits; {best} fits {mult[best]:.2f}x as many ({cap['sequences'][best]})"
        + ("" if "int4" not in mult or best == "int4" else f", int4 {mult['int4']:.2f}x")
        + (
            f"; live cache of the loaded model within {100 * worst_live:.2f}% of the formula"
            if worst_live is not None
            else ""
        )
    )
    return Verdict(holds, text), {"capacity": cap}


def verdict_long_range(found: Findings) -> tuple[Verdict, dict]:
    th = found.thresholds
    short = th["short_tokens"]
    rows = []
    for label in found.precisions:
        if label == "full" or label not in found.runs():
            continue
        w = window_deltas(found, label)
        n = needle_deltas(found, label)
        if not w and not n:
            continue
        short_w = [x["delta"] for x in w if x["end"] <= short] or ([w[0]["delta"]] if w else [])
        long_w = w[-1]["delta"] if w else None
        short_n = n[0]["delta"] if n else None
        long_n = n[-1]["delta"] if n else None
        s_nll = sum(short_w) / len(short_w) if short_w else None
        short_pass = (s_nll is None or s_nll <= th["nll_ok_nats"]) and (
            short_n is None or short_n >= -th["needle_ok_nats"]
        )
        long_fail = (long_w is not None and long_w > th["nll_ok_nats"]) or (
            long_n is not None and long_n < -th["needle_ok_nats"]
        )
        # the claim is that loss grows with length: a measure that gets better with length (beyond its noise)
        # contradicts it, whatever the other measure does
        improves = [
            name
            for name, short_x, long_x, noise in (
                ("NLL", s_nll, long_w, th["noise_nll_nats"]),
                ("needle log p", None if short_n is None else -short_n, None if long_n is None else -long_n,
                 th["noise_needle_nats"]),
            )
            if short_x is not None and long_x is not None and long_x < short_x - noise
        ]  # fmt: skip
        rows.append(
            {
                "precision": label,
                "short_nll_delta": s_nll,
                "long_nll_delta": long_w,
                "short_needle_delta": short_n,
                "long_needle_delta": long_n,
                "short_length": n[0]["length"] if n else None,
                "long_length": n[-1]["length"] if n else None,
                "short_pass": short_pass,
                "long_fail": long_fail,
                "improves_with_length": improves,
                "holds": short_pass and long_fail and not improves,
            }
        )
    if not rows:
        return Verdict(None, "no quantized precision was measured"), {"rows": []}
    holding = [r for r in rows if r["holds"]]
    fine = [r["precision"] for r in rows if r["short_pass"] and not r["long_fail"]]
    mixed = [r for r in rows if r["short_pass"] and r["long_fail"] and r["improves_with_length"]]
    broken = [r["precision"] for r in rows if not r["short_pass"]]
    parts = []
    for r in holding:
        parts.append(
            f"{r['precision']}: NLL {_fmt(r['short_nll_delta'])} at <= {short} tokens vs {_fmt(r['long_nll_delta'])} at the end, "
            f"needle log p {_fmt(r['short_needle_delta'], 2)} at {r['short_length']} vs {_fmt(r['long_needle_delta'], 2)} at {r['long_length']}"
        )
    text = (
        ("a short eval passes while long recall degrades for " + "; ".join(parts))
        if holding
        else "no precision passes the short eval and then degrades at length"
    )
    if mixed:
        text += ". Mixed, so not counted: " + "; ".join(
            f"{r['precision']} (worse at the end by one measure, but {' and '.join(r['improves_with_length'])} "
            f"improves with length: NLL {_fmt(r['short_nll_delta'])} -> {_fmt(r['long_nll_delta'])}, needle log p "
            f"{_fmt(r['short_needle_delta'], 2)} -> {_fmt(r['long_needle_delta'], 2)})"
            for r in mixed
        )
    if fine:
        text += f". Pass at both ends: {', '.join(fine)}"
    if broken:
        text += f". Fail already when short: {', '.join(broken)}"
    return Verdict(bool(holding), text), {"rows": rows}


def _losses(found: Findings, label: str) -> dict:
    nd = mean_needle_delta(found, label)
    return {"kl": mean_kl(found, label), "nll": nll_delta(found, label), "needle": None if nd is None else -nd}


def verdict_keys(found: Findings) -> tuple[Verdict, dict]:
    th = found.thresholds
    noise = {"kl": th["noise_kl_nats"], "nll": th["noise_nll_nats"], "needle": th["noise_needle_nats"]}
    k4v8, k8v4, k8v2 = (_losses(found, p) for p in KEY_VALUE)
    measures = [m for m in noise if k4v8[m] is not None and k8v4[m] is not None]
    if not measures:
        return Verdict(None, "k4v8 and k8v4 were not both measured"), {"losses": {}}
    keys_worse = [m for m in measures if k4v8[m] - k8v4[m] > noise[m]]
    holds = len(keys_worse) >= min(th["key_value_measures_needed"], len(measures))
    names = {"kl": "logit KL", "nll": "NLL delta", "needle": "needle log p loss"}
    text = "4-bit keys (k4v8) vs 4-bit values (k8v4): " + ", ".join(
        f"{names[m]} {_fmt(k4v8[m], 4, False)} vs {_fmt(k8v4[m], 4, False)}" for m in measures
    )
    text += f"; keys are the sensitive half on {len(keys_worse)} of {len(measures)} measures"
    two = [m for m in measures if k8v2[m] is not None]
    if two:
        better = [m for m in two if k8v2[m] < k4v8[m]]
        text += f"; even 2-bit values (k8v2) lose less than 4-bit keys on {len(better)} of {len(two)}"
    return Verdict(holds, text), {"losses": {"k4v8": k4v8, "k8v4": k8v4, "k8v2": k8v2}}


def verdict_axis(found: Findings) -> tuple[Verdict, dict]:
    th = found.thresholds
    rows, parts = [], []
    for bits, (chan, tokn) in AXIS.items():
        a, b = nll_delta(found, chan), nll_delta(found, tokn)
        ka, kb = mean_kl(found, chan), mean_kl(found, tokn)
        if a is None or b is None:
            continue
        wins = b - a > th["noise_nll_nats"] or (
            ka is not None and kb is not None and kb - ka > th["noise_kl_nats"] and b >= a
        )
        rows.append(
            {
                "bits": bits,
                "channel": chan,
                "token": tokn,
                "nll_channel": a,
                "nll_token": b,
                "kl_channel": ka,
                "kl_token": kb,
                "channel_wins": wins,
            }
        )
        parts.append(
            f"{bits}-bit: NLL delta {_fmt(a, 4)} per channel vs {_fmt(b, 4)} per token, KL {_fmt(ka, 4, False)} vs {_fmt(kb, 4, False)}"
        )
    if not rows:
        return Verdict(None, "per-channel and per-token keys were not both measured"), {"rows": []}
    holds = all(r["channel_wins"] for r in rows)
    return Verdict(holds, "; ".join(parts)), {"rows": rows}


def verdict_sinks(found: Findings) -> tuple[Verdict, dict]:
    th = found.thresholds
    rows = []
    for what, (without, with_) in (("4 sink tokens", SINKS), ("residual 128 vs 32", RESIDUAL)):
        a, b = nll_delta(found, without), nll_delta(found, with_)
        if a is None or b is None:
            continue
        cut = a - b
        matters = cut > th["noise_nll_nats"] and (a <= 0 or cut / a >= th["matters_fraction"])
        rows.append(
            {
                "what": what,
                "without": without,
                "with": with_,
                "nll_without": a,
                "nll_with": b,
                "cut": cut,
                "matters": matters,
            }
        )
    if not rows:
        return Verdict(None, "the sink / residual variants were not measured"), {"rows": []}
    text = "; ".join(
        f"{r['what']}: NLL delta {_fmt(r['nll_without'], 4)} ({r['without']}) -> {_fmt(r['nll_with'], 4)} ({r['with']})"
        + (" matters" if r["matters"] else " within noise / below the threshold")
        for r in rows
    )
    return Verdict(all(r["matters"] for r in rows), text), {"rows": rows}


WEIGHT_BITS = {"loaded": 16, "int8": 8, "int4": 4}  # the weights' bits the capacity of a grid cell assumes


def stacking_grid(found: Findings) -> list[dict]:
    """Weights x KV cells on the stack text: NLL delta and needle log p delta vs (loaded, full), and the
    sequences per GPU of that combination for the findings' config."""
    try:
        stacking = capacity(found)["stacking"]
    except (ValueError, KeyError):
        stacking = {}
    end = found.sizes.stack_tokens
    lengths = {p["length"] for p in found.text.get("stack_prompts", [])} or None
    rows = []
    for w in found.sizes.weights:
        for kv in STACK_KV:
            rows.append(
                {
                    "weights": w,
                    "kv": kv,
                    "nll_delta": nll_delta(found, kv, w, max_end=end),
                    "needle_delta": mean_needle_delta(found, kv, w, lengths),
                    "sequences": stacking.get(kv, {}).get(str(WEIGHT_BITS[w])),
                    "weight_bits": WEIGHT_BITS[w],
                }
            )
    return rows


def verdict_stacking(found: Findings) -> tuple[Verdict, dict]:
    th = found.thresholds
    grid = stacking_grid(found)
    cell = {(r["weights"], r["kv"]): r["nll_delta"] for r in grid}
    ratios = []
    for r in grid:
        if r["weights"] == "loaded" or r["kv"] == "full" or r["nll_delta"] is None:
            continue
        w, kv = cell.get((r["weights"], "full")), cell.get(("loaded", r["kv"]))
        if w is None or kv is None or w + kv < th["stack_min_loss_nats"]:
            continue
        ratios.append(
            {
                "weights": r["weights"],
                "kv": r["kv"],
                "combined": r["nll_delta"],
                "sum": w + kv,
                "ratio": r["nll_delta"] / (w + kv),
            }
        )
    measured = sum(r["nll_delta"] is not None for r in grid if r["weights"] != "loaded")
    if not ratios:
        text = f"{measured} weight-quantized cells measured; none with a loss above the noise to judge"
        return Verdict(None, text), {"grid": grid, "ratios": []}
    lo, hi = th["stack_ratio_range"]
    inside = [r for r in ratios if lo <= r["ratio"] <= hi]
    worst = max(ratios, key=lambda r: r["combined"])
    text = (
        f"combined loss / (weights alone + KV alone) within [{lo}, {hi}] in {len(inside)} of {len(ratios)} cells; "
        f"worst cell weights {worst['weights']} x KV {worst['kv']}: NLL delta {_fmt(worst['combined'], 4)} "
        f"vs {_fmt(worst['sum'], 4)} summed"
    )
    return Verdict(len(inside) * 2 > len(ratios), text), {"grid": grid, "ratios": ratios}


def verdict_tradeoff(found: Findings, budget: float | None = None, config: dict | None = None) -> tuple[Verdict, dict]:
    t = tradeoff(found, budget, config)
    if not t["points"]:
        return Verdict(None, "no precision measured"), {"tradeoff": t}
    pick = t["pick"]
    front = [p["precision"] for p in sorted(t["points"], key=lambda p: p["multiplier"] or 0) if p["pareto"]]
    if pick is None:
        text = f"no precision stays within {t['budget']:g} nats/token"
    else:
        text = (
            f"within {t['budget']:g} nats/token the cheapest is {pick['precision']}: {pick['multiplier']:.2f}x the sequences "
            f"of 16-bit ({pick['sequences']} on {t['config']['gpu']}), NLL delta {_fmt(pick['nll_delta'], 4)}"
        )
    text += f"; Pareto front: {', '.join(front)}"
    return Verdict(pick is not None and pick["precision"] != "full", text), {"tradeoff": t}


@dataclass(frozen=True)
class ClaimSpec:
    """A claim as the report states it, and the function that judges it."""

    id: str
    title: str
    claim: str
    method: str
    page: str  # the app page that explores it
    judge: Callable[..., tuple[Verdict, dict]]


CLAIMS = [
    ClaimSpec(
        "capacity",
        "1. Capacity",
        "A quantized KV cache multiplies the sequences a GPU serves at once, close to the bits ratio.",
        "kvdemo.memory.headroom for the chosen model config, GPU(s) and context (16-bit weights, 10% reserve); "
        "beside it the live cache bytes of the loaded model after storing the whole text, against the layout formula.",
        "app_pages/memory.py",
        verdict_capacity,
    ),
    ClaimSpec(
        "long_range",
        "2. Long-range recall breaks before short chat",
        "A 500-token eval passes while long recall degrades: quality loss grows with context length.",
        "(a) NLL delta vs full precision in windows at growing positions of held-out prose, each scored "
        "token attending over the stored quantized past; (b) needle answer log-prob delta vs prompt length "
        "(needles near the start, asked after the whole prompt).",
        "app_pages/needle.py",
        verdict_long_range,
    ),
    ClaimSpec(
        "keys",
        "3. Keys are more sensitive than values",
        "4-bit keys cost more than 4-bit values (k4v8 worse than k8v4), end to end.",
        "k4v8 vs k8v4 (and k8v2) on logit KL vs full, NLL delta and needle answer log-prob loss, "
        "averaged over every window and prompt length.",
        "app_pages/drift.py",
        verdict_keys,
    ),
    ClaimSpec(
        "axis",
        "4. Per-channel keys beat per-token keys",
        "Keys quantized per channel (KIVI / KVQuant) lose less than keys quantized per token, at 4 and 2 bits.",
        "int4 vs int4:ktoken and int2 vs int2:ktoken (per-token groups of 64 channels: slightly more "
        "metadata), NLL delta and logit KL.",
        "app_pages/drift.py",
        verdict_axis,
    ),
    ClaimSpec(
        "sinks",
        "5. Sinks and the residual window matter at low bits",
        "At 2 bits, keeping 4 sink tokens and a 128-token residual window in full precision cuts the loss.",
        "int2 vs int2:s4 (sinks) and int2:g32:r32 vs int2:g32 (residual 32 vs 128 tokens; the smallest "
        "window is one group), NLL delta.",
        "app_pages/drift.py",
        verdict_sinks,
    ),
    ClaimSpec(
        "stacking",
        "6. Stacking weight and KV quantization",
        "The losses of weight quantization and KV quantization add up when both are applied.",
        "weights as loaded, int8 and int4 (optimum-quanto, dequantized) x KV full/int8/int4/int2 on the "
        "first part of the text: NLL delta and needle log-prob vs (as loaded, full); sequences per GPU beside.",
        "app_pages/memory.py",
        verdict_stacking,
    ),
    ClaimSpec(
        "tradeoff",
        "7. The trade-off and a recommendation",
        "Some quantized precision buys capacity within a small quality budget.",
        "every measured precision as (capacity multiplier for the chosen config, mean NLL delta); the "
        "Pareto front; the cheapest precision within the budget that also keeps the needle loss under the threshold.",
        "app_pages/memory.py",
        verdict_tradeoff,
    ),
]


def evaluate(found: Findings, config: dict | None = None, budget: float | None = None) -> list[Claim]:
    """Every claim judged on `found`: capacity for `config` (default: the report's), the trade-off within
    `budget` (default: the report's threshold)."""
    out = []
    for c in CLAIMS:
        if c.id == "capacity":
            verdict, data = c.judge(found, config)
        elif c.id == "tradeoff":
            verdict, data = c.judge(found, budget, config)
        else:
            verdict, data = c.judge(found)
        out.append(Claim(c.id, c.title, c.claim, c.method, c.page, verdict, jsonable(data)))
    return out


def judged(found: Findings, config: dict | None = None, budget: float | None = None) -> Findings:
    """`found` with its claims judged for `config` and `budget` (what the page and the files show)."""
    return replace(found, claims=evaluate(found, config, budget))


CAPTION = (
    "{model}: {n} precisions measured on {tokens:,} tokens of held-out prose. A {size} model with a "
    "{ctx:,}-token context is a weak retriever: every number is a difference from its own full precision, on the "
    "same tokens; what fails at full precision says nothing about quantization."
)


def caption(found: Findings) -> str:
    return CAPTION.format(
        model=found.model or "?",
        n=len(found.runs()),
        tokens=found.sizes.tokens,
        size="135M" if found.embedded else "loaded",
        ctx=found.model_info.get("max_context", 0),
    )
