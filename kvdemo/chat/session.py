"""Chat over one document, answered at full precision and at a chosen KV precision, side by side.

A `ChatSession` holds a document, a conversation and two *lanes* (`kvdemo/chat/lane.py`), one per
precision: each has its own `QuantizedKVCache`, the token ids that cache holds, and its own
conversation (its own earlier answers, as a user of a server running that precision would see them).
The document sits in the system message, so `prepare()` can prefill it before the first question;
every later turn feeds only the new tokens: the chat-templated ids of the lane's conversation are
compared with the ids in its cache, and when those are a prefix only the rest is prefilled (else the
lane is re-prefilled from scratch). A follow-up question on a 6k-token document therefore costs a few
dozen tokens, not 6k. Both lanes prefill, then decode one token each in turn, so both answers stream
together, each timed on its own decode steps.

Reliability:
- one generation at a time per loaded model: `models.model_lock()` holds `LoadedModel.lock`, polling with a
  timeout so a caller can show "waiting for another user" (`on_wait`) and cancel (`should_stop`);
- cancellation (`should_stop`, or any exception raised by a callback, e.g. Streamlit's rerun on a
  Stop click or a page change) keeps the partial turn, releases the lock and leaves every cache in a
  state the next turn can reuse (a cache interrupted inside a forward pass is dropped);
- out of memory (`torch.OutOfMemoryError`, `MemoryError`) in prefill or generation: both caches
  are freed and a `ChatError` suggests a shorter document or a lower precision; the chat is kept.

No Streamlit here: the Chat page (app_pages/chat.py) and tests drive this module.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from ..models import LoadedModel, WaitCallback, model_lock
from ..precision import PRESETS, PrecisionSpec, parse_precision
from ..progress import ProgressFn, StopFn, Tracker
from ..results.chat import AnswerComparison
from ..runner import PREFILL_CHUNK, PREFILL_MODES, chat_ids, first_divergence, stop_token_ids
from .compare import PromptState, compare_answers, snapshot
from .lane import Answer, Decoding, Lane, TokenCallback, decode_together, free_memory

SYSTEM_PROMPT = "Answer the user's questions about the document below. Be brief and quote the document when you can."
NO_DOCUMENT_PROMPT = "You are a helpful assistant. Be brief."
OUT_OF_MEMORY = (torch.OutOfMemoryError, MemoryError)


class ChatError(ValueError):
    """A chat turn that cannot run (empty question, context full, out of memory), one line for a user."""


@dataclass
class Turn:
    """A question and the answers of every lane (baseline first)."""

    question: str
    answers: list[Answer]
    first_divergence: int | None  # first token index where the chosen precision differs from baseline
    waited_s: float = 0.0  # time spent waiting for another user's generation
    comparison: AnswerComparison | None = None  # each answer scored under both caches (finished turns only)

    @property
    def cancelled(self) -> bool:
        return any(a.stopped in ("cancelled", "skipped") for a in self.answers)

    def to_dict(self) -> dict:
        d = asdict(self)
        for a, row in zip(self.answers, d["answers"], strict=True):
            row["decode_tok_s"] = round(a.decode_tok_s, 3)
        return d


class ChatSession:
    """A document plus a conversation, answered by `baseline` and by `spec`, with caches reused across turns."""

    def __init__(
        self,
        lm: LoadedModel,
        spec: PrecisionSpec | str,
        document: str = "",
        baseline: PrecisionSpec | str = "full",
        prefill_chunk: int = PREFILL_CHUNK,
        prefill_mode: str = "chunked",
        compare: bool = True,
    ):
        if prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk must be a positive number of tokens, got {prefill_chunk}")
        if prefill_mode not in PREFILL_MODES:
            raise ValueError(f"unknown prefill mode {prefill_mode!r}; allowed: {', '.join(PREFILL_MODES)}")
        self.prefill_mode = prefill_mode  # how a new quantized cache stores the document (runner.PREFILL_MODES)
        self.lm = lm
        self.prefill_chunk = prefill_chunk
        self.compare = compare  # score each finished turn's answers under both caches (kvdemo/chat/compare.py)
        self.baseline = parse_precision(baseline)
        self.document = document.strip()
        self.turns: list[Turn] = []
        self._running = threading.Lock()  # held by ask() / prepare(): see wait_idle()
        self._lanes = [Lane(self.baseline, self._system()), Lane(parse_precision(spec), self._system())]

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
            lane.messages = self._system()
            lane.drop_cache()
        free_memory(self.lm.device)

    def set_precision(self, spec: PrecisionSpec | str) -> None:
        """Switch the chosen precision; the chat is kept and the new lane continues the baseline's conversation.

        Its cache is rebuilt at the next turn (or `prepare()`), since cached codes depend on the precision.
        """
        spec = parse_precision(spec)
        if spec == self.spec:
            return
        self._lanes[1] = Lane(spec, [dict(m) for m in self._lanes[0].messages])
        free_memory(self.lm.device)

    def set_prefill_mode(self, mode: str) -> None:
        """Switch how a new quantized cache stores its prompt; the chat is kept and the quantized lane's
        cache is rebuilt at the next turn (or `prepare()`), since what it stores depends on the mode."""
        if mode not in PREFILL_MODES:
            raise ValueError(f"unknown prefill mode {mode!r}; allowed: {', '.join(PREFILL_MODES)}")
        if mode == self.prefill_mode:
            return
        self.prefill_mode = mode
        for lane in self._lanes:
            if lane.spec.is_quantized:
                lane.drop_cache()
        free_memory(self.lm.device)

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
        return {lane.label: lane.cache_bytes() for lane in self._lanes}

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

    def tokens_to_read(self, question: str = "") -> int:
        """Prompt tokens the lanes would prefill now (the document before the first turn, a few dozen after):
        what a chat turn's time hint counts (`kvdemo.rates`, task "chat-read")."""
        extra = [{"role": "user", "content": question}] if question else []
        plans = [chat_ids(self.lm, lane.messages + extra, add_generation_prompt=bool(extra)) for lane in self._lanes]
        return sum(0 if lane.holds(ids) else lane.to_feed(ids) for lane, ids in zip(self._lanes, plans, strict=True))

    # --- running ----------------------------------------------------------------------------------
    def prepare(
        self,
        on_progress: ProgressFn | None = None,
        should_stop: StopFn | None = None,
        on_wait: WaitCallback | None = None,
    ) -> dict[str, int]:
        """Prefill each lane's conversation so far (the document) now; returns the tokens fed per lane.
        `on_progress` counts the tokens read, every lane's together."""
        plans = [chat_ids(self.lm, lane.messages, add_generation_prompt=False) for lane in self._lanes]
        self._check_context(max(map(len, plans)), 0)
        track = self._tracker(plans, on_progress, only_new=True)
        fed = {}
        with (
            self._running,
            model_lock(self.lm, on_wait, should_stop),
            self._caches_freed_on_oom("reading the document"),
        ):
            for lane, ids in zip(self._lanes, plans, strict=True):
                answer = Answer(lane.label)
                if not lane.holds(ids):
                    lane.feed(self.lm, ids, answer, self.prefill_chunk, track, should_stop, self.prefill_mode)
                fed[lane.label] = answer.fed_tokens
        return fed

    def ask(
        self,
        question: str,
        max_new_tokens: int = 256,
        on_token: TokenCallback | None = None,
        on_progress: ProgressFn | None = None,
        should_stop: StopFn | None = None,
        on_wait: WaitCallback | None = None,
    ) -> Turn:
        """Answer `question` at every precision, both answers streaming together through `on_token`
        (`on_progress` counts the prompt tokens the lanes read first).

        Every lane prefills its new tokens (baseline first), then the lanes decode one token each in
        turn. An answer ends at the model's end of turn, at a sentence end near `max_new_tokens`, or
        at `max_new_tokens` (`Answer.stopped`: "eos", "sentence", "length").

        Raises `ChatError` for an empty question, a conversation that no longer fits the model's
        context, or out of memory; `progress.Cancelled` if stopped while waiting for the lock (nothing
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
        answers = [Answer(lane.label, cap=max_new_tokens) for lane in self._lanes]
        with self._running, model_lock(self.lm, on_wait, should_stop) as waited, self._caches_freed_on_oom("answering"):
            try:
                comparison = self._answer(plans, answers, on_token, self._tracker(plans, on_progress), should_stop)
            except OUT_OF_MEMORY:
                raise  # nothing recorded: the user can ask again once the caches are freed
            except BaseException:
                self._record(question, msgs, answers, waited)  # interrupted by a callback: keep the partial turn
                raise
            return self._record(question, msgs, answers, waited, comparison)

    def _answer(
        self,
        plans: list[list[int]],
        answers: list[Answer],
        on_token: TokenCallback | None,
        track: Tracker | None,
        should_stop: StopFn | None,
    ) -> AnswerComparison | None:
        """Prefill every lane, then decode them together; returns early (answers "cancelled") when stopped.

        With `compare`, each lane's cache is forked once its prompt is read, and a turn whose answers both
        finished is scored token by token under both forks (`compare.compare_answers`).
        """
        stop_ids = stop_token_ids(self.lm)
        decodings, states = [], []
        for lane, ids, answer in zip(self._lanes, plans, answers, strict=True):
            answer.stopped = "cancelled"  # until its decoding says otherwise
            logits = lane.feed(self.lm, ids, answer, self.prefill_chunk, track, should_stop, self.prefill_mode)
            if logits is None:
                return None
            if self.compare:
                states.append(snapshot(lane.label, lane.cache, logits))
            decodings.append(Decoding(lane, answer, logits, stop_ids))
        decode_together(self.lm, decodings, on_token, should_stop)
        return self._compare(states, answers, should_stop)

    def _compare(
        self, states: list[PromptState], answers: list[Answer], should_stop: StopFn | None
    ) -> AnswerComparison | None:
        """The answers scored under both prompt caches; None when a turn did not finish, or when scoring runs out
        of memory (the answers are kept: the comparison is an extra)."""
        if not states or not all(a.finished for a in answers) or (should_stop is not None and should_stop()):
            return None
        try:
            return compare_answers(self.lm, states, [a.tokens for a in answers])
        except OUT_OF_MEMORY:
            states.clear()
            free_memory(self.lm.device)
            return None

    def _tracker(
        self, plans: list[list[int]], on_progress: ProgressFn | None, only_new: bool = False
    ) -> Tracker | None:
        """A count of the prompt tokens the lanes will read for `plans` (none for lanes that already hold
        theirs when `only_new`)."""
        if on_progress is None:
            return None
        total = sum(
            0 if only_new and lane.holds(ids) else lane.to_feed(ids)
            for lane, ids in zip(self._lanes, plans, strict=True)
        )
        return Tracker(total, "tokens", on_progress)

    def _check_context(self, prompt_tokens: int, max_new_tokens: int) -> None:
        limit = self.lm.max_context
        if prompt_tokens + max_new_tokens > limit:
            raise ChatError(
                f"the conversation ({prompt_tokens} tokens) plus {max_new_tokens} new tokens exceeds the model's "
                f"context ({limit} tokens): start a new chat, shorten the document or ask for fewer new tokens"
            )

    @contextmanager
    def _caches_freed_on_oom(self, doing: str) -> Iterator[None]:
        """Out of memory inside: free both caches and raise one `ChatError` line instead."""
        try:
            yield
        except OUT_OF_MEMORY:
            for lane in self._lanes:
                lane.drop_cache()
            free_memory(self.lm.device)
            raise ChatError(
                f"out of memory while {doing}: the caches were freed; try a shorter document, fewer new tokens "
                "or a lower KV precision (int4, int2)"
            ) from None

    def _record(
        self,
        question: str,
        msgs: list[list[dict]],
        answers: list[Answer],
        waited: float,
        comparison: AnswerComparison | None = None,
    ) -> Turn:
        tok = self.lm.tokenizer
        for lane, m, answer in zip(self._lanes, msgs, answers, strict=True):
            answer.text = tok.decode(answer.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            if lane.cache is not None:
                answer.cache_bytes = lane.cache_bytes()
                answer.cache_tokens = len(lane.ids)
            lane.messages = m + [{"role": "assistant", "content": answer.text.strip()}]
        base, chosen = answers[0], answers[-1]
        div = first_divergence(base.tokens, chosen.tokens) if base.tokens and chosen.tokens else None
        turn = Turn(question, answers, div, waited, comparison)
        self.turns.append(turn)
        return turn


def work_done(answers: list[Answer]) -> dict[str, tuple[float, float]]:
    """{"chat-read": (prompt tokens read, seconds), "chat-answer": (decode steps, seconds)} over every lane of a
    turn: a chat turn's two kinds of work, each with its own speed (`kvdemo.rates.record`)."""
    return {
        "chat-read": (sum(a.fed_tokens for a in answers), sum(a.prefill_s for a in answers)),
        "chat-answer": (sum(a.decode_steps for a in answers), sum(a.decode_s for a in answers)),
    }


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
