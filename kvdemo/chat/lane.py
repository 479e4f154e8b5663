"""One precision's side of a chat (a *lane*): its cache, the token ids that cache holds, its own
conversation, and its answer to the current question, decoded one token per call so that two lanes
can take turns and stream side by side (`kvdemo/chat/session.py` runs them).

An answer ends at the model's end-of-turn token, at its cap (`max_new_tokens`), or, once it is in
the last quarter of the cap, at the first sentence end: the text so far ends in `.`, `!` or `?`
(not an abbreviation such as "Mr.") and the next token starts with a space, or the next token breaks
the line after a complete one (a sentence, a list item, a heading, a line ending in `:`). The cap
therefore cuts mid-sentence only when no sentence ended in that last quarter.

No Streamlit here. References: KIVI (arXiv:2402.02750) for the residual/blocked cache a lane holds;
vLLM's automatic prefix caching for reusing a prompt's cached prefix across requests.
"""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..cache import QuantizedKVCache
from ..models import LoadedModel
from ..precision import PrecisionSpec
from ..progress import StopFn, Tracker
from ..runner import PREFILL_MODES, decoder_layers, layer_progress, new_cache, prefill, transplant

SENTENCE_WINDOW = 0.25  # the last quarter of the cap: there an answer ends at the first sentence end
ABBREVIATIONS = {"mr.", "mrs.", "ms.", "dr.", "st.", "mt.", "jr.", "sr.", "vs.", "etc.", "e.g.", "i.e.", "no."}
_SENTENCE_END = re.compile(r"[.!?…][\"'”’)\]*_]*$")
_OPENERS = "\"'“‘([*_"  # quotes and brackets a word may open with: '"Mr.' is still "Mr."

TokenCallback = Callable[["Answer", str], None]  # (the answer so far, its newest token's text; "" if none)


@dataclass
class Answer:
    """One precision's answer to one question."""

    precision: str
    cap: int = 0  # the most new tokens this answer could have (max_new_tokens)
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # streamed pieces while decoding, the decoded tokens once the turn is recorded
    stopped: str = "skipped"  # "eos" | "sentence" | "length" | "cancelled" | "skipped" (never started)
    prompt_tokens: int = 0  # tokens of the conversation up to the answer
    fed_tokens: int = 0  # tokens prefilled for this turn (the rest were already in the cache)
    reprefilled: bool = False  # the cache could not be reused and was rebuilt from scratch
    prefill_s: float = 0.0
    decode_s: float = 0.0  # time in this lane's own decode steps (not the other lane's, not streaming)
    decode_steps: int = 0  # one-token forward passes behind `decode_s`
    cache_bytes: int = 0  # live bytes of this precision's cache after the turn
    cache_tokens: int = 0  # tokens held in that cache

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 and self.decode_steps else 0.0

    @property
    def finished(self) -> bool:
        return self.stopped in ("eos", "sentence", "length")


