"""The text every findings measurement runs over: one token sequence per model and size, with needles.

The chat template's user turn with a RULER-style instruction, then held-out prose (`kvdemo.texts.held_out`,
a book no other measurement uses) with multikey needles ("One of the special magic numbers for {key} is:
{7 digits}.", Hsieh et al., RULER, arXiv 2404.06654) placed near its start, cut to the tokens asked for.
At each prompt length the user turn is closed after the text read so far and the question for a needle is
asked; its true answer is scored after the needle's own lead-in ("The special magic number for {key}
mentioned in the provided text is", as RULER puts it in the prompt).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass

from .. import texts
from ..needle.prompts import MULTIKEY_LEAD_IN as LEAD_IN
from ..needle.prompts import MULTIKEY_NEEDLE as NEEDLE
from ..needle.prompts import MULTIKEY_QUESTION as QUESTION
from ..needle.prompts import insert_at, nearest_boundary, split_answer, token_offsets

# The needle grid's RULER-style multikey task (needle, question, answer lead-in) with the instruction's "it"
# made "them": the findings ask about several of the needles in one text. The shipped findings report was
# measured with this wording; changing it changes every prompt the findings score.
INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards."
)
ASKED_KEYS = 2  # needles asked about at every length; 2 more are distractors
NEEDLE_FRACTIONS = (0.15, 0.35, 0.6, 0.8)  # of the shortest prompt's text: asked, distractor, asked, distractor


class FindingsError(ValueError):
    """Settings a findings run cannot use (sizes beyond the model's context, unknown weights)."""


@dataclass
class Prompt:
    """A needle asked at one prompt length: the text's first `context` ids, then `suffix` (the user turn
    closed, the question, the reply's lead-in), then `answer` (the ids scored)."""

    length: int  # the prompt length asked for
    tokens: int  # the prompt's real length: context + suffix + answer
    context: int  # ids of the text read before the question
    key: str
    distance: int  # tokens from the needle to the end of the context
    suffix: list[int]
    answer: list[int]

    def to_json(self) -> dict:
        """What the report keeps of it (the ids stay out)."""
        return {"length": self.length, "tokens": self.tokens, "key": self.key, "distance": self.distance}


@dataclass
class FindingsText:
    """The shared text: its ids, where each prompt length's context ends and what is asked there."""

    ids: list[int]
    head: int  # tokens before the text (template + instruction)
    needles: list[dict]  # {"key", "value", "position"} (token index of the needle's first token)
    prompts: list[Prompt]
    windows: list[int]  # checkpoints where a perplexity window starts
    digest: str  # of the ids and the prompts: the disk cache's key

    def checkpoints(self) -> list[int]:
        return sorted({*self.windows, *(p.context for p in self.prompts)})


def _template_parts(lm, content_head: str, question: str) -> tuple[str, str, bool]:
    """(text before the document, text after it, whether the tokenizer adds special tokens itself)."""
    tok = lm.tokenizer
    mark = "\u2063DOC\u2063"
    content = content_head + mark + "\n\n" + question
    if getattr(tok, "chat_template", None):
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        special = False
    else:
        rendered, special = f"user: {content}\n\nassistant:", True
    head, tail = rendered.split(mark)
    return head, tail, special


def _ids(tok, text: str, special: bool = False) -> list[int]:
    return list(tok(text, add_special_tokens=special)["input_ids"])


def build_text(lm, tokens: int, needle_lengths: Sequence[int], windows: Sequence[int], seed: int = 0) -> FindingsText:
    """The held-out text with needles near its start, cut to `tokens` ids, and the prompts asked of it."""
    tok = lm.tokenizer
    rng = random.Random(f"kvdemo-findings:{seed}")
    keys = [f"{a}-{n}" for a, n in rng.sample([(a, n) for a in _ADJ for n in _NOUN], len(NEEDLE_FRACTIONS))]
    values = rng.sample(range(1_000_000, 10_000_000), len(keys))
    head_text, _, special = _template_parts(lm, INSTRUCTION + "\n\n", QUESTION.format(key=keys[0]))
    head_ids = _ids(tok, head_text, special)
    shortest = min(needle_lengths)
    budget = max(shortest - len(head_ids) - 160, 32)  # room for the needles, the question and the answer
    source = texts.held_out()
    offsets = token_offsets(tok, source[: 16 * (budget + 64)])
    piece, rest = source[: offsets[budget - 1][1]], source[offsets[budget - 1][1] :]
    for frac, key, value in sorted(zip(NEEDLE_FRACTIONS, keys, values, strict=True), reverse=True):
        piece = insert_at(
            piece, nearest_boundary(piece, token_offsets(tok, piece), frac), NEEDLE.format(key=key, value=value)
        )[0]
    body_ids = _ids(tok, piece + rest)
    while len(head_ids) + len(body_ids) < tokens:
        body_ids = body_ids + _ids(tok, "\n\n" + source)
    ids = head_ids + body_ids[: tokens - len(head_ids)]
    needles = []
    for key, value in zip(keys, values, strict=True):
        sentence = _ids(tok, NEEDLE.format(key=key, value=value))
        needles.append({"key": key, "value": str(value), "position": _find(ids, sentence[1:]) - 1})
    pieces = [tok.decode([t]) for t in ids]
    breaks = [  # cut after a sentence or before a line break: the question follows a whole sentence
        i
        for i in range(len(head_ids) + 1, len(ids))
        if pieces[i].startswith("\n") or pieces[i - 1].rstrip().endswith((".", "!", "?", '"', "\u201d"))
    ]
    prompts = []
    for length in needle_lengths:
        for needle in needles[:: len(needles) // ASKED_KEYS][:ASKED_KEYS]:
            _, tail_text, _ = _template_parts(lm, "", QUESTION.format(key=needle["key"]))
            prefix_ids, answer_ids = split_answer(lm, LEAD_IN.format(key=needle["key"]), needle["value"])
            suffix = _ids(tok, tail_text) + prefix_ids
            room = length - len(suffix) - len(answer_ids)
            cut = max((b for b in breaks if b <= room), default=None)
            if cut is None or cut <= max(n["position"] for n in needles) + 16:
                raise FindingsError(f"a {length}-token prompt cannot hold the needles; use lengths >= {shortest}")
            prompts.append(
                Prompt(
                    length=length,
                    tokens=cut + len(suffix) + len(answer_ids),
                    context=cut,
                    key=needle["key"],
                    distance=cut - needle["position"],
                    suffix=suffix,
                    answer=answer_ids,
                )
            )
    windows = sorted({w for w in windows if 32 <= w and w + 2 <= len(ids)})
    digest = hashlib.sha256(json.dumps([ids, [p.suffix + p.answer for p in prompts]]).encode()).hexdigest()[:16]
    return FindingsText(ids, len(head_ids), needles, prompts, windows, digest)


def window_starts(tokens: int, window: int, fractions: Sequence[float]) -> list[int]:
    """Window starts at `fractions` of the text, multiples of 32, each window inside the text."""
    return sorted({_window_start(f, tokens, window) for f in fractions})


def _window_start(fraction: float, tokens: int, window: int) -> int:
    start = int(fraction * tokens) // 32 * 32
    return max(32, min(start, (tokens - window - 1) // 32 * 32))


def _find(ids: list[int], part: list[int]) -> int:
    for i in range(len(ids) - len(part) + 1):
        if ids[i : i + len(part)] == part:
            return i
    raise FindingsError("a needle was not found in the tokenized text")


_ADJ = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "ivory", "jolly", "keen", "lively")
_NOUN = ("anchor", "basket", "candle", "desert", "engine", "falcon", "garden", "harbor", "island", "jacket")
