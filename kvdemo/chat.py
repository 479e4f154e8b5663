"""Chat over one document, answered at full precision and at a chosen KV precision, side by side.

A `ChatSession` holds a document and a conversation. Each precision is a *lane*: its own
`QuantizedKVCache`, the token ids that cache holds, and its own conversation (its own earlier
answers, as a user of a server running that precision would see them). The document sits in the
system message, so `prepare()` can prefill it before the first question; every later turn feeds only
the new tokens: the chat-templated ids of the lane's conversation are compared with the ids in its
cache, and when those are a prefix only the rest is prefilled (else the lane is re-prefilled from
scratch). A follow-up question on a 6k-token document therefore costs a few dozen tokens, not 6k.

Reliability (issue 7):
- one generation at a time per loaded model: `model_lock()` holds `LoadedModel.lock`, polling with a
  timeout so a caller can show "waiting for another user" (`on_wait`) and cancel (`should_stop`);
- cancellation (`should_stop`, or any exception raised by a callback, e.g. Streamlit's rerun on a
  Stop click or a page change) keeps the partial turn, releases the lock and leaves every cache in a
  state the next turn can reuse (a cache interrupted inside a forward pass is dropped);
- out of memory (`torch.OutOfMemoryError`, `MemoryError`) in prefill or generation: both caches
  are freed and a `ChatError` suggests a shorter document or a lower precision; the chat is kept.

No Streamlit here: the Chat page (app_pages/chat.py) and tests drive this module.
References: KIVI (arXiv:2402.02750) for the residual/blocked cache the lanes use; vLLM's automatic
prefix caching for the idea of reusing a prompt's cached prefix across requests.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from .cache import QuantizedKVCache
from .models import LoadedModel
from .precision import PRESETS, PrecisionSpec, parse_precision
from .runner import PREFILL_CHUNK, Cancelled, chat_ids, first_divergence, generate, new_cache, prefill

SYSTEM_PROMPT = "Answer the user's questions about the document below. Be brief and quote the document when you can."
NO_DOCUMENT_PROMPT = "You are a helpful assistant. Be brief."
LOCK_POLL_S = 0.25  # how often a waiting turn re-checks the lock, `should_stop` and calls `on_wait`

TokenCallback = Callable[[str, int, str], None]  # (precision label, token id, decoded piece)
ProgressCallback = Callable[[str, int, int], None]  # (precision label, tokens prefilled, tokens to prefill)
WaitCallback = Callable[[float], None]  # seconds waited so far for another user's generation
StopCallback = Callable[[], bool]


class ChatError(ValueError):
    """A chat turn that cannot run (empty question, context full, out of memory), one line for a user."""


@dataclass
class Answer:
    """One precision's answer to one question."""

    precision: str
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stopped: str = "skipped"  # "eos" | "length" | "cancelled" | "skipped" (never started)
    prompt_tokens: int = 0  # tokens of the conversation up to the answer
    fed_tokens: int = 0  # tokens prefilled for this turn (the rest were already in the cache)
    reprefilled: bool = False  # the cache could not be reused and was rebuilt from scratch
    prefill_s: float = 0.0
    decode_s: float = 0.0
    cache_bytes: int = 0  # live bytes of this precision's cache after the turn
    cache_tokens: int = 0  # tokens held in that cache

    @property
    def decode_tok_s(self) -> float:
        steps = max(len(self.tokens) - 1, 0)  # the first token comes from the prefill's logits
        return steps / self.decode_s if self.decode_s > 0 and steps else 0.0


@dataclass
class Turn:
    """A question and the answers of every lane (baseline first)."""

    question: str
    answers: list[Answer]
    first_divergence: int | None  # first token index where the chosen precision differs from baseline
    waited_s: float = 0.0  # time spent waiting for another user's generation

    @property
    def cancelled(self) -> bool:
        return any(a.stopped in ("cancelled", "skipped") for a in self.answers)

    def to_dict(self) -> dict:
        d = asdict(self)
        for a, row in zip(self.answers, d["answers"], strict=True):
            row["decode_tok_s"] = round(a.decode_tok_s, 3)
        return d


