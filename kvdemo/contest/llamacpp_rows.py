"""llama.cpp's rows in the benchmark: its own engine (`kvdemo.llamacpp.Engine`) on the model's GGUF file and the
same token ids as the other rows, measured phase by phase as `kvdemo.contest.run` measures them: a set-up call
(loading the file into a context with the cache type, a short prefill, two steps), prefill and greedy decode at
each context, perplexity through `llamacpp.score_text`, needle cells through `llamacpp.answer_score`. Each
quantized row is read against llama.cpp's own f16 row, measured in the same run."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .. import llamacpp
from ..engines import KvTypes
from ..llamacpp import Engine
from ..ppl import logit_kl, per_length
from ..results.bench import BenchSizes
from .decode import DecodeRound


def decode_steps(engine: Engine, logits: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decode `steps` tokens, one llama_decode each (no stop token: a fixed amount of work); the last
    logits [V]."""
    for _ in range(steps):
        logits = engine.feed([int(logits.argmax())], last=1)[-1]
    return logits


def decode_round(engine: Engine, logits: torch.Tensor, steps: int) -> tuple[DecodeRound, torch.Tensor]:
    """Greedy decode `steps` tokens, each timed alone. llama.cpp's cache has no residual window: no step flushes."""
    step_s = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = engine.feed([int(logits.argmax())], last=1)[-1]
        step_s.append(time.perf_counter() - t0)
    return DecodeRound(step_s, []), logits


def setup_call(path: Path, kv: KvTypes, prompt: Sequence[int], steps: int = 2) -> tuple[float, float]:
    """(seconds of one set-up call: loading the GGUF file into a context with this cache type, a prefill of
    `prompt` and `steps` greedy steps; seconds of the load alone)."""
    t0 = time.perf_counter()
    engine = Engine(path, kv, n_ctx=len(prompt) + steps + 1)
    try:
        loaded = time.perf_counter() - t0
        decode_steps(engine, engine.feed(prompt, last=1)[-1], steps)
    finally:
        engine.close()
    return time.perf_counter() - t0, loaded


def open_for_decode(path: Path, kv: KvTypes, ctx: int, sizes: BenchSizes) -> Engine:
    """A context with room for a `ctx`-token prompt, the warm-up steps and every timed round."""
    return Engine(path, kv, n_ctx=ctx + sizes.warmup_steps + sizes.rounds * sizes.new_tokens + 1)


def prefill(engine: Engine, ids: Sequence[int]) -> tuple[float, torch.Tensor]:
    """(seconds, logits [V] of the last token) of llama.cpp's own prefill of `ids` (batches of its n_batch)."""
    t0 = time.perf_counter()
    logits = engine.feed(ids, last=1)[-1]
    return time.perf_counter() - t0, logits


def perplexity(
    path: Path,
    kv: KvTypes,
    text: Sequence[int],
    sizes: BenchSizes,
    reference: torch.Tensor | None,
    on_tokens: Callable[[int], None] | None = None,
) -> tuple[dict[str, float], dict[str, float], torch.Tensor]:
    """({"N": perplexity}, {"N": logit KL against `reference`}, the log-softmax rows kept for the KL) of `text`
    through llama.cpp with this cache: `llamacpp.score_text` with the bench's prefix, chunk and KL spacing, reduced
    per length as kvdemo's rows are (`kvdemo.ppl.per_length`). `reference`: llama.cpp's f16 rows (None: this is
    that row)."""
    engine = Engine(path, kv, n_ctx=len(text))
    try:
        nll, kept = llamacpp.score_text(engine, text, sizes.ppl_prefix, sizes.chunk, sizes.kl_every, on_tokens)
    finally:
        engine.close()
    kl = logit_kl(kept if reference is None else reference, kept)  # [n_kept]
    ppl, kls = per_length(nll, kl, sizes.ppl_prefix, sizes.ppl_lengths, sizes.kl_every)
    return ppl, kls, kept
