"""Running needles: one cell at every precision on the same tokens, and a grid of cells (lengths x depths x seeds).

- Per (length, depth) cell the context is prefilled once, at full precision, in one forward call. A first
  prefill attends over the exact keys/values whatever the cache stores (kvdemo/attention.py), so a quantized
  cache that had prefilled the same tokens would hold exactly the full-precision states, quantized:
  `transplant` builds it from them with the same `update` call, bit for bit (tested). Every precision, full
  included, then reads its own cache from the question on: the suffix (the prompt's last chunk), then the
  true answer teacher-forced in as few calls as give the same logits as one-by-one decoding
  (`forward_as_decoding`). That yields the answer's log-probability and verifies greedy decoding along it
  (speculative decoding with the true answer as the draft: Leviathan et al., arXiv 2211.17192); only where
  greedy leaves the answer is the reply decoded token by token.
- Score: exact match of the reply (`prompts.answer_matches`) and the answer's log-probability (natural log,
  summed over its tokens).
- Repeats: `run_grid(..., repeats=R)` runs the grid again with the next seeds (new needles, e.g. new
  passkeys, at the same lengths and depths), seed by seed; kvdemo/results/needle.py turns the runs into
  found rates with intervals and paired differences.
- Progress (kvdemo/progress.py): the unit is a token of model work, a cell's target length once per precision
  (`work_tokens`), so a 4,096-token cell counts four times a 1,024-token one in the time left.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

import torch

from .. import codebooks as books
from .. import engines, llamacpp, runner
from ..cache import QuantizedKVCache
from ..models import LoadedModel
from ..precision import PRESETS, PrecisionSpec, parse_precision, parse_precision_list
from ..progress import Cancelled, ProgressFn, StopFn, Tracker
from ..results.needle import NeedleGrid, NeedleRow
from ..runner import fork, forward, generate, new_cache, prefill
from .prompts import (
    NUM_KEYS,
    NeedleError,
    NeedlePrompt,
    NeedleTask,
    answer_matches,
    build_prompt,
    cell_rng,
    choose_haystack,
    make_task,
)

MAX_REPEATS = 20  # runs per cell (seeds) one grid may ask for


def transplant(
    lm: LoadedModel, source: QuantizedKVCache, spec: PrecisionSpec | str, codebooks=None
) -> QuantizedKVCache:
    """A cache at `spec` holding `source`'s keys/values, stored as one prefill call would store them.

    `source` must hold exact states (full precision) from a single prefill call; the result equals
    prefilling the same tokens into a fresh `spec` cache in one call. codebooks: as `runner.new_cache`.
    """
    return runner.transplant(source, new_cache(lm, spec, codebooks))


class _AnswerStop:
    """`should_stop` for `runner.generate`: the user's cancel, or the short answer is complete."""

    def __init__(self, at_sentence_end: bool, should_stop: StopFn | None):
        self.at_sentence_end, self.user = at_sentence_end, should_stop
        self.text, self.answered, self.cancelled = "", False, False

    def on_token(self, token: int, piece: str) -> None:
        self.text += piece
        body = self.text.strip()
        if body and ("\n" in body or (self.at_sentence_end and body[-1] in ".!?" and any(c.isalnum() for c in body))):
            self.answered = True

    def __call__(self) -> bool:
        if self.user is not None and self.user():
            self.cancelled = True
            return True
        return self.answered


def flush_points(cache: QuantizedKVCache, n: int) -> list[int]:
    """Indices i < n of the tokens whose one-by-one append would quantize a block, given the cache's
    present state (kvdemo.layout's rule; every layer holds the same regions)."""
    layer = cache.layers[0]
    return layer.layout.flushes(layer.regions, n)