@dataclass
class _Lane:
    spec: PrecisionSpec
    messages: list[dict]  # this lane's conversation, system message included
    cache: QuantizedKVCache | None = None
    ids: list[int] = field(default_factory=list)  # the token ids whose keys/values `cache` holds

    @property
    def label(self) -> str:
        return self.spec.label


@contextmanager
def model_lock(
    lm: LoadedModel,
    on_wait: WaitCallback | None = None,
    should_stop: StopCallback | None = None,
    poll_s: float = LOCK_POLL_S,
) -> Iterator[float]:
    """Hold `lm.lock` (one generation at a time per loaded model); yields the seconds spent waiting.

    While another generation holds it, `on_wait(seconds)` is called every `poll_s` and
    `should_stop()` is polled: if it returns True, `runner.Cancelled` is raised without the lock.
    """
    lock: threading.Lock = lm.lock
    start = time.perf_counter()
    if not lock.acquire(blocking=False):
        while True:
            if on_wait is not None:
                on_wait(time.perf_counter() - start)
            if should_stop is not None and should_stop():
                raise Cancelled("cancelled while waiting for another user's generation")
            if lock.acquire(timeout=poll_s):
                break
    try:
        yield time.perf_counter() - start
    finally:
        lock.release()


def _consistent(cache: QuantizedKVCache) -> bool:
    """Every layer holds the same number of tokens (false after an exception inside a forward pass)."""
    return len({layer.get_seq_length() for layer in cache.layers}) <= 1


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


