"""A findings run: what it measures (`plan`: the texts, the units in order, the empty report) and the loop
that measures it (`run_plan`), reusing the disk cache and reporting by the progress protocol.

Units are (weights, precision, text): every precision on the main text with the weights as loaded, then
the weight x KV grid on the stack text (the main text's first `stack_tokens` tokens). Full precision runs
first: the others' KL is measured against its kept rows. Progress counts tokens of model work (a unit on
the main text is worth its length, one on the stack text less), so the time left is honest; a unit read
from the cache costs nothing.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..precision import parse_precision
from ..progress import ProgressFn, StopFn, Tracker
from ..results.findings import DEFAULT_CONFIG, THRESHOLDS, Findings, Sizes
from .measure import CODE_VERSION, cache_path, cached_states, load_cached, measure_spec, save_cached, weights_model
from .text import FindingsError, FindingsText, build_text, window_starts
from .verdicts import STACK_KV, claim_precisions, default_precisions, evaluate

WEIGHT_NOTE = (
    "The embedded SmolLM2-135M weights come from a Q4_1 GGUF (4-bit blocks of 32 with a scale and a minimum), "
    "dequantized to fp32 at load: 'as loaded' is already 4-bit-derived, and int8 / int4 re-quantize those values."
)

FULL = Sizes()
MEDIUM = Sizes(  # a quarter of the full context: what a busy 2-core machine measures in ~30 minutes
    tokens=2048,
    window=64,
    window_fractions=(0.05, 0.22, 0.5, 1.0),
    needle_lengths=(512, 1024, 2000),
    stack_tokens=1024,
    weights=("loaded", "int8"),
)
QUICK = Sizes(
    tokens=768, window=32, needle_lengths=(256, 768), kl_every=2, stack_tokens=384, weights=("loaded", "int8")
)
TINY = Sizes(  # tests: seconds per measurement
    tokens=320, window=32, window_fractions=(0.1, 1.0), needle_lengths=(256, 320), kl_every=2, weights=("loaded",)
)
SIZES = {"full": FULL, "medium": MEDIUM, "quick": QUICK, "tiny": TINY}


@dataclass(frozen=True)
class Unit:
    """One measurement of a run: a KV precision under a weight setting on the main or the stack text."""

    weights: str  # "loaded", "int8", "int4"
    precision: str  # label
    text: str  # "main" or "stack"


def units(precisions: Sequence[str], sizes: Sizes, claims: bool = True) -> list[Unit]:
    """The units in the order they run: full precision first (KL needs it), the claims' pairs next
    (`claims`), then the rest of `precisions`, then the weight x KV grid."""
    labels = [parse_precision(p).label for p in precisions]
    needed = [parse_precision(p).label for p in claim_precisions()] if claims else ["full"]
    first = ["full", "int8", "int4", "int2", "k8v4", "k4v8"]
    order = list(dict.fromkeys([p for p in first if p in labels or p in needed] + needed + labels))
    out = [Unit("loaded", p, "main") for p in order]
    for w in sizes.weights:
        if w != "loaded":
            out += [Unit(w, p, "stack") for p in STACK_KV if p in order]
    return out


def parse_shard(text: str) -> tuple[int, int]:
    """ "k/N" -> (k, N): this process measures every N-th unit from the k-th (0 <= k < N)."""
    try:
        k, n = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise FindingsError(f"--shard must look like 0/2, got {text!r}") from None
    if not 0 <= k < n:
        raise FindingsError(f"--shard {text}: need 0 <= k < N")
    return k, n


@dataclass
class FindingsPlan:
    """What a run measures: the report it fills (no measurement yet), its two texts, its units in order."""

    findings: Findings
    main: FindingsText
    stack: FindingsText
    units: list[Unit]

    def text_of(self, unit: Unit) -> FindingsText:
        return self.main if unit.text == "main" else self.stack


def planned_tokens(lm, sizes: Sizes, precisions: Sequence[str] | None = None, quick: bool = False) -> int:
    """Tokens of model work a run of `sizes` plans (each unit's text once), without building the texts: what
    the page's time hint counts (`kvdemo.rates`, task "findings"); units the disk cache holds cost less."""
    labels = [parse_precision(p).label for p in (precisions or default_precisions(quick))]  # as `plan` takes them
    tokens = min(sizes.tokens, lm.max_context)
    stack = min(sizes.stack_tokens, tokens)
    return sum(tokens if u.text == "main" else stack for u in units(["full", *labels], sizes))


def plan(
    lm,
    precisions: Sequence[str] | None = None,
    sizes: Sizes | None = None,
    config: dict | None = None,
    claims: bool = True,
    quick: bool = False,
) -> FindingsPlan:
    """Build the texts for `lm` and `sizes` (default: `QUICK` if `quick` else `FULL`) and list the units;
    `claims=False` measures `precisions` only (tests). Raises `FindingsError` for sizes the model cannot take."""
    sizes = sizes or (QUICK if quick else FULL)
    precisions = [parse_precision(p).label for p in (precisions or default_precisions(quick))]
    if "full" not in precisions:
        precisions = ["full", *precisions]
    tokens = min(sizes.tokens, lm.max_context)
    lengths = sorted({min(n, lm.max_context - 16, tokens) for n in sizes.needle_lengths})
    if tokens < 2 * sizes.window + 64:
        raise FindingsError(f"the text ({tokens} tokens) is too short for windows of {sizes.window}")
    todo = units(precisions, sizes, claims)
    windows = window_starts(tokens, sizes.window, sizes.window_fractions)
    main = build_text(lm, tokens, lengths, windows, sizes.seed)
    stack_tokens = min(sizes.stack_tokens, tokens)
    stack_lengths = [n for n in lengths if n <= stack_tokens] or [lengths[0]]
    stack_windows = [w for w in windows if w + sizes.window + 1 <= stack_tokens] or windows[:1]
    stack = build_text(lm, stack_tokens, stack_lengths, stack_windows, sizes.seed)
    found = Findings(
        model=lm.name,
        model_info=lm.info(),
        sizes=replace(sizes, tokens=len(main.ids), stack_tokens=len(stack.ids)),
        precisions=list(dict.fromkeys([*precisions, *(u.precision for u in todo if u.weights == "loaded")])),
        version=CODE_VERSION,
        created=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        embedded=lm.source == "embedded",
        weights_note=WEIGHT_NOTE if lm.source == "embedded" else "",
        quick=sizes == QUICK,
        sizes_name=next((n for n, v in SIZES.items() if v == sizes), "custom"),
        thresholds=dict(THRESHOLDS),
        config=dict(config or DEFAULT_CONFIG),
        text={
            "head_tokens": main.head,
            "needles": main.needles,
            "windows": main.windows,
            "prompts": [p.to_json() for p in main.prompts],
            "stack_windows": stack.windows,
            "stack_prompts": [p.to_json() for p in stack.prompts],
        },
    )
    return FindingsPlan(found, main, stack, todo)


def run_plan(
    lm,
    the_plan: FindingsPlan,
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
    use_cache: bool = True,
    shard: tuple[int, int] = (0, 1),
    reverse: bool = False,
    cached_only: bool = False,
) -> Findings:
    """Measure `the_plan` on `lm`: the report with every measurement and the claims judged.

    `on_progress` gets a `Progress` in tokens of model work, with the finished `Measurement` as its row;
    `should_stop()` is polled between checkpoints and raises `Cancelled` carrying the finished measurements.
    `shard=(k, N)` measures every N-th unit (parallel processes sharing the cache; the others wait for
    shard 0's exact states and full-precision runs); `reverse` takes a shard's units from its last (a
    second process per shard meets the first halfway); `cached_only` collects what the cache holds and
    measures nothing (a report from shards' results).
    """
    sizes = the_plan.findings.sizes
    found = replace(the_plan.findings, measurements={}, claims=[])
    todo = the_plan.units
    k, n_shards = shard
    size_key = {"window": sizes.window, "kl_every": sizes.kl_every}
    paths = [cache_path(lm.name, u.weights, u.precision, the_plan.text_of(u), size_key) for u in todo]
    is_full = [not parse_precision(u.precision).is_quantized for u in todo]
    mine = [i % n_shards == k or (is_full[i] and k == 0) for i in range(len(todo))]
    work = [  # tokens each unit will cost: 0 when the cache holds it or another process measures it
        0 if (use_cache and paths[i].is_file()) or not mine[i] or cached_only else len(the_plan.text_of(u).ids)
        for i, u in enumerate(todo)
    ]
    track = Tracker(sum(work), "tokens", on_progress, should_stop)
    states_for: dict[tuple[str, str], object] = {}
    reference: dict[str, dict] = {}
    order = sorted(range(len(todo)), key=lambda i: (todo[i] != Unit("loaded", "full", "main"), -i if reverse else i))
    for i in order:
        u, path = todo[i], paths[i]
        text = the_plan.text_of(u)
        if not mine[i] and not is_full[i]:
            continue
        track.check("the findings run")
        wait = 4 * 3600.0 if k != 0 and u.text == "main" else 0.0  # shard 0 makes the main text's states and full run
        hit = load_cached(path, need_rows=is_full[i]) if use_cache else None
        if hit is None and is_full[i] and wait and not cached_only:  # the KL reference comes from shard 0
            deadline = time.monotonic() + wait
            while hit is None and time.monotonic() < deadline:
                time.sleep(5)
                hit = load_cached(path, need_rows=True)
        if hit is None and (not mine[i] or cached_only):
            continue
        ref_key = f"{u.weights}:{u.text}"
        what = f"weights {u.weights}, " if u.weights != "loaded" else ""
        if hit is None:
            track.report(f"measuring {u.precision} ({what}{len(text.ids):,} tokens)")
            model = weights_model(lm, u.weights)
            key = (u.weights, u.text)
            if key not in states_for:
                states_for.clear()
                states_for[key] = cached_states(model, u.weights, text, use_cache, wait)
            m, rows = measure_spec(
                model,
                text,
                states_for[key],
                u.precision,
                sizes.window,
                sizes.kl_every,
                reference.get(ref_key),
                u.weights,
                check=lambda: track.check("the findings run"),
            )
            if use_cache:
                save_cached(path, m, rows)
            done = f"{u.precision} measured in {m.seconds:.0f} s" + (f" (weights {u.weights})" if what else "")
        else:
            m, rows = hit
            m.weights = u.weights
            done = f"{u.precision} from the cache"
        if rows is not None:
            reference[ref_key] = rows
        found.add(m)
        found.seconds = round(time.perf_counter() - track.started, 1)
        count = sum(len(runs) for runs in found.measurements.values())
        track.advance(f"{done}, {count} of {len(todo)} measurements", units=work[i], row=m)
    found.stopped = "done"
    found.seconds = round(time.perf_counter() - track.started, 1)
    found.claims = evaluate(found)
    return found


def run_findings(
    lm,
    precisions: Sequence[str] | None = None,
    quick: bool = False,
    sizes: Sizes | None = None,
    config: dict | None = None,
    claims: bool = True,
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
    use_cache: bool = True,
    shard: tuple[int, int] = (0, 1),
    reverse: bool = False,
    cached_only: bool = False,
) -> Findings:
    """`plan` and `run_plan` in one call: every claim measured on `lm`."""
    the_plan = plan(lm, precisions, sizes, config, claims, quick)
    return run_plan(lm, the_plan, on_progress, should_stop, use_cache, shard, reverse, cached_only)
