"""Greedy decoding, timed: steps through one cache, rounds that count the cache's flushes, and several precisions
decoding side by side (`decode_speed`, the methods ablation's decode part)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import runner
from ..models import LoadedModel
from ..precision import PrecisionSpec, parse_precision
from ..progress import ProgressFn, StopFn, Tracker
from ..results.bench import DecodeSpeed, DecodeSpeedRow, paired_ratio
from .contenders import held_exact


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
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
) -> DecodeSpeed:
    """Greedy decode tokens/s after a `context`-token prompt of held-out text, every precision in one run.

    Each cache is prefilled once and warmed by one untimed step; then `rounds` x `steps` steps go round-robin
    one step at a time over the caches, so each precision's step i runs within a second of the others' step
    i and load on the machine (which drifts over seconds here) hits them alike. Per precision: tokens/s from
    the median step time, and `vs_first`, the median over steps of (first precision's step time / this
    one's) for the steps taken side by side. Progress in tokens of model work: each prompt and warm-up step,
    then a round of steps at a time."""
    from ..texts import held_out_ids

    specs = [parse_precision(p) for p in precisions]
    ids = held_out_ids(lm, context)
    track = Tracker(len(specs) * (context + 1 + rounds * steps), "tokens", on_progress, should_stop)
    live = []
    for spec in specs:
        track.check("decode speed")
        cache = runner.new_cache(lm, spec)
        logits = runner.prefill(lm, ids, cache, mode="exact")
        _, logits = decode_steps(lm, cache, logits, 1)  # warm-up, untimed
        live.append([cache, logits, []])
        track.advance(f"decode speed: prefill {context} tokens at {spec.label}", context + 1)
    for r in range(rounds):
        track.check("decode speed")
        for _ in range(steps):
            for entry in live:
                seconds, entry[1] = decode_steps(lm, entry[0], entry[1], 1)
                entry[2].append(seconds)
        track.advance(f"decode speed: round {r + 1}/{rounds}", len(specs) * steps)
    first = live[0][2]
    results = [
        DecodeSpeedRow(spec.label, round(1.0 / statistics.median(times), 3), round(paired_ratio(first, times), 3))
        for spec, (_, _, times) in zip(specs, live, strict=True)
    ]
    protocol = (
        f"{rounds * steps} steps per precision after one warm-up step, interleaved one step at a time; "
        "tokens/s from the median step, vs_first the median of paired step-time ratios"
    )
    return DecodeSpeed(context, steps, rounds, protocol, results)


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
