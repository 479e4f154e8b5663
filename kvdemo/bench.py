"""Benchmark: kvdemo's packed KV cache against transformers' own caches, on one model, text and machine.

Answers "why not just use transformers' ``cache_implementation="quantized"``?" with numbers measured
side by side in one run (`python -m kvdemo bench --json --out reports/`). Contenders:

- ``full``: transformers' `DynamicCache` with SDPA attention (the honest baseline, model dtype);
- ``kvdemo-int8``, ``kvdemo-k8v4``, ``kvdemo-k4v8``, ``kvdemo-int4``, ``kvdemo-int2``, ``kvdemo-fp8``:
  `QuantizedKVCache` at those presets (kvdemo/precision.py), read by the "kvdemo" attention
  (kvdemo/attention.py); k8v4 against k4v8 says end to end which half (keys or values) is sensitive;
- ``kvdemo-int4:ktoken:g64``: transformers' own scheme (4-bit, keys and values per token in groups of 64
  channels, residual 128) in kvdemo's implementation, so the gap to ``hf-quanto-int4`` splits into what
  the scheme costs and what the implementation costs;
- ``kvdemo-int3``, ``kvdemo-nuq4:o1``, ``kvdemo-nuq3:o1``, ``kvdemo-nuq2:o1:s1``, ``kvdemo-int4:hadamard``,
  ``kvdemo-nvfp4``: the methods beyond uniform codes (KVQuant's nuq with outliers and the fp16 first token,
  3-bit, Hadamard rotation, NVFP4; kvdemo/precision.py), in the same harness;
- ``hf-quanto-int4`` / ``-int2`` and ``hf-hqq-int4`` / ``-int2``: transformers `QuantizedCache` with the
  optimum-quanto / HQQ backend at its defaults (group 64 along head_dim for keys and values, residual
  128; it dequantizes the whole cache at every step and re-quantizes all of it when the residual
  fills), and ``hf-fp8`` (its fp8 backend: one per-tensor scale, frozen after the first update).

Measured per contender (`BenchSizes` holds the sizes; `QUICK` is a tiny version for tests):

- cache bytes right after a prefill of real prose at each context length (tensors actually stored:
  packed codes, scales, zero points, residual, sinks), and the ratio to a 16-bit cache of the tokens;
- perplexity of held-out real text (a book the other texts never use): the first ``ppl_prefix``
  tokens are prefilled exactly (the same exact keys/values are stored into every contender's cache),
  then the rest is fed in chunks of `DECODE_MAX_QUERIES` (16) tokens, as decoding would, so every
  scored token attends over the *stored* (quantized) past; ``ppl[N]`` is the perplexity of the
  tokens at positions [N/2, N), and ``ppl_delta[N]`` its difference from ``full``; ``logit_kl[N]`` is
  KL(full || contender) of the next-token distributions, averaged over every ``kl_every``-th of those
  positions;
- needle retrieval (kvdemo.needle's RULER-style multikey prompts in real prose): teacher-forced
  log-probability of the answer on a small grid of prompt lengths x needle depths; the context's exact
  states are stored in two updates, its first floor(T / R) * R tokens and then the rest (R: the residual
  length every contender shares), so every quantized contender holds the same tokens quantized and the
  same last T mod R tokens exact; the question arrives afterwards and attends over the stored cache (a
  document cached before the user asks);
- prefill seconds at each context (runner.prefill, as the app prefills), and decode tokens/s at each
  context: warm (after untimed warm-up steps), ``rounds`` rounds of ``new_tokens`` steps interleaved
  across contenders. ``new_tokens`` is a multiple of the shared residual length, so every round holds
  each quantized contender's flushes (kvdemo quantizing its residual window, transformers re-quantizing
  its whole cache) as steady decoding would; the flushes inside the window are counted and reported.
  Reduced by medians (tok/s: median round; speed ratios: median of per-round ratios), so a burst of
  load on a shared machine spoils a round, not the comparison;
- ``setup_s``: the one-time cost of a contender's first call (first tiny run minus an identical second
  one), e.g. importing optimum-quanto and building its C++ extension, reported apart from the speeds.

References: transformers `QuantizedCache` (cache_utils.py; KIVI, arXiv 2402.02750), optimum-quanto,
HQQ (Badri & Shaji 2023), users' latency reports (transformers issue 34096).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

from . import runner
from .attention import DECODE_MAX_QUERIES
from .cache import QuantizedKVCache
from .memory import fp16_cache_bytes
from .models import LoadedModel
from .ppl import exact_states, score_caches, store_states
from .precision import PrecisionSpec, parse_precision

KVDEMO_PRESETS = ("int8", "k8v4", "k4v8", "int4", "int4:ktoken:g64", "int2", "fp8")
METHOD_PRESETS = ("int3", "nuq4:o1", "nuq3:o1", "nuq2:o1:s1", "int4:hadamard", "nvfp4")  # issue 17's formats
QUICK_PRESETS = ("int4", "int4:ktoken:g64")
HF_DEFAULTS = {"q_group_size": 64, "residual_length": 128, "axis_key": 0, "axis_value": 0}  # transformers' own
KEY_VS_VALUE = ("kvdemo-k4v8", "kvdemo-k8v4")  # 4-bit keys (8-bit values) vs 4-bit values (8-bit keys)
SAME_SCHEME = ("kvdemo-int4:ktoken:g64", "hf-quanto-int4")  # one scheme, two implementations
SAME_BITS = (  # (kvdemo, transformers) pairs compared for the memory goal
    ("kvdemo-int4", "hf-quanto-int4"),
    ("kvdemo-int4", "hf-hqq-int4"),
    ("kvdemo-int2", "hf-quanto-int2"),
    ("kvdemo-int2", "hf-hqq-int2"),
    ("kvdemo-fp8", "hf-fp8"),
)
NEEDLE_KIND = "multikey"  # kvdemo.needle's RULER-style task: real prose, 3 distractor keys, 7-digit answer
REPORT_FILES = ("bench.json", "bench.md", "bench.html")


class BenchError(ValueError):
    """A benchmark that cannot run as asked (sizes beyond the model's context, unknown contender)."""


@dataclass(frozen=True)
class BenchSizes:
    contexts: tuple[int, ...] = (1024, 4096)  # prefill / cache bytes / decode context lengths
    ppl_prefix: int = 1024  # exactly prefilled tokens before scoring starts
    ppl_lengths: tuple[int, ...] = (2048, 4096)  # ppl[N]: tokens at positions [N/2, N)
    chunk: int = DECODE_MAX_QUERIES  # tokens per scoring forward (<= 16: kvdemo's decode path)
    residual: int = 128  # full-precision residual window of every quantized contender (transformers' default)
    new_tokens: int = 128  # timed decode steps per round: a multiple of `residual`, so each round holds flushes
    warmup_steps: int = 2  # untimed decode steps before the first timed round
    rounds: int = 2  # decode rounds, interleaved across contenders; medians count (see _report)
    kl_every: int = 4  # logit KL vs full on every kl_every-th scored position of the held-out text
    needle_lengths: tuple[int, ...] = (1024, 4096)
    needle_depths: tuple[int, ...] = (10, 50, 90)  # percent of the haystack
    warmup_tokens: int = 160  # prompt of the set-up probe (more than one residual window)
    seed: int = 0

    def __post_init__(self):
        if self.ppl_prefix <= 0 or any(n // 2 < self.ppl_prefix for n in self.ppl_lengths):
            raise BenchError(f"every ppl length must be at least 2 x ppl_prefix ({self.ppl_prefix})")
        if not 1 <= self.chunk <= DECODE_MAX_QUERIES:
            raise BenchError(f"chunk must be 1..{DECODE_MAX_QUERIES} (kvdemo's decode path), got {self.chunk}")
        if min(self.new_tokens, self.rounds, self.kl_every) < 1 or self.warmup_steps < 0:
            raise BenchError("new_tokens, rounds and kl_every must be >= 1, warmup_steps >= 0")
        if self.residual < 64 or self.residual % 64:
            raise BenchError(
                f"residual must be a multiple of 64 (the ktoken:g64 contender's group), got {self.residual}"
            )
        if self.new_tokens % self.residual:
            raise BenchError(
                f"new_tokens ({self.new_tokens}) must be a multiple of residual ({self.residual}): "
                "every timed round then holds the same number of flushes"
            )
        if any(not 0 <= d <= 100 for d in self.needle_depths):
            raise BenchError("needle depths are percentages: 0..100")

    def longest(self) -> int:
        """Most positions any measurement puts in one cache."""
        decode = max(self.contexts) + self.warmup_steps + self.rounds * self.new_tokens
        needle = max(self.needle_lengths) + 32  # the answer after the prompt
        return max(decode, needle, max(self.ppl_lengths))


FULL = BenchSizes()
QUICK = BenchSizes(  # a residual of 64 (kvdemo int4 then uses g64) so one short round crosses a flush
    contexts=(256, 512),
    ppl_prefix=128,
    ppl_lengths=(256, 512),
    residual=64,
    new_tokens=64,
    warmup_steps=1,
    rounds=1,
    needle_lengths=(512,),
    needle_depths=(50,),
    warmup_tokens=144,
)

ONE_K = BenchSizes(  # 1k context, perplexity at 2k, 3 needle cells: what a busy shared 2-core machine finishes
    contexts=(1024,),
    ppl_prefix=1024,
    ppl_lengths=(2048,),
    needle_lengths=(1024,),
)
SIZES = {"full": FULL, "1k": ONE_K, "quick": QUICK}


@dataclass(frozen=True)
class Contender:
    """One cache implementation under test: how to build it and which attention reads it."""

    name: str  # "full" | "kvdemo-int4" | "hf-quanto-int4" | ...
    backend: str  # "dynamic" | "kvdemo" | "quanto" | "hqq" | "fp8"
    bits: int | None = None  # nominal code bits; None: the model's dtype
    precision: str = ""  # kvdemo precision string, residual included (see `kvdemo_precision`)
    residual: int = HF_DEFAULTS["residual_length"]  # transformers' residual_length (quanto, hqq)

    @property
    def attention(self) -> str:
        return "kvdemo" if self.backend == "kvdemo" else "sdpa"

    @property
    def family(self) -> str:
        return "kvdemo" if self.backend == "kvdemo" else "transformers"

    def make_cache(self, lm: LoadedModel):
        from transformers import DynamicCache, QuantizedCache

        if self.backend == "kvdemo":
            return runner.new_cache(lm, self.precision)
        if self.backend == "dynamic":
            return DynamicCache(config=lm.config)
        if self.backend == "fp8":
            return QuantizedCache(backend="fp8", config=lm.config)
        return QuantizedCache(backend=self.backend, config=lm.config, nbits=self.bits, **self.hf_options)

    @property
    def hf_options(self) -> dict:
        return HF_DEFAULTS | {"residual_length": self.residual}

    def settings(self, lm: LoadedModel) -> dict:
        if self.backend == "kvdemo":
            return parse_precision(self.precision).to_dict()
        if self.backend == "dynamic":
            return {"dtype": str(lm.dtype).replace("torch.", ""), "attention": "sdpa"}
        if self.backend == "fp8":
            return {"format": "float8_e4m3fn", "scale": "one per tensor, frozen after the first update"}
        return {"nbits": self.bits, **self.hf_options, "metadata_dtype": str(lm.dtype).replace("torch.", "")}


def kvdemo_precision(preset: str, residual: int) -> str:
    """`preset` with a full-precision residual of `residual` tokens: the group shrinks to fit when it must
    (the residual is a whole number of groups), e.g. ("int4", 64) -> "int4:g64:r64"."""
    spec = parse_precision(preset)
    if spec.residual != residual:
        spec = dataclasses.replace(spec, residual=residual, group_size=min(spec.group_size, residual))
    return spec.label


def contenders(quick: bool = False, residual: int | None = None) -> tuple[list[Contender], list[dict]]:
    """(contenders that can run here, [{"contender", "reason"}] for those skipped). Every quantized
    contender keeps the same full-precision residual window: `residual` (default: QUICK's or FULL's)."""
    from transformers.utils import is_hqq_available, is_optimum_quanto_available

    residual = residual or (QUICK if quick else FULL).residual
    presets = QUICK_PRESETS if quick else KVDEMO_PRESETS + METHOD_PRESETS
    run = [Contender("full", "dynamic")]
    run += [
        Contender(f"kvdemo-{p}", "kvdemo", parse_precision(p).key_bits, kvdemo_precision(p, residual), residual)
        for p in presets
    ]
    hf = [Contender("hf-quanto-int4", "quanto", 4, residual=residual)]
    hf += [Contender("hf-quanto-int2", "quanto", 2, residual=residual)]
    hf += [Contender("hf-hqq-int4", "hqq", 4, residual=residual), Contender("hf-hqq-int2", "hqq", 2, residual=residual)]
    hf += [Contender("hf-fp8", "fp8", 8)]
    if quick:
        hf = [c for c in hf if c.name in ("hf-quanto-int4", "hf-fp8")]
    skipped = []
    for c in hf:
        reason = None
        if c.backend == "quanto" and not is_optimum_quanto_available():
            reason = "optimum-quanto is not installed (pip install optimum-quanto)"
        elif c.backend == "quanto" and quick and not quanto_extension_built():
            reason = (
                "quick mode: optimum-quanto's C++ extension is not built yet (its first call builds it, "
                "70-240 s on 2 cores); the full bench measures that set-up"
            )
        elif c.backend == "hqq" and not is_hqq_available():
            reason = "hqq is not installed (pip install hqq; CPU torch is enough)"
        if reason:
            skipped.append({"contender": c.name, "reason": reason})
        else:
            run.append(c)
    return run, skipped


def quanto_extension_built() -> bool:
    """Whether optimum-quanto's CPU extension is already compiled for this torch (no build on first call)."""
    try:
        from optimum.quanto.library.extensions import get_extension
    except ImportError:
        return False
    folder = Path(get_extension("quanto_cpp").build_directory)
    version = folder / "pytorch_version.txt"
    built = any(folder.glob("*.so")) or any(folder.glob("*.pyd"))
    return built and version.is_file() and version.read_text().strip() == torch.__version__


# --- bytes -----------------------------------------------------------------------------------------


def tensor_bytes(obj) -> int:
    """Bytes of the tensors held by `obj`: a tensor, a tensor subclass (its inner tensors, e.g. quanto's
    packed data + scale + shift), or tuples / lists / dicts of them (HQQ's (codes, meta))."""
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x) for x in obj.values())
    return 0


