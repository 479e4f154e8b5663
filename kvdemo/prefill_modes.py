"""The two prefill modes side by side for one setting: one needle cell and one drift run per precision,
with the prompt stored `exact` and `chunked` (runner.PREFILL_MODES), and the differences.

- exact: the prompt's states are computed at full precision and stored quantized (KVQuant's evaluation,
  the needle grid's default): quantization error enters only once the question is read.
- chunked: the prompt goes into the quantized cache chunk after chunk (runner.PREFILL_CHUNK tokens), each
  chunk attending over the earlier chunks as stored (llama.cpp, chunked-prefill servers): the error
  compounds inside the prompt. A prompt of one chunk or less is stored the same way in both modes (a
  first prefill attends over its own exact states), so the modes differ only beyond one chunk.

The needle side is `needle.run_cell` (the grid's own code) on one (length, depth) cell; the drift side is
`drift.run_drift` with one full-precision reference shared by both modes. The results are the dataclasses of
kvdemo/results/prefill_modes.py. Progress (kvdemo/progress.py) counts tokens of model work: the cell's length
once at full precision and twice (once per mode) per quantized precision; the drift prompt and queries likewise.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from . import needle, runner
from .drift import capture_reference, document_prompt, document_text, run_drift
from .drift import work_tokens as drift_work_tokens
from .models import LoadedModel
from .precision import PRESETS, PrecisionSpec, parse_precision
from .progress import ProgressFn, StopFn, Tracker
from .results.drift import PrecisionDrift
from .results.prefill_modes import DriftModes, NeedleModes, PrefillModesReport

MODES = runner.PREFILL_MODES
MODE_HELP = {
    "exact": "the prompt is computed at full precision, then stored quantized (KVQuant's evaluation)",
    "chunked": "the prompt enters the quantized cache chunk by chunk, each chunk attending over the earlier "
    "chunks already quantized (llama.cpp, chunked-prefill servers): errors compound inside the prompt",
}
NEEDLE_FIELDS = ("answer", "correct", "answer_logprob")
DRIFT_FIELDS = ("mean_js", "mean_kl", "top1_agreement", "coded_keys")


def describe(mode: str) -> str:
    """One line for a prefill mode (pages and CLI help)."""
    if mode not in MODES:
        raise ValueError(f"unknown prefill mode {mode!r}; allowed: {', '.join(MODES)}")
    return f"{mode}: {MODE_HELP[mode]}"


def chunks(tokens: int, chunk: int | None = None) -> int:
    """How many prefill chunks a prompt of `tokens` tokens takes (the modes differ only above 1)."""
    chunk = chunk or runner.PREFILL_CHUNK
    return max(1, -(-int(tokens) // chunk))


def needle_work_tokens(length: int, quantized: int) -> int:
    """Tokens of model work of `needle_modes`: the cell at full precision, then per quantized precision each mode."""
    return int(length) * (1 + len(MODES) * quantized)


def _quantized(specs: Sequence[PrecisionSpec | str]) -> list[PrecisionSpec]:
    specs = [parse_precision(s) for s in specs]
    specs = [s for s in dict((s.label, s) for s in specs).values() if s.is_quantized]
    if not specs:
        raise ValueError("pick at least one quantized precision: at full precision the two prefill modes are one")
    return specs


def needle_modes(
    lm: LoadedModel,
    specs: Sequence[PrecisionSpec | str],
    length: int,
    depth: float = 50.0,
    kind: str = "passkey",
    haystack: str | None = None,
    haystack_name: str = "document",
    seed: int = 0,
    needle_text: str = "",
    question: str = "",
    answer: str = "",
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
) -> NeedleModes:
    """One needle cell (the grid's cell for this seed, length and depth): full precision, then every spec
    with its haystack stored exact and chunked. Returns the rows and each spec's log-prob changes."""
    specs = _quantized(specs)
    rng = needle.cell_rng(seed, length, depth)
    task = needle.make_task(kind, rng, needle_text, question, answer)
    needle.check_length(lm, length, task.max_new_tokens)
    name, hay, joiner = needle.choose_haystack(kind, haystack, haystack_name)
    prompt = needle.build_prompt(lm, task, hay, length, depth, rng, joiner)
    track = Tracker(needle_work_tokens(length, len(specs)), "tokens", on_progress, should_stop)
    t0 = time.perf_counter()
    rows = {
        "exact": needle.run_cell(lm, task, prompt, [PRESETS["full"], *specs], track, "exact", seed=seed),
        "chunked": needle.run_cell(lm, task, prompt, specs, track, "chunked", seed=seed),
    }
    full = next(r for r in rows["exact"] if r.precision == "full")
    results = []
    for spec in specs:
        exact = next(r for r in rows["exact"] if r.precision == spec.label)
        chunked = next(r for r in rows["chunked"] if r.precision == spec.label)
        results.append(
            {
                "precision": spec.label,
                "full": {f: getattr(full, f) for f in NEEDLE_FIELDS},
                "exact": {f: getattr(exact, f) for f in NEEDLE_FIELDS},
                "chunked": {f: getattr(chunked, f) for f in NEEDLE_FIELDS},
                "exact_vs_full": round(exact.answer_logprob - full.answer_logprob, 4),
                "chunked_vs_full": round(chunked.answer_logprob - full.answer_logprob, 4),
                "chunked_vs_exact": round(chunked.answer_logprob - exact.answer_logprob, 4),
            }
        )
    return NeedleModes(
        kind=kind,
        haystack=name,
        seed=seed,
        length=length,
        depth=float(depth),
        prompt_tokens=prompt.length,
        context_tokens=prompt.context_len,
        chunks=chunks(prompt.context_len),
        expected=task.answer,
        results=results,
        rows=rows,
        seconds=time.perf_counter() - t0,
    )


def _drift_numbers(r: PrecisionDrift) -> dict:
    return {f: getattr(r, f) for f in DRIFT_FIELDS} | {
        "logit_kl_mean": r.logit_kl_mean,
        "logit_kl_max": max(r.logit_kl),
    }


def drift_modes(
    lm: LoadedModel,
    prompt_ids: Sequence[int],
    specs: Sequence[PrecisionSpec | str],
    new_tokens: int = 16,
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
) -> DriftModes:
    """`run_drift` in both modes against one full-precision reference; per spec the numbers of each mode
    and chunked over exact (a ratio: drift numbers span orders of magnitude)."""
    specs = _quantized(specs)
    t0 = time.perf_counter()
    per_run = len(prompt_ids) + new_tokens
    work = drift_work_tokens(len(prompt_ids), new_tokens, len(MODES) * len(specs))
    track = Tracker(work, "tokens", on_progress, should_stop)
    track.check("the full-precision reference")
    track.report("full precision (the reference)")
    ref = capture_reference(lm, prompt_ids, new_tokens)
    track.advance("full precision (the reference)", per_run)
    runs = {}
    for mode in MODES:
        step = track.part(per_run * len(specs), mode)
        runs[mode] = run_drift(
            lm,
            prompt_ids,
            specs,
            new_tokens,
            on_progress=step,
            should_stop=should_stop,
            reference=ref,
            prefill_mode=mode,
        )
    results = []
    for i, spec in enumerate(specs):
        exact, chunked = (_drift_numbers(runs[m].results[i]) for m in MODES)
        ratio = {f: (chunked[f] / exact[f] if exact[f] else None) for f in ("mean_js", "mean_kl", "logit_kl_mean")}
        results.append({"precision": spec.label, "exact": exact, "chunked": chunked, "chunked_over_exact": ratio})
    return DriftModes(
        prompt_tokens=len(prompt_ids),
        new_tokens=runs["exact"].new_tokens,
        chunks=chunks(len(prompt_ids) - 1),
        generated=runs["exact"].generated,
        results=results,
        seconds=time.perf_counter() - t0,
    )


def compare_prefill_modes(
    lm: LoadedModel,
    tokens: int,
    specs: Sequence[PrecisionSpec | str],
    kind: str = "passkey",
    depth: float = 50.0,
    seed: int = 0,
    new_tokens: int = 16,
    document: str = "",
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
) -> PrefillModesReport:
    """A needle cell of `tokens` tokens and a drift run on `tokens` tokens of prose (or of the file
    `document`), each with the prompt stored exact and chunked, for every quantized spec."""
    specs = _quantized(specs)
    t0 = time.perf_counter()
    text, n = document_text(lm, max(tokens - 40, 32), document)  # the question and template take ~30 tokens
    prompt = document_prompt(lm, text)
    needle_work = needle_work_tokens(tokens, len(specs))
    drift_work = drift_work_tokens(len(prompt), new_tokens, len(MODES) * len(specs))
    track = Tracker(needle_work + drift_work, "tokens", on_progress)
    needle_progress = track.part(needle_work, "needle")
    cell = needle_modes(lm, specs, tokens, depth, kind, seed=seed, on_progress=needle_progress, should_stop=should_stop)
    drift = drift_modes(lm, prompt, specs, new_tokens, track.part(drift_work, "drift"), should_stop)
    drift.document_tokens = n
    return PrefillModesReport(
        model=lm.name,
        device=str(lm.device),
        dtype=str(lm.dtype).replace("torch.", ""),
        tokens=tokens,
        chunk=runner.PREFILL_CHUNK,
        modes={m: MODE_HELP[m] for m in MODES},
        needle=cell,
        drift=drift,
        seconds=time.perf_counter() - t0,
    )
