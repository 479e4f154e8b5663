"""Findings, as data and numbers: the report a findings run builds, and what its verdicts and figures read.

A findings report (`Findings`, built by `kvdemo.findings.run.run_findings`) holds per (weights, text) and
precision one `Measurement`: its windows (NLL, logit KL) and needle answers (answer log-prob, found). Here
those become deltas against (loaded weights, full precision), capacity on a GPU config, and the quality /
capacity trade-off. Nothing here runs a model.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Self

from .. import layout
from ..configs import get_gpu, get_model_config
from ..memory import headroom
from ..precision import parse_precision
from ..production import ENGINES
from .ppl import measured_setting

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

# The capacity claims' reference config: a model config, a GPU preset, how many GPUs, tokens per sequence.
DEFAULT_CONFIG = {"model_config": "llama-3.1-8b", "gpu": "h100-80gb", "gpus": 1, "context": 32768}
REPORT_DIR = Path(__file__).resolve().parents[2] / "assets" / "reports" / "findings"  # the shipped report
CONTEXTS = (2048, 4096, 8192, 16384, 32768, 65536, 131072)  # tokens per sequence offered for capacity


def capacity_config(
    model_config: str | None = None, gpu: str | None = None, gpus: int | None = None, context: int | None = None
) -> dict:
    """A capacity config: what is given, `DEFAULT_CONFIG` for the rest."""
    given = {"model_config": model_config, "gpu": gpu, "gpus": gpus, "context": context}
    return {k: DEFAULT_CONFIG[k] if not v else v for k, v in given.items()}


def jsonable(x):
    """`x` as the report file writes it: dict keys as strings, tuples as lists, floats rounded to 6 digits
    (None where not finite)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, float):
        return None if not math.isfinite(x) else round(x, 6)
    return x


# --- the report ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """How much a findings run measures. In a report, `tokens` and `stack_tokens` are the texts' real lengths."""

    tokens: int = 8192  # the text's length (capped at the model's context)
    window: int = 128  # scored tokens per perplexity window
    window_fractions: tuple[float, ...] = (0.05, 0.125, 0.22, 0.5, 1.0)  # window starts, share of `tokens`
    needle_lengths: tuple[int, ...] = (512, 2048, 4096, 8000)  # prompt lengths (capped at the context)
    kl_every: int = 4  # KL on every kl_every-th scored token
    stack_tokens: int = 2048  # text length of the weight x KV grid
    weights: tuple[str, ...] = ("loaded", "int8", "int4")  # weight settings of the grid ("loaded": as loaded)
    seed: int = 0

    def to_json(self) -> dict:
        return jsonable(asdict(self))

    @classmethod
    def from_json(cls, d: dict) -> Self:
        return cls(**{f.name: tuple(d[f.name]) if isinstance(d[f.name], list) else d[f.name] for f in fields(cls)})


@dataclass
class Window:
    """A perplexity window: `tokens` scored tokens from `start`, mean next-token NLL (nats/token) and mean
    KL(full || this precision) on every `kl_every`-th of them (None where no full-precision reference was at hand)."""

    start: int
    tokens: int
    nll: float
    kl: float | None = None

    def to_json(self) -> dict:
        d = {"start": self.start, "tokens": self.tokens, "nll": self.nll}
        return d if self.kl is None else d | {"kl": self.kl}

    @classmethod
    def from_json(cls, d: dict) -> Self:
        return cls(d["start"], d["tokens"], d["nll"], d.get("kl"))


@dataclass
class NeedleAnswer:
    """A needle asked at one prompt length: log p(its true answer) after its lead-in, and whether greedy
    decoding would give the answer (`found`). `distance`: tokens between the needle and the question."""

    length: int  # the prompt length asked for
    tokens: int  # the prompt's real length
    key: str
    distance: int
    logprob: float
    found: bool

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Self:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


