"""What quantization changed in a chat turn, token by token (results: `kvdemo.results.chat.AnswerComparison`).

Each lane's cache is forked right after it has read the turn's prompt (`PromptState`): the same conversation
and document prefix, stored at full precision in one and in the quantized format in the other. Every answer
is then teacher-forced through both forks with `needle.forward_as_decoding` (the few calls that give the
logits one-token-at-a-time decoding would give), so under its own cache it reproduces the logits the lane
decoded with, and under the other cache it shows what that cache thought of the same tokens: the
log-probability of each token, KL(full || quantized) of the two next-token distributions, and the first token
the other cache would not have chosen (greedy). No prompt is read twice: the cost is one teacher-forced pass
per answer and cache, as many tokens as the answers have.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..cache import QuantizedKVCache
from ..models import LoadedModel
from ..needle.run import forward_as_decoding
from ..results.chat import AnswerComparison, TokenScores
from ..runner import fork


@dataclass
class PromptState:
    """A lane's cache as it was once the turn's prompt was read, and the logits [V] of the answer's first token."""

    label: str
    cache: QuantizedKVCache
    logits: torch.Tensor  # [V] float32


def snapshot(label: str, cache: QuantizedKVCache, logits: torch.Tensor) -> PromptState:
    """A fork of `cache` (the lane goes on decoding into its own) and a copy of the first token's logits."""
    return PromptState(label, fork(cache), logits.detach().clone())


@torch.no_grad()
def teacher_forced_logprobs(lm: LoadedModel, state: PromptState, tokens: Sequence[int]) -> torch.Tensor:
    """Log-softmax [k, V] of the next-token logits before each of `tokens`, read from a fork of `state.cache`."""
    tokens = list(tokens)
    rows = [state.logits[None]]  # [1, V]: predicts tokens[0]
    if len(tokens) > 1:
        rows.append(forward_as_decoding(lm, tokens[:-1], fork(state.cache)))  # [k - 1, V]
    return torch.log_softmax(torch.cat(rows).float(), -1)  # [k, V]


def score_answer(
    lm: LoadedModel, tokens: Sequence[int], own: PromptState, other: PromptState, baseline: str
) -> TokenScores:
    """`tokens` (written by `own`'s lane) scored under both caches; KL is always KL(baseline || the other)."""
    tokens = list(tokens)
    lp_own = teacher_forced_logprobs(lm, own, tokens)  # [k, V]
    lp_other = teacher_forced_logprobs(lm, other, tokens)  # [k, V]
    full, quant = (lp_own, lp_other) if own.label == baseline else (lp_other, lp_own)
    kl = (full.exp() * (full - quant)).sum(-1).clamp_min(0.0)  # [k]
    idx = torch.arange(len(tokens))
    ids = torch.tensor(tokens)
    choices = lp_other.argmax(-1).tolist()  # [k]: the other cache's greedy token at each position
    div = next((i for i, (c, t) in enumerate(zip(choices, tokens, strict=True)) if c != t), None)
    decode = lm.tokenizer.decode
    return TokenScores(
        answer_of=own.label,
        scored_under=other.label,
        tokens=tokens,
        pieces=[decode([t], skip_special_tokens=True) for t in tokens],
        logprob_own=[round(x, 4) for x in lp_own[idx, ids].tolist()],
        logprob_other=[round(x, 4) for x in lp_other[idx, ids].tolist()],
        kl=[round(x, 5) for x in kl.tolist()],
        divergence=div,
        divergence_piece="" if div is None else decode([choices[div]], skip_special_tokens=True),
    )


def compare_answers(
    lm: LoadedModel, states: Sequence[PromptState], answers: Sequence[Sequence[int]]
) -> AnswerComparison:
    """The baseline's answer and the other lane's (`states` and `answers` baseline first), each scored under
    both prompt caches. An empty answer is left out."""
    if len(states) != 2 or len(answers) != 2:
        raise ValueError("compare_answers takes two lanes: the baseline and one quantized precision")
    t0 = time.perf_counter()
    base, chosen = states
    scored = [
        score_answer(lm, tokens, own, other, base.label)
        for tokens, own, other in ((answers[0], base, chosen), (answers[1], chosen, base))
        if tokens
    ]
    return AnswerComparison(base.label, chosen.label, scored, time.perf_counter() - t0)