def cache_bytes(cache) -> dict:
    """{"live", "allocated"} bytes of a cache: kvdemo counts itself; a transformers cache is counted
    tensor by tensor over every attribute of every layer (quantized states, residual, scales)."""
    if isinstance(cache, QuantizedKVCache):
        nb = cache.nbytes()
        return {"live": nb["total"], "allocated": nb["allocated"]}
    live = sum(tensor_bytes(v) for layer in cache.layers for v in vars(layer).values())
    return {"live": live, "allocated": live}


# --- model calls -------------------------------------------------------------------------------------


def held_exact(cache) -> int | None:
    """How much a cache holds outside its quantized store (kvdemo: residual bytes; transformers'
    QuantizedCache: residual tokens of layer 0); it drops at a flush. None: a cache that never flushes."""
    if isinstance(cache, QuantizedKVCache):
        return cache.nbytes()["residual"]
    layer = cache.layers[0]
    if not hasattr(layer, "residual_length"):  # DynamicCache, the fp8 backend: appended as they come
        return None
    keys = getattr(layer, "keys", None)
    return keys.shape[-2] if keys is not None and keys.dim() == 4 else 0


@torch.no_grad()
def decode_steps(lm: LoadedModel, cache, logits: torch.Tensor, steps: int) -> tuple[float, torch.Tensor]:
    """Greedy decode `steps` tokens (no stop token: a fixed amount of work); (seconds, last logits [V])."""
    start = time.perf_counter()
    for _ in range(steps):
        logits = runner.prefill(lm, [int(torch.argmax(logits))], cache)
    return time.perf_counter() - start, logits