@dataclass
class Measurement:
    """One precision (under one weight setting) over a findings text: windows, needle answers, live cache bytes."""

    precision: str  # the label
    spec: dict  # PrecisionSpec.to_dict()
    windows: list[Window]
    needles: list[NeedleAnswer]
    cache_bytes: int  # the cache's live bytes after storing the whole text
    cache_tokens: int  # the text's length
    updates: list[int]  # tokens stored per cache update (the checkpoints' gaps): the layout formula's input
    seconds: float
    weights: str = "loaded"

    def to_json(self) -> dict:
        return {
            "precision": self.precision,
            "spec": self.spec,
            "windows": [w.to_json() for w in self.windows],
            "needles": [n.to_json() for n in self.needles],
            "cache_bytes": self.cache_bytes,
            "cache_tokens": self.cache_tokens,
            "updates": self.updates,
            "seconds": self.seconds,
            "weights": self.weights,
        }

    @classmethod
    def from_json(cls, d: dict) -> Self:
        return cls(
            precision=d["precision"],
            spec=d["spec"],
            windows=[Window.from_json(w) for w in d["windows"]],
            needles=[NeedleAnswer.from_json(n) for n in d["needles"]],
            cache_bytes=d["cache_bytes"],
            cache_tokens=d["cache_tokens"],
            updates=d["updates"],
            seconds=d["seconds"],
            weights=d.get("weights", "loaded"),
        )


def measurement_key(weights: str) -> str:
    """Where a measurement under `weights` sits in `Findings.measurements`: loaded weights on the main text,
    quantized weights on the stack text (its first `stack_tokens` tokens: the same ids, windows and prompts)."""
    return f"{weights}:{'main' if weights == 'loaded' else 'stack'}"


VERDICT_WORDS = {True: "holds", False: "does not hold", None: "not measured"}


@dataclass
class Verdict:
    """A claim's verdict on a model: holds (True), does not hold (False) or not measured (None), and the
    numbers behind it in words."""

    holds: bool | None
    text: str

    @property
    def word(self) -> str:
        return VERDICT_WORDS[self.holds]

    def to_json(self) -> dict:
        return {"holds": self.holds, "word": self.word, "text": self.text}

    @classmethod
    def from_json(cls, d: dict) -> Self:
        return cls(d["holds"], d["text"])


@dataclass
class Claim:
    """A claim's section of the report: the claim, how it is measured, the page that explores it, its
    verdict and the numbers the verdict read (`data`, JSON-ready, what the claim's figures draw)."""

    id: str
    title: str
    claim: str  # the claim itself, one sentence
    method: str  # how it was measured
    page: str  # the app page that explores it
    verdict: Verdict
    data: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "title": self.title,
            "claim": self.claim,
            "method": self.method,
            "page": self.page,
            "verdict": self.verdict.to_json(),
            "data": self.data,
        }

    @classmethod
    def from_json(cls, d: dict) -> Self:
        return cls(
            d["id"], d["title"], d["claim"], d["method"], d["page"], Verdict.from_json(d["verdict"]), d.get("data", {})
        )


