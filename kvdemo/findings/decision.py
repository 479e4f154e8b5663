"""The decision box: for long-context serving of the report's model, one word per KV format (safe /
recommended / risky / breaks) and the measured numbers behind it, by one rule over the report's numbers.

The rule (`decide`), with the report's thresholds (`Findings.thresholds`, `kvdemo.results.findings.THRESHOLDS`)
and `BREAKS_NLL_NATS`:

- **breaks**: the NLL loss vs full precision (mean over the text, or at its end) is over `BREAKS_NLL_NATS`
  nats/token, or the format finds under half the needles full precision finds.
- **risky**: not broken, but the NLL loss (mean or at the end) is over the quality budget (`nll_ok_nats`), or
  the needle answers at the longest prompt lose more than `needle_ok_nats` of log-prob, or the format finds
  more than `NEEDLE_NOISE` fewer needles than full precision.
- **recommended**: within all of those, the format that saves the most memory (bytes per token against a
  16-bit cache; the lower NLL loss breaks a tie).
- **safe**: within all of those too, saving less memory than the recommended one.

Only the report's formats are judged (its precisions without ":" variants: those answer the claims).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout import bytes_per_token
from ..precision import parse_precision
from ..results.findings import Findings, capacity, mean_kl, needle_deltas, nll_delta, window_deltas

BREAKS_NLL_NATS = 0.1  # nats/token of NLL loss at which a format no longer serves long contexts at all
NEEDLE_NOISE = 1  # needles: one answer more or less in a few questions is noise, not a verdict
WORDS = ("safe", "recommended", "risky", "breaks")  # the order the box lists them in
COLORS = {"safe": "#1b7f3b", "recommended": "#0b5cad", "risky": "#b86e00", "breaks": "#b3261e"}
SERVE_BITS = 16


@dataclass(frozen=True)
class Decision:
    """One format's word and the numbers it was read from."""

    precision: str
    word: str  # one of WORDS
    why: str  # the part of the rule that decided, with its numbers
    nll_delta: float  # mean NLL loss vs full precision over the text, nats/token
    long_nll_delta: float | None  # the same in the text's last window
    kl: float | None  # mean KL(full || quantized) of the next-token distribution, nats
    found: int  # needles found
    full_found: int  # needles full precision found on the same prompts
    asked: int
    long_needle_delta: float | None  # answer log-prob vs full at the longest prompt, nats
    x_smaller: float  # a 16-bit cache over this one, bytes per token in the quantized region
    sequences_x: float | None  # sequences that fit on the chosen config vs 16-bit

    def evidence(self) -> str:
        """The numbers, in one line."""
        long = "" if self.long_nll_delta is None else f" ({self.long_nll_delta:+.4f} at the end)"
        kl = "" if self.kl is None else f"; KL {self.kl:.4f}"
        needle = (
            f"; needles found {self.found}/{self.asked} (full {self.full_found}/{self.asked})" if self.asked else ""
        )
        lp = "" if self.long_needle_delta is None else f", log p {self.long_needle_delta:+.2f} at the longest prompt"
        seqs = "" if self.sequences_x is None else f", {self.sequences_x:.2f}x the sequences"
        return (
            f"NLL {self.nll_delta:+.4f} nats/token{long}{kl}{needle}{lp}; "
            f"{self.x_smaller:.2f}x smaller than 16-bit{seqs}"
        )


RULE = (
    f"breaks: NLL loss vs full precision (mean, or at the end of the text) over {BREAKS_NLL_NATS} nats/token, or under "
    "half the needles full precision finds. risky: NLL loss over the quality budget, or needle answers at the "
    "longest prompt losing more than the needle threshold, or more than one needle fewer found than full "
    "precision. recommended: passes all of these and saves the most memory against a 16-bit cache. safe: passes "
    "all of these and saves less."
)


def formats(found: Findings) -> list[str]:
    """The report's quantized formats (its precisions without the claims' ":" variants) that it measured."""
    runs = found.runs()
    return [p for p in found.precisions if p != "full" and ":" not in p and p in runs]


