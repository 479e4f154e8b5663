"""Perplexity reports, as data: what `kvdemo.ppl.run_ppl` measures, and the tables and notes read from it.

A `PplReport` holds one row per KV precision (`PplRow`, full precision first: the reference of every delta and
KL) and the per-block means its 95% intervals come from (`Blocks`; `kvdemo.ppl` draws the resamples). The
tables here are what the Perplexity page shows, what the CLI prints and what README and docs/perplexity.md
carry (`markdown_table`); docs/methods.md's oracle-codebooks table is `codebooks_markdown`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .markdown import paired_markdown

HELD_OUT_NAME = "Held-out prose (Sense and Sensibility)"  # the text run_ppl scores unless given one


@dataclass
class PplRow:
    """One precision's scores over the text, and its cache's size after scoring."""

    precision: str
    ppl: float  # exp(mean NLL) over the scored positions
    delta_vs_full: float  # ppl - full precision's ppl
    logit_kl: float  # mean KL(full || this) of the next-token distributions (nats); 0 for full
    bits_per_element: float  # every stored byte at 16 bits for the full-precision parts, per cached element
    ratio_vs_fp16: float  # a 16-bit cache of the same tokens / this cache (16-bit basis)
    live_bytes: int  # as stored (full-precision parts in the model's dtype)
    stored_tokens: int  # tokens the cache held after scoring: every token but the last
    delta_vs_full_ci95: list[float] | None = None  # [low, high] over resampled text; None until every cache ran
    logit_kl_ci95: list[float] | None = None

    def to_json(self) -> dict:
        d = {
            "precision": self.precision,
            "ppl": self.ppl,
            "delta_vs_full": self.delta_vs_full,
            "logit_kl": self.logit_kl,
            "bits_per_element": self.bits_per_element,
            "ratio_vs_fp16": self.ratio_vs_fp16,
            "live_bytes": self.live_bytes,
            "stored_tokens": self.stored_tokens,
        }
        for name in ("delta_vs_full_ci95", "logit_kl_ci95"):
            if getattr(self, name) is not None:
                d[name] = list(getattr(self, name))
        return d

    @classmethod
    def from_json(cls, d: dict) -> PplRow:
        return cls(**d)


@dataclass
class Blocks:
    """The scored positions cut into blocks of `size` tokens: each precision's mean NLL and mean logit KL per
    block, and how many positions each block holds (the KL is kept on every `kl_every`-th position). What the
    paired block bootstrap (`kvdemo.ppl.resampled_figures`) draws from."""

    size: int
    resamples: int
    seed: int
    nll: dict[str, list[float]] = field(default_factory=dict)  # precision -> [blocks] mean NLL
    logit_kl: dict[str, list[float]] = field(default_factory=dict)  # precision -> [blocks] mean KL
    nll_counts: list[int] = field(default_factory=list)  # [blocks] scored positions in each
    kl_counts: list[int] = field(default_factory=list)  # [blocks] KL positions in each

    def to_json(self) -> dict:
        return {
            "size": self.size,
            "resamples": self.resamples,
            "seed": self.seed,
            "nll": {k: list(v) for k, v in self.nll.items()},
            "logit_kl": {k: list(v) for k, v in self.logit_kl.items()},
            "nll_counts": list(self.nll_counts),
            "kl_counts": list(self.kl_counts),
        }

    @classmethod
    def from_json(cls, d: dict) -> Blocks:
        return cls(**d)


@dataclass
class PplReport:
    """`run_ppl`'s report: the text, how it was scored, one row per precision and the blocks of its intervals.
    `command` and `date` are set by `python -m kvdemo ppl`."""

    model: str
    text: str | None  # the scored text's name; None in reports written before other texts could be scored
    tokens: int
    prefix: int  # tokens stored exactly before scoring
    chunk: int  # tokens fed per forward through the cache
    scored_positions: list[int]  # [tokens / 2, tokens)
    basis: str  # what the bits and ratios count, in words
    results: list[PplRow]
    blocks: Blocks | None = None
    codebooks: str | None = None  # what the nuq precisions' levels were fitted on, when there are any
    engine: dict | None = None  # the llama.cpp rows' engine, file and protocol (kvdemo.llamacpp.engine_note)
    command: str | None = None
    date: str | None = None

    @property
    def text_name(self) -> str:
        return self.text or HELD_OUT_NAME

    def row(self, precision: str) -> PplRow:
        return next(r for r in self.results if r.precision == precision)

    def to_json(self) -> dict:
        d = {"model": self.model}
        if self.text is not None:
            d["text"] = self.text
        d |= {
            "tokens": self.tokens,
            "prefix": self.prefix,
            "chunk": self.chunk,
            "scored_positions": list(self.scored_positions),
            "basis": self.basis,
            "results": [r.to_json() for r in self.results],
        }
        if self.blocks is not None:
            d["blocks"] = self.blocks.to_json()
        if self.codebooks is not None:
            d["codebooks"] = self.codebooks
        if self.engine is not None:
            d["engine"] = dict(self.engine)
        return d | self.provenance_json()

    def provenance_json(self) -> dict:
        """The command and date, where the report has them (they close every report's JSON)."""
        return {k: v for k, v in (("command", self.command), ("date", self.date)) if v is not None}

    @classmethod
    def from_json(cls, d: dict) -> PplReport:
        return cls(
            model=d["model"],
            text=d.get("text"),
            tokens=d["tokens"],
            prefix=d["prefix"],
            chunk=d["chunk"],
            scored_positions=list(d["scored_positions"]),
            basis=d["basis"],
            results=[PplRow.from_json(r) for r in d["results"]],
            blocks=Blocks.from_json(d["blocks"]) if "blocks" in d else None,
            codebooks=d.get("codebooks"),
            engine=d.get("engine"),
            command=d.get("command"),
            date=d.get("date"),
        )


# --- read from a report ------------------------------------------------------------------------------


def interval_text(ci: list | None, spec: str = "+.3f") -> str:
    """An interval [low, high] as "low .. high" ("" for None: a row before the intervals)."""
    return "" if ci is None else f"{ci[0]:{spec}} .. {ci[1]:{spec}}"


def result_rows(rows: list[PplRow]) -> list[dict]:
    """Result rows as the app's table shows them (a row without its intervals, as a cancelled run keeps it,
    shows none)."""
    return [
        {
            "precision": r.precision,
            "perplexity": round(r.ppl, 3),
            "delta vs full": round(r.delta_vs_full, 3),
            "delta 95%": interval_text(r.delta_vs_full_ci95),
            "logit KL": float(f"{r.logit_kl:.3g}"),
            "KL 95%": interval_text(r.logit_kl_ci95, ".3g"),
            "bits/element": r.bits_per_element,
            "x smaller than fp16": round(r.ratio_vs_fp16, 2),
        }
        for r in rows
    ]


def size_note(report: PplReport) -> str:
    """What the table's "x smaller than fp16" divides: a 16-bit cache of the stored tokens over the whole stored
    cache with its full-precision parts at 16 bits: the basis of the sidebar and Home, whose per-token figure is
    higher because it counts the quantized region alone."""
    stored = max((r.stored_tokens for r in report.results), default=0)
    return (
        f"x smaller than fp16: a 16-bit cache of the {stored:,} stored tokens over this whole cache, its "
        "full-precision parts (the residual window, sinks) counted at 16 bits: the same 16-bit basis as the "
        "sidebar, whose per-token figure counts the quantized region alone and so is higher."
    )


def interval_note(report: PplReport) -> str:
    """What a report's intervals rest on, and where they are too thin to rank anything."""
    lo, hi = report.scored_positions
    blocks = len(report.blocks.nll_counts)
    note = (
        f"Perplexity over tokens {lo:,} to {hi:,} ({hi - lo:,} scored, the first {report.prefix:,} stored exactly). "
        f"95% intervals: {report.blocks.resamples:,} resamples of {blocks} blocks of {report.blocks.size} "
        "tokens; two precisions differ beyond doubt on a measure only where their intervals of the difference exclude "
        "zero, so overlapping intervals here rank nothing. Bits and ratios count every stored byte (codes, scales, "
        "outliers, sinks, residual window) at 16 bits for full-precision parts."
    )
    if blocks < 8:
        note += f" With {blocks} blocks the intervals are rough: score more tokens for intervals worth reading."
    return note


def bracketed(ci: list | None) -> str:
    """An interval as "[+low, +high]" ("" for None)."""
    return "" if ci is None else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"


def report_text(report: PplReport) -> str:
    """The report as `python -m kvdemo ppl` prints it: a line per precision, the basis, the intervals' source."""
    lo, hi = report.scored_positions
    lines = [
        f"model: {report.model}  perplexity of {report.text_name}, tokens [{lo}, {hi}) (first "
        f"{report.prefix} stored exactly, then {report.chunk} at a time through the cache)",
        f"{'precision':<20}{'ppl':>10}{'delta':>10}{'delta 95%':>20}{'logit KL':>11}{'bits/elem':>11}{'vs 16-bit':>11}",
    ]
    for r in report.results:
        lines.append(
            f"{r.precision:<20}{r.ppl:>10.3f}{r.delta_vs_full:>+10.3f}{bracketed(r.delta_vs_full_ci95):>20}"
            f"{r.logit_kl:>11.4f}{r.bits_per_element:>11.2f}{r.ratio_vs_fp16:>10.2f}x"
        )
    lines.append(report.basis)
    if report.blocks is not None:
        b = report.blocks
        lines.append(
            f"delta 95%: the middle 95% of {b.resamples} resamples of the scored text in blocks of {b.size} "
            "tokens (the spread over text like this one)"
        )
    if report.codebooks is not None:
        lines.append(f"nuq codebooks: {report.codebooks}")
    if report.engine is not None:
        e = report.engine
        lines.append(f"llama.cpp rows: {e['engine']} on {e['gguf']}, {e['flags']}; {e['protocol']}")
    return "\n".join(lines)


def markdown_table(report: PplReport) -> str:
    """The table README and docs/perplexity.md carry (with the delta's 95% interval over resampled text when the
    report has one)."""
    ci = report.results[0].delta_vs_full_ci95 is not None
    lines = [
        f"| precision | ppl @{report.tokens} | delta vs full |{' delta 95% |' if ci else ''} logit KL | bits/element | "
        "ratio vs fp16 |",
        "|---|---|---|---|---|---|" + ("---|" if ci else ""),
    ]
    for r in report.results:
        interval = f" {bracketed(r.delta_vs_full_ci95)} |" if ci else ""
        lines.append(
            f"| {r.precision} | {r.ppl:.3f} | {r.delta_vs_full:+.3f} |{interval} {r.logit_kl:.2e} | "
            f"{r.bits_per_element:.3f} | {r.ratio_vs_fp16:.2f}x |"
        )
    return "\n".join(lines)


def codebooks_markdown(own: PplReport, other: PplReport, own_name: str = "own", other_name: str = "other") -> str:
    """docs/methods.md's oracle table: the precisions of `other` (a `ppl --codebooks FILE` report) beside the same
    precisions in `own` (a report with the model's own codebooks, e.g. the ablation's): delta and logit KL."""
    measures = [("delta", lambda r: f"{r.delta_vs_full:+.3f}"), ("logit KL", lambda r: f"{r.logit_kl:.2e}")]
    return paired_markdown(own.results, other.results, measures, own_name, other_name, lambda r: r.precision)


# --- kvdemo's formats beside llama.cpp's cache types, at equal code widths ---------------------------------

LLAMACPP_REPORT = Path(__file__).resolve().parents[2] / "assets" / "reports" / "ppl_llamacpp.json"  # shipped run


def code_widths(precision: str) -> tuple[int, int]:
    """(key, value) bits per code of a row: kvdemo's precision string or a ``llama.cpp:<k>[/<v>]`` contender."""
    from ..engines import CACHE_TYPES, is_llamacpp, parse_kv
    from ..precision import parse_precision

    if is_llamacpp(precision):
        kv = parse_kv(precision)
        return CACHE_TYPES[kv.key].code_bits, CACHE_TYPES[kv.value].code_bits
    spec = parse_precision(precision)
    return (spec.key_bits, spec.value_bits) if spec.is_quantized else (16, 16)


def side_by_side(report: PplReport) -> list[dict]:
    """kvdemo's rows beside llama.cpp's, grouped by code width (K/V bits per code, widest first): each row's bits
    per element as stored, its perplexity delta with its 95% interval and its logit KL, each against its own
    engine's full row. Only widths both engines measured; empty when the report has no llama.cpp rows."""
    from ..engines import is_llamacpp

    groups: dict[tuple[int, int], list[PplRow]] = {}
    for r in report.results:
        groups.setdefault(code_widths(r.precision), []).append(r)
    out = []
    for widths in sorted(groups, key=lambda w: (-sum(w), -w[0])):
        rows = groups[widths]
        engines = {is_llamacpp(r.precision) for r in rows}
        if len(engines) < 2 or widths == (16, 16):
            continue
        for r in sorted(rows, key=lambda r: (is_llamacpp(r.precision), r.bits_per_element)):
            out.append(
                {
                    "codes (K/V bits)": f"{widths[0]}/{widths[1]}" if widths[0] != widths[1] else f"{widths[0]}",
                    "engine": "llama.cpp" if is_llamacpp(r.precision) else "kvdemo",
                    "precision": r.precision,
                    "bits/element": r.bits_per_element,
                    "delta vs own full": r.delta_vs_full,
                    "delta 95%": bracketed(r.delta_vs_full_ci95),
                    "logit KL": float(f"{r.logit_kl:.3g}"),
                }
            )
    return out


def side_by_side_markdown(report: PplReport) -> str:
    """`side_by_side` as the table README and docs/llamacpp.md carry."""
    rows = side_by_side(report)
    lines = ["| codes (K/V bits) | engine | precision | bits/element | delta vs own full | delta 95% | logit KL |"]
    lines.append("|---|---|---|---|---|---|---|")
    for r in rows:
        lines.append(
            f"| {r['codes (K/V bits)']} | {r['engine']} | {r['precision']} | {r['bits/element']:.3f} | "
            f"{r['delta vs own full']:+.3f} | {r['delta 95%']} | {r['logit KL']:.2e} |"
        )
    return "\n".join(lines)


def measured_setting(engine: str, setting: str, report: PplReport | None = None) -> str:
    """Where kvdemo measured a serving engine's KV setting (the production tables' "measured here"): llama.cpp's
    ``-ctk K -ctv V`` as its row in the kvdemo-beside-llama.cpp report (default: the shipped one), with
    llama.cpp's version and the date; "" for a setting no report measured."""
    import re

    from ..engines import KvTypes

    m = re.search(r"-ctk (\S+) -ctv (\S+)", setting) if engine == "llama.cpp" else None
    report = report or (load_llamacpp_report() if m else None)
    if m is None or report is None:
        return ""
    kv = KvTypes(m.group(1), m.group(2))
    row = next((r for r in report.results if r.precision == kv.label), None)
    if row is None:
        return ""
    return (
        f"measured: {kv.flags()} with {report.engine['engine']} on {report.date}, perplexity "
        f"{row.delta_vs_full:+.3f} against its f16 cache, logit KL {row.logit_kl:.2e} (assets/reports/"
        f"{LLAMACPP_REPORT.name})"
    )


def load_llamacpp_report(path: Path = LLAMACPP_REPORT) -> PplReport | None:
    """The shipped kvdemo-beside-llama.cpp perplexity report, or None when there is none."""
    import json

    return PplReport.from_json(json.loads(path.read_text())) if path.is_file() else None
