"""The probe's prompts: the needle page's prompts (kvdemo.needle.prompts: the same tasks, haystacks, depths and
sentence boundaries), built to a length counted by an estimate, since an endpoint's tokenizer is not at hand.

`WordPieces` splits text the way byte-pair tokenizers of English mostly do (a word of up to six letters with
its leading space, digits in threes, each punctuation mark), about one piece per token of GPT-4's or
Llama 3's tokenizer on English prose; `needle.build_prompt` runs on it unchanged. The length a cell asks
for is therefore approximate in the endpoint's own tokens: the report keeps the estimate and, per endpoint,
the `usage.prompt_tokens` it counted.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

from ..needle.prompts import NeedlePrompt, NeedleTask, build_prompt

_PIECE = re.compile(r" ?[^\W\d_]{1,6}| ?\d{1,3}| ?[^\w\s]| ?_|\s")


class WordPieces:
    """A stand-in tokenizer with the calls `needle.build_prompt` makes (no chat template: the prompt is the
    plain ``user: ...`` rendering, about the size of a chat template's overhead)."""

    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = False, return_offsets_mapping: bool = False) -> dict:
        spans = [m.span() for m in _PIECE.finditer(text)]
        out = {"input_ids": [zlib.crc32(text[a:b].encode("utf-8")) for a, b in spans]}
        if return_offsets_mapping:
            out["offset_mapping"] = spans
        return out

    def count(self, text: str) -> int:
        return sum(1 for _ in _PIECE.finditer(text))


class _Estimator:
    """What `build_prompt` reads of a model: its tokenizer."""

    name = "word-piece estimate"
    tokenizer = WordPieces()


ESTIMATOR = _Estimator()


@dataclass
class Question:
    """One needle as the probe asks it: its cell, its task and prompt (the user message is `prompt.text`)."""

    length: int
    depth: float
    seed: int
    task: NeedleTask
    prompt: NeedlePrompt

    @property
    def estimated_tokens(self) -> int:
        return self.prompt.length

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.prompt.text}]


def question(task: NeedleTask, haystack: str, length: int, depth: float, seed: int, rng, joiner: str) -> Question:
    """The cell's prompt of about `length` tokens (by `WordPieces`) with the needle at `depth`%."""
    return Question(
        length, float(depth), seed, task, build_prompt(ESTIMATOR, task, haystack, length, depth, rng, joiner)
    )


def answer_logprob(token_logprobs: list[tuple[str, float]] | None, reply: str, answer: str) -> float | None:
    """The summed log-prob of the reply's tokens that spell `answer` (its first occurrence, case ignored): what the
    endpoint's own sampling gave the answer it wrote. None without log-probs, when the answer is not in the reply,
    or when the tokens do not spell the reply."""
    if not token_logprobs:
        return None
    text = "".join(t for t, _ in token_logprobs)
    at = text.lower().find(answer.strip().lower()) if answer.strip() else -1
    if at < 0 or text.strip() != reply.strip():
        return None
    end, pos, total = at + len(answer.strip()), 0, 0.0
    for token, logprob in token_logprobs:
        if pos < end and pos + len(token) > at:
            total += logprob
        pos += len(token)
    return round(total, 4)