@dataclass
class Findings:
    """A findings report: what was measured on which model, every measurement, and the claims' verdicts.

    `measurements`: {"loaded:main" | "<weights>:stack": {precision label: Measurement}} (`measurement_key`).
    `text`: the texts' layout (head tokens, needles and their positions, window starts, prompts).
    `stopped`: "running" while measuring, "done", or "cancelled" (what finished before a Cancel).
    """

    model: str
    model_info: dict  # LoadedModel.info(): layers, kv_heads, head_dim, dtype, max_context, ...
    sizes: Sizes
    precisions: list[str]  # labels, in the order measured
    measurements: dict[str, dict[str, Measurement]] = field(default_factory=dict)
    claims: list[Claim] = field(default_factory=list)
    version: str = ""  # the measuring code's version (the disk cache's key)
    created: str = ""  # "YYYY-MM-DD HH:MM UTC"
    embedded: bool = False  # the embedded SmolLM2-135M
    weights_note: str = ""  # where the weights come from, when that matters for the numbers
    quick: bool = False
    sizes_name: str = "custom"  # the name of `sizes` in kvdemo.findings.run.SIZES
    thresholds: dict = field(default_factory=lambda: dict(THRESHOLDS))
    config: dict = field(default_factory=lambda: dict(DEFAULT_CONFIG))  # capacity: model config, GPU(s), context
    text: dict = field(default_factory=dict)
    seconds: float = 0.0  # of measurement (model load and report files not counted)
    stopped: str = "running"

    def runs(self, text: str = "main", weights: str = "loaded") -> dict[str, Measurement]:
        return self.measurements.get(f"{weights}:{text}", {})

    def run_of(self, label: str, weights: str = "loaded") -> Measurement | None:
        """A precision's measurement: loaded weights on the main text, quantized weights on the stack text."""
        return self.measurements.get(measurement_key(weights), {}).get(label)

    def add(self, m: Measurement) -> None:
        self.measurements.setdefault(measurement_key(m.weights), {})[m.precision] = m

    def claim(self, claim_id: str) -> Claim | None:
        return next((c for c in self.claims if c.id == claim_id), None)

    def to_json(self) -> dict:
        return jsonable(
            {
                "version": self.version,
                "created": self.created,
                "model": self.model,
                "model_info": self.model_info,
                "embedded": self.embedded,
                "weights_note": self.weights_note,
                "sizes": self.sizes.to_json(),
                "quick": self.quick,
                "sizes_name": self.sizes_name,
                "precisions": self.precisions,
                "thresholds": self.thresholds,
                "config": self.config,
                "text": self.text,
                "measurements": {
                    key: {label: m.to_json() for label, m in runs.items()} for key, runs in self.measurements.items()
                },
                "claims": [c.to_json() for c in self.claims],
                "seconds": self.seconds,
                "stopped": self.stopped,
            }
        )

    @classmethod
    def from_json(cls, d: dict) -> Self:
        return cls(
            model=d["model"],
            model_info=d.get("model_info", {}),
            sizes=Sizes.from_json(d["sizes"]),
            precisions=list(d.get("precisions", [])),
            measurements={
                key: {label: Measurement.from_json(m) for label, m in runs.items()}
                for key, runs in d.get("measurements", {}).items()
            },
            claims=[Claim.from_json(c) for c in d.get("claims", [])],
            version=d.get("version", ""),
            created=d.get("created", ""),
            embedded=d.get("embedded", False),
            weights_note=d.get("weights_note", ""),
            quick=d.get("quick", False),
            sizes_name=d.get("sizes_name", "custom"),
            thresholds=d.get("thresholds", dict(THRESHOLDS)),
            config=d.get("config", dict(DEFAULT_CONFIG)),
            text=d.get("text", {}),
            seconds=d.get("seconds", 0.0),
            stopped=d.get("stopped", "done"),
        )


def kept_after_cancel(skeleton: dict, rows: list[dict], seconds: float) -> Findings:
    """The report of a cancelled run: its skeleton (`Findings.to_json()` before any measurement) with the
    measurements that finished (`Measurement.to_json()` rows)."""
    found = Findings.from_json(skeleton)
    for row in rows:
        found.add(Measurement.from_json(row))
    found.seconds, found.stopped = seconds, "cancelled"
    return found


