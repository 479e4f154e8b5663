"""The probe run: the needle grid asked of every endpoint, the same prompts to each, a few requests at a time.

- Cells: (seed, length, depth), lengths ascending; each cell's prompt is built once (kvdemo.probe.prompts) and
  sent to every endpoint through chat completions (kvdemo.probe.client), its reply scored by exact match
  (`needle.answer_matches`) and by the answer's log-prob, read where `logprobs` says: "chat", the log-probs of
  the reply's tokens that spell the answer (when found); "echo", a second request per answered cell to the
  completions API with the prompt and the true answer echoed (kvdemo.probe.echo: teacher-forced, hit or miss);
  "off", none. An endpoint that refuses echo is said so once (a note) and its cells go on without it.
- Polite: each endpoint has its own `concurrency` request slots; the client retries 429/5xx/timeouts with
  backoff. A prompt an endpoint finds too long stops it being sent as long or longer prompts; a failure that
  concerns the whole endpoint (unreachable, wrong key, unknown model, no key) stops it being sent anything more.
  Cells not sent are recorded with the reason, so the report says what happened to every cell.
- Nothing measured is lost: a failed request is an error cell and the run goes on; `Cancelled` (kvdemo.progress)
  carries every finished cell.
- Progress: the unit is a token sent, a cell's requested length once per endpoint and request (twice with echo).
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
from .client import (
    AUTH,
    CONTEXT,
    ENDPOINT_FAILURES,
    MALFORMED,
    MODEL,
    RATE_LIMITED,
    REQUEST,
    Client,
    Endpoint,
    ProbeError,
)
from .echo import LOGPROB_PATHS, EchoUnsupported, answer_logprob_from_echo, echo_body, echo_prompt, resolve_template
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
    echo_refused: str = ""  # why the endpoint will not score by echo ("": it may)
    echo_misses: dict[str, int] = field(default_factory=dict)  # why a cell got no echo log-prob: how many cells
    lock: Lock = field(default_factory=Lock)

    def echo_notes(self, name: str) -> list[str]:
        """What the report says about this endpoint's echo log-probs: a refusal, and each reason cells had none."""
        out = []
        if self.echo_refused:
            out.append(f"{name}: no answer log-probs by echo ({self.echo_refused}); its cells are kept without them")
        for why, n in self.echo_misses.items():
            out.append(f"{name}: no echo log-prob for {n} cell{'' if n == 1 else 's'} ({why})")
        return out


def work_tokens(
    lengths: Sequence[int], depths: Sequence[float], endpoints: int, repeats: int = 1, logprobs: str = "chat"
) -> int:
    """Tokens a probe sends by its requested lengths, each prompt twice when the answer is scored by echo: its
    progress unit."""
    requests = 2 if logprobs == "echo" else 1
    return sum(int(n) for n in lengths) * len(depths) * endpoints * repeats * requests


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


# an echo request that fails so says the endpoint will not score by echo: refused, no such API, a 200 without fields
_ECHO_REFUSALS = (AUTH, MODEL, REQUEST, MALFORMED)


def echo_logprob(client: Client, q: Question, state: _EndpointState, template: str, stop: Event) -> float | None:
    """The cell's teacher-forced answer log-prob by an echoed completion (kvdemo.probe.echo), or None: the endpoint
    refused echo (remembered in `state`: it is not asked again) or this cell's could not be read (counted)."""
    if state.echo_refused or stop.is_set():
        return None
    sent = echo_prompt(template, q)
    try:
        return answer_logprob_from_echo(client.complete(echo_body(client.endpoint.model, sent), stop.is_set), sent,
                                        q.task.answer)  # fmt: skip
    except EchoUnsupported as err:
        refused, why = True, str(err)
    except ProbeError as err:
        status = err.status or 0
        refused = err.kind in _ECHO_REFUSALS or (400 <= status < 500 and err.kind not in (CONTEXT, RATE_LIMITED))
        why = str(err).removeprefix(f"{client.endpoint.name}: ")
    except ValueError as err:
        refused, why = False, str(err)
    with state.lock:
        if refused:
            state.echo_refused = state.echo_refused or why
        else:
            state.echo_misses[why] = state.echo_misses.get(why, 0) + 1
    return None