@torch.no_grad()
def decode_speed(
    lm: LoadedModel,
    precisions: Sequence[PrecisionSpec | str],
    context: int = 4096,
    steps: int = 16,
    rounds: int = 5,
    on_progress=None,
) -> dict:
    """Greedy decode tokens/s after a `context`-token prompt of held-out text, every precision in one run.

    Each cache is prefilled once and warmed by one untimed step; then `rounds` x `steps` steps go round-robin
    one step at a time over the caches, so each precision's step i runs within a second of the others' step
    i and load on the machine (which drifts over seconds here) hits them alike. Per precision: tokens/s from
    the median step time, and `vs_first`, the median over steps of (first precision's step time / this
    one's) for the steps taken side by side ({"context", "steps", "rounds", "protocol", "results":
    [{"precision", "tokens_per_s", "vs_first"}]})."""
    from .texts import held_out_ids

    specs = [parse_precision(p) for p in precisions]
    ids = held_out_ids(lm, context)
    live = []
    for spec in specs:
        if on_progress is not None:
            on_progress(f"decode speed: prefill {context} tokens at {spec.label}")
        cache = runner.new_cache(lm, spec)
        logits = runner.prefill(lm, ids, cache, mode="exact")
        _, logits = decode_steps(lm, cache, logits, 1)  # warm-up, untimed
        live.append([cache, logits, []])
    for _ in range(rounds * steps):
        for entry in live:
            seconds, entry[1] = decode_steps(lm, entry[0], entry[1], 1)
            entry[2].append(seconds)
    first = live[0][2]
    results = [
        {
            "precision": spec.label,
            "tokens_per_s": round(1.0 / statistics.median(times), 3),
            "vs_first": round(paired_ratio(first, times), 3),
        }
        for spec, (_, _, times) in zip(specs, live, strict=True)
    ]
    protocol = (
        f"{rounds * steps} steps per precision after one warm-up step, interleaved one step at a time; "
        "tokens/s from the median step, vs_first the median of paired step-time ratios"
    )
    return {"context": context, "steps": steps, "rounds": rounds, "protocol": protocol, "results": results}


