"""What quantization changed in one chat turn, token by token: each precision's answer scored under its own
cache and under the other one (`kvdemo.chat.compare` produces it), and the numbers the Chat page shows of it.

Every answer is teacher-forced through both prompt caches (the same conversation, the same document in the
cache): full precision and the quantized format. Per token that gives its log-probability under each cache,
the KL divergence between the two next-token distributions, KL(full || quantized) in nats, and each cache's
greedy choice. The first divergence of an answer is its first token the *other* cache would not have chosen
(greedy), with the token it would have chosen instead.

Also what the "plant a fact and ask it" check returns (`kvdemo.chat.planted`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

# KL(full || quantized) per token, nats: where a token's colour changes (below the first: the caches agree)
KL_LEVELS = (0.01, 0.1, 1.0)
LEVEL_NAMES = ("agree", "slight", "clear", "strong")  # one name per band the KL_LEVELS cut


@dataclass
class TokenScores:
    """One answer (`answer_of`'s), teacher-forced through its own cache and through `scored_under`'s."""

    answer_of: str  # the precision that wrote the answer
    scored_under: str  # the other precision
    tokens: list[int]
    pieces: list[str]  # each token's text ("" for the end-of-turn token)
    logprob_own: list[float]  # log p(token) under the writer's cache, nats
    logprob_other: list[float]  # log p(token) under the other cache, nats
    kl: list[float]  # KL(full || quantized) of the next-token distributions before each token, nats
    divergence: int | None  # first token the other cache's greedy choice differs from; None: it agrees on all
    divergence_piece: str = ""  # what the other cache would have said there

    @property
    def total_own(self) -> float:
        return sum(self.logprob_own)

    @property
    def total_other(self) -> float:
        return sum(self.logprob_other)

    @property
    def max_kl(self) -> float:
        return max(self.kl, default=0.0)

    @property
    def mean_kl(self) -> float:
        return sum(self.kl) / len(self.kl) if self.kl else 0.0

    def levels(self) -> list[int]:
        """Per token, the band (0..3, see LEVEL_NAMES) its KL falls in."""
        return [kl_level(k) for k in self.kl]

    def summary(self) -> str:
        """One line: the answer's log-prob under each cache, the KL, and the first divergence."""
        line = (
            f"log p(answer): {self.total_own:.2f} under {self.answer_of}, {self.total_other:.2f} under "
            f"{self.scored_under} · KL per token: mean {self.mean_kl:.3f}, max {self.max_kl:.3f} nats"
        )
        if self.divergence is None:
            return line + f" · {self.scored_under} would have chosen every token of it"
        said = self.pieces[self.divergence]
        return (
            line + f" · first divergence at token #{self.divergence}: {self.scored_under} would have said "
            f"{self.divergence_piece!r} instead of {said!r}"
        )

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> TokenScores:
        return cls(**d)


@dataclass
class AnswerComparison:
    """A turn's answers (baseline first), each scored under both caches."""

    baseline: str
    precision: str
    answers: list[TokenScores] = field(default_factory=list)
    seconds: float = 0.0  # time the teacher-forced passes took

    def of(self, precision: str) -> TokenScores | None:
        return next((a for a in self.answers if a.answer_of == precision), None)

    def to_json(self) -> dict:
        return {
            "baseline": self.baseline,
            "precision": self.precision,
            "answers": [a.to_json() for a in self.answers],
            "seconds": round(self.seconds, 3),
        }

    @classmethod
    def from_json(cls, d: dict) -> AnswerComparison:
        return cls(d["baseline"], d["precision"], [TokenScores.from_json(a) for a in d["answers"]], d["seconds"])


@dataclass
class PlantedCheck:
    """A fact planted in the user's document and asked for, at full precision and at `precision`."""

    document: str  # the document's name
    document_tokens: int
    needle: str
    question: str
    expected: str
    depth: float  # where the fact went, as a fraction of the document
    answers: dict[str, str]  # precision -> its answer
    found: dict[str, bool]  # precision -> the answer contains the expected one
    comparison: AnswerComparison | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["comparison"] = None if self.comparison is None else self.comparison.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict) -> PlantedCheck:
        comp = d.get("comparison")
        return cls(**(d | {"comparison": None if comp is None else AnswerComparison.from_json(comp)}))


def kl_level(kl: float) -> int:
    """The band (0..3) of one token's KL in nats: 0 below KL_LEVELS[0], 3 at KL_LEVELS[-1] and above."""
    return sum(kl >= cut for cut in KL_LEVELS)


def legend() -> list[tuple[str, str]]:
    """(band name, its KL range in nats) for a strip's legend."""
    bounds = [0.0, *KL_LEVELS]
    out = []
    for i, name in enumerate(LEVEL_NAMES):
        hi = f"< {bounds[i + 1]:g}" if i + 1 < len(bounds) else f">= {bounds[i]:g}"
        out.append((name, hi if i == 0 else f"{bounds[i]:g} to {bounds[i + 1]:g}" if i + 1 < len(bounds) else hi))
    return out


CHAT_SPEED_REPORT = Path(__file__).resolve().parents[2] / "assets" / "reports" / "chat_cpu_speed.json"  # shipped run


@dataclass
class SpeedRow:
    """One precision's decode speed in the Chat page's setting (bench/chat_cpu_speed.py)."""

    precision: str
    median_step_ms: float
    tok_s: float
    slower_than_full: float  # median step time over full precision's, measured round by round beside it

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> SpeedRow:
        return cls(**d)


@dataclass
class ChatSpeedReport:
    """Decode speed of the chat lanes on the CPU, precisions side by side, and a profile of a quantized step."""

    command: str
    commit: str
    date: str
    machine: str
    model: str
    prompt_tokens: int
    steps: int
    rows: list[SpeedRow]
    profile: dict | None = None  # {"precision", "steps", "per_step_ms": [{"function", "calls", "own_ms", "cum_ms"}]}

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in ("command", "commit", "date", "machine", "model", "prompt_tokens", "steps")}
        d["rows"] = [r.to_json() for r in self.rows]
        if self.profile is not None:
            d["profile"] = self.profile
        return d

    @classmethod
    def from_json(cls, d: dict) -> ChatSpeedReport:
        return cls(**(d | {"rows": [SpeedRow.from_json(r) for r in d["rows"]]}))

    def row(self, precision: str) -> SpeedRow | None:
        return next((r for r in self.rows if r.precision == precision), None)


def load_chat_speed(path: Path = CHAT_SPEED_REPORT) -> ChatSpeedReport | None:
    """The chat speed report at `path` (the shipped one by default), or None when there is none."""
    return ChatSpeedReport.from_json(json.loads(path.read_text())) if path.is_file() else None


def cpu_speed_caption(report: ChatSpeedReport | None, precision: str) -> str:
    """Why the quantized column decodes slower on a CPU, with the measured ratio when `report` ran `precision`."""
    why = (
        "On a CPU the quantized column decodes slower than full precision: the PyTorch reference path turns "
        "the packed codes into floats at every step, for every stored position of every layer; on a GPU the "
        "Triton kernels read the codes directly."
    )
    row = report.row(precision) if report is not None else None
    if row is None:
        return why
    return why + (
        f" Measured: {precision} {row.slower_than_full:.1f}x slower per step than full precision on a "
        f"{report.prompt_tokens:,}-token chat prompt ({report.machine}, {report.date}, "
        "assets/reports/chat_cpu_speed.json)."
    )