def ask(
    client: Client,
    q: Question,
    state: _EndpointState,
    max_tokens: int,
    stop: Event,
    logprobs: str = "chat",
    template: str = "plain",
) -> ProbeCell | None:
    """One question to one endpoint as a cell: answered, failed (with its message) or not sent (with why), its
    answer log-prob read as `logprobs` says (with echo, by `template`). None when the run was cancelled before it
    was sent."""
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
    answer_lp = None
    if logprobs == "echo":
        answer_lp = echo_logprob(client, q, state, template, stop)
    elif logprobs == "chat":
        answer_lp = answer_logprob(reply.token_logprobs, reply.text, q.task.answer)
    return _cell(
        name,
        q,
        found=answer_matches(q.task.answer, reply.text),
        answer=reply.text.strip(),
        latency_s=reply.latency_s,
        prompt_tokens=reply.prompt_tokens,
        completion_tokens=reply.completion_tokens,
        answer_logprob=answer_lp,
        reply_logprob=reply_lp,
        attempts=reply.attempts,
        logprob_source=logprobs if answer_lp is not None else "",
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
    logprobs: str = "chat",
    echo_template: str = "plain",
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
) -> ProbeReport:
    """Every (length, depth) cell, `repeats` seeds, asked of every endpoint; a `ProbeReport` of the cells.

    `logprobs` says where the answer's log-prob is read (`LOGPROB_PATHS`): "chat" (the reply's log-probs, the
    default), "echo" (the prompt and true answer echoed by the completions API, the prompt rendered by
    `echo_template`: a name in `kvdemo.probe.echo.ECHO_TEMPLATES` or a template with ``{prompt}``), "off".

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
    if logprobs not in LOGPROB_PATHS:
        raise ValueError(f"log-probs from {logprobs!r}? allowed: {', '.join(LOGPROB_PATHS)}")
    template = resolve_template(echo_template) if logprobs == "echo" else ""
    clients = [Client(e, timeout_s, retries, backoff_s) for e in endpoints]
    for client in clients:
        client.logprobs = logprobs == "chat"  # with echo the chat request needs none: the answer is scored apart
    haystack, built = _questions(kind, lengths, depths, seed, repeats, document, document_name, needle, question,
                                 answer)  # fmt: skip
    notes = [ESTIMATE_NOTE]
    total = work_tokens(lengths, depths, len(endpoints), repeats, logprobs)
    track = Tracker(total, "tokens", on_progress, should_stop)
    per_cell = 2 if logprobs == "echo" else 1  # requests a cell sends
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
                track.advance(_cell_text(cell), cell.length * per_cell, cell)
                last[0] = time.perf_counter()
        if pending and time.perf_counter() - last[0] > 1.0:
            track.report(f"waiting for {min(len(pending), concurrency * len(endpoints))} requests")
            last[0] = time.perf_counter()

    try:
        for q, note in built:  # requests go out while the next, longer prompts are built
            notes += [note] if note and note not in notes else []
            pending |= {
                pool.submit(ask, client, q, state, max_tokens, stop, logprobs, template)
                for pool, client, state in zip(pools, clients, states, strict=True)
            }
            collect(0)
        while pending:
            collect(POLL_S)
    finally:
        stop.set()  # queued requests return unsent; those in flight end on their own timeout
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
    for e, state in zip(endpoints, states, strict=True):
        notes += state.echo_notes(e.name)
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
        settings={
            "concurrency": concurrency,
            "timeout_s": timeout_s,
            "retries": retries,
            "max_tokens": max_tokens,
            "logprobs": logprobs,
        }
        | ({"echo_template": template} if template else {}),  # fmt: skip
        notes=notes,
    )
