"""Keys or values: where a precision's loss sits (`python -m kvdemo ppl --kv-split`), as data, with the table and
lines docs/methods.md carries and the Findings page shows.

Each precision is scored beside its roles (`kvdemo.ppl.kv_split_precisions`): its keys alone and its values alone
(the other part at int8, near exact), both at int8, and the same mean bits with a bit moved between keys and
values. Each role's logit KL is compared with the precision's own over resampled text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .ppl import PplReport, PplRow

KV_SPLIT_REPORT = Path(__file__).resolve().parents[2] / "assets" / "reports" / "ppl_kv_split.json"  # shipped run

# difference_ci95(role's precision, the precision as given) -> [low, high]: the 95% interval of their logit KL
# difference over resampled text
KlDifference = Callable[[str, str], list[float]]


@dataclass
class Comparison:
    """A role against the precision as given, on the logit KL."""

    role: str  # "keys alone" | "values alone" | "both at int8" | "a bit to the keys" | "a bit to the values"
    precision: str  # what the role stores
    difference: float  # its KL minus the precision's
    difference_ci95: list[float]
    verdict: str  # "lower" | "higher" | "not settled by this text"

    def to_json(self) -> dict:
        return dict(vars(self)) | {"difference_ci95": list(self.difference_ci95)}

    @classmethod
    def from_json(cls, d: dict) -> Comparison:
        return cls(**d)


@dataclass
class Split:
    """One precision's split: its roles, the share of its logit KL each part alone reaches, the comparisons."""

    precision: str
    roles: dict[str, str]  # role -> precision label ("as given" first)
    kl_share: dict[str, float | None]  # "keys alone", "values alone" -> their KL / the precision's (None: no KL)
    comparisons: list[Comparison]

    def to_json(self) -> dict:
        return {
            "precision": self.precision,
            "roles": dict(self.roles),
            "kl_share": dict(self.kl_share),
            "comparisons": [c.to_json() for c in self.comparisons],
        }

    @classmethod
    def from_json(cls, d: dict) -> Split:
        return cls(**(d | {"comparisons": [Comparison.from_json(c) for c in d["comparisons"]]}))

    def sentence(self) -> str:
        """The split in words: how much of its logit KL its keys alone and its values alone reach, and what moving
        a bit between them does."""
        share = self.kl_share
        if share["keys alone"] is None:
            return f"{self.precision}: no logit KL to split"
        text = (
            f"{self.precision}: its keys alone reach {share['keys alone']:.0%} of its logit KL, its values alone "
            f"{share['values alone']:.0%}"
        )
        for c in self.comparisons:
            if c.role.startswith("a bit"):
                low, high = c.difference_ci95
                text += f"; {c.role} ({c.precision}): KL {c.difference:+.3g} (95% {low:+.3g}..{high:+.3g}), {c.verdict}"
        return text


def summarize(rows: list[PplRow], roles: dict[str, str], difference_ci95: KlDifference) -> Split:
    """One precision's `Split` from rows holding its roles (`difference_ci95`: kvdemo.ppl.split_summary draws it
    from the report's blocks)."""
    by_name = {r.precision: r for r in rows}
    given = roles["as given"]
    kl = by_name[given].logit_kl
    comparisons = []
    for role, label in roles.items():
        if role != "as given":
            low, high = difference_ci95(label, given)
            comparisons.append(
                Comparison(
                    role,
                    label,
                    float(f"{by_name[label].logit_kl - kl:.4g}"),
                    [low, high],
                    "lower" if high < 0 else "higher" if low > 0 else "not settled by this text",
                )
            )
    share = {  # a part alone over the whole: k8v4's values alone are k8v4 itself (share 1)
        role: round(by_name[roles.get(role, given)].logit_kl / kl, 4) if kl > 0 else None
        for role in ("keys alone", "values alone")
    }
    return Split(given, dict(roles), share, comparisons)


@dataclass
class KvSplitReport:
    """`run_kv_split`'s report (ppl_kv_split.json): every role scored in one `run_ppl` (`ppl`), one `Split` per
    precision."""

    ppl: PplReport  # every role's row, full precision first; its command and date are the report's
    splits: list[Split]

    def to_json(self) -> dict:
        scores = self.ppl.to_json()
        tail = {k: scores.pop(k) for k in ("command", "date") if k in scores}
        return scores | {"splits": [s.to_json() for s in self.splits]} | tail

    @classmethod
    def from_json(cls, d: dict) -> KvSplitReport:
        return cls(PplReport.from_json(d), [Split.from_json(s) for s in d["splits"]])

    def rows(self) -> list[dict]:
        """One row per precision and role: what it stores, its bits, delta and logit KL, and its KL minus the
        precision's as given with the 95% interval over resampled text and the verdict."""
        by_name = {r.precision: r for r in self.ppl.results}
        rows = []
        for split in self.splits:
            against = {c.role: c for c in split.comparisons}
            for role, label in split.roles.items():
                r, c = by_name[label], against.get(role)
                rows.append(
                    {
                        "precision": split.precision,
                        "role": role,
                        "stored as": label,
                        "bits/element": f"{r.bits_per_element:.2f}",
                        "delta vs full": f"{r.delta_vs_full:+.3f}",
                        "logit KL": f"{r.logit_kl:.2e}",
                        "KL minus as given, 95%": ""
                        if c is None
                        else f"{c.difference:+.3g} [{c.difference_ci95[0]:+.3g}, {c.difference_ci95[1]:+.3g}]",
                        "verdict": "" if c is None else c.verdict,
                    }
                )
        return rows

    def markdown(self) -> str:
        """docs/methods.md's table (`rows`), the verdicts left to the lines under it."""
        rows = self.rows()
        heads = [h for h in rows[0] if h != "verdict"]
        lines = ["| " + " | ".join(heads) + " |", "|---" * len(heads) + "|"]
        lines += ["| " + " | ".join(row[h] for h in heads) + " |" for row in rows]
        return "\n".join(lines)

    def lines(self) -> list[str]:
        """docs/methods.md's lines under the table: each precision's `Split.sentence`."""
        return [f"- {split.sentence()}" for split in self.splits]


def load_kv_split(path: Path = KV_SPLIT_REPORT) -> KvSplitReport | None:
    """The `ppl --kv-split` report at `path` (the shipped one by default), or None when there is none."""
    return KvSplitReport.from_json(json.loads(path.read_text())) if path.is_file() else None