def forward_as_decoding(lm: LoadedModel, ids: Sequence[int], cache: QuantizedKVCache) -> torch.Tensor:
    """Logits [len(ids), V] of teacher-forcing `ids`, equal to feeding them one token at a time.

    A call over several tokens reads the stored past as it is after that call's append (and flush)
    and the call's own tokens exactly, so the tokens are fed in pieces cut around each token that
    would quantize a block: [.., p - 1], [p], [p + 1, ..]. Then every query sees the cache exactly as
    step-by-step decoding would have left it, in 1-3 calls instead of len(ids).
    """
    ids = list(ids)
    cuts = sorted({0, len(ids)} | {c for p in flush_points(cache, len(ids)) for c in (p, p + 1)})
    outs = [forward(lm, ids[a:b], cache) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
    return torch.cat(outs)  # [len(ids), V]


def score_and_answer(
    lm: LoadedModel,
    cache: QuantizedKVCache,
    suffix: Sequence[int],
    answer_ids: Sequence[int],
    max_new_tokens: int,
    stop: _AnswerStop,
) -> tuple[float, list[int], str]:
    """Run `suffix` after the cached context; return (teacher-forced log p(answer), greedy reply, reason).

    Teacher-forcing the true answer (on a fork) gives its log-probability and, as in speculative
    decoding with the true answer as the draft, verifies greedy decoding: when every argmax along the
    answer is the answer's next token, the greedy reply starts with the whole answer and decoding goes
    on from there. Otherwise the reply is decoded greedily on the untouched cache. `cache` is consumed.
    """
    answer_ids = list(answer_ids)
    k = len(answer_ids)
    first = forward(lm, suffix, cache)[-1]  # [V]: the prompt's last chunk, then the first answer token
    probe = fork(cache)
    logits = torch.cat([first[None], forward_as_decoding(lm, answer_ids, probe)])  # [k + 1, V]
    lp = torch.log_softmax(logits[:k], -1)  # [k, V]: row j predicts answer token j
    logprob = float(lp[torch.arange(k), torch.tensor(answer_ids)].sum())
    if logits[:k].argmax(-1).tolist() == answer_ids:
        for t in answer_ids:
            stop.on_token(t, lm.tokenizer.decode([t]))
        more, _, reason, _ = generate(lm, probe, logits[k], max(max_new_tokens - k, 0), stop.on_token, stop)
        return logprob, answer_ids + more, reason
    del probe
    tokens, _, reason, _ = generate(lm, cache, first, max_new_tokens, stop.on_token, stop)
    return logprob, tokens, reason


def _row_text(row: NeedleRow) -> str:
    """What a finished row says in the progress bar: "int4 at 1,024 tokens, depth 50%, seed 0: found"."""
    at = f"{row.precision} at {row.length:,} tokens, depth {row.depth:g}%, seed {row.seed}"
    return f"{at}: {'found' if row.correct else 'missed'}"


def run_cell(
    lm: LoadedModel,
    task: NeedleTask,
    prompt: NeedlePrompt,
    specs: Sequence[PrecisionSpec],
    track: Tracker | None = None,
    prefill_mode: str = "chunked",
    codebooks=None,
    seed: int = 0,
    others: Sequence[engines.KvTypes] = (),
) -> list[NeedleRow]:
    """Every precision on one prompt: one shared prefill, then per precision suffix + score + answer.

    Rows come back in the order of `specs`; each is counted in `track` as it is done (quantized ones first, the
    full-precision row last, as it reuses the prefilled cache): `prompt.target_length` tokens of work, the row
    in `Progress.row`. `track` (the run this cell belongs to) also stops the cell: its `should_stop` is polled
    between precisions and while an answer is decoded, and `Cancelled` carries every row the run finished.
    prefill_mode (runner.PREFILL_MODES): "exact" stores the shared full-precision prefill quantized per
    precision; "chunked" prefills the haystack into each quantized cache chunk by chunk instead.
    codebooks: a `codebooks.Codebooks` for the nuq precisions (default: the model's own). seed: the seed the
    task and prompt were drawn with, recorded in each row. others: llama.cpp contenders, each run after kvdemo's
    rows on the same token ids (kvdemo.llamacpp; its f16 row first, their baseline).
    """
    if prefill_mode not in runner.PREFILL_MODES:
        raise NeedleError(f"unknown prefill mode {prefill_mode!r}; allowed: {', '.join(runner.PREFILL_MODES)}")
    track = track or Tracker((len(specs) + len(others)) * prompt.target_length, "tokens")
    ctx, suffix = prompt.ids[: prompt.context_len], prompt.ids[prompt.context_len :]
    where = f"{prompt.target_length:,} tokens, depth {prompt.depth:g}%"
    track.check(where)
    track.report(f"{where}: prefill")
    t0 = time.perf_counter()
    full = new_cache(lm, PRESETS["full"])
    prefill(lm, ctx, full, chunk=len(ctx))  # one call: attention over the exact states
    prefill_s = time.perf_counter() - t0
    order = sorted(range(len(specs)), key=lambda i: not specs[i].is_quantized)
    rows: dict[int, NeedleRow] = {}
    for i in order:
        spec = specs[i]
        track.check(f"{where}, {spec.label}")
        t1 = time.perf_counter()
        if not spec.is_quantized:
            cache = full
        elif prefill_mode == "exact":
            cache = transplant(lm, full, spec, codebooks)
        else:
            cache = new_cache(lm, spec, codebooks)
            prefill(lm, ctx, cache, mode="chunked")
        stop = _AnswerStop(task.kind != "custom", track.should_stop)
        logprob, tokens, reason = score_and_answer(lm, cache, suffix, prompt.answer_ids, task.max_new_tokens, stop)
        del cache
        if stop.cancelled:
            raise Cancelled(f"{where}, {spec.label} was stopped", track.rows)
        rows[i] = _finish_row(lm, task, prompt, spec.label, logprob, tokens, reason, prefill_s, t1, seed, track)
    out = [rows[i] for i in sorted(rows)]
    for kv in others:
        out.append(_llamacpp_row(lm, kv, task, prompt, track, prefill_s, seed))
    return out


def _llamacpp_row(
    lm: LoadedModel, kv: engines.KvTypes, task: NeedleTask, prompt: NeedlePrompt, track: Tracker, prefill_s, seed
) -> NeedleRow:
    """One llama.cpp contender on the cell's prompt (kvdemo.llamacpp.needle_answer): the same token ids, its own
    prefill into its own cache, the answer's log-prob and the greedy reply."""
    where = f"{prompt.target_length:,} tokens, depth {prompt.depth:g}%, {kv.label}"
    track.check(where)
    t1 = time.perf_counter()
    ctx, suffix = prompt.ids[: prompt.context_len], prompt.ids[prompt.context_len :]
    need = prompt.length + max(task.max_new_tokens, len(prompt.answer_ids)) + 1
    engine = llamacpp.Engine(llamacpp.gguf_path(lm), kv, n_ctx=need)
    stop = _AnswerStop(task.kind != "custom", track.should_stop)
    try:
        logprob, tokens, reason = llamacpp.needle_answer(
            engine,
            ctx,
            suffix,
            prompt.answer_ids,
            task.max_new_tokens,
            runner.stop_token_ids(lm),
            lambda t: stop.on_token(t, lm.tokenizer.decode([t])),
            stop,
        )
    finally:
        engine.close()
    if stop.cancelled:
        raise Cancelled(f"{where} was stopped", track.rows)
    return _finish_row(lm, task, prompt, kv.label, logprob, tokens, reason, prefill_s, t1, seed, track)


def _finish_row(
    lm: LoadedModel,
    task: NeedleTask,
    prompt: NeedlePrompt,
    label: str,
    logprob: float,
    tokens: list[int],
    reason: str,
    prefill_s: float,
    started: float,
    seed: int,
    track: Tracker,
) -> NeedleRow:
    """One contender's answer on the cell's prompt as a row (its reply decoded and scored, its seconds since
    `started`), counted in `track` with the row in `Progress.row`."""
    text = lm.tokenizer.decode(tokens, skip_special_tokens=True).strip()
    row = NeedleRow(
        length=prompt.target_length,
        depth=prompt.depth,
        precision=label,
        answer=text,
        correct=answer_matches(task.answer, text),
        answer_logprob=round(logprob, 4),
        expected=task.answer,
        kind=task.kind,
        key=task.key,
        prompt_tokens=prompt.length,
        depth_actual=prompt.depth_actual,
        needle_position=prompt.needle_position,
        answer_tokens=len(prompt.answer_ids),
        generated_tokens=len(tokens),
        stopped="answer_end" if reason == "cancelled" else reason,
        prefill_s=round(prefill_s, 3),
        seconds=round(time.perf_counter() - started, 3),
        seed=seed,
    )
    track.advance(_row_text(row), prompt.target_length, row)
    return row


# --- grids ------------------------------------------------------------------------------------------------


def _split(precisions: Sequence[PrecisionSpec | str] | str) -> tuple[list, list[engines.KvTypes]]:
    """(kvdemo precisions, llama.cpp contenders: its f16 row first when there are any); a string's kvdemo part
    is parsed as a list (duplicates dropped)."""
    ours, theirs = engines.split_contenders(precisions)
    if isinstance(precisions, str) and ours:
        ours = parse_precision_list(",".join(ours))
    return ours, theirs


def contender_labels(precisions: Sequence[PrecisionSpec | str] | str) -> list[str]:
    """The rows' labels a grid of `precisions` has: kvdemo's precisions with full first (`specs_with_full`), then
    llama.cpp's contenders with its f16 row first whenever any is given (their baseline, as the CLI adds it)."""
    return [s.label for s in specs_with_full(precisions)] + [kv.label for kv in _split(precisions)[1]]


LLAMACPP_FAILED = "llama.cpp failed"  # how a grid's note about a llama.cpp engine that failed mid-grid begins
LLAMACPP_INSTALL = (
    "llama.cpp rows need its Python binding, llama-cpp-python: `make llamacpp` builds it (PyPI has it as source "
    "only: cmake and a C++ compiler, several minutes on 2 cores)"
)


def llamacpp_choices(lm: LoadedModel) -> tuple[list[str], str | None]:
    """(the llama.cpp contenders a grid on `lm` can have: every quantized cache type as ``llama.cpp:<type>``,
    why not when none: the binding is not installed, or the model was not loaded from a GGUF file, which
    llama.cpp runs). llama.cpp's f16 row is not among them: it comes with any of them (`contender_labels`)."""
    if llamacpp.available() is not None:
        return [], LLAMACPP_INSTALL
    try:
        llamacpp.gguf_path(lm)
    except engines.LlamaCppError as err:
        return [], str(err)
    return [engines.PREFIX + name for name in engines.CACHE_TYPES if name != engines.FULL], None


def specs_with_full(precisions: Sequence[PrecisionSpec | str] | str) -> list[PrecisionSpec]:
    """The grid's precisions, duplicates dropped, with full precision first when none is given: it is always a
    row (the baseline every quantized run is read against)."""
    precisions, _ = _split(precisions)
    specs = [parse_precision(p) for p in precisions]
    labels = dict.fromkeys(s.label for s in specs)
    unique = [next(s for s in specs if s.label == label) for label in labels]
    if not any(not s.is_quantized for s in unique):
        unique.insert(0, PRESETS["full"])
    return unique


def work_tokens(
    lengths: Sequence[int], depths: Sequence[float], precisions: Sequence[PrecisionSpec | str] | str, repeats: int = 1
) -> int:
    """Tokens of model work a grid does, its progress unit and its time hint's (`rates.hint`, task "needle"):
    every run's prompt, a cell's target length once per precision (full included) and seed."""
    contenders = len(specs_with_full(precisions)) + len(_split(precisions)[1])
    return sum(int(n) for n in lengths) * len(depths) * contenders * repeats


def check_length(lm: LoadedModel, length: int, new_tokens: int) -> None:
    """A prompt of `length` tokens and an answer of up to `new_tokens` must fit the model's context."""
    if length <= 0 or length + new_tokens > lm.max_context:
        raise NeedleError(
            f"length {length} is not allowed: prompt + {new_tokens} new tokens must fit the model's context "
            f"({lm.max_context}); use 1..{lm.max_context - new_tokens}"
        )


def check_grid(
    lm: LoadedModel,
    lengths: Sequence[int],
    depths: Sequence[float],
    repeats: int = 1,
    kind: str = "passkey",
    needle: str = "",
    question: str = "",
    answer: str = "",
    seed: int = 0,
    num_keys: int = NUM_KEYS,
    max_new_tokens: int | None = None,
) -> None:
    """A `NeedleError` saying what is wrong with a grid's settings (no length or depth, a depth outside 0..100,
    repeats out of range, a custom needle without its answer, a length the model's context cannot hold);
    nothing when `run_grid` can run them. Cheap: the page checks before it estimates the grid's time."""
    if not lengths or not depths:
        raise NeedleError("give at least one length and one depth")
    for d in depths:
        if not 0 <= d <= 100:
            raise NeedleError(f"depth {d:g} is outside 0..100 (percent of the haystack)")
    if not 1 <= repeats <= MAX_REPEATS:
        raise NeedleError(f"repeats must be 1..{MAX_REPEATS}, not {repeats}")
    probe = make_task(kind, cell_rng(seed, 0, 0.0), needle, question, answer, num_keys)  # validates the needle
    new_tokens = max_new_tokens or probe.max_new_tokens
    for n in lengths:
        check_length(lm, int(n), new_tokens)


def run_grid(
    lm: LoadedModel,
    lengths: Sequence[int],
    depths: Sequence[float],
    precisions: Sequence[PrecisionSpec | str] | str = "full,int8,int4,int2",
    kind: str = "passkey",
    document: str | None = None,
    document_name: str = "document",
    needle: str = "",
    question: str = "",
    answer: str = "",
    seed: int = 0,
    num_keys: int = NUM_KEYS,
    max_new_tokens: int | None = None,
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
    prefill_mode: str = "chunked",
    codebooks=None,
    repeats: int = 1,
) -> NeedleGrid:
    """Every (length, depth) cell at full precision and every precision in `precisions`, same tokens.
    prefill_mode: how each quantized cache stores the haystack (see `run_cell`); codebooks: a
    `codebooks.Codebooks` for the nuq precisions (default: the model's own). repeats: run the whole grid
    with seeds seed, seed + 1, ... (a new needle each time, e.g. a new passkey), so a found rate rests on
    more than one run per cell; seed by seed, so a cancelled run holds whole grids first.

    `document`: the haystack text (a user document); default: the filler for passkey, the bundled prose
    otherwise. `on_progress` gets a `Progress` in tokens of work (`work_tokens`) after every row, the row in
    `Progress.row`; when `should_stop()` says so the grid raises `Cancelled` carrying the rows finished.
    """
    try:  # llama.cpp contenders are refused before any work: a bad type, no binding, a model without GGUF
        specs, others = specs_with_full(precisions), _split(precisions)[1]
        if others:
            llamacpp.gguf_path(lm)
            llamacpp.require()
    except engines.LlamaCppError as err:
        raise NeedleError(str(err)) from None
    lengths = [int(n) for n in lengths]
    depths = [float(d) for d in depths]
    check_grid(lm, lengths, depths, repeats, kind, needle, question, answer, seed, num_keys, max_new_tokens)
    name, hay, joiner = choose_haystack(kind, document, document_name)
    labels = [s.label for s in specs] + [kv.label for kv in others]
    track = Tracker(work_tokens(lengths, depths, labels, repeats), "tokens", on_progress, should_stop)
    rows: list[NeedleRow] = []
    notes: list[str] = []
    t0 = time.perf_counter()
    for run_seed, length, depth in itertools.product(range(seed, seed + repeats), lengths, depths):  # seed by seed
        rng = cell_rng(run_seed, length, depth)
        task = make_task(kind, rng, needle, question, answer, num_keys)
        if max_new_tokens:
            task.max_new_tokens = max_new_tokens
        prompt = build_prompt(lm, task, hay, length, depth, rng, joiner)
        if prompt.haystack_copies > 1 and name != "filler":
            note = f"the {name} is shorter than {length} tokens: it was repeated to fill the haystack"
            notes += [note] if note not in notes else []
        rows += run_cell(lm, task, prompt, specs, track, prefill_mode, codebooks, run_seed)
        try:
            for kv in others:
                rows.append(_llamacpp_row(lm, kv, task, prompt, track, rows[-1].prefill_s, run_seed))
        except Cancelled:
            raise
        except Exception as err:  # the engine failed (its library, a file, memory): kvdemo's rows go on without it
            where = f"{length:,} tokens, depth {depth:g}%, seed {run_seed}"
            notes.append(f"{LLAMACPP_FAILED} at {where}: {type(err).__name__}: {err}; the grid has no llama.cpp rows "
                         "from there on (kvdemo's rows are complete)")  # fmt: skip
            others = []
    return NeedleGrid(
        model=lm.name,
        kind=kind,
        haystack=name,
        seed=seed,
        lengths=lengths,
        depths=depths,
        precisions=labels,
        rows=rows,
        seconds=time.perf_counter() - t0,
        notes=notes,
        prefill_mode=prefill_mode,
        codebooks=books.used_by(lm, specs, codebooks),
        repeats=repeats,
    )


# --- settings as text (CLI and needle page) ---------------------------------------------------------------


def parse_numbers(text: str, what: str, cast: Callable[[str], int | float]) -> list:
    """Comma-separated numbers (duplicates dropped, order kept), or a NeedleError naming `what`."""
    items = [t.strip() for t in str(text).replace(";", ",").split(",") if t.strip()]
    try:
        values = [cast(t) for t in items]
    except ValueError:
        raise NeedleError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise NeedleError(f"{what}: give at least one value")
    return list(dict.fromkeys(values))