@dataclass
class DecodeRound:
    """One timed round of greedy decoding: per-step seconds and which steps flushed the cache."""

    step_s: list[float]
    flush_steps: list[int]  # indices into step_s of the steps at which the cache flushed its residual

    @property
    def seconds(self) -> float:
        return sum(self.step_s)


@torch.no_grad()
def decode_round(lm: LoadedModel, cache, logits: torch.Tensor, steps: int) -> tuple[DecodeRound, torch.Tensor]:
    """Greedy decode `steps` tokens, each timed alone; a flush is a step after which the cache holds less
    outside its quantized store than before (`held_exact`, read between the timed steps)."""
    step_s, flushes = [], []
    held = held_exact(cache)
    for i in range(steps):
        t0 = time.perf_counter()
        logits = runner.prefill(lm, [int(torch.argmax(logits))], cache)
        step_s.append(time.perf_counter() - t0)
        now = held_exact(cache)
        if held is not None and now is not None and now < held:
            flushes.append(i)
        held = now
    return DecodeRound(step_s, flushes), logits


@torch.no_grad()
def answer_score(lm: LoadedModel, cache, question: Sequence[int], answer: Sequence[int]) -> dict:
    """Feed question + answer[:-1] through the cache: {"logprob" (nats, summed), "found" (greedy would say it)}."""
    q, a = list(question), list(answer)
    if not q or not a:
        raise BenchError("a needle cell needs a non-empty question suffix and answer")
    logits = runner.forward(lm, q + a[:-1], cache)[len(q) - 1 :]  # [len(a), V]: row i predicts a[i]
    lp = torch.log_softmax(logits, -1)
    target = torch.tensor(a, device=lp.device)
    logprob = float(lp[torch.arange(len(a)), target].sum())
    found = bool((logits.argmax(-1) == target).all())
    return {"logprob": round(logprob, 4), "found": found}


# --- the run -----------------------------------------------------------------------------------------


@dataclass
class _Row:
    contender: Contender
    settings: dict
    cache_bytes: dict = field(default_factory=dict)
    cache_bytes_allocated: dict = field(default_factory=dict)
    prefill_s: dict = field(default_factory=dict)
    decode_rounds: dict = field(default_factory=dict)  # ctx -> [tok/s per round]
    decode_steps: dict = field(default_factory=dict)  # ctx -> [DecodeRound]
    ppl: dict = field(default_factory=dict)
    logit_kl: dict = field(default_factory=dict)
    needle: list = field(default_factory=list)
    first_call_s: float = 0.0
    second_call_s: float = 0.0