def _x_smaller(found: Findings, label: str) -> float:
    info = found.model_info
    shape = (info["layers"], info["kv_heads"], info["head_dim"])
    spec = parse_precision(label)
    return bytes_per_token(*shape, "full", SERVE_BITS) / bytes_per_token(*shape, spec, SERVE_BITS)


def decide(found: Findings, config: dict | None = None) -> list[Decision]:
    """Every format's word by the rule in the module docstring (capacity on `config`, default the report's),
    in the order of `WORDS`, then by memory saved."""
    th = found.thresholds
    seqs = capacity(found, config)["multiplier"]
    rows = []
    for label in formats(found):
        mean = nll_delta(found, label)
        if mean is None:
            continue
        windows = window_deltas(found, label)
        needles = needle_deltas(found, label)
        rows.append(
            dict(
                precision=label,
                nll_delta=mean,
                long_nll_delta=windows[-1]["delta"] if windows else None,
                kl=mean_kl(found, label),
                found=sum(n["found"] for n in needles),
                full_found=sum(n["full_found"] for n in needles),
                asked=sum(n["asked"] for n in needles),
                long_needle_delta=needles[-1]["delta"] if needles else None,
                x_smaller=_x_smaller(found, label),
                sequences_x=seqs.get(label),
            )
        )
    words = {}
    for r in rows:
        worst = max(r["nll_delta"], r["long_nll_delta"] if r["long_nll_delta"] is not None else r["nll_delta"])
        if worst > BREAKS_NLL_NATS:
            words[r["precision"]] = ("breaks", f"NLL loss {worst:+.4f} > {BREAKS_NLL_NATS} nats/token")
        elif r["full_found"] and r["found"] * 2 < r["full_found"]:
            words[r["precision"]] = (
                "breaks",
                f"finds {r['found']} of the {r['full_found']} needles full precision finds",
            )
        elif worst > th["nll_ok_nats"]:
            words[r["precision"]] = ("risky", f"NLL loss {worst:+.4f} > the {th['nll_ok_nats']} nats/token budget")
        elif r["long_needle_delta"] is not None and r["long_needle_delta"] < -th["needle_ok_nats"]:
            words[r["precision"]] = (
                "risky",
                f"needle log p {r['long_needle_delta']:+.2f} < -{th['needle_ok_nats']} nats at the longest prompt",
            )
        elif r["full_found"] - r["found"] > NEEDLE_NOISE:
            words[r["precision"]] = ("risky", f"finds {r['found']} needles, full precision {r['full_found']}")
    passing = [r for r in rows if r["precision"] not in words]
    best = max(passing, key=lambda r: (r["x_smaller"], -r["nll_delta"]), default=None)
    for r in passing:
        within = f"within the {th['nll_ok_nats']} nats/token budget and the needle checks"
        if r is best:
            words[r["precision"]] = ("recommended", f"{within}, and the most memory saved of those")
        else:
            words[r["precision"]] = ("safe", f"{within}; {best['precision']} saves more")
    out = [Decision(word=words[r["precision"]][0], why=words[r["precision"]][1], **r) for r in rows]
    return sorted(out, key=lambda d: (WORDS.index(d.word), -d.x_smaller))


def summary(decisions: list[Decision]) -> str:
    """One line: the formats per word, e.g. "recommended: k8v4 · safe: fp8, int8 · risky: int4 · breaks: int2"."""
    parts = []
    for word in ("recommended", "safe", "risky", "breaks"):
        names = [d.precision for d in decisions if d.word == word]
        if names:
            parts.append(f"{word}: {', '.join(names)}")
    return " · ".join(parts)


def rows(decisions: list[Decision]) -> list[dict]:
    """The box as table rows: format, word, why, evidence."""
    return [{"format": d.precision, "verdict": d.word, "why": d.why, "evidence": d.evidence()} for d in decisions]