def save(found: Findings, out_dir: str | Path) -> Path:
    """`out_dir`/findings.json (written whole or not at all)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "findings.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(found.to_json(), indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def load(path: str | Path = REPORT_DIR) -> Findings | None:
    """The report in `path` (a findings.json or the folder holding one; default: the shipped report), None
    when there is none."""
    path = Path(path)
    if path.is_dir():
        path = path / "findings.json"
    if not path.is_file():
        return None
    return Findings.from_json(json.loads(path.read_text(encoding="utf-8")))


# --- deltas against (loaded, full) ---------------------------------------------------------------------------


def nll_delta(found: Findings, label: str, weights: str = "loaded", max_end: int | None = None) -> float | None:
    """Mean NLL (nats/token) of (`weights`, `label`) minus (loaded, full)'s over the same windows (ending by
    `max_end` when given)."""
    run, base = found.run_of(label, weights), found.run_of("full")
    if run is None or base is None:
        return None
    ref = {w.start: w.nll for w in base.windows}
    mine = [w for w in run.windows if w.start in ref and (max_end is None or w.start + w.tokens + 1 <= max_end)]
    if not mine:
        return None
    return sum(w.nll - ref[w.start] for w in mine) / len(mine)


def window_deltas(found: Findings, label: str) -> list[dict]:
    """Per window of the main text: {"start", "end", "delta"} (NLL vs full, nats/token)."""
    run, base = found.run_of(label), found.run_of("full")
    if run is None or base is None:
        return []
    ref = {w.start: w.nll for w in base.windows}
    return [
        {"start": w.start, "end": w.start + w.tokens, "delta": w.nll - ref[w.start]}
        for w in run.windows
        if w.start in ref
    ]


def mean_kl(found: Findings, label: str) -> float | None:
    run = found.run_of(label)
    kls = [w.kl for w in (run.windows if run else []) if w.kl is not None]
    return sum(kls) / len(kls) if kls else None


def needle_deltas(found: Findings, label: str, weights: str = "loaded", lengths=None) -> list[dict]:
    """Per prompt length: {"length", "delta" (mean answer log-prob minus (loaded, full)'s, nats), "found",
    "full_found", "asked"}."""
    run, base = found.run_of(label, weights), found.run_of("full")
    if run is None or base is None:
        return []
    ref = {(n.length, n.key): n for n in base.needles}
    out = {}
    for n in run.needles:
        r = ref.get((n.length, n.key))
        if r is None or (lengths is not None and n.length not in lengths):
            continue
        d = out.setdefault(n.length, {"deltas": [], "found": 0, "full_found": 0})
        d["deltas"].append(n.logprob - r.logprob)
        d["found"] += n.found
        d["full_found"] += r.found
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


def mean_needle_delta(found: Findings, label: str, weights: str = "loaded", lengths=None) -> float | None:
    rows = needle_deltas(found, label, weights, lengths)
    return sum(r["delta"] for r in rows) / len(rows) if rows else None


# --- capacity --------------------------------------------------------------------------------------------


def capacity(found: Findings, config: dict | None = None) -> dict:
    """Headroom of every measured precision for `config` (default: the findings' own), plus the weight x KV
    stacking sequences, plus the loaded model's live cache bytes beside the layout formula."""
    cfg = dict(found.config or DEFAULT_CONFIG) | dict(config or {})
    labels = [lbl for lbl in found.precisions if lbl in found.runs()] or ["full"]
    if "full" not in labels:
        labels = ["full", *labels]
    out = headroom(
        get_model_config(cfg["model_config"]), get_gpu(cfg["gpu"]), labels, int(cfg["context"]), gpus=int(cfg["gpus"])
    )
    plan = out.by_label()
    info = found.model_info
    full_bits = 32 if info.get("dtype") == "float32" else 16
    live = []
    for label in labels:
        run = found.runs().get(label)
        if run is None or not info:
            continue
        regions = layout.Layout(parse_precision(label)).regions(run.updates)
        formula = layout.region_bytes(regions, info["layers"], info["kv_heads"], info["head_dim"], label, full_bits)
        live.append(
            {
                "precision": label,
                "tokens": run.cache_tokens,
                "bytes": run.cache_bytes,
                "formula_bytes": formula["total"],
                "error_vs_formula": run.cache_bytes / formula["total"] - 1,
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


def tradeoff(found: Findings, budget: float | None = None, config: dict | None = None) -> dict:
    """Every measured precision as (capacity multiplier, NLL delta, needle delta), the Pareto front and
    the cheapest precision within `budget` (NLL delta, nats/token) that also passes the needle threshold."""
    th = found.thresholds
    budget = th["budget_nll_nats"] if budget is None else budget
    cap = capacity(found, config)
    points = []
    for label in found.precisions:
        if label not in found.runs():
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


def production_rows(production: dict) -> list[dict]:
    """The pick's settings per serving engine: {"engine", "setting", "match", "measured here"} (reports written
    before an engine was mapped lack it; "measured here": where kvdemo measured that setting, `measured_setting`)."""
    return [
        {
            "engine": e,
            "setting": production[e]["setting"],
            "match": production[e]["match"],
            "measured here": measured_setting(e, production[e]["setting"]),
        }
        for e in ENGINES
        if e in production
    ]