def run_bench(
    lm: LoadedModel,
    quick: bool = False,
    out_dir: str | Path | None = "reports",
    on_progress: Callable[[str], None] | None = None,
    sizes: BenchSizes | None = None,
    only: Sequence[str] | None = None,
) -> dict:
    """Measure every available contender on the same model, texts and machine; write the report files
    (bench.json, bench.md, bench.html) to `out_dir` (None: write nothing) and return the report dict."""
    from .texts import held_out_ids, prose_ids

    sizes = sizes or (QUICK if quick else FULL)
    if sizes.longest() > lm.max_context:
        raise BenchError(f"the bench needs {sizes.longest()} positions; the model's context is {lm.max_context}")
    run, skipped = contenders(quick, sizes.residual)
    if only is not None:
        unknown = set(only) - {c.name for c in run} - {s["contender"] for s in skipped}
        if unknown:
            raise BenchError(
                f"unknown contender(s) {', '.join(sorted(unknown))}; known: {', '.join(c.name for c in run)}"
            )
        run = [c for c in run if c.name in only]
        skipped = [s for s in skipped if s["contender"] in only]
    t_start = time.perf_counter()
    machine = machine_info(lm)

    def progress(msg: str) -> None:
        if on_progress is not None:
            on_progress(f"[{time.perf_counter() - t_start:7.1f} s] {msg}")

    rows = {c.name: _Row(c, c.settings(lm)) for c in run}
    prose = prose_ids(lm, max(max(sizes.contexts), sizes.warmup_tokens))

    # 1. one-time set-up: the first tiny run of each contender, then the same run again
    for row in rows.values():
        c = row.contender
        progress(f"set-up probe: {c.name}")
        for attr in ("first_call_s", "second_call_s"):
            with runner.attention_impl(lm, c.attention):
                t0 = time.perf_counter()
                cache = c.make_cache(lm)
                logits = runner.prefill(lm, prose[: sizes.warmup_tokens], cache)
                decode_steps(lm, cache, logits, 2)
                setattr(row, attr, time.perf_counter() - t0)
            del cache

    # 2. prefill time and cache bytes at each context, then warm decode rounds interleaved across contenders
    for ctx in sizes.contexts:
        live = {}
        for row in rows.values():
            c = row.contender
            progress(f"prefill {ctx}: {c.name}")
            with runner.attention_impl(lm, c.attention):
                cache = c.make_cache(lm)
                t0 = time.perf_counter()
                logits = runner.prefill(lm, prose[:ctx], cache)
                row.prefill_s[str(ctx)] = time.perf_counter() - t0
                nb = cache_bytes(cache)
                row.cache_bytes[str(ctx)], row.cache_bytes_allocated[str(ctx)] = nb["live"], nb["allocated"]
                _, logits = decode_steps(lm, cache, logits, sizes.warmup_steps)
            live[c.name] = (cache, logits)
        for r in range(sizes.rounds):
            for row in rows.values():
                c = row.contender
                progress(f"decode {ctx} round {r + 1}/{sizes.rounds}: {c.name}")
                cache, logits = live[c.name]
                with runner.attention_impl(lm, c.attention):
                    timed, logits = decode_round(lm, cache, logits, sizes.new_tokens)
                live[c.name] = (cache, logits)
                row.decode_rounds.setdefault(str(ctx), []).append(sizes.new_tokens / timed.seconds)
                row.decode_steps.setdefault(str(ctx), []).append(timed)
        del live

    # 3. perplexity of held-out text (kvdemo.ppl's protocol): an exact prefix, the rest fed in chunks
    # through each cache; logit KL against full precision's next-token distributions (the first row: full)
    text = held_out_ids(lm, max(sizes.ppl_lengths))
    caches = [
        (row.contender.name, row.contender.attention, partial(row.contender.make_cache, lm)) for row in rows.values()
    ]
    scores = score_caches(
        lm, caches, text, sizes.ppl_prefix, sizes.ppl_lengths, sizes.chunk, sizes.residual, sizes.kl_every, progress
    )
    for name, scored in scores:
        rows[name].ppl, rows[name].logit_kl = scored.ppl, scored.logit_kl

    # 4. needle grid (kvdemo.needle's prompts): the context stored exactly, the question through each cache
    from .needle import build_prompt, cell_rng, default_haystack, make_task

    _, haystack = default_haystack(NEEDLE_KIND)
    for length in sizes.needle_lengths:
        for depth in sizes.needle_depths:
            task = make_task(NEEDLE_KIND, cell_rng(sizes.seed, length, depth))
            prompt = build_prompt(lm, task, haystack, length, depth, rng=cell_rng(sizes.seed, length, depth))
            context, suffix = prompt.ids[: prompt.context_len], prompt.ids[prompt.context_len :]
            progress(f"needle {length} tokens, depth {depth}%: exact context of {len(context)} tokens")
            states, _ = exact_states(lm, context)
            for row in rows.values():
                c = row.contender
                with runner.attention_impl(lm, c.attention):
                    cache = c.make_cache(lm)
                    store_states(cache, states, sizes.residual)
                    score = answer_score(lm, cache, suffix, prompt.answer_ids)
                row.needle.append({"length": length, "depth": depth, "depth_actual": prompt.depth_actual, **score})
                del cache
            del states

    report = _report(lm, sizes, quick, machine, rows, skipped, time.perf_counter() - t_start)
    if out_dir is not None:
        report["files"] = write_report(report, out_dir)
    progress("done")
    return report