def _layer_counter(track: Tracker | None, what: str, tokens: int):
    """An `on_layer` for `runner.layer_progress`: each decoder layer counts its share of the chunk's tokens."""
    if track is None:
        return None
    return lambda done, layers: track.advance(what, units=tokens * done // layers - tokens * (done - 1) // layers)


def free_memory(device: torch.device) -> None:
    """Return a dropped cache's memory now (on a GPU, to the driver) rather than at the next collection."""
    gc.collect()
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def sentence_window_start(cap: int) -> int:
    """Tokens an answer has before it may end at a sentence end instead of running to `cap`."""
    return cap - max(1, round(cap * SENTENCE_WINDOW))


def ends_sentence(text: str, next_piece: str) -> bool:
    """True when `text` ends a sentence and `next_piece` (the next token's text) starts the next one.

    A line break ends a sentence only after a line that is one: it ends in `.`, `!`, `?` or `:`, or it is a
    list item or a heading. A line broken mid-sentence (a model looping over a quote it breaks into lines)
    is not an end, so an answer said to end at a sentence end never stops mid-sentence.
    """
    line = text.rsplit("\n", 1)[-1].strip()
    if next_piece.startswith("\n") and line:
        return _complete_line(line)
    if not next_piece[:1].isspace():
        return False  # "3." + "14", "e.g" + "."
    return _ends_with_sentence_end(text)


def _ends_with_sentence_end(text: str) -> bool:
    words = text.split()
    if not words or not _SENTENCE_END.search(words[-1]):
        return False
    last = words[-1].lower().lstrip(_OPENERS)
    if last in ABBREVIATIONS or re.fullmatch(r"[a-z]\.", last):
        return False  # "Mr. Darcy", '"Mrs. Long', "J. Austen"
    return not re.fullmatch(r"\d+\.", text.rsplit("\n", 1)[-1].strip())  # "2." opening a list item


def _complete_line(line: str) -> bool:
    """A line that may end an answer before a line break: a sentence end, a colon, a list item, a heading."""
    if re.match(r"([-*•+]|\d+[.)]|#+)\s", line) or re.fullmatch(r"\*\*.+\*\*:?", line):
        return True
    return line.endswith(":") or _ends_with_sentence_end(line)


class Lane:
    """One precision's cache, the ids it holds and the conversation it answers."""

    def __init__(self, spec: PrecisionSpec, messages: list[dict]):
        self.spec = spec
        self.messages = messages  # this lane's conversation, system message included
        self.cache: QuantizedKVCache | None = None
        self.ids: list[int] = []  # the token ids whose keys/values `cache` holds

    @property
    def label(self) -> str:
        return self.spec.label

    def drop_cache(self) -> None:
        self.cache, self.ids = None, []

    def cache_bytes(self) -> int:
        return self.cache.nbytes()["total"] if self.cache is not None else 0

    def holds(self, ids: Sequence[int]) -> bool:
        """The cache already holds `ids` (or more after them)."""
        return self.cache is not None and self.ids[: len(ids)] == list(ids)

    def reusable(self, ids: Sequence[int]) -> bool:
        """The cache holds a proper prefix of `ids`: `feed` only adds the rest."""
        held = len(self.ids)
        return self.cache is not None and held < len(ids) and list(ids[:held]) == self.ids

    def to_feed(self, ids: Sequence[int]) -> int:
        """Tokens `feed(ids)` prefills: the rest after a reusable cache, else all of them."""
        return len(ids) - len(self.ids) if self.reusable(ids) else len(ids)

    def feed(
        self,
        lm: LoadedModel,
        ids: Sequence[int],
        answer: Answer,
        chunk: int,
        track: Tracker | None = None,
        should_stop: StopFn | None = None,
        mode: str = "chunked",
    ) -> torch.Tensor | None:
        """Bring the cache to hold `ids`; return the next-token logits [V] (None if stopped first).

        Reuses the cache when its ids are a prefix of `ids` and feeds the rest in chunks of `chunk`
        tokens, polling `should_stop` between chunks and counting each chunk's tokens on `track`; else
        starts a new cache.
        mode (runner.PREFILL_MODES): "exact" computes a new quantized cache's tokens at full precision,
        chunk by chunk, and stores them quantized once all are in (`runner.prefill`'s exact mode);
        tokens added to a cache that already holds some go in chunk by chunk in both modes.
        """
        if mode not in PREFILL_MODES:
            raise ValueError(f"unknown prefill mode {mode!r}; allowed: {', '.join(PREFILL_MODES)}")
        ids = list(ids)
        held = len(self.ids)
        if not self.reusable(ids):
            answer.reprefilled = self.cache is not None
            self.drop_cache()
            free_memory(lm.device)
            self.cache, held = new_cache(lm, self.spec), 0
        rest = ids[held:]  # never empty: a new turn always adds tokens
        answer.prompt_tokens = len(ids)
        exact = mode == "exact" and held == 0 and self.spec.is_quantized
        target = new_cache(lm, "full") if exact else self.cache  # exact: states at full precision first
        t0 = time.perf_counter()
        logits = None
        try:
            for start in range(0, len(rest), chunk):
                if should_stop is not None and should_stop():
                    return None
                piece = rest[start : start + chunk]
                what = f"{self.label}: reading tokens {start + 1:,}-{start + len(piece):,} of {len(rest):,}"
                if track is not None:
                    track.report(what)
                with layer_progress(lm, _layer_counter(track, what, len(piece))):  # a chunk moves layer by layer
                    logits = prefill(lm, piece, target)  # [V]
                if not exact:
                    answer.fed_tokens += len(piece)
                if track is not None and not decoder_layers(lm):
                    track.advance(what, units=len(piece))
            if exact:
                transplant(target, self.cache)  # one append per layer: as one call would store them
                answer.fed_tokens += len(rest)
        finally:
            answer.prefill_s = time.perf_counter() - t0
            self.sync(ids)
        return logits

    def sync(self, attempted: Sequence[int]) -> None:
        """Record which of `attempted` the cache now holds; drop a cache an exception left half-updated
        (its layers hold different numbers of tokens)."""
        if self.cache is None:
            return
        if len({layer.get_seq_length() for layer in self.cache.layers}) > 1:
            self.drop_cache()
            return
        self.ids = list(attempted[: self.cache.get_seq_length()])


@dataclass
class Decoding:
    """A lane's answer in progress: the logits of its next token and the rules that end it."""

    lane: Lane
    answer: Answer
    logits: torch.Tensor  # [V] float32, the next token's
    stop_ids: set[int]

    def step(self, lm: LoadedModel, on_token: TokenCallback | None = None) -> bool:
        """Choose the next token (greedy), stream it, and feed it unless the answer ends with it.

        Returns False once the answer has ended (its `stopped` says why); an answer that ends before a
        new sentence streams one last call with an empty piece. Only the forward pass counts towards
        the lane's decode time.
        """
        answer = self.answer
        nxt = int(torch.argmax(self.logits))
        piece = lm.tokenizer.decode([nxt])
        near_cap = len(answer.tokens) >= sentence_window_start(answer.cap)
        if near_cap and nxt not in self.stop_ids and ends_sentence(answer.text, piece):
            answer.stopped = "sentence"
            if on_token is not None:
                on_token(answer, "")
            return False
        answer.tokens.append(nxt)  # kept even if the callback below raises
        if nxt in self.stop_ids:
            answer.stopped, piece = "eos", ""  # the end-of-turn token is not text
        elif len(answer.tokens) >= answer.cap:
            answer.stopped = "length"
        answer.text += piece
        if on_token is not None:
            on_token(answer, piece)
        if answer.finished:
            return False
        t0 = time.perf_counter()
        self.logits = prefill(lm, [nxt], self.lane.cache)  # [V]
        answer.decode_s += time.perf_counter() - t0
        answer.decode_steps += 1
        return True


def decode_together(
    lm: LoadedModel,
    decodings: list[Decoding],
    on_token: TokenCallback | None = None,
    should_stop: StopFn | None = None,
) -> None:
    """Decode every lane's answer, one token per lane in turn, until each has ended or `should_stop()`.

    Answers not finished when stopped (or when a callback raises) keep `stopped="cancelled"`. Each
    lane's cache is synced with its answer's tokens however this returns.
    """
    active = list(decodings)
    try:
        while active:
            for run in list(active):
                if should_stop is not None and should_stop():
                    return
                if not run.step(lm, on_token):
                    active.remove(run)
    finally:
        for run in decodings:
            run.lane.sync(run.lane.ids + run.answer.tokens)
