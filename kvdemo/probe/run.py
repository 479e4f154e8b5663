"""The probe run: the needle grid asked of every endpoint, the same prompts to each, a few requests at a time.

- Cells: (seed, length, depth), lengths ascending; each cell's prompt is built once (kvdemo.probe.prompts) and
  sent to every endpoint through chat completions (kvdemo.probe.client), its reply scored by exact match
  (`needle.answer_matches`) and, where log-probs come back, by the log-prob of the answer's tokens.
- Polite: each endpoint has its own `concurrency` request slots; the client retries 429/5xx/timeouts with
  backoff. A prompt an endpoint finds too long stops it being sent as long or longer prompts; a failure that
  concerns the whole endpoint (unreachable, wrong key, unknown model, no key) stops it being sent anything more.
  Cells not sent are recorded with the reason, so the report says what happened to every cell.
- Nothing measured is lost: a failed request is an error cell and the run goes on; `Cancelled` (kvdemo.progress)
  carries every finished cell.
- Progress: the unit is a token sent, a cell's requested length once per endpoint.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from threading import Event, Lock

from ..needle.prompts import NUM_KEYS, answer_matches, cell_rng, choose_haystack, make_task
from ..needle.run import MAX_REPEATS
from ..progress import ProgressFn, StopFn, Tracker
from ..results.probe import ProbeCell, ProbeReport
from .client import CONTEXT, ENDPOINT_FAILURES, Client, Endpoint, ProbeError
from .prompts import Question, answer_logprob, question

MAX_CONCURRENCY = 32
DEFAULT_MAX_TOKENS = 32  # room for a chatty "The pass key is 12345." and the like
POLL_S = 0.25  # how often the run looks at Cancel while requests are in flight
ESTIMATE_NOTE = (
    "lengths are approximate: prompts are sized by kvdemo's word-piece estimate; prompt_tokens is what each "
    "endpoint counted (usage)"
)


@dataclass
class _EndpointState:
    """What one endpoint has shown so far: a failure that ends it, the shortest length it found too long."""

    fatal: ProbeError | None = None
    too_long_at: int | None = None
    lock: Lock = field(default_factory=Lock)


def work_tokens(lengths: Sequence[int], depths: Sequence[float], endpoints: int, repeats: int = 1) -> int:
    """Tokens a probe sends by its requested lengths: its progress unit."""
    return sum(int(n) for n in lengths) * len(depths) * endpoints * repeats


def _questions(
    kind: str,
    lengths: Sequence[int],
    depths: Sequence[float],
    seed: int = 0,
    repeats: int = 1,
    document: str | None = None,
    document_name: str = "document",
    needle: str = "",
    question_text: str = "",
    answer: str = "",
    num_keys: int = NUM_KEYS,
) -> tuple[str, Iterator[tuple[Question, str | None]]]:
    """(haystack name, the cells' questions seed by seed and lengths ascending, each with a note or None), the
    questions built as they are taken (a long prompt takes a second or two to build)."""
    name, hay, joiner = choose_haystack(kind, document, document_name)
    make_task(kind, cell_rng(seed, 0, 0.0), needle, question_text, answer, num_keys)  # a bad needle fails now

    def build() -> Iterator[tuple[Question, str | None]]:
        for s, n, d in itertools.product(range(seed, seed + repeats), sorted(lengths), depths):
            rng = cell_rng(s, n, d)
            q = question(make_task(kind, rng, needle, question_text, answer, num_keys), hay, n, d, s, rng, joiner)
            repeated = q.prompt.haystack_copies > 1 and name != "filler"
            yield (
                q,
                f"the {name} is shorter than {n} tokens: it was repeated to fill the haystack" if repeated else None,
            )

    return name, build()


def questions(*args, **kw) -> tuple[str, list[Question], list[str]]:
    """(haystack name, every cell's question seed by seed and lengths ascending, notes); `_questions`' arguments."""
    name, built = _questions(*args, **kw)
    out, notes = [], [ESTIMATE_NOTE]
    for q, note in built:
        out.append(q)
        notes += [note] if note and note not in notes else []
    return name, out, notes


def _cell(endpoint: str, q: Question, **kw) -> ProbeCell:
    return ProbeCell(
        endpoint=endpoint,
        length=q.length,
        depth=q.depth,
        seed=q.seed,
        expected=q.task.answer,
        estimated_tokens=q.estimated_tokens,
        depth_actual=q.prompt.depth_actual,
        **kw,
    )


def ask(client: Client, q: Question, state: _EndpointState, max_tokens: int, stop: Event) -> ProbeCell | None:
    """One question to one endpoint as a cell: answered, failed (with its message) or not sent (with why).
    None when the run was cancelled before it was sent."""
    name = client.endpoint.name
    if stop.is_set():
        return None
    with state.lock:
        if state.fatal is not None:
            return _cell(name, q, found=None, error=f"not sent: {state.fatal}", error_kind=state.fatal.kind)
        if state.too_long_at is not None and q.length >= state.too_long_at:
            why = f"not sent: a {state.too_long_at:,}-token prompt was already too long for {name}"
            return _cell(name, q, found=None, error=why, error_kind=CONTEXT)
    try:
        reply = client.chat(q.messages(), max_tokens, stop.is_set)
    except ProbeError as err:
        with state.lock:
            if err.kind in ENDPOINT_FAILURES and state.fatal is None:
                state.fatal = err
            if err.kind == CONTEXT:
                state.too_long_at = min(q.length, state.too_long_at or q.length)
        return _cell(name, q, found=None, error=str(err), error_kind=err.kind, attempts=err.attempts)
    except Exception as err:  # a failure the client does not know: the cell says so, the run goes on
        return _cell(name, q, found=None, error=f"{name}: {type(err).__name__}: {err}", error_kind="error")
    reply_lp = round(sum(lp for _, lp in reply.token_logprobs), 4) if reply.token_logprobs else None
    return _cell(
        name,
        q,
        found=answer_matches(q.task.answer, reply.text),
        answer=reply.text.strip(),
        latency_s=reply.latency_s,
        prompt_tokens=reply.prompt_tokens,
        completion_tokens=reply.completion_tokens,
        answer_logprob=answer_logprob(reply.token_logprobs, reply.text, q.task.answer),
        reply_logprob=reply_lp,
        attempts=reply.attempts,
    )


def _cell_text(c: ProbeCell) -> str:
    at = f"{c.endpoint} at {c.length:,} tokens, depth {c.depth:g}%, seed {c.seed}"
    return f"{at}: {'found' if c.found else 'missed' if c.answered else c.error_kind or 'failed'}"


def run_probe(
    endpoints: Sequence[Endpoint],
    lengths: Sequence[int],
    depths: Sequence[float],
    kind: str = "passkey",
    document: str | None = None,
    document_name: str = "document",
    needle: str = "",
    question: str = "",
    answer: str = "",
    seed: int = 0,
    repeats: int = 1,
    concurrency: int = 2,
    timeout_s: float = 60.0,
    retries: int = 3,
    backoff_s: float = 1.0,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
) -> ProbeReport:
    """Every (length, depth) cell, `repeats` seeds, asked of every endpoint; a `ProbeReport` of the cells.

    `on_progress` gets a `Progress` in tokens sent after each cell (the cell in `Progress.row`) and about every
    second while requests are in flight; when `should_stop()` says so no more requests are sent and `Cancelled`
    carries the finished cells. ValueError (a message for the user) for settings that cannot run.
    """
    endpoints = list(endpoints)
    if not endpoints:
        raise ValueError("give at least one endpoint (NAME=BASE_URL,MODEL[,KEY_ENV])")
    names = [e.name for e in endpoints]
    if len(set(names)) < len(names):
        raise ValueError(f"endpoint names must differ: {', '.join(names)}")
    lengths, depths = sorted({int(n) for n in lengths}), list(dict.fromkeys(float(d) for d in depths))
    if not lengths or not depths:
        raise ValueError("give at least one length and one depth")
    if any(not 0 <= d <= 100 for d in depths):
        raise ValueError("depths are percent of the haystack: 0..100")
    if not 1 <= concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"concurrency must be 1..{MAX_CONCURRENCY} requests per endpoint, not {concurrency}")
    if not 1 <= repeats <= MAX_REPEATS:
        raise ValueError(f"repeats must be 1..{MAX_REPEATS}, not {repeats}")
    if max_tokens < 1:
        raise ValueError("max tokens must be at least 1")
    clients = [Client(e, timeout_s, retries, backoff_s) for e in endpoints]
    haystack, built = _questions(kind, lengths, depths, seed, repeats, document, document_name, needle, question,
                                 answer)  # fmt: skip
    notes = [ESTIMATE_NOTE]
    track = Tracker(work_tokens(lengths, depths, len(endpoints), repeats), "tokens", on_progress, should_stop)
    t0 = time.perf_counter()
    stop = Event()
    pools = [ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=f"probe-{e.name}") for e in endpoints]
    states = [_EndpointState() for _ in endpoints]
    pending: set = set()
    last = [time.perf_counter()]  # when progress was last reported

    def collect(timeout: float) -> None:
        """Count the cells finished within `timeout` seconds (0: those already finished); stop when asked."""
        nonlocal pending
        track.check("the probe")
        done, pending = wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
        for fut in done:
            cell = fut.result()
            if cell is not None:
                track.advance(_cell_text(cell), cell.length, cell)
                last[0] = time.perf_counter()
        if pending and time.perf_counter() - last[0] > 1.0:
            track.report(f"waiting for {min(len(pending), concurrency * len(endpoints))} requests")
            last[0] = time.perf_counter()

    try:
        for q, note in built:  # requests go out while the next, longer prompts are built
            notes += [note] if note and note not in notes else []
            pending |= {
                pool.submit(ask, client, q, state, max_tokens, stop)
                for pool, client, state in zip(pools, clients, states, strict=True)
            }
            collect(0)
        while pending:
            collect(POLL_S)
    finally:
        stop.set()  # queued requests return unsent; those in flight end on their own timeout
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
    order = {n: i for i, n in enumerate(names)}
    cells = sorted(track.rows, key=lambda c: (c.seed, c.length, depths.index(c.depth), order[c.endpoint]))
    return ProbeReport(
        endpoints=[e.to_json() for e in endpoints],
        kind=kind,
        haystack=haystack,
        lengths=lengths,
        depths=depths,
        seed=seed,
        repeats=repeats,
        cells=cells,
        seconds=time.perf_counter() - t0,
        settings={"concurrency": concurrency, "timeout_s": timeout_s, "retries": retries, "max_tokens": max_tokens},
        notes=notes,
    )
