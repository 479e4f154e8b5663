"""The benchmark's run: every contender on the same model, texts and machine, measured phase by phase
(set-up, prefill and decode at each context, perplexity of held-out text, a needle grid), into a
`kvdemo.results.bench.BenchReport`. The package docstring says what each number is. llama.cpp's rows
(`kvdemo.contest.llamacpp_rows`) take every phase beside the others, their decode rounds interleaved with them."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from .. import llamacpp, runner
from ..attention import DECODE_MAX_QUERIES
from ..machine import load_note, machine_info
from ..memory import fp16_cache_bytes
from ..models import LoadedModel
from ..ppl import exact_states, score_caches, store_states, work_tokens
from ..progress import ProgressFn, StopFn, Tracker
from ..results.bench import (
    FULL,
    QUICK,
    SIZES,
    BenchError,
    BenchReport,
    BenchSizes,
    ContenderResult,
    DecodeWindow,
    NeedleCell,
    NeedleSummary,
    paired_ratio,
)
from . import llamacpp_rows
from .contenders import Contender, cache_bytes, contenders
from .decode import DecodeRound, decode_round, decode_steps

NEEDLE_KIND = "multikey"  # kvdemo.needle's RULER-style task: real prose, 3 distractor keys, 7-digit answer
NEEDLE_TAIL = 32  # tokens of question and answer after a needle's context, for the progress count


@torch.no_grad()
def answer_score(lm: LoadedModel, cache, question: Sequence[int], answer: Sequence[int]) -> tuple[float, bool]:
    """Feed question + answer[:-1] through the cache: (log-probability of the answer, nats summed, rounded to 4
    digits; whether greedy decoding would say it)."""
    q, a = list(question), list(answer)
    if not q or not a:
        raise BenchError("a needle cell needs a non-empty question suffix and answer")
    logits = runner.forward(lm, q + a[:-1], cache)[len(q) - 1 :]  # [len(a), V]: row i predicts a[i]
    lp = torch.log_softmax(logits, -1)
    target = torch.tensor(a, device=lp.device)
    logprob = float(lp[torch.arange(len(a)), target].sum())
    return round(logprob, 4), bool((logits.argmax(-1) == target).all())


@dataclass
class _Measured:
    """What the run collects of one contender before the report reduces it."""

    contender: Contender
    settings: dict
    cache_bytes: dict = field(default_factory=dict)
    cache_bytes_allocated: dict = field(default_factory=dict)
    prefill_s: dict = field(default_factory=dict)
    decode_rounds: dict = field(default_factory=dict)  # ctx -> [tok/s per round]
    decode_steps: dict = field(default_factory=dict)  # ctx -> [DecodeRound]
    ppl: dict = field(default_factory=dict)
    logit_kl: dict = field(default_factory=dict)
    needle: list = field(default_factory=list)  # [NeedleCell]
    first_call_s: float = 0.0
    second_call_s: float = 0.0
    load_s: float | None = None  # llama.cpp: loading the GGUF into a context (the second set-up call's)


def planned_tokens(sizes: BenchSizes, n_contenders: int, n_llamacpp: int = 0) -> int:
    """Tokens of model work in a run (its progress units): per contender the two set-up probes, each context's
    prefill, warm-up and timed rounds, the perplexity text and the needle questions; each needle context once for
    the `n_contenders` run in transformers, and once per llama.cpp row (each prefills it in its own engine)."""
    probes = 2 * (sizes.warmup_tokens + 2)
    decode = sum(ctx + sizes.warmup_steps + sizes.rounds * sizes.new_tokens for ctx in sizes.contexts)
    needle_cells = len(sizes.needle_lengths) * len(sizes.needle_depths)
    ppl = work_tokens(max(sizes.ppl_lengths), sizes.ppl_prefix, n_contenders - 1) if n_contenders else 0
    needle = sum(sizes.needle_lengths) * len(sizes.needle_depths) if n_contenders else 0
    needle += needle_cells * NEEDLE_TAIL * n_contenders
    theirs = probes + decode + max(sizes.ppl_lengths) - 1 + sum(sizes.needle_lengths) * len(sizes.needle_depths)
    theirs += needle_cells * NEEDLE_TAIL
    return n_contenders * (probes + decode) + ppl + needle + n_llamacpp * theirs


def run_bench(
    lm: LoadedModel,
    quick: bool = False,
    sizes: BenchSizes | None = None,
    only: Sequence[str] | None = None,
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
    precisions: str | Sequence | None = None,
) -> BenchReport:
    """Measure every available contender (or those named in `only`) on the same model, texts and machine.
    `precisions` (`kvdemo ppl --precision`'s grammar): kvdemo's precisions in place of the presets, and
    ``llama.cpp:<type>`` rows on the model's GGUF file (llama.cpp's f16 row with them, their baseline; refused
    before any work without llama-cpp-python or a GGUF file). Progress in tokens of model work (`planned_tokens`);
    `should_stop` ends the run between steps."""
    from ..engines import baseline_of
    from ..texts import held_out_ids, prose_ids

    sizes = sizes or (QUICK if quick else FULL)
    if not 1 <= sizes.chunk <= DECODE_MAX_QUERIES:
        raise BenchError(f"chunk must be 1..{DECODE_MAX_QUERIES} (kvdemo's decode path), got {sizes.chunk}")
    if sizes.longest() > lm.max_context:
        raise BenchError(f"the bench needs {sizes.longest()} positions; the model's context is {lm.max_context}")
    run, skipped = contenders(quick, sizes.residual, precisions)
    if only is not None:
        unknown = set(only) - {c.name for c in run} - {s.contender for s in skipped}
        if unknown:
            raise BenchError(
                f"unknown contender(s) {', '.join(sorted(unknown))}; known: {', '.join(c.name for c in run)}"
            )
        keep = set(only) | {baseline_of(n) for n in only if n != baseline_of(n) and baseline_of(n) != "full"}
        run = [c for c in run if c.name in keep]  # a llama.cpp row brings its f16 row
        skipped = [s for s in skipped if s.contender in only]
    ours = [c for c in run if c.backend != "llama.cpp"]
    theirs = [c for c in run if c.backend == "llama.cpp"]
    gguf = llamacpp.gguf_path(lm) if theirs else None  # refused before any work: no GGUF file, no binding
    if theirs:
        llamacpp.require()
    t_start = time.perf_counter()
    machine = machine_info(lm)
    track = Tracker(planned_tokens(sizes, len(ours), len(theirs)), "tokens", on_progress, should_stop)
    rows = {c.name: _Measured(c, c.settings(lm)) for c in ours}
    lc_rows = {c.name: _Measured(c, c.settings(lm)) for c in theirs}
    prose = prose_ids(lm, max(max(sizes.contexts), sizes.warmup_tokens))

    # 1. one-time set-up: the first tiny run of each contender, then the same run again
    for row in rows.values():
        c = row.contender
        track.check("the bench")
        for attr in ("first_call_s", "second_call_s"):
            with runner.attention_impl(lm, c.attention):
                t0 = time.perf_counter()
                cache = c.make_cache(lm)
                logits = runner.prefill(lm, prose[: sizes.warmup_tokens], cache)
                decode_steps(lm, cache, logits, 2)
                setattr(row, attr, time.perf_counter() - t0)
            del cache
        track.advance(f"set-up probe: {c.name}", 2 * (sizes.warmup_tokens + 2))
    for row in lc_rows.values():  # loading the GGUF file into a context with the cache type is part of each call
        track.check("the bench")
        row.first_call_s, _ = llamacpp_rows.setup_call(gguf, row.contender.kv, prose[: sizes.warmup_tokens])
        row.second_call_s, row.load_s = llamacpp_rows.setup_call(gguf, row.contender.kv, prose[: sizes.warmup_tokens])
        track.advance(f"set-up probe: {row.contender.name}", 2 * (sizes.warmup_tokens + 2))

    # 2. prefill time and cache bytes at each context, then warm decode rounds interleaved across contenders
    for ctx in sizes.contexts:
        with contextlib.ExitStack() as engines:
            _context_phase(lm, sizes, ctx, prose, rows, lc_rows, gguf, engines, track)

    # 3. perplexity of held-out text (kvdemo.ppl's protocol): an exact prefix, the rest fed in chunks
    # through each cache; logit KL against full precision's next-token distributions (the first row: full)
    text = held_out_ids(lm, max(sizes.ppl_lengths))
    caches = [
        (row.contender.name, row.contender.attention, partial(row.contender.make_cache, lm)) for row in rows.values()
    ]
    if caches:
        scores = score_caches(
            lm, caches, text, sizes.ppl_prefix, sizes.ppl_lengths, sizes.chunk, sizes.residual, sizes.kl_every, track
        )
        for name, scored in scores:
            rows[name].ppl, rows[name].logit_kl = scored.ppl, scored.logit_kl
    reference = None  # llama.cpp's f16 rows: the KL reference of its quantized rows (its f16 row comes first)
    for name, row in lc_rows.items():
        track.check(name)
        row.ppl, row.logit_kl, kept = llamacpp_rows.perplexity(
            gguf, row.contender.kv, text, sizes, reference, lambda n, what=name: _count(track, what, n)
        )
        reference = kept if reference is None else reference

    # 4. needle grid (kvdemo.needle's prompts): the context stored exactly, the question through each cache;
    # llama.cpp's rows prefill the context in llama.cpp
    from ..needle import build_prompt, cell_rng, default_haystack, make_task

    _, haystack = default_haystack(NEEDLE_KIND)
    prompts = []  # (length, depth asked, prompt)
    for length in sizes.needle_lengths:
        for depth in sizes.needle_depths:
            task = make_task(NEEDLE_KIND, cell_rng(sizes.seed, length, depth))
            prompt = build_prompt(lm, task, haystack, length, depth, rng=cell_rng(sizes.seed, length, depth))
            prompts.append((length, depth, prompt))
    for length, depth, prompt in prompts if rows else []:
        track.check("the bench")
        context, suffix = prompt.ids[: prompt.context_len], prompt.ids[prompt.context_len :]
        states, _ = exact_states(lm, context)
        track.advance(f"needle {length} tokens, depth {depth}%: exact context of {len(context)} tokens", length)
        for row in rows.values():
            c = row.contender
            with runner.attention_impl(lm, c.attention):
                cache = c.make_cache(lm)
                store_states(cache, states, sizes.residual)
                logprob, found = answer_score(lm, cache, suffix, prompt.answer_ids)
            row.needle.append(NeedleCell(length, depth, prompt.depth_actual, logprob, found))
            del cache
            track.advance(f"needle {length} tokens, depth {depth}%: {c.name}", NEEDLE_TAIL)
        del states
    room = max((p.length + len(p.answer_ids) for _, _, p in prompts), default=1)
    for name, row in lc_rows.items():
        track.check(name)
        with contextlib.closing(llamacpp.Engine(gguf, row.contender.kv, n_ctx=room)) as engine:
            for length, depth, prompt in prompts:
                track.check(name)
                context, suffix = prompt.ids[: prompt.context_len], prompt.ids[prompt.context_len :]
                logprob, found = llamacpp.answer_score(engine, context, suffix, prompt.answer_ids)
                row.needle.append(NeedleCell(length, depth, prompt.depth_actual, logprob, found))
                track.advance(f"needle {length} tokens, depth {depth}%: {name}", length + NEEDLE_TAIL)

    engine_note = llamacpp.engine_note(gguf) if theirs else None
    report = _report(lm, sizes, quick, machine, rows | lc_rows, skipped, time.perf_counter() - t_start, engine_note)
    track.report("done")
    return report


def _count(track: Tracker, what: str, n: int) -> None:
    """One llama.cpp call's tokens counted, and a stop requested before the next."""
    track.advance(what, n)
    track.check(what)


