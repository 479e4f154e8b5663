"""The benchmark against transformers' QuantizedCache (`kvdemo.contest`), as data: the sizes it ran at, one row
per contender, the goals judged on them, keys against values, scheme against implementation, and the markdown
table docs/benchmark.md carries (bench.md). Also the decode-speed run (`kvdemo.contest.decode.decode_speed`)
the methods ablation records.

Per-length and per-context figures are keyed by the length as a string ("4096"), as the JSON holds them. A row
says which engine ran it and which row it is read against (`ContenderResult.engine`, `.baseline`): llama.cpp's
rows against llama.cpp's f16 row, every other row against ``full``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

KEY_VS_VALUE = ("kvdemo-k4v8", "kvdemo-k8v4")  # 4-bit keys (8-bit values) vs 4-bit values (8-bit keys)
SAME_SCHEME = ("kvdemo-int4:ktoken:g64", "hf-quanto-int4")  # one scheme, two implementations
SAME_BITS = (  # (kvdemo, transformers) pairs compared for the memory goal
    ("kvdemo-int4", "hf-quanto-int4"),
    ("kvdemo-int4", "hf-hqq-int4"),
    ("kvdemo-int2", "hf-quanto-int2"),
    ("kvdemo-int2", "hf-hqq-int2"),
    ("kvdemo-fp8", "hf-fp8"),
)
REPORT_FILES = ("bench.json", "bench.md", "bench.html")


class BenchError(ValueError):
    """A benchmark that cannot run as asked (sizes beyond the model's context, unknown contender)."""


@dataclass(frozen=True)
class BenchSizes:
    """How much the benchmark measures. (`chunk` must also fit kvdemo's decode path: the run checks it.)"""

    contexts: tuple[int, ...] = (1024, 4096)  # prefill / cache bytes / decode context lengths
    ppl_prefix: int = 1024  # exactly prefilled tokens before scoring starts
    ppl_lengths: tuple[int, ...] = (2048, 4096)  # ppl[N]: tokens at positions [N/2, N)
    chunk: int = 16  # tokens per scoring forward (kvdemo.attention.DECODE_MAX_QUERIES: its decode path)
    residual: int = 128  # full-precision residual window of every quantized contender (transformers' default)
    new_tokens: int = 128  # timed decode steps per round: a multiple of `residual`, so each round holds flushes
    warmup_steps: int = 2  # untimed decode steps before the first timed round
    rounds: int = 2  # decode rounds, interleaved across contenders; medians count
    kl_every: int = 4  # logit KL vs full on every kl_every-th scored position of the held-out text
    needle_lengths: tuple[int, ...] = (1024, 4096)
    needle_depths: tuple[int, ...] = (10, 50, 90)  # percent of the haystack
    warmup_tokens: int = 160  # prompt of the set-up probe (more than one residual window)
    seed: int = 0

    def __post_init__(self):
        if self.ppl_prefix <= 0 or any(n // 2 < self.ppl_prefix for n in self.ppl_lengths):
            raise BenchError(f"every ppl length must be at least 2 x ppl_prefix ({self.ppl_prefix})")
        if min(self.new_tokens, self.rounds, self.kl_every) < 1 or self.warmup_steps < 0:
            raise BenchError("new_tokens, rounds and kl_every must be >= 1, warmup_steps >= 0")
        if self.residual < 64 or self.residual % 64:
            raise BenchError(
                f"residual must be a multiple of 64 (the ktoken:g64 contender's group), got {self.residual}"
            )
        if self.new_tokens % self.residual:
            raise BenchError(
                f"new_tokens ({self.new_tokens}) must be a multiple of residual ({self.residual}): "
                "every timed round then holds the same number of flushes"
            )
        if any(not 0 <= d <= 100 for d in self.needle_depths):
            raise BenchError("needle depths are percentages: 0..100")

    def longest(self) -> int:
        """Most positions any measurement puts in one cache."""
        decode = max(self.contexts) + self.warmup_steps + self.rounds * self.new_tokens
        needle = max(self.needle_lengths) + 32  # the answer after the prompt
        return max(decode, needle, max(self.ppl_lengths))

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, d: dict) -> BenchSizes:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


FULL = BenchSizes()
QUICK = BenchSizes(  # a residual of 64 (kvdemo int4 then uses g64) so one short round crosses a flush
    contexts=(256, 512),
    ppl_prefix=128,
    ppl_lengths=(256, 512),
    residual=64,
    new_tokens=64,
    warmup_steps=1,
    rounds=1,
    needle_lengths=(512,),
    needle_depths=(50,),
    warmup_tokens=144,
)
ONE_K = BenchSizes(  # 1k context, perplexity at 2k, 3 needle cells: what a busy shared 2-core machine finishes
    contexts=(1024,),
    ppl_prefix=1024,
    ppl_lengths=(2048,),
    needle_lengths=(1024,),
)
SIZES = {"full": FULL, "1k": ONE_K, "quick": QUICK}


# --- one contender's row -------------------------------------------------------------------------------


@dataclass
class NeedleCell:
    """One needle cell through one contender's cache: the answer's teacher-forced log-probability."""

    length: int
    depth: float  # percent asked
    depth_actual: float  # percent where the needle landed
    logprob: float  # summed over the answer's tokens (nats)
    found: bool  # greedy decoding would produce the answer

    def to_json(self) -> dict:
        return dict(vars(self))

    @classmethod
    def from_json(cls, d: dict) -> NeedleCell:
        return cls(**d)


@dataclass
class NeedleSummary:
    cells: list[NeedleCell]
    mean_logprob: float | None
    found: int
    total: int

    @classmethod
    def of(cls, cells: list[NeedleCell]) -> NeedleSummary:
        if not cells:
            return cls([], None, 0, 0)
        mean = sum(c.logprob for c in cells) / len(cells)
        return cls(list(cells), round(mean, 4), sum(c.found for c in cells), len(cells))

    def to_json(self) -> dict:
        cells = [c.to_json() for c in self.cells]
        return {"cells": cells, "mean_logprob": self.mean_logprob, "found": self.found, "total": self.total}

    @classmethod
    def from_json(cls, d: dict) -> NeedleSummary:
        return cls(**(d | {"cells": [NeedleCell.from_json(c) for c in d["cells"]]}))


@dataclass
class DecodeWindow:
    """Flushes and step times of a contender's timed decode window at one context."""

    steps: int
    flushes: int
    flushes_per_round: list[int]
    median_step_ms: float  # of the steps that did not flush
    mean_flush_step_ms: float | None  # None: the cache never flushed
    seconds: float

    def to_json(self) -> dict:
        return dict(vars(self))

    @classmethod
    def from_json(cls, d: dict) -> DecodeWindow:
        return cls(**d)


@dataclass
class ContenderResult:
    """Everything measured of one contender; per-context and per-length maps keyed by the length as a string."""

    contender: str  # "full" | "kvdemo-int4" | "hf-quanto-int4" | ...
    family: str  # "kvdemo" | "transformers"
    backend: str  # "dynamic" | "kvdemo" | "quanto" | "hqq" | "fp8"
    bits: int | None  # nominal code bits; None: the model's dtype
    attention: str  # "kvdemo" | "sdpa"
    settings: dict  # the cache's settings (a kvdemo PrecisionSpec's, or transformers' options)
    cache_bytes: dict[str, int]  # context -> live bytes after the prefill
    cache_bytes_allocated: dict[str, int]
    ratio_vs_fp16: dict[str, float]
    ratio_allocated_vs_fp16: dict[str, float]
    bits_per_element: dict[str, float]
    ppl: dict[str, float]  # length N -> perplexity of positions [N/2, N)
    ppl_delta: dict[str, float]  # vs full
    ppl_delta_pct: dict[str, float]
    logit_kl: dict[str, float]
    needle: NeedleSummary
    needle_logprob_delta: float | None  # mean log-prob vs full's
    decode_tok_s: dict[str, float]  # context -> median round
    decode_tok_s_rounds: dict[str, list[float]]
    decode_speed_vs_full: dict[str, float]  # median of per-round ratios
    decode_window: dict[str, DecodeWindow]
    prefill_s: dict[str, float]
    setup_s: float  # first call minus an identical second one
    first_call_s: float
    # written only when not the default, so reports from before llama.cpp rows existed read back unchanged
    engine: str = "transformers"  # what runs the model: "transformers" (PyTorch) | "llama.cpp"
    baseline: str = "full"  # the row the deltas, KL and speed ratios are against: its own engine's full row
    load_s: float | None = None  # llama.cpp: seconds to load the GGUF into a context of this cache (warm call)

    def to_json(self) -> dict:
        d = dict(vars(self))
        d["needle"] = self.needle.to_json()
        d["decode_window"] = {k: w.to_json() for k, w in self.decode_window.items()}
        for name, default in _ROW_DEFAULTS.items():
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_json(cls, d: dict) -> ContenderResult:
        windows = {k: DecodeWindow.from_json(w) for k, w in d["decode_window"].items()}
        return cls(**(d | {"needle": NeedleSummary.from_json(d["needle"]), "decode_window": windows}))


_ROW_DEFAULTS = {"engine": "transformers", "baseline": "full", "load_s": None}


@dataclass
class Goal:
    goal: str
    met: bool | None  # None: a contender it needs did not run
    measured: dict  # the figures it was judged on

    def to_json(self) -> dict:
        return {"goal": self.goal, "met": self.met, "measured": self.measured}

    @classmethod
    def from_json(cls, d: dict) -> Goal:
        return cls(**d)


@dataclass
class KeyValueMeasure:
    keys_4bit: float
    values_4bit: float
    ratio: float | None  # keys' damage over values' (None: signs differ or values' is zero)

    def to_json(self) -> dict:
        return {"keys_4bit": self.keys_4bit, "values_4bit": self.values_4bit, "ratio": self.ratio}


@dataclass
class KeyVsValue:
    """4-bit keys (k4v8) against 4-bit values (k8v4), end to end: each damage measure of both and their ratio."""

    contenders: dict[str, str]  # {"keys_4bit": name, "values_4bit": name}
    measures: dict[str, KeyValueMeasure]  # "ppl_delta@4096", "logit_kl@4096", "needle_logprob_loss"

    def to_json(self) -> dict:
        return {"contenders": dict(self.contenders), "measures": {k: m.to_json() for k, m in self.measures.items()}}

    @classmethod
    def from_json(cls, d: dict) -> KeyVsValue:
        return cls(d["contenders"], {k: KeyValueMeasure(**m) for k, m in d["measures"].items()})


@dataclass
class Skipped:
    contender: str
    reason: str

    def to_json(self) -> dict:
        return {"contender": self.contender, "reason": self.reason}


@dataclass
class BenchReport:
    """`run_bench`'s report (bench.json)."""

    machine: dict  # kvdemo.machine.machine_info, with load_avg_end and notes
    model: str
    quick: bool
    sizes_name: str  # "full" | "1k" | "quick" | "custom"
    sizes: BenchSizes
    method: dict[str, str]  # how each number was measured, in words
    results: list[ContenderResult]
    skipped: list[Skipped]
    wall_s: float
    goals: list[Goal] = field(default_factory=list)
    key_vs_value: KeyVsValue | None = None
    scheme_vs_implementation: dict | None = None  # see `scheme_vs_implementation`
    engine: dict | None = None  # llama.cpp rows' binding, file and protocol (kvdemo.llamacpp.engine_note)
    files: dict[str, str] | None = None  # {"json", "md", "html"}: where the CLI wrote the report

    def rows(self) -> dict[str, ContenderResult]:
        return {r.contender: r for r in self.results}

    def to_json(self) -> dict:
        d = {
            "machine": dict(self.machine),
            "model": self.model,
            "quick": self.quick,
            "sizes_name": self.sizes_name,
            "sizes": self.sizes.to_json(),
            "method": dict(self.method),
            "results": [r.to_json() for r in self.results],
            "skipped": [s.to_json() for s in self.skipped],
            "wall_s": self.wall_s,
            "goals": [g.to_json() for g in self.goals],
            "key_vs_value": None if self.key_vs_value is None else self.key_vs_value.to_json(),
            "scheme_vs_implementation": self.scheme_vs_implementation,
        }
        if self.engine is not None:
            d["engine"] = dict(self.engine)
        if self.files is not None:
            d["files"] = dict(self.files)
        return d

    @classmethod
    def from_json(cls, d: dict) -> BenchReport:
        return cls(
            machine=d["machine"],
            model=d["model"],
            quick=d["quick"],
            sizes_name=d["sizes_name"],
            sizes=BenchSizes.from_json(d["sizes"]),
            method=d["method"],
            results=[ContenderResult.from_json(r) for r in d["results"]],
            skipped=[Skipped(**s) for s in d["skipped"]],
            wall_s=d["wall_s"],
            goals=[Goal.from_json(g) for g in d["goals"]],
            key_vs_value=None if d.get("key_vs_value") is None else KeyVsValue.from_json(d["key_vs_value"]),
            scheme_vs_implementation=d.get("scheme_vs_implementation"),
            engine=d.get("engine"),
            files=d.get("files"),
        )

    def judge(self) -> None:
        """Fill in what follows from the rows: the goals, keys against values, scheme against implementation."""
        self.goals = goals(self)
        self.key_vs_value = key_vs_value(self)
        self.scheme_vs_implementation = scheme_vs_implementation(self)


def read_json(folder: str | Path) -> dict | None:
    """The bench.json in `folder` as JSON (None when there is none or it is not JSON): a page shows an unexpected
    layout raw."""
    path = Path(folder) / "bench.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


# --- what the rows say ------------------------------------------------------------------------------------


def paired_ratio(mine: Sequence[float], theirs: Sequence[float]) -> float:
    """Median over rounds of mine[r] / theirs[r] (rounds measured side by side, interleaved)."""
    return statistics.median(a / b for a, b in zip(mine, theirs, strict=True))


def damage_ratio(a: float | None, b: float | None) -> float | None:
    """a / b where both have the same sign and b is not zero (a ratio of two damages), else None."""
    if a is None or b is None or b == 0 or (a > 0) != (b > 0):
        return None
    return round(a / b, 2)


def _biggest(report: BenchReport) -> tuple[str, str]:
    """(the longest ppl length, the longest context) as the rows key them."""
    return str(max(report.sizes.ppl_lengths)), str(max(report.sizes.contexts))


def key_vs_value(report: BenchReport) -> KeyVsValue | None:
    """4-bit keys (k4v8) against 4-bit values (k8v4): each damage measure of both and their ratio (how many times
    more quantizing keys to 4 bits costs than quantizing values to 4 bits)."""
    rows = report.rows()
    keys, values = (rows.get(n) for n in KEY_VS_VALUE)
    if keys is None or values is None:
        return None
    measures = {}
    for n in keys.ppl_delta:
        measures[f"ppl_delta@{n}"] = (keys.ppl_delta[n], values.ppl_delta[n])
    for n in keys.logit_kl:
        measures[f"logit_kl@{n}"] = (keys.logit_kl[n], values.logit_kl[n])
    if keys.needle_logprob_delta is not None:
        loss = (-keys.needle_logprob_delta, -values.needle_logprob_delta)  # nats of answer log-prob lost
        measures["needle_logprob_loss"] = loss
    return KeyVsValue(
        {"keys_4bit": KEY_VS_VALUE[0], "values_4bit": KEY_VS_VALUE[1]},
        {m: KeyValueMeasure(a, b, damage_ratio(a, b)) for m, (a, b) in measures.items()},
    )


def scheme_vs_implementation(report: BenchReport) -> dict | None:
    """transformers' scheme in kvdemo (int4:ktoken:g64) vs in transformers+quanto (hf-quanto-int4): the
    implementation's share of the gap; vs kvdemo's own scheme (kvdemo-int4): the scheme's share.
    {"at": {"ppl_tokens", "context"}, contender: {"ppl_delta", "logit_kl", "needle_logprob", "ratio_vs_fp16",
    "decode_tok_s"}, "decode speed <scheme> / <other>": paired ratio, ...}."""
    rows = report.rows()
    ours_scheme, theirs = (rows.get(n) for n in SAME_SCHEME)
    ours = rows.get("kvdemo-int4")
    if ours_scheme is None:
        return None
    big_ppl, big_ctx = _biggest(report)

    def facts(r: ContenderResult) -> dict:
        return {
            "ppl_delta": r.ppl_delta.get(big_ppl),
            "logit_kl": r.logit_kl.get(big_ppl),
            "needle_logprob": r.needle.mean_logprob,
            "ratio_vs_fp16": r.ratio_vs_fp16[big_ctx],
            "decode_tok_s": r.decode_tok_s[big_ctx],
        }

    out = {"at": {"ppl_tokens": int(big_ppl), "context": int(big_ctx)}, SAME_SCHEME[0]: facts(ours_scheme)}
    for name, other in ((SAME_SCHEME[1], theirs), ("kvdemo-int4", ours)):
        if other is None:
            continue
        out[name] = facts(other)
        out[f"decode speed {SAME_SCHEME[0]} / {name}"] = round(
            paired_ratio(ours_scheme.decode_tok_s_rounds[big_ctx], other.decode_tok_s_rounds[big_ctx]), 3
        )
    return out


def goals(report: BenchReport) -> list[Goal]:
    """The benchmark's three goals, judged on its numbers (met None when a contender needed is missing):
    kvdemo int4 loses less perplexity than quanto int4, decodes >= 1.2x as fast, and stores at least as
    compactly as transformers at the same bits."""
    rows = report.rows()
    big_ppl, big_ctx = _biggest(report)
    out = []
    a, b = rows.get("kvdemo-int4"), rows.get("hf-quanto-int4")
    if a and b and a.ppl_delta and b.ppl_delta:
        da, db = a.ppl_delta[big_ppl], b.ppl_delta[big_ppl]
        met, measured = abs(da) < abs(db), {"kvdemo-int4": da, "hf-quanto-int4": db}
    else:
        met, measured = None, {}
    out.append(Goal(f"kvdemo int4 ppl delta smaller than quanto int4's at {big_ppl} tokens", met, measured))
    if a and b:
        speed = paired_ratio(a.decode_tok_s_rounds[big_ctx], b.decode_tok_s_rounds[big_ctx])
        measured = {"kvdemo-int4": a.decode_tok_s[big_ctx], "hf-quanto-int4": b.decode_tok_s[big_ctx]}
        measured |= {"speedup": round(speed, 3), "hf-quanto-int4 setup_s": b.setup_s}
        goal = (
            f"kvdemo int4 decode >= 1.2x quanto int4's tokens/s at {big_ctx} context (warm, a window that crosses "
            "both caches' flushes)"
        )
        out.append(Goal(goal, speed >= 1.2, measured))
    else:
        out.append(Goal("kvdemo int4 decode >= 1.2x quanto int4's tokens/s", None, {}))
    pairs = {}
    for ours, theirs in SAME_BITS:
        if ours in rows and theirs in rows:
            mine, other = rows[ours].ratio_vs_fp16, rows[theirs].ratio_vs_fp16
            pairs[f"{ours} vs {theirs}"] = {k: [mine[k], other[k], mine[k] >= other[k]] for k in mine}
    met = all(v[2] for p in pairs.values() for v in p.values()) if pairs else None
    out.append(Goal("kvdemo memory ratio >= transformers' at the same bits", met, pairs))
    return out


def markdown_table(report: BenchReport) -> str:
    """The results as one markdown table, plus the machine and the goals (bench.md; docs/benchmark.md)."""
    s = report.sizes
    ctx, ppl = [str(c) for c in s.contexts], [str(n) for n in s.ppl_lengths]
    # reports written before logit KL and the flush-crossing decode window existed have neither column; a
    # "read against" column only when some row has another baseline than full (llama.cpp's rows)
    has_kl = any(r.logit_kl for r in report.results)
    has_window = any(r.decode_window for r in report.results)
    has_baselines = any(r.baseline != "full" for r in report.results)
    head = ["contender"] + (["read against"] if has_baselines else [])
    head += [f"ratio vs fp16 @{c}" for c in ctx]
    head += [f"ppl @{n} (delta)" for n in ppl]
    head += [f"logit KL @{ppl[-1]}"] if has_kl else []
    head += [f"allocated ratio @{ctx[-1]}", "needle log-prob (found)"]
    head += [f"decode tok/s @{c}" for c in ctx]
    head += [f"flushes @{ctx[-1]}", f"step ms (flush step) @{ctx[-1]}"] if has_window else []
    head += [f"prefill s @{c}" for c in ctx]
    head += ["setup s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report.results:
        cells = [f"`{r.contender}`"]
        cells += ([""] if r.baseline == r.contender else [f"`{r.baseline}`"]) if has_baselines else []
        cells += [f"{r.ratio_vs_fp16[c]:.2f}x" for c in ctx]
        for n in ppl:
            delta = r.ppl_delta.get(n)
            cells.append(f"{r.ppl[n]:.3f}" + ("" if delta is None else f" ({delta:+.3f})"))
        if has_kl:
            kl = r.logit_kl.get(ppl[-1])
            cells.append("" if kl is None else f"{kl:.2e}")
        cells.append(f"{r.ratio_allocated_vs_fp16[ctx[-1]]:.2f}x")
        cells.append(f"{r.needle.mean_logprob:.2f} ({r.needle.found}/{r.needle.total})")
        cells += [f"{r.decode_tok_s[c]:.2f}" for c in ctx]
        win = r.decode_window.get(ctx[-1])
        if has_window and win is None:
            cells += ["", ""]
        elif has_window:
            flush_ms = "" if win.mean_flush_step_ms is None else f" ({win.mean_flush_step_ms:.0f})"
            cells += [f"{win.flushes} in {win.steps} steps", f"{win.median_step_ms:.1f}{flush_ms}"]
        cells += [f"{r.prefill_s[c]:.2f}" for c in ctx]
        cells.append(f"{r.setup_s:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    m = report.machine
    lines.append("")
    lines.append(
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), {m['device']} {m['dtype']}, "
        f"torch {m['torch']}, transformers {m['transformers']}, optimum-quanto {m['optimum-quanto']}, hqq {m['hqq']}; "
        f"{m['date']}; load average {m['load_avg_start'][0]} at start, {m['load_avg_end'][0]} at end; "
        f"wall time {report.wall_s:.0f} s." + (f" {m['notes']}" if m.get("notes") else "")
    )
    if report.engine:
        e = report.engine
        lines.append(
            f"llama.cpp rows: {e['engine']} on {e['gguf']}, {e['flags']}; each delta, KL and speed ratio against "
            "`llama.cpp:f16`, measured in the same run."
        )
    for sk in report.skipped:
        lines.append(f"Skipped `{sk.contender}`: {sk.reason}.")
    lines.append("")
    for g in report.goals:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[g.met]
        lines.append(f"- {g.goal}: **{verdict}** {json.dumps(g.measured)}")
    kv = report.key_vs_value
    if kv:
        lines += ["", f"Keys vs values (`{KEY_VS_VALUE[0]}`: 4-bit keys / `{KEY_VS_VALUE[1]}`: 4-bit values):", ""]
        lines += ["| measure | 4-bit keys | 4-bit values | ratio |", "|---|---|---|---|"]
        for name, m in kv.measures.items():
            ratio = "n/a" if m.ratio is None else f"{m.ratio:.1f}x"
            lines.append(f"| {name} | {m.keys_4bit:.4g} | {m.values_4bit:.4g} | {ratio} |")
    sv = report.scheme_vs_implementation
    if sv:
        lines += ["", f"Scheme vs implementation: {json.dumps(sv)}"]
    return "\n".join(lines) + "\n"


# --- decode speed side by side (the methods ablation's decode part) ---------------------------------------


@dataclass
class DecodeSpeedRow:
    precision: str
    tokens_per_s: float  # from the median step
    vs_first: float  # median over steps of (first precision's step time / this one's), steps taken side by side

    def to_json(self) -> dict:
        return {"precision": self.precision, "tokens_per_s": self.tokens_per_s, "vs_first": self.vs_first}


@dataclass
class DecodeSpeed:
    """Greedy decode tokens/s after a `context`-token prompt, every precision in one interleaved run."""

    context: int
    steps: int
    rounds: int
    protocol: str  # in words
    results: list[DecodeSpeedRow]

    def to_json(self) -> dict:
        d = {"context": self.context, "steps": self.steps, "rounds": self.rounds, "protocol": self.protocol}
        return d | {"results": [r.to_json() for r in self.results]}

    @classmethod
    def from_json(cls, d: dict) -> DecodeSpeed:
        return cls(**(d | {"results": [DecodeSpeedRow(**r) for r in d["results"]]}))

    def markdown(self) -> str:
        """docs/methods.md's decode-speed table (side by side in one run)."""
        lines = [f"| precision | decode tok/s @{self.context} | vs {self.results[0].precision} |", "|---|---|---|"]
        for r in self.results:
            lines.append(f"| {r.precision} | {r.tokens_per_s:.2f} | {r.vs_first:.2f}x |")
        return "\n".join(lines)