def _report(lm, sizes: BenchSizes, quick: bool, machine: dict, rows: dict, skipped: list, wall_s: float) -> dict:
    per_token_fp16 = fp16_cache_bytes(lm.num_layers, lm.kv_heads, lm.head_dim, 1)
    base = rows.get("full")
    results = []
    for row in rows.values():
        c = row.contender
        ratio = {k: round(per_token_fp16 * int(k) / b, 4) for k, b in row.cache_bytes.items()}
        bits = {k: round(16 * b / (per_token_fp16 * int(k)), 3) for k, b in row.cache_bytes.items()}
        # short rounds interleaved across contenders, reduced by medians: a burst of load from other
        # processes spoils a round or two, not the result (best-of picks whoever a quiet moment favoured)
        speed = {k: round(statistics.median(v), 3) for k, v in row.decode_rounds.items()}
        out = {
            "contender": c.name,
            "family": c.family,
            "backend": c.backend,
            "bits": c.bits,
            "attention": c.attention,
            "settings": row.settings,
            "cache_bytes": row.cache_bytes,
            "cache_bytes_allocated": row.cache_bytes_allocated,
            "ratio_vs_fp16": ratio,
            "ratio_allocated_vs_fp16": {
                k: round(per_token_fp16 * int(k) / b, 4) for k, b in row.cache_bytes_allocated.items()
            },
            "bits_per_element": bits,
            "ppl": {k: round(v, 4) for k, v in row.ppl.items()},
            "ppl_delta": {},
            "ppl_delta_pct": {},
            "logit_kl": {k: float(f"{v:.4g}") for k, v in row.logit_kl.items()},
            "needle": _needle_summary(row.needle),
            "needle_logprob_delta": None,
            "decode_tok_s": speed,
            "decode_tok_s_rounds": {k: [round(x, 3) for x in v] for k, v in row.decode_rounds.items()},
            "decode_speed_vs_full": {},
            "decode_window": {k: _window_summary(v) for k, v in row.decode_steps.items()},
            "prefill_s": {k: round(v, 3) for k, v in row.prefill_s.items()},
            "setup_s": round(max(row.first_call_s - row.second_call_s, 0.0), 3),
            "first_call_s": round(row.first_call_s, 3),
        }
        if base is not None:
            for k, v in row.ppl.items():
                out["ppl_delta"][k] = round(v - base.ppl[k], 4)
                out["ppl_delta_pct"][k] = round(100 * (v / base.ppl[k] - 1), 3)
            ref = _needle_summary(base.needle)["mean_logprob"]
            out["needle_logprob_delta"] = round(out["needle"]["mean_logprob"] - ref, 4)
            for k, v in row.decode_rounds.items():
                out["decode_speed_vs_full"][k] = round(paired_ratio(v, base.decode_rounds[k]), 3)
        results.append(out)
    machine = machine | {"load_avg_end": [round(x, 2) for x in os.getloadavg()]}
    if (note := load_note(machine)) is not None:
        machine["notes"] = note
    report = {
        "machine": machine,
        "model": lm.name,
        "quick": quick,
        "sizes_name": next((name for name, v in SIZES.items() if v == sizes), "custom"),
        "sizes": asdict(sizes),
        "method": method_text(sizes),
        "results": results,
        "skipped": skipped,
        "wall_s": round(wall_s, 1),
    }
    report["goals"] = goals(report)
    report["key_vs_value"] = key_vs_value(report)
    report["scheme_vs_implementation"] = scheme_vs_implementation(report)
    return report