def _context_phase(
    lm: LoadedModel,
    sizes: BenchSizes,
    ctx: int,
    prose: Sequence[int],
    rows: dict[str, _Measured],
    lc_rows: dict[str, _Measured],
    gguf,
    engines: contextlib.ExitStack,
    track: Tracker,
) -> None:
    """Prefill seconds and cache bytes of every contender at `ctx` tokens, then its warm decode rounds, the
    contenders taking turns round by round (llama.cpp's rows among them, each engine kept open in `engines`)."""
    live = {}
    for row in rows.values():
        c = row.contender
        track.check("the bench")
        with runner.attention_impl(lm, c.attention):
            cache = c.make_cache(lm)
            t0 = time.perf_counter()
            logits = runner.prefill(lm, prose[:ctx], cache)
            row.prefill_s[str(ctx)] = time.perf_counter() - t0
            nb = cache_bytes(cache)
            row.cache_bytes[str(ctx)], row.cache_bytes_allocated[str(ctx)] = nb["live"], nb["allocated"]
            _, logits = decode_steps(lm, cache, logits, sizes.warmup_steps)
        live[c.name] = (cache, logits)
        track.advance(f"prefill {ctx}: {c.name}", ctx + sizes.warmup_steps)
    for row in lc_rows.values():
        c = row.contender
        track.check("the bench")
        engine = engines.enter_context(contextlib.closing(llamacpp_rows.open_for_decode(gguf, c.kv, ctx, sizes)))
        row.prefill_s[str(ctx)], logits = llamacpp_rows.prefill(engine, prose[:ctx])
        # llama.cpp allocates its whole context up front: its cells for the prompt, the steps and the rounds
        row.cache_bytes[str(ctx)] = engine.kv_bytes()
        row.cache_bytes_allocated[str(ctx)] = engine.kv_bytes(engine.n_ctx)
        live[c.name] = (engine, llamacpp_rows.decode_steps(engine, logits, sizes.warmup_steps))
        track.advance(f"prefill {ctx}: {c.name}", ctx + sizes.warmup_steps)
    for r in range(sizes.rounds):
        for row in (rows | lc_rows).values():
            c = row.contender
            track.check("the bench")
            cache, logits = live[c.name]
            if c.backend == "llama.cpp":
                timed, logits = llamacpp_rows.decode_round(cache, logits, sizes.new_tokens)
            else:
                with runner.attention_impl(lm, c.attention):
                    timed, logits = decode_round(lm, cache, logits, sizes.new_tokens)
            live[c.name] = (cache, logits)
            row.decode_rounds.setdefault(str(ctx), []).append(sizes.new_tokens / timed.seconds)
            row.decode_steps.setdefault(str(ctx), []).append(timed)
            track.advance(f"decode {ctx} round {r + 1}/{sizes.rounds}: {c.name}", sizes.new_tokens)


