"""The two prefill modes side by side for one setting: one needle cell and one drift run per precision,
with the prompt stored `exact` and `chunked` (runner.PREFILL_MODES), and the differences.

- exact: the prompt's states are computed at full precision and stored quantized (KVQuant's evaluation,
  the needle grid's default): quantization error enters only once the question is read.
- chunked: the prompt goes into the quantized cache chunk after chunk (runner.PREFILL_CHUNK tokens), each
  chunk attending over the earlier chunks as stored (llama.cpp, chunked-prefill servers): the error
  compounds inside the prompt. A prompt of one chunk or less is stored the same way in both modes (a
  first prefill attends over its own exact states), so the modes differ only beyond one chunk.

The needle side is `needle.run_cell` (the grid's own code) on one (length, depth) cell; the drift side is
`drift.run_drift` with one full-precision reference shared by both modes. Results are plain dicts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from . import needle, runner
from .drift import capture_reference, document_prompt, document_text, run_drift
from .models import LoadedModel
from .precision import PRESETS, PrecisionSpec, parse_precision
from .progress import Cancelled

MODES = runner.PREFILL_MODES
MODE_HELP = {
    "exact": "the prompt is computed at full precision, then stored quantized (KVQuant's evaluation)",
    "chunked": "the prompt enters the quantized cache chunk by chunk, each chunk attending over the earlier "
    "chunks already quantized (llama.cpp, chunked-prefill servers): errors compound inside the prompt",
}
NEEDLE_FIELDS = ("answer", "correct", "answer_logprob")
DRIFT_FIELDS = ("mean_js", "mean_kl", "top1_agreement", "coded_keys")

Progress = Callable[[str], None]


def describe(mode: str) -> str:
    """One line for a prefill mode (pages and CLI help)."""
    if mode not in MODES:
        raise ValueError(f"unknown prefill mode {mode!r}; allowed: {', '.join(MODES)}")
    return f"{mode}: {MODE_HELP[mode]}"


def chunks(tokens: int, chunk: int | None = None) -> int:
    """How many prefill chunks a prompt of `tokens` tokens takes (the modes differ only above 1)."""
    chunk = chunk or runner.PREFILL_CHUNK
    return max(1, -(-int(tokens) // chunk))


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
    should_stop: Callable[[], bool] | None = None,
) -> dict:
    """One needle cell (the grid's cell for this seed, length and depth): full precision, then every spec
    with its haystack stored exact and chunked. Returns the rows and each spec's log-prob changes."""
    specs = _quantized(specs)
    rng = needle.cell_rng(seed, length, depth)
    task = needle.make_task(kind, rng, needle_text, question, answer)
    if length <= 0 or length + task.max_new_tokens > lm.max_context:
        raise needle.NeedleError(
            f"length {length} is not allowed: prompt + {task.max_new_tokens} new tokens must fit the model's "
            f"context ({lm.max_context}); use 1..{lm.max_context - task.max_new_tokens}"
        )
    if haystack is None:
        name, hay = needle.default_haystack(kind)
        joiner = " " if name == "filler" else "\n\n"
    else:
        name, hay, joiner = haystack_name, haystack, "\n\n"
    prompt = needle.build_prompt(lm, task, hay, length, depth, rng, joiner)
    t0 = time.perf_counter()
    rows = {"exact": needle.run_cell(lm, task, prompt, [PRESETS["full"], *specs], should_stop, prefill_mode="exact")}
    rows["chunked"] = needle.run_cell(lm, task, prompt, specs, should_stop, prefill_mode="chunked")
    if len(rows["exact"]) < len(specs) + 1 or len(rows["chunked"]) < len(specs):
        raise Cancelled("the prefill-mode comparison was stopped")
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
    return {
        "kind": kind,
        "haystack": name,
        "seed": seed,
        "length": length,
        "depth": float(depth),
        "prompt_tokens": prompt.length,
        "context_tokens": prompt.context_len,
        "chunks": chunks(prompt.context_len),
        "expected": task.answer,
        "results": results,
        "rows": {mode: [r.to_dict() for r in rs] for mode, rs in rows.items()},
        "seconds": round(time.perf_counter() - t0, 2),
    }


def _drift_numbers(r: dict) -> dict:
    kls = r["logit_kl"]
    return {f: r[f] for f in DRIFT_FIELDS} | {"logit_kl_mean": statistics.fmean(kls), "logit_kl_max": max(kls)}


def drift_modes(
    lm: LoadedModel,
    prompt_ids: Sequence[int],
    specs: Sequence[PrecisionSpec | str],
    new_tokens: int = 16,
    on_progress: Progress | None = None,
) -> dict:
    """`run_drift` in both modes against one full-precision reference; per spec the numbers of each mode
    and chunked over exact (a ratio: drift numbers span orders of magnitude)."""
    specs = _quantized(specs)
    t0 = time.perf_counter()
    if on_progress:
        on_progress("drift: full precision")
    ref = capture_reference(lm, prompt_ids, new_tokens)
    runs = {}
    for mode in MODES:
        step = (lambda label, m=mode: on_progress(f"drift: {label}, {m}")) if on_progress else None
        runs[mode] = run_drift(lm, prompt_ids, specs, new_tokens, on_progress=step, reference=ref, prefill_mode=mode)
    results = []
    for i, spec in enumerate(specs):
        exact, chunked = (_drift_numbers(runs[m]["results"][i]) for m in MODES)
        ratio = {f: (chunked[f] / exact[f] if exact[f] else None) for f in ("mean_js", "mean_kl", "logit_kl_mean")}
        results.append({"precision": spec.label, "exact": exact, "chunked": chunked, "chunked_over_exact": ratio})
    return {
        "prompt_tokens": len(prompt_ids),
        "new_tokens": runs["exact"]["new_tokens"],
        "chunks": chunks(len(prompt_ids) - 1),
        "generated": runs["exact"]["generated"],
        "results": results,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def compare_prefill_modes(
    lm: LoadedModel,
    tokens: int,
    specs: Sequence[PrecisionSpec | str],
    kind: str = "passkey",
    depth: float = 50.0,
    seed: int = 0,
    new_tokens: int = 16,
    document: str = "",
    on_progress: Progress | None = None,
) -> dict:
    """A needle cell of `tokens` tokens and a drift run on `tokens` tokens of prose (or of the file
    `document`), each with the prompt stored exact and chunked, for every quantized spec."""
    specs = _quantized(specs)
    t0 = time.perf_counter()
    if on_progress:
        on_progress("needle")
    cell = needle_modes(lm, specs, tokens, depth, kind, seed=seed)
    text, n = document_text(lm, max(tokens - 40, 32), document)  # the question and template take ~30 tokens
    prompt = document_prompt(lm, text)
    drift = drift_modes(lm, prompt, specs, new_tokens, on_progress)
    return {
        "model": lm.name,
        "device": str(lm.device),
        "dtype": str(lm.dtype).replace("torch.", ""),
        "tokens": tokens,
        "chunk": runner.PREFILL_CHUNK,
        "modes": {m: MODE_HELP[m] for m in MODES},
        "needle": cell,
        "drift": drift | {"document_tokens": n},
        "summary": summary_rows(cell, drift),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def summary_rows(cell: dict | None = None, drift: dict | None = None) -> list[dict]:
    """One row per precision: the needle's answer log-prob at full precision, exact and chunked and
    chunked minus exact; the drift's mean attention JS and mean logit KL per mode and chunked over exact."""
    labels = [r["precision"] for r in (cell or drift)["results"]]
    needles = {r["precision"]: r for r in cell["results"]} if cell else {}
    drifts = {r["precision"]: r for r in drift["results"]} if drift else {}
    rows = []
    for label in labels:
        row, n, d = {"precision": label}, needles.get(label), drifts.get(label)
        if n:
            row |= {
                "log p full": n["full"]["answer_logprob"],
                "log p exact": n["exact"]["answer_logprob"],
                "log p chunked": n["chunked"]["answer_logprob"],
                "log p chunked - exact": n["chunked_vs_exact"],
                "found (full/exact/chunked)": "/".join("yes" if n[m]["correct"] else "no" for m in ("full", *MODES)),
            }
        if d:
            for name, field in (("JS", "mean_js"), ("logit KL", "logit_kl_mean")):
                ratio = d["chunked_over_exact"][field]
                row |= {
                    f"{name} exact": d["exact"][field],
                    f"{name} chunked": d["chunked"][field],
                    f"{name} chunked/exact": None if ratio is None else round(ratio, 3),
                }
        rows.append(row)
    return rows


def headlines(cell: dict | None = None, drift: dict | None = None) -> list[str]:
    """One sentence per precision: the two modes' numbers and their difference (pages, CLI)."""
    out = []
    for r in cell["results"] if cell else []:
        out.append(
            f"{r['precision']}: log p(true answer) full {r['full']['answer_logprob']:.4f}, exact "
            f"{r['exact']['answer_logprob']:.4f}, chunked {r['chunked']['answer_logprob']:.4f}: chunked minus "
            f"exact {r['chunked_vs_exact']:+.4f} nats"
        )
    for r in drift["results"] if drift else []:
        e, c, q = r["exact"], r["chunked"], r["chunked_over_exact"]
        times = "" if q["logit_kl_mean"] is None else f" ({q['logit_kl_mean']:.2f}x)"
        out.append(
            f"{r['precision']}: mean attention JS exact {e['mean_js']:.3g}, chunked {c['mean_js']:.3g}; mean logit "
            f"KL exact {e['logit_kl_mean']:.3g}, chunked {c['logit_kl_mean']:.3g}{times}"
        )
    chunked = (cell or drift or {}).get("chunks", 2)
    if chunked == 1:
        out.append(
            f"The prompt fits one prefill chunk ({runner.PREFILL_CHUNK:,} tokens): both modes store it the same "
            "way. Use a longer prompt to see them differ."
        )
    return out