def _window_summary(rounds: list[DecodeRound]) -> dict:
    """Flushes and step times of a contender's timed decode window at one context."""
    steps = [t for r in rounds for t in r.step_s]
    flush = [r.step_s[i] for r in rounds for i in r.flush_steps]
    flush_set = [{*r.flush_steps} for r in rounds]
    plain = [t for r, f in zip(rounds, flush_set, strict=True) for i, t in enumerate(r.step_s) if i not in f]
    return {
        "steps": len(steps),
        "flushes": len(flush),
        "flushes_per_round": [len(r.flush_steps) for r in rounds],
        "median_step_ms": round(1000 * statistics.median(plain or steps), 3),
        "mean_flush_step_ms": round(1000 * sum(flush) / len(flush), 3) if flush else None,
        "seconds": round(sum(steps), 3),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b where both have the same sign and b is not zero (a ratio of two damages), else None."""
    if a is None or b is None or b == 0 or (a > 0) != (b > 0):
        return None
    return round(a / b, 2)


def key_vs_value(report: dict) -> dict | None:
    """4-bit keys (k4v8) against 4-bit values (k8v4), end to end: each damage measure of both and their ratio
    (how many times more quantizing keys to 4 bits costs than quantizing values to 4 bits)."""
    rows = {r["contender"]: r for r in report["results"]}
    keys, values = (rows.get(n) for n in KEY_VS_VALUE)
    if keys is None or values is None:
        return None
    measures = {}
    for n in keys["ppl_delta"]:
        measures[f"ppl_delta@{n}"] = (keys["ppl_delta"][n], values["ppl_delta"][n])
    for n in keys["logit_kl"]:
        measures[f"logit_kl@{n}"] = (keys["logit_kl"][n], values["logit_kl"][n])
    if keys["needle_logprob_delta"] is not None:
        loss = (-keys["needle_logprob_delta"], -values["needle_logprob_delta"])  # nats of answer log-prob lost
        measures["needle_logprob_loss"] = loss
    return {
        "contenders": {"keys_4bit": KEY_VS_VALUE[0], "values_4bit": KEY_VS_VALUE[1]},
        "measures": {m: {"keys_4bit": a, "values_4bit": b, "ratio": _ratio(a, b)} for m, (a, b) in measures.items()},
    }


def scheme_vs_implementation(report: dict) -> dict | None:
    """transformers' scheme in kvdemo (int4:ktoken:g64) vs in transformers+quanto (hf-quanto-int4): the
    implementation's share of the gap; vs kvdemo's own scheme (kvdemo-int4): the scheme's share."""
    rows = {r["contender"]: r for r in report["results"]}
    ours_scheme, theirs = (rows.get(n) for n in SAME_SCHEME)
    ours = rows.get("kvdemo-int4")
    if ours_scheme is None:
        return None
    big_ppl = str(max(report["sizes"]["ppl_lengths"]))
    big_ctx = str(max(report["sizes"]["contexts"]))

    def facts(r: dict) -> dict:
        return {
            "ppl_delta": r["ppl_delta"].get(big_ppl),
            "logit_kl": r["logit_kl"].get(big_ppl),
            "needle_logprob": r["needle"]["mean_logprob"],
            "ratio_vs_fp16": r["ratio_vs_fp16"][big_ctx],
            "decode_tok_s": r["decode_tok_s"][big_ctx],
        }

    out = {"at": {"ppl_tokens": int(big_ppl), "context": int(big_ctx)}, SAME_SCHEME[0]: facts(ours_scheme)}
    for name, other in ((SAME_SCHEME[1], theirs), ("kvdemo-int4", ours)):
        if other is None:
            continue
        out[name] = facts(other)
        out[f"decode speed {SAME_SCHEME[0]} / {name}"] = round(
            paired_ratio(ours_scheme["decode_tok_s_rounds"][big_ctx], other["decode_tok_s_rounds"][big_ctx]), 3
        )
    return out


def paired_ratio(mine: Sequence[float], theirs: Sequence[float]) -> float:
    """Median over rounds of mine[r] / theirs[r] (rounds measured side by side, interleaved)."""
    return statistics.median(a / b for a, b in zip(mine, theirs, strict=True))


def _needle_summary(cells: list[dict]) -> dict:
    if not cells:
        return {"cells": [], "mean_logprob": None, "found": 0, "total": 0}
    mean = sum(c["logprob"] for c in cells) / len(cells)
    return {
        "cells": cells,
        "mean_logprob": round(mean, 4),
        "found": sum(c["found"] for c in cells),
        "total": len(cells),
    }


def method_text(sizes: BenchSizes) -> dict:
    """How each number was measured, in words (goes into the report and README)."""
    return {
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


def goals(report: dict) -> list[dict]:
    """The issue's goals, judged on this report's numbers (None when a contender needed is missing)."""
    rows = {r["contender"]: r for r in report["results"]}
    big_ppl = str(max(report["sizes"]["ppl_lengths"]))
    big_ctx = str(max(report["sizes"]["contexts"]))
    out = []
    a, b = rows.get("kvdemo-int4"), rows.get("hf-quanto-int4")
    if a and b and a["ppl_delta"] and b["ppl_delta"]:
        da, db = a["ppl_delta"][big_ppl], b["ppl_delta"][big_ppl]
        met = abs(da) < abs(db)
        measured = {"kvdemo-int4": da, "hf-quanto-int4": db}
    else:
        met, measured = None, {}
    out.append(
        {"goal": f"kvdemo int4 ppl delta smaller than quanto int4's at {big_ppl} tokens", "met": met}
        | {"measured": measured}
    )
    if a and b:
        speed = paired_ratio(a["decode_tok_s_rounds"][big_ctx], b["decode_tok_s_rounds"][big_ctx])
        measured = {"kvdemo-int4": a["decode_tok_s"][big_ctx], "hf-quanto-int4": b["decode_tok_s"][big_ctx]}
        out.append(
            {
                "goal": f"kvdemo int4 decode >= 1.2x quanto int4's tokens/s at {big_ctx} context (warm, "
                "a window that crosses both caches' flushes)",
                "met": speed >= 1.2,
                "measured": measured | {"speedup": round(speed, 3), "hf-quanto-int4 setup_s": b["setup_s"]},
            }
        )
    else:
        out.append({"goal": "kvdemo int4 decode >= 1.2x quanto int4's tokens/s", "met": None, "measured": {}})
    pairs = {}
    for ours, theirs in SAME_BITS:
        if ours in rows and theirs in rows:
            mine, other = rows[ours]["ratio_vs_fp16"], rows[theirs]["ratio_vs_fp16"]
            pairs[f"{ours} vs {theirs}"] = {k: [mine[k], other[k], mine[k] >= other[k]] for k in mine}
    met = all(v[2] for p in pairs.values() for v in p.values()) if pairs else None
    out.append({"goal": "kvdemo memory ratio >= transformers' at the same bits", "met": met, "measured": pairs})
    return out


def machine_info(lm: LoadedModel) -> dict:
    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    if lm.device.type == "cuda":
        cpu += f"; GPU {torch.cuda.get_device_name(lm.device)}"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "optimum-quanto": version("optimum-quanto"),
        "hqq": version("hqq"),
        "quanto_extension_built_before_run": quanto_extension_built(),
        "device": str(lm.device),
        "dtype": str(lm.dtype).replace("torch.", ""),
        "model": lm.name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


# --- report files ------------------------------------------------------------------------------------


def load_note(machine: dict) -> str | None:
    """A note when other processes had the CPU busy as the run began (1-minute load average over half the cores).
    The load average at the end is not a sign of other load: the run itself keeps every core busy to the end."""
    busy = machine["load_avg_start"][0]
    if busy <= 0.5 * (machine["cores"] or 1):
        return None
    return (
        f"Other processes had the CPU busy as this run began (load average {busy} on {machine['cores']} cores): "
        "absolute tok/s and seconds may be lower and noisier than on an idle machine; speed ratios come from "
        "rounds measured side by side."
    )


def markdown_table(report: dict) -> str:
    """The results as one markdown table, plus the machine and the goals."""
    s = report["sizes"]
    ctx, ppl = [str(c) for c in s["contexts"]], [str(n) for n in s["ppl_lengths"]]
    head = ["contender"]
    head += [f"ratio vs fp16 @{c}" for c in ctx]
    # reports written before logit KL and the flush-crossing decode window existed have neither column
    has_kl = any(r.get("logit_kl") for r in report["results"])
    has_window = any(r.get("decode_window") for r in report["results"])
    head += [f"ppl @{n} (delta)" for n in ppl]
    head += [f"logit KL @{ppl[-1]}"] if has_kl else []
    head += [f"allocated ratio @{ctx[-1]}", "needle log-prob (found)"]
    head += [f"decode tok/s @{c}" for c in ctx]
    head += [f"flushes @{ctx[-1]}", f"step ms (flush step) @{ctx[-1]}"] if has_window else []
    head += [f"prefill s @{c}" for c in ctx]
    head += ["setup s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["results"]:
        cells = [f"`{r['contender']}`"]
        cells += [f"{r['ratio_vs_fp16'][c]:.2f}x" for c in ctx]
        for n in ppl:
            delta = r["ppl_delta"].get(n)
            cells.append(f"{r['ppl'][n]:.3f}" + ("" if delta is None else f" ({delta:+.3f})"))
        if has_kl:
            kl = r["logit_kl"].get(ppl[-1])
            cells.append("" if kl is None else f"{kl:.2e}")
        cells.append(f"{r['ratio_allocated_vs_fp16'][ctx[-1]]:.2f}x")
        nd = r["needle"]
        cells.append(f"{nd['mean_logprob']:.2f} ({nd['found']}/{nd['total']})")
        cells += [f"{r['decode_tok_s'][c]:.2f}" for c in ctx]
        win = r.get("decode_window", {}).get(ctx[-1])
        if has_window and win is None:
            cells += ["", ""]
        elif has_window:
            flush_ms = "" if win["mean_flush_step_ms"] is None else f" ({win['mean_flush_step_ms']:.0f})"
            cells += [f"{win['flushes']} in {win['steps']} steps", f"{win['median_step_ms']:.1f}{flush_ms}"]
        cells += [f"{r['prefill_s'][c]:.2f}" for c in ctx]
        cells.append(f"{r['setup_s']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    m = report["machine"]
    lines.append("")
    lines.append(
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), {m['device']} {m['dtype']}, "
        f"torch {m['torch']}, transformers {m['transformers']}, optimum-quanto {m['optimum-quanto']}, hqq {m['hqq']}; "
        f"{m['date']}; load average {m['load_avg_start'][0]} at start, {m['load_avg_end'][0]} at end; "
        f"wall time {report['wall_s']:.0f} s." + (f" {m['notes']}" if m.get("notes") else "")
    )
    for sk in report["skipped"]:
        lines.append(f"Skipped `{sk['contender']}`: {sk['reason']}.")
    lines.append("")
    for g in report["goals"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[g["met"]]
        lines.append(f"- {g['goal']}: **{verdict}** {json.dumps(g['measured'])}")
    kv = report.get("key_vs_value")
    if kv:
        lines += ["", f"Keys vs values (`{KEY_VS_VALUE[0]}`: 4-bit keys / `{KEY_VS_VALUE[1]}`: 4-bit values):", ""]
        lines += ["| measure | 4-bit keys | 4-bit values | ratio |", "|---|---|---|---|"]
        for name, m in kv["measures"].items():
            ratio = "n/a" if m["ratio"] is None else f"{m['ratio']:.1f}x"
            lines.append(f"| {name} | {m['keys_4bit']:.4g} | {m['values_4bit']:.4g} | {ratio} |")
    sv = report.get("scheme_vs_implementation")
    if sv:
        lines += ["", f"Scheme vs implementation: {json.dumps(sv)}"]
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: str | Path) -> dict:
    """Write bench.json, bench.md and bench.html into `out_dir`; return their paths."""
    import plotly.io as pio

    from .figures.bench import bench_figures

    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {name.split(".")[1]: str(folder / name) for name in REPORT_FILES}
    body = {k: v for k, v in report.items() if k != "files"} | {"files": paths}
    Path(paths["json"]).write_text(json.dumps(body, indent=2) + "\n")
    Path(paths["md"]).write_text(f"# kvdemo bench: {report['model']}\n\n" + markdown_table(report))
    figs = [pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(bench_figures(report))]
    title = f"kvdemo bench: {report['model']}"
    Path(paths["html"]).write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head><body>"
        f"<h1>{title}</h1><pre>{_html_escape(markdown_table(report))}</pre>" + "\n".join(figs) + "</body></html>\n"
    )
    return paths


def _html_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def load_report(out_dir: str | Path = "reports") -> dict | None:
    """The latest bench.json in `out_dir` (for the Memory page), or None when there is none."""
    path = Path(out_dir) / "bench.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