def _report(
    lm,
    sizes: BenchSizes,
    quick: bool,
    machine: dict,
    rows: dict[str, _Measured],
    skipped: list,
    wall_s: float,
    engine: dict | None = None,
) -> BenchReport:
    per_token_fp16 = fp16_cache_bytes(lm.num_layers, lm.kv_heads, lm.head_dim, 1)
    results = []
    for row in rows.values():
        c = row.contender
        base = rows.get(c.baseline)  # its own engine's full row: "full", or llama.cpp's f16 row
        # short rounds interleaved across contenders, reduced by medians: a burst of load from other
        # processes spoils a round or two, not the result (best-of picks whoever a quiet moment favoured)
        needle = NeedleSummary.of(row.needle)
        out = ContenderResult(
            contender=c.name,
            family=c.family,
            backend=c.backend,
            bits=c.bits,
            attention=c.attention,
            settings=row.settings,
            cache_bytes=row.cache_bytes,
            cache_bytes_allocated=row.cache_bytes_allocated,
            ratio_vs_fp16={k: round(per_token_fp16 * int(k) / b, 4) for k, b in row.cache_bytes.items()},
            ratio_allocated_vs_fp16={
                k: round(per_token_fp16 * int(k) / b, 4) for k, b in row.cache_bytes_allocated.items()
            },
            bits_per_element={k: round(16 * b / (per_token_fp16 * int(k)), 3) for k, b in row.cache_bytes.items()},
            ppl={k: round(v, 4) for k, v in row.ppl.items()},
            ppl_delta={},
            ppl_delta_pct={},
            logit_kl={k: float(f"{v:.4g}") for k, v in row.logit_kl.items()},
            needle=needle,
            needle_logprob_delta=None,
            decode_tok_s={k: round(statistics.median(v), 3) for k, v in row.decode_rounds.items()},
            decode_tok_s_rounds={k: [round(x, 3) for x in v] for k, v in row.decode_rounds.items()},
            decode_speed_vs_full={},
            decode_window={k: _window(v) for k, v in row.decode_steps.items()},
            prefill_s={k: round(v, 3) for k, v in row.prefill_s.items()},
            setup_s=round(max(row.first_call_s - row.second_call_s, 0.0), 3),
            first_call_s=round(row.first_call_s, 3),
            engine=c.engine,
            baseline=c.baseline,
            load_s=None if row.load_s is None else round(row.load_s, 3),
        )
        if base is not None:
            for k, v in row.ppl.items():
                out.ppl_delta[k] = round(v - base.ppl[k], 4)
                out.ppl_delta_pct[k] = round(100 * (v / base.ppl[k] - 1), 3)
            out.needle_logprob_delta = round(needle.mean_logprob - NeedleSummary.of(base.needle).mean_logprob, 4)
            for k, v in row.decode_rounds.items():
                out.decode_speed_vs_full[k] = round(paired_ratio(v, base.decode_rounds[k]), 3)
        results.append(out)
    machine = machine | {"load_avg_end": [round(x, 2) for x in os.getloadavg()]}
    if (note := load_note(machine)) is not None:
        machine["notes"] = note
    report = BenchReport(
        machine=machine,
        model=lm.name,
        quick=quick,
        sizes_name=next((name for name, v in SIZES.items() if v == sizes), "custom"),
        sizes=sizes,
        method=method_text(sizes, engine is not None),
        results=results,
        skipped=skipped,
        wall_s=round(wall_s, 1),
        engine=engine,
    )
    report.judge()
    return report