class ChatSession:
    """A document plus a conversation, answered by `baseline` and by `spec`, with caches reused across turns."""

    def __init__(
        self,
        lm: LoadedModel,
        spec: PrecisionSpec | str,
        document: str = "",
        baseline: PrecisionSpec | str = "full",
        prefill_chunk: int = PREFILL_CHUNK,
    ):
        if prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk must be a positive number of tokens, got {prefill_chunk}")
        self.lm = lm
        self.prefill_chunk = prefill_chunk
        self.baseline = parse_precision(baseline)
        self.document = document.strip()
        self.turns: list[Turn] = []
        self._running = threading.Lock()  # held by ask() / prepare(): see wait_idle()
        self._lanes = [_Lane(self.baseline, self._system()), _Lane(parse_precision(spec), self._system())]

    # --- state ------------------------------------------------------------------------------------
    @property
    def spec(self) -> PrecisionSpec:
        return self._lanes[1].spec

    @property
    def labels(self) -> list[str]:
        return [lane.label for lane in self._lanes]

    def _system(self) -> list[dict]:
        content = f"{SYSTEM_PROMPT}\n\n{self.document}" if self.document else NO_DOCUMENT_PROMPT
        return [{"role": "system", "content": content}]

    def set_document(self, document: str) -> None:
        """A new document starts a new conversation (both caches are dropped)."""
        self.document = document.strip()
        self.reset()

    def reset(self) -> None:
        """Forget the conversation and the caches; keep the document and the precisions."""
        self.turns = []
        for lane in self._lanes:
            lane.messages, lane.cache, lane.ids = self._system(), None, []
        _free_memory(self.lm.device)

    def set_precision(self, spec: PrecisionSpec | str) -> None:
        """Switch the chosen precision; the chat is kept and the new lane continues the baseline's conversation.

        Its cache is rebuilt at the next turn (or `prepare()`), since cached codes depend on the precision.
        """
        spec = parse_precision(spec)
        if spec == self.spec:
            return
        base = self._lanes[0]
        self._lanes[1] = _Lane(spec, [dict(m) for m in base.messages])
        _free_memory(self.lm.device)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no ask() / prepare() of this session is running; False if one still is after `timeout` s.

        A run stopped from the UI can still be unwinding in its old script thread (Streamlit may start
        the next run before the stopped one has reached its next yield point); the page waits here so
        it shows the stopped turn and never changes the session under a running turn.
        """
        if not self._running.acquire(timeout=timeout):
            return False
        self._running.release()
        return True

    def cache_bytes(self) -> dict[str, int]:
        """Live bytes of each lane's cache now (0 for a lane not prefilled yet)."""
        return {lane.label: lane.cache.nbytes()["total"] if lane.cache is not None else 0 for lane in self._lanes}

    def cached_tokens(self) -> dict[str, int]:
        return {lane.label: len(lane.ids) for lane in self._lanes}

    def history(self) -> dict[str, list[dict]]:
        """Each lane's conversation (copies), system message included."""
        return {lane.label: [dict(m) for m in lane.messages] for lane in self._lanes}

    def prompt_tokens(self, question: str = "") -> int:
        """Tokens of the longest lane's conversation plus `question` (what the context must hold)."""
        extra = [{"role": "user", "content": question}] if question else []
        return max(
            len(chat_ids(self.lm, lane.messages + extra, add_generation_prompt=bool(extra))) for lane in self._lanes
        )

    # --- running ----------------------------------------------------------------------------------
    def prepare(
        self,
        on_progress: ProgressCallback | None = None,
        should_stop: StopCallback | None = None,
        on_wait: WaitCallback | None = None,
    ) -> dict[str, int]:
        """Prefill each lane's conversation so far (the document) now; returns the tokens fed per lane."""
        plans = [chat_ids(self.lm, lane.messages, add_generation_prompt=False) for lane in self._lanes]
        self._check_context(max(map(len, plans)), 0)
        fed = {}
        try:
            with self._running, model_lock(self.lm, on_wait, should_stop):
                for lane, ids in zip(self._lanes, plans, strict=True):
                    answer = Answer(lane.label)
                    if lane.cache is None or lane.ids[: len(ids)] != ids:  # not prefilled yet
                        self._feed(lane, ids, answer, on_progress, should_stop)
                    fed[lane.label] = answer.fed_tokens
        except (torch.OutOfMemoryError, MemoryError):
            raise self._out_of_memory("reading the document") from None
        return fed

    def ask(
        self,
        question: str,
        max_new_tokens: int = 128,
        on_token: TokenCallback | None = None,
        on_progress: ProgressCallback | None = None,
        should_stop: StopCallback | None = None,
        on_wait: WaitCallback | None = None,
    ) -> Turn:
        """Answer `question` at every precision (baseline first), streaming tokens through `on_token`.

        Raises `ChatError` for an empty question, a conversation that no longer fits the model's
        context, or out of memory; `runner.Cancelled` if stopped while waiting for the lock (nothing
        recorded). A turn stopped later (or interrupted by an exception from a callback) is recorded
        with its partial answers, `stopped="cancelled"` / `"skipped"`.
        """
        question = (question or "").strip()
        if not question:
            raise ChatError("type a question first")
        if max_new_tokens <= 0:
            raise ChatError(f"max_new_tokens must be a positive number, got {max_new_tokens}")
        msgs = [lane.messages + [{"role": "user", "content": question}] for lane in self._lanes]
        plans = [chat_ids(self.lm, m) for m in msgs]
        self._check_context(max(map(len, plans)), max_new_tokens)
        answers = [Answer(lane.label) for lane in self._lanes]
        with self._running, model_lock(self.lm, on_wait, should_stop) as waited:
            try:
                for lane, ids, answer in zip(self._lanes, plans, answers, strict=True):
                    self._answer(lane, ids, answer, max_new_tokens, on_token, on_progress, should_stop)
            except (torch.OutOfMemoryError, MemoryError):
                raise self._out_of_memory("answering") from None  # nothing recorded: the user can retry
            except BaseException:
                self._record(question, msgs, answers, waited)  # interrupted by a callback: keep the partial turn
                raise
            return self._record(question, msgs, answers, waited)

    def _check_context(self, prompt_tokens: int, max_new_tokens: int) -> None:
        limit = self.lm.max_context
        if prompt_tokens + max_new_tokens > limit:
            raise ChatError(
                f"the conversation ({prompt_tokens} tokens) plus {max_new_tokens} new tokens exceeds the model's "
                f"context ({limit} tokens): start a new chat, shorten the document or ask for fewer new tokens"
            )

    def _out_of_memory(self, doing: str) -> ChatError:
        for lane in self._lanes:
            lane.cache, lane.ids = None, []
        _free_memory(self.lm.device)
        return ChatError(
            f"out of memory while {doing}: the caches were freed; try a shorter document, fewer new tokens "
            "or a lower KV precision (int4, int2)"
        )

    def _feed(
        self,
        lane: _Lane,
        ids: Sequence[int],
        answer: Answer,
        on_progress: ProgressCallback | None,
        should_stop: StopCallback | None,
    ) -> torch.Tensor | None:
        """Bring the lane's cache to hold `ids`; return the next-token logits [V] (None if stopped first).

        Reuses the cache when its ids are a prefix of `ids`; feeds the rest in chunks of
        `prefill_chunk` tokens, polling `should_stop` and reporting progress between chunks.
        """
        ids = list(ids)
        held = len(lane.ids)
        reusable = lane.cache is not None and held < len(ids) and ids[:held] == lane.ids
        if not reusable:
            answer.reprefilled = lane.cache is not None
            lane.cache, lane.ids, held = new_cache(self.lm, lane.spec), [], 0
            _free_memory(self.lm.device)
        rest = ids[held:]  # never empty: a new turn always adds tokens
        answer.prompt_tokens = len(ids)
        t0 = time.perf_counter()
        logits = None
        try:
            for start in range(0, len(rest), self.prefill_chunk):
                if should_stop is not None and should_stop():
                    return None
                if on_progress is not None:
                    on_progress(lane.label, start, len(rest))
                logits = prefill(self.lm, rest[start : start + self.prefill_chunk], lane.cache)  # [V]
                answer.fed_tokens += len(rest[start : start + self.prefill_chunk])
            if on_progress is not None:
                on_progress(lane.label, len(rest), len(rest))
        finally:
            answer.prefill_s = time.perf_counter() - t0
            self._sync(lane, ids)
        return logits

    def _answer(
        self,
        lane: _Lane,
        ids: list[int],
        answer: Answer,
        max_new_tokens: int,
        on_token: TokenCallback | None,
        on_progress: ProgressCallback | None,
        should_stop: StopCallback | None,
    ) -> None:
        answer.stopped = "cancelled"  # until generate() says otherwise
        logits = self._feed(lane, ids, answer, on_progress, should_stop)
        if logits is None:
            return

        def streamed(token: int, piece: str) -> None:
            answer.tokens.append(token)  # kept even if the callback below raises
            if on_token is not None:
                on_token(lane.label, token, piece)

        t0 = time.perf_counter()
        try:
            _, _, answer.stopped, _ = generate(self.lm, lane.cache, logits, max_new_tokens, streamed, should_stop)
        finally:
            answer.decode_s = time.perf_counter() - t0
            self._sync(lane, ids + answer.tokens)

    def _sync(self, lane: _Lane, attempted: list[int]) -> None:
        """Record which of `attempted` the lane's cache now holds (drop a cache left half-updated)."""
        if lane.cache is None:
            return
        if not _consistent(lane.cache):
            lane.cache, lane.ids = None, []
            return
        lane.ids = list(attempted[: lane.cache.get_seq_length()])

    def _record(self, question: str, msgs: list[list[dict]], answers: list[Answer], waited: float) -> Turn:
        tok = self.lm.tokenizer
        for lane, m, answer in zip(self._lanes, msgs, answers, strict=True):
            answer.text = tok.decode(answer.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            if lane.cache is not None:
                answer.cache_bytes = lane.cache.nbytes()["total"]
                answer.cache_tokens = len(lane.ids)
            lane.messages = m + [{"role": "assistant", "content": answer.text.strip()}]
        base, chosen = answers[0], answers[-1]
        div = first_divergence(base.tokens, chosen.tokens) if base.tokens and chosen.tokens else None
        turn = Turn(question, answers, div, waited)
        self.turns.append(turn)
        return turn


def divergence_split(answer: Answer, index: int | None, tokenizer) -> tuple[str, str, str]:
    """The answer's text before its token `index`, that token, and the rest ("", "" when `index` is None)."""
    if index is None or index >= len(answer.tokens):
        return answer.text, "", ""
    kw = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}
    parts = (answer.tokens[:index], answer.tokens[index : index + 1], answer.tokens[index + 1 :])
    return tuple(tokenizer.decode(p, **kw) for p in parts)


def quantized_presets() -> list[str]:
    """Preset names a user can compare with full precision (everything except the baseline)."""
    return [name for name, spec in PRESETS.items() if spec.is_quantized]