def _window(rounds: list[DecodeRound]) -> DecodeWindow:
    """Flushes and step times of a contender's timed decode window at one context."""
    steps = [t for r in rounds for t in r.step_s]
    flush = [r.step_s[i] for r in rounds for i in r.flush_steps]
    flush_set = [{*r.flush_steps} for r in rounds]
    plain = [t for r, f in zip(rounds, flush_set, strict=True) for i, t in enumerate(r.step_s) if i not in f]
    return DecodeWindow(
        steps=len(steps),
        flushes=len(flush),
        flushes_per_round=[len(r.flush_steps) for r in rounds],
        median_step_ms=round(1000 * statistics.median(plain or steps), 3),
        mean_flush_step_ms=round(1000 * sum(flush) / len(flush), 3) if flush else None,
        seconds=round(sum(steps), 3),
    )


def method_text(sizes: BenchSizes, with_llamacpp: bool = False) -> dict[str, str]:
    """How each number was measured, in words (goes into the report and docs/benchmark.md); `with_llamacpp`: how
    llama.cpp's rows were, too."""
    text = {
        "cache_bytes": "bytes of the tensors each cache holds right after prefilling N tokens of prose; "
        "ratio = 16-bit cache of N tokens / those bytes",
        "residual": f"every quantized contender keeps the newest tokens in full precision until {sizes.residual} "
        "have collected (kvdemo's residual window; transformers' residual_length), then flushes: kvdemo quantizes "
        "its whole blocks, transformers' QuantizedCache re-quantizes its whole cache",
        "ppl": f"held-out text: first {sizes.ppl_prefix} tokens stored exactly, the rest fed {sizes.chunk} tokens "
        "at a time through the cache; ppl[N] = exp(mean NLL) of the tokens at positions [N/2, N)",
        "logit_kl": f"KL(full || contender) in nats of the next-token distributions at every {sizes.kl_every}th "
        "of the positions [N/2, N) of the same held-out run, averaged",
        "needle": f"kvdemo.needle {NEEDLE_KIND} prompts (chat template, real prose, needle at a depth): the exact "
        f"states of the T-token context up to the question stored in two updates, [0, T // {sizes.residual} * "
        f"{sizes.residual}) then the rest, so every quantized contender holds the same tokens quantized and the "
        f"last T mod {sizes.residual} exact (transformers quantizes all of a first update, kvdemo's residual keeps "
        "the partial block); the question and answer prefix then attend over the stored cache; summed "
        "teacher-forced log-prob of the answer (nats); found = greedy decoding would produce it",
        "decode_tok_s": f"after prefilling N tokens and {sizes.warmup_steps} untimed steps: {sizes.new_tokens} greedy "
        f"steps per round ({sizes.new_tokens // sizes.residual} residual length(s): every round holds each quantized "
        f"contender's flushes, counted in decode_window), {sizes.rounds} rounds interleaved across contenders; "
        "tok/s = median over rounds, speed ratios = median of the per-round ratios (round r of one contender / "
        "round r of the other)",
        "prefill_s": "runner.prefill of N tokens (chunks of 2048), into a fresh cache",
        "setup_s": f"first call minus an identical second call (cache construction, a {sizes.warmup_tokens}-token "
        "prefill and 2 decode steps): imports, extension builds, first-use allocations",
    }
    if with_llamacpp:
        text["llama.cpp"] = (
            "llama.cpp's rows run llama.cpp itself (llama-cpp-python, flash attention on, -ctk/-ctv per row) on the "
            "model's GGUF file and the same token ids; each row read against llama.cpp's f16 row (deltas, KL, decode "
            "ratio). Set-up: each call loads the file into a context with the cache type (load_s: the load alone, "
            "warm), then the same prefill and 2 steps. Prefill: llama.cpp's own, batches of 512. Decode: one "
            "llama_decode per greedy token, its rounds interleaved with the other rows'; no residual window, so no "
            "flush. Cache bytes: its cache rows (ggml blocks, kvdemo.engines.kv_bytes) for N tokens; allocated: the "
            f"whole context it reserves. Perplexity: kvdemo.llamacpp.score_text, the first {sizes.ppl_prefix} tokens "
            f"through llama.cpp's prefill (its cache, as stored, is what they attend over), the rest {sizes.chunk} at a "
            "time. Needle: the context through llama.cpp's prefill, then question + answer in one call "
            "(kvdemo.llamacpp.answer_score)"
        )
    return text
