"""Needle in a haystack: full precision and quantized KV caches, side by side, on the same tokens.

References:
- Mohtashami & Jaggi, "Landmark Attention" (arXiv 2305.16300): passkey retrieval, a pass key hidden in
  repeated filler ("The grass is green. The sky is blue. ...").
- Kamradt, LLMTest_NeedleInAHaystack (github.com/gkamradt): needle depth by token position, placed at a
  sentence boundary, results drawn as a depth x context-length heatmap.
- Hsieh et al., "RULER" (arXiv 2404.06654): multi-key needles, "One of the special magic numbers for
  {key} is: {7 digits}.", with distractor keys in real prose.

Prompt layout (one user turn in the model's chat template, then the start of the assistant's answer):

    <template> instruction \\n\\n haystack-with-needle(s) | \\n\\n question <end of turn, assistant> answer-prefix
    `---------------- context: prefilled once per cell ---´`--- suffix: run per precision -----------´

- Length: the target is the length of the whole prompt as fed to the model (template, instruction,
  haystack, needles, question, answer prefix). The haystack is cut to fit, at a word boundary, and the
  prompt lands within 0.5% of the target, never above it (tests check 1%).
- Depth: the needle starts at the sentence boundary (or paragraph break) of the haystack whose token
  position is nearest to depth% of the haystack; `depth_actual` is measured on the final tokens:
  100 x (needle start - body start) / (body tokens - needle tokens), 0 = first token, 100 = last.
- Runner: per (length, depth) cell the context is prefilled once, at full precision, in one forward
  call. A first prefill attends over the exact keys/values whatever the cache stores
  (kvdemo/attention.py), so a quantized cache that had prefilled the same tokens would hold exactly the
  full-precision states, quantized: `transplant` builds it from them with the same `update` call, bit
  for bit (tested). Every precision, full included, then reads its own cache from the question on:
  the suffix (the prompt's last chunk), then the true answer teacher-forced in as few calls as give
  the same logits as one-by-one decoding (`forward_as_decoding`). That yields the answer's
  log-probability and verifies greedy decoding along it (speculative decoding with the true answer
  as the draft: Leviathan et al., arXiv 2211.17192); only where greedy leaves the answer is the
  reply decoded token by token.
- Score: exact match (the expected answer appears in the generated text, both normalised: NFKC, case,
  digit separators, punctuation) and the answer's log-probability (natural log, summed over its tokens).
- Repeats: one cell is one needle, so a found count over a grid of 15 cells moves by cells between
  settings alike in every other measure. `repeats` runs the grid again with the next seeds (new needles,
  e.g. new passkeys, at the same lengths and depths); `summarize` gives each precision's found rate over
  all its runs with a 95% Wilson interval, and `found_check` judges a bar against it; `paired_difference`
  compares two precisions on the same needles.
"""

from __future__ import annotations

import bisect
import csv
import itertools
import json
import math
import random
import re
import time
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import codebooks as books
from . import runner, texts
from .cache import QuantizedKVCache
from .models import LoadedModel
from .precision import PRESETS, PrecisionSpec, parse_precision, parse_precision_list
from .results.needle import cell_key
from .runner import chat_ids, fork, forward, generate, new_cache, prefill

KINDS = ("passkey", "multikey", "custom")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
MULTIKEY_NEEDLE = "One of the special magic numbers for {key} is: {value}."
INSTRUCTIONS = {
    "passkey": "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there.",
    "multikey": "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the numbers afterwards.",
    "custom": "Read the following document carefully. I will ask you a question about it afterwards.",
}
NUM_KEYS = 4  # multikey: the key asked for + 3 distractor keys
MAX_NEW_TOKENS = {"passkey": 12, "multikey": 12, "custom": 24}
MIN_HAYSTACK_TOKENS = 32
LENGTH_TOLERANCE = 0.005  # the prompt is built within 0.5% below its target length
ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "st", "messrs", "mme", "mlle", "sr", "jr", "prof", "rev", "vs", "etc", "no"}
# RULER draws its keys from a word list; these make two-word keys like "amber-harbor"
_KEY_ADJECTIVES = (
    "amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "ivory", "jolly", "keen", "lively",
    "mellow", "narrow", "olive", "plain", "quiet", "rapid", "silver", "tidy", "upper", "vivid", "wooden", "young",
)  # fmt: skip
_KEY_NOUNS = (
    "anchor", "basket", "candle", "desert", "engine", "falcon", "garden", "harbor", "island", "jacket", "kettle",
    "lantern", "meadow", "needle", "orchard", "pebble", "quarry", "river", "saddle", "tunnel", "valley", "window",
)  # fmt: skip


class NeedleError(ValueError):
    """A needle setting that cannot run; the message says what is allowed."""


# --- tasks: needle, question, expected answer -------------------------------------------------------


@dataclass
class NeedleTask:
    """What is hidden and asked: the needle, distractor needles (multikey), the question and answer."""

    kind: str
    needle: str
    question: str
    answer: str
    instruction: str
    answer_prefix: str = ""  # the start of the assistant's reply, part of the prompt
    distractors: list[str] = field(default_factory=list)
    key: str = ""  # multikey: the key asked about
    max_new_tokens: int = 12

    def to_dict(self) -> dict:
        return asdict(self)


def normalize(text: str) -> str:
    """Lower case, NFKC, digit-group separators dropped, punctuation to spaces, single spaces."""
    text = unicodedata.normalize("NFKC", str(text)).lower()
    text = re.sub(r"(?<=\d)[,_\u202f\u00a0'](?=\d{3})", "", text)
    text = re.sub(r"[^\w\s]|_", " ", text)
    return " ".join(text.split())


def answer_matches(expected: str, generated: str) -> bool:
    """Exact match: the normalised expected answer appears in the normalised text as whole words."""
    want, got = normalize(expected), normalize(generated)
    return bool(want) and re.search(rf"(?<!\w){re.escape(want)}(?!\w)", got) is not None


def make_task(
    kind: str,
    rng: random.Random,
    needle: str = "",
    question: str = "",
    answer: str = "",
    num_keys: int = NUM_KEYS,
) -> NeedleTask:
    """A passkey (5 random digits), a RULER multikey needle (7 digits; `num_keys - 1` distractor keys)
    or the caller's custom needle + question + answer (the answer must appear in the needle)."""
    if kind not in KINDS:
        raise NeedleError(f"unknown needle kind {kind!r}; allowed: {', '.join(KINDS)}")
    custom = (needle, question, answer)
    if kind != "custom" and any(s.strip() for s in custom):
        raise NeedleError("a needle, question and answer are given only with kind 'custom'")
    if kind == "passkey":
        key = str(rng.randint(10_000, 99_999))
        return NeedleTask(
            kind,
            PASSKEY_NEEDLE.format(key=key),
            "What is the pass key?",
            key,
            INSTRUCTIONS[kind],
            "The pass key is",
            max_new_tokens=MAX_NEW_TOKENS[kind],
        )
    if kind == "multikey":
        if not 1 <= num_keys <= 16:
            raise NeedleError(f"num_keys must be 1..16, got {num_keys}")
        pairs = rng.sample([(a, n) for a in _KEY_ADJECTIVES for n in _KEY_NOUNS], num_keys)
        keys = [f"{a}-{n}" for a, n in pairs]
        values = rng.sample(range(1_000_000, 10_000_000), num_keys)
        needles = [MULTIKEY_NEEDLE.format(key=k, value=v) for k, v in zip(keys, values, strict=True)]
        return NeedleTask(
            kind,
            needles[0],
            f"What is the special magic number for {keys[0]} mentioned in the provided text?",
            str(values[0]),
            INSTRUCTIONS[kind],
            f"The special magic number for {keys[0]} mentioned in the provided text is",
            distractors=needles[1:],
            key=keys[0],
            max_new_tokens=MAX_NEW_TOKENS[kind],
        )
    needle, question, answer = (" ".join(s.split()) for s in custom)
    for name, value in (("needle", needle), ("question", question), ("answer", answer)):
        if not value:
            raise NeedleError(f"a custom needle needs a non-empty {name} (--needle, --question, --answer)")
    if not answer_matches(answer, needle):
        raise NeedleError(f"the answer {answer!r} must appear in the needle sentence {needle!r}")
    return NeedleTask(
        kind, needle, question, answer, INSTRUCTIONS[kind], lead_in(needle, answer), max_new_tokens=MAX_NEW_TOKENS[kind]
    )


def lead_in(needle: str, answer: str) -> str:
    """The needle's words before its answer ("The secret ingredient of the soup is" for "... is cardamom."),
    the start of the reply as RULER puts it in the prompt: the answer is then scored where the needle
    had it, so a found needle scores near 0 and a lost one far below, however the answer begins
    ("eat a sandwich and ..." scored right after the question costs ~13 nats even when it is known).
    Empty when the answer opens the needle or is found only after normalisation."""
    words = [re.escape(w) for w in answer.split()]
    m = re.search(r"(?<!\w)" + r"\s+".join(words) + r"(?!\w)", needle, flags=re.IGNORECASE) if words else None
    return needle[: m.start()].rstrip() if m else ""


def default_haystack(kind: str) -> tuple[str, str]:
    """(name, text) of the haystack a kind uses when no document is given."""
    if kind == "passkey":
        return "filler", FILLER
    return "prose", texts.prose()


# --- haystack text, sentence boundaries, insertion ----------------------------------------------------


_CLOSERS = "\"'\u201d\u2019)\\]"  # closing quotes and brackets, for use inside [...]


def _is_abbreviation(text: str, dot: int) -> bool:
    """Whether the period at `dot` ends an abbreviation ("Mr.") or an initial ("J.") rather than a sentence."""
    word = re.search(r"(\w+)$", text[max(0, dot - 12) : dot])
    return bool(word) and (
        word.group(1).lower() in ABBREVIATIONS or (len(word.group(1)) == 1 and word.group(1).isupper())
    )


def ends_sentence(text: str) -> bool:
    """Whether `text` ends with a sentence's final punctuation (not an abbreviation)."""
    m = re.search(rf"[.!?][{_CLOSERS}]*$", text.rstrip())
    return bool(m) and not (text.rstrip()[m.start()] == "." and _is_abbreviation(text.rstrip(), m.start()))


def sentence_starts(text: str) -> list[int]:
    """Character offsets where a needle may go: 0, after each sentence end or paragraph break, len(text)."""
    starts = {0, len(text)}
    for m in re.finditer(rf"[.!?][{_CLOSERS}]*\s+", text):
        if text[m.start()] == "." and _is_abbreviation(text, m.start()):
            continue  # "Mr. Darcy", "J. Smith"
        nxt = text[m.end() : m.end() + 1]
        if nxt and (nxt.isupper() or nxt.isdigit() or nxt in "\"'\u201c\u2018([" or "\n" in m.group()):
            starts.add(m.end())
    for m in re.finditer(r"\n\s*\n", text):
        starts.add(m.end())
    return sorted(starts)


def insert_at(text: str, pos: int, needle: str) -> tuple[str, int]:
    """Insert `needle` at boundary `pos`, separated as the surrounding text is; returns (text, needle offset)."""
    if pos <= 0:
        return (needle + (" " + text if text else ""), 0)
    if pos >= len(text):  # after a sentence, or as a paragraph of its own after a cut-off sentence
        sep = " " if ends_sentence(text) else "\n\n"
        return text + sep + needle, len(text) + len(sep)
    ws = re.search(r"\s*$", text[:pos]).group()
    return text[:pos] + needle + (ws or " ") + text[pos:], pos


def _long_text(tokenizer, text: str, joiner: str, n_tokens: int) -> tuple[str, list[tuple[int, int]], int]:
    """A prefix of `text` (repeated with `joiner` if needed) holding at least `n_tokens` tokens, with the
    token offsets of that prefix and the number of copies used."""
    copies, limit = 1, (n_tokens + 64) * 8
    while True:
        whole = joiner.join([text] * copies)
        piece = whole[:limit]
        offsets = _offsets(tokenizer, piece)
        if len(offsets) >= n_tokens + 8 or (len(piece) == len(whole) and copies > 64):
            return piece, offsets, copies
        if len(piece) < len(whole):
            limit *= 2
        else:
            copies = max(copies + 1, -(-(n_tokens + 8) * copies // max(len(offsets), 1)) + 1)


def _cut(piece: str, offsets: list[tuple[int, int]], n_tokens: int, slack: int = 0) -> str:
    """The first `n_tokens` tokens' text: ending at a sentence end if one lies within the last `slack`
    tokens, else shortened to the last whole word."""
    if n_tokens >= len(offsets):
        return piece.rstrip()
    end = offsets[max(n_tokens, 1) - 1][1]
    floor = offsets[max(n_tokens - slack, 1) - 1][1]
    ends = [len(piece[:b].rstrip()) for b in sentence_starts(piece[: end + 64])[1:-1]]
    ends = [e for e in ends if floor <= e <= end]
    if ends:
        return piece[: ends[-1]]
    if end < len(piece) and not piece[end].isspace():
        space = max(piece.rfind(c, 0, end) for c in " \n\t")
        end = space if space > 0 else end
    return piece[:end].rstrip()


def _offsets(tokenizer, text: str) -> list[tuple[int, int]]:
    """Character span of every token of `text` (no special tokens)."""
    return [tuple(o) for o in tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]


def _nearest_boundary(text: str, offsets: list[tuple[int, int]], fraction: float) -> int:
    """The sentence boundary of `text` whose token position is nearest to `fraction` of its tokens."""
    starts = [o[0] for o in offsets]
    target = fraction * len(offsets)
    best, best_err = 0, float("inf")
    for b in sentence_starts(text):
        err = abs(bisect.bisect_left(starts, b) - target)
        if err < best_err:
            best, best_err = b, err
    return best


# --- prompts -------------------------------------------------------------------------------------------


@dataclass
class NeedlePrompt:
    """One cell's tokens: `ids[:context_len]` is prefilled once, `ids[context_len:]` run per precision."""

    ids: list[int]
    context_len: int
    target_length: int
    depth: float  # requested, percent
    depth_actual: float  # measured on the tokens, percent
    needle_position: int  # token index of the needle's first token in `ids`
    needle_tokens: int
    body_start: int  # token index of the haystack's first token
    body_tokens: int  # haystack + needles
    haystack_copies: int  # > 1 when the haystack text was repeated to reach the length
    answer_ids: list[int]
    text: str  # the user message

    @property
    def length(self) -> int:
        return len(self.ids)


def _encode(lm: LoadedModel, content: str) -> tuple[str, list[int], list[tuple[int, int]]]:
    """(rendered prompt, ids as `runner.chat_ids` makes them, offsets of those ids in the rendered text)."""
    tok = lm.tokenizer
    messages = [{"role": "user", "content": content}]
    ids = chat_ids(lm, messages)
    if getattr(tok, "chat_template", None):
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        enc = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)
    else:
        rendered = f"user: {content}\n\nassistant:"
        enc = tok(rendered, add_special_tokens=True, return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(ids):
        raise NeedleError("this model's chat template does not tokenize like its text: needles cannot be placed")
    return rendered, list(ids), [tuple(o) for o in enc["offset_mapping"]]


def split_answer(lm: LoadedModel, prefix: str, answer: str) -> tuple[list[int], list[int]]:
    """(prompt ids of the answer prefix, ids of the answer after it) as the tokenizer splits the reply
    `prefix + " " + answer`. Where the space before the answer is a token of its own (SmolLM2 before a
    number) it ends the prefix, so the first scored and generated token is the answer's own first token.
    """
    tok = lm.tokenizer

    def ids(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    if not prefix:
        return [], ids(answer)
    both = ids(prefix + " " + answer)
    for pre in (ids(prefix + " "), ids(prefix)):
        if both[: len(pre)] == pre and len(both) > len(pre):
            return pre, both[len(pre) :]
    return ids(prefix), ids(" " + answer)


def build_prompt(
    lm: LoadedModel,
    task: NeedleTask,
    haystack: str,
    length: int,
    depth: float,
    rng: random.Random | None = None,
    joiner: str = "\n\n",
) -> NeedlePrompt:
    """The chat-templated prompt of `length` tokens (within 0.5%, never more) with the needle at `depth`%.

    Multikey distractors go to random sentence boundaries (from `rng`) before the needle is placed, so
    the depth is measured over the whole haystack body, distractors included.
    """
    if not 0 <= depth <= 100:
        raise NeedleError(f"depth {depth} is outside 0..100 (percent of the haystack)")
    haystack = haystack.strip()
    if not haystack:
        raise NeedleError("the haystack document has no text")
    rng = rng or random.Random(0)
    fractions = [rng.random() for _ in task.distractors]
    tok = lm.tokenizer
    prefix_ids, answer_ids = split_answer(lm, task.answer_prefix, task.answer)
    head = task.instruction + "\n\n"

    def content_of(body: str) -> str:
        return head + body + "\n\n" + task.question

    skeleton = " ".join([task.needle, *task.distractors])
    overhead = len(_encode(lm, content_of(skeleton))[1]) + len(prefix_ids)
    if length - overhead < MIN_HAYSTACK_TOKENS:
        raise NeedleError(
            f"length {length} is too short: the prompt without haystack takes {overhead} tokens; "
            f"use at least {overhead + MIN_HAYSTACK_TOKENS}"
        )
    tolerance = max(2, int(length * LENGTH_TOLERANCE))
    budget = length - overhead
    piece, offsets, copies = _long_text(tok, haystack, joiner, budget + 4 * tolerance)
    best = None
    for _ in range(8):
        cut = _cut(piece, offsets, budget, tolerance)
        for frac, needle in zip(fractions, task.distractors, strict=True):
            cut = insert_at(cut, _nearest_boundary(cut, _offsets(tok, cut), frac), needle)[0]
        body, needle_at = insert_at(cut, _nearest_boundary(cut, _offsets(tok, cut), depth / 100), task.needle)
        rendered, ids, ids_offsets = _encode(lm, content_of(body))
        n = len(ids) + len(prefix_ids)
        if n <= length and (best is None or n > best[0]):
            best = (n, body, needle_at, rendered, ids, ids_offsets, len(cut) > len(haystack))
        if 0 <= length - n <= tolerance:
            break
        budget += length - n
        if budget >= len(offsets) - 4:
            piece, offsets, more = _long_text(tok, haystack, joiner, budget + 4 * tolerance)
            copies = max(copies, more)
    if best is None:
        raise NeedleError(f"cannot build a prompt of {length} tokens from this haystack")
    _, body, needle_at, rendered, ids, ids_offsets, repeated = best
    base = rendered.rfind(content_of(body))
    body_char = base + len(head)
    starts = [o[0] for o in ids_offsets]
    ends = [o[1] for o in ids_offsets]
    body_start = bisect.bisect_right(ends, body_char)
    context_len = bisect.bisect_left(starts, body_char + len(body))
    needle_start = bisect.bisect_right(ends, body_char + needle_at)
    needle_end = bisect.bisect_right(ends, body_char + needle_at + len(task.needle) - 1) + 1
    body_tokens = context_len - body_start
    span = max(body_tokens - (needle_end - needle_start), 1)
    return NeedlePrompt(
        ids=ids + prefix_ids,
        context_len=context_len,
        target_length=length,
        depth=float(depth),
        depth_actual=round(100.0 * (needle_start - body_start) / span, 2),
        needle_position=needle_start,
        needle_tokens=needle_end - needle_start,
        body_start=body_start,
        body_tokens=body_tokens,
        haystack_copies=copies if repeated else 1,
        answer_ids=answer_ids,
        text=content_of(body),
    )


# --- running a cell ---------------------------------------------------------------------------------


@dataclass
class NeedleRow:
    """One (length, depth, precision) result."""

    length: int  # target prompt length, tokens
    depth: float  # requested needle depth, percent
    precision: str
    answer: str  # the generated reply (after the answer prefix)
    correct: bool
    answer_logprob: float  # teacher-forced log p(true answer | prompt), natural log, summed
    expected: str
    kind: str
    key: str
    prompt_tokens: int
    depth_actual: float
    needle_position: int
    answer_tokens: int
    generated_tokens: int
    stopped: str  # "eos" | "length" | "answer_end"
    prefill_s: float  # the cell's one shared full-precision prefill
    seconds: float  # this precision's own work: suffix, answer log-prob, greedy answer
    seed: int = 0  # the needle's seed (cell_rng): repeats of a cell differ in it

    def to_dict(self) -> dict:
        return asdict(self)


def _as_dicts(rows: Sequence[NeedleRow | dict]) -> list[dict]:
    return [r.to_dict() if hasattr(r, "to_dict") else r for r in rows]


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

    def __init__(self, at_sentence_end: bool, should_stop: Callable[[], bool] | None):
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


def run_cell(
    lm: LoadedModel,
    task: NeedleTask,
    prompt: NeedlePrompt,
    specs: Sequence[PrecisionSpec],
    should_stop: Callable[[], bool] | None = None,
    on_row: Callable[[NeedleRow], None] | None = None,
    prefill_mode: str = "exact",
    codebooks=None,
    seed: int = 0,
) -> list[NeedleRow]:
    """Every precision on one prompt: one shared prefill, then per precision suffix + score + answer.

    Rows come back in the order of `specs`; `on_row` is called as each is done (quantized ones first, the
    full-precision row last, as it reuses the prefilled cache). Stops early (fewer rows) on `should_stop`.
    prefill_mode (runner.PREFILL_MODES): "exact" stores the shared full-precision prefill quantized per
    precision; "chunked" prefills the haystack into each quantized cache chunk by chunk instead.
    codebooks: a `codebooks.Codebooks` for the nuq precisions (default: the model's own). seed: the seed the
    task and prompt were drawn with, recorded in each row.
    """
    if prefill_mode not in runner.PREFILL_MODES:
        raise NeedleError(f"unknown prefill mode {prefill_mode!r}; allowed: {', '.join(runner.PREFILL_MODES)}")
    ctx, suffix = prompt.ids[: prompt.context_len], prompt.ids[prompt.context_len :]
    t0 = time.perf_counter()
    full = new_cache(lm, PRESETS["full"])
    prefill(lm, ctx, full, chunk=len(ctx))  # one call: attention over the exact states
    prefill_s = time.perf_counter() - t0
    order = sorted(range(len(specs)), key=lambda i: not specs[i].is_quantized)
    rows: dict[int, NeedleRow] = {}
    for i in order:
        if should_stop is not None and should_stop():
            break
        spec = specs[i]
        t1 = time.perf_counter()
        if not spec.is_quantized:
            cache = full
        elif prefill_mode == "exact":
            cache = transplant(lm, full, spec, codebooks)
        else:
            cache = new_cache(lm, spec, codebooks)
            prefill(lm, ctx, cache, mode="chunked")
        stop = _AnswerStop(task.kind != "custom", should_stop)
        logprob, tokens, reason = score_and_answer(lm, cache, suffix, prompt.answer_ids, task.max_new_tokens, stop)
        del cache
        if stop.cancelled:
            break
        text = lm.tokenizer.decode(tokens, skip_special_tokens=True).strip()
        row = NeedleRow(
            length=prompt.target_length,
            depth=prompt.depth,
            precision=spec.label,
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
            seconds=round(time.perf_counter() - t1, 3),
            seed=seed,
        )
        rows[i] = row
        if on_row is not None:
            on_row(row)
    return [rows[i] for i in sorted(rows)]


# --- grids ------------------------------------------------------------------------------------------------


@dataclass
class NeedleResult:
    model: str
    kind: str
    haystack: str  # "filler", "prose" or the document's name
    seed: int
    lengths: list[int]
    depths: list[float]
    precisions: list[str]
    rows: list[NeedleRow]
    seconds: float
    stopped: str  # "done" | "cancelled"
    notes: list[str] = field(default_factory=list)
    prefill_mode: str = "exact"
    codebooks: str | None = None  # what the nuq precisions' levels were fitted on (None: no nuq precision)
    repeats: int = 1  # every cell run with seeds seed .. seed + repeats - 1

    def to_dict(self) -> dict:
        out = {
            "model": self.model,
            "kind": self.kind,
            "prefill_mode": self.prefill_mode,
            "haystack": self.haystack,
            "seed": self.seed,
            "repeats": self.repeats,
            "lengths": self.lengths,
            "depths": self.depths,
            "precisions": self.precisions,
            "rows": [r.to_dict() for r in self.rows],
            "summary": summarize(self.rows),
            "seconds": round(self.seconds, 2),
            "stopped": self.stopped,
            "notes": self.notes,
        }
        if self.codebooks is not None:
            out["codebooks"] = self.codebooks
        return out


def wilson_interval(found: int, runs: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95% at z = 1.96) of a found rate `found / runs`, each run taken as an
    independent trial: it stays inside [0, 1] and is not empty at 0 or `runs` found, unlike the normal one."""
    if runs <= 0:
        raise ValueError("no runs")
    p, z2 = found / runs, z * z
    centre = (p + z2 / (2 * runs)) / (1 + z2 / runs)
    half = z * math.sqrt(p * (1 - p) / runs + z2 / (4 * runs * runs)) / (1 + z2 / runs)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(rows: Sequence[NeedleRow | dict], baseline: str = "full") -> list[dict]:
    """Per precision: cells (runs: a cell per seed), correct, accuracy with its 95% Wilson interval
    (`found_low`, `found_high`), mean answer log-prob, runs that agree with the baseline on the same
    (length, depth, seed), and `full_missed`: its runs where the baseline itself missed (a miss there says
    nothing about quantization)."""
    rows = _as_dicts(rows)
    base = {cell_key(r): r for r in rows if r["precision"] == baseline}
    out = []
    for label in dict.fromkeys(r["precision"] for r in rows):
        mine = [r for r in rows if r["precision"] == label]
        paired = [(r, base[cell_key(r)]) for r in mine if cell_key(r) in base]
        found = sum(r["correct"] for r in mine)
        low, high = wilson_interval(found, len(mine))
        out.append(
            {
                "precision": label,
                "cells": len(mine),
                "correct": found,
                "accuracy": round(found / len(mine), 4),
                "found_low": round(low, 4),
                "found_high": round(high, 4),
                "mean_answer_logprob": round(sum(r["answer_logprob"] for r in mine) / len(mine), 4),
                "agree_with_full": sum(r["correct"] == b["correct"] for r, b in paired) if paired else None,
                "full_missed": sum(not b["correct"] for _, b in paired) if paired else None,
                "mean_logprob_change": round(
                    sum(r["answer_logprob"] - b["answer_logprob"] for r, b in paired) / len(paired), 4
                )
                if paired
                else None,
            }
        )
    return out


def found_check(summary: dict, found: int, cells: int) -> dict:
    """A precision's found rate against a bar of `found` of `cells` (e.g. issue 17's 13 of 15), on the runs
    its summary row counts: holds when the 95% Wilson interval lies at or above the bar, does not hold when
    it lies below, not settled when it straddles it."""
    bar = found / cells
    low, high = summary["found_low"], summary["found_high"]
    verdict = "holds" if low >= bar else "does not hold" if high < bar else "not settled by these runs"
    return {
        "precision": summary["precision"],
        "found": summary["correct"],
        "runs": summary["cells"],
        "bar": f"{found}/{cells}",
        "low": low,
        "high": high,
        "verdict": verdict,
    }


PAIRED_VALUES = {"correct": "found rate", "answer_logprob": "answer log p"}  # what paired_difference compares


def paired_difference(
    rows: Sequence[NeedleRow | dict], a: str, b: str, value: str = "correct", draws: int = 2000, seed: int = 0
) -> dict:
    """Precision `a` minus `b` on the runs both have (same length, depth and seed: the same needle), in found
    rate (value="correct") or in the answer's log-prob ("answer_logprob"), with a 95% interval from a paired
    bootstrap over those runs (`draws` seeded resamples). Verdict: which does better when the interval
    excludes zero, else not settled by these runs."""
    if value not in PAIRED_VALUES:
        raise ValueError(f"unknown value {value!r}; allowed: {', '.join(PAIRED_VALUES)}")
    rows = _as_dicts(rows)
    of_b = {cell_key(r): float(r[value]) for r in rows if r["precision"] == b}
    diffs = [float(r[value]) - of_b[cell_key(r)] for r in rows if r["precision"] == a and cell_key(r) in of_b]
    if not diffs:
        raise ValueError(f"{a} and {b} share no runs")
    rng = random.Random(f"kvdemo-paired-difference:{seed}")
    n = len(diffs)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(draws))
    low, high = means[int(0.025 * draws)], means[int(0.975 * draws) - 1]
    better = "finds more" if value == "correct" else "gives the answer a higher log p"
    verdict = f"{a} {better}" if low > 0 else f"{b} {better}" if high < 0 else "not settled by these runs"
    return {
        "a": a,
        "b": b,
        "value": value,
        "runs": n,
        "difference": round(sum(diffs) / n, 4),
        "low": round(low, 4),
        "high": round(high, 4),
        "verdict": verdict,
    }


def found_line(check: dict) -> str:
    """One `kvdemo.needle.found_check` as a sentence (README's verdict lines are these)."""
    return (
        f"{check['precision']} finds the needle in >= {check['bar']} of cells: {check['verdict']} "
        f"(found {check['found']}/{check['runs']} runs, 95% [{check['low']:.1%}, {check['high']:.1%}])"
    )


def difference_line(d: dict) -> str:
    """One `kvdemo.needle.paired_difference` as a sentence."""
    if d["value"] == "correct":
        amount = f"{d['difference']:+.1%} (95% {d['low']:+.1%}..{d['high']:+.1%}"
    else:
        amount = f"{d['difference']:+.3f} nats (95% {d['low']:+.3f}..{d['high']:+.3f}"
    return (
        f"{d['a']} against {d['b']}: {PAIRED_VALUES[d['value']]} {amount}, paired over {d['runs']} runs): "
        f"{d['verdict']}"
    )


def differences_from_full(rows: Sequence[NeedleRow | dict], baseline: str = "full") -> list[dict]:
    """`paired_difference` of every other precision against `baseline`, found rate then answer log-prob, in
    the rows' order (none without a baseline)."""
    rows = _as_dicts(rows)
    labels = list(dict.fromkeys(r["precision"] for r in rows))
    if baseline not in labels:
        return []
    return [paired_difference(rows, x, baseline, value) for x in labels if x != baseline for value in PAIRED_VALUES]


MAX_REPEATS = 20  # runs per cell (seeds) one grid may ask for


def cell_rng(seed: int, length: int, depth: float) -> random.Random:
    """The random source of one cell: the same needle for the same (seed, length, depth) in any grid."""
    return random.Random(f"kvdemo-needle:{seed}:{length}:{float(depth)}")


def _specs_with_full(precisions: Sequence[PrecisionSpec | str] | str) -> list[PrecisionSpec]:
    specs = (
        parse_precision_list(precisions) if isinstance(precisions, str) else [parse_precision(p) for p in precisions]
    )
    labels = dict.fromkeys(s.label for s in specs)
    unique = [next(s for s in specs if s.label == label) for label in labels]
    if not any(not s.is_quantized for s in unique):
        unique.insert(0, PRESETS["full"])  # full precision is always a row
    return unique


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
    on_progress: Callable[[int, int, NeedleRow], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    prefill_mode: str = "exact",
    codebooks=None,
    repeats: int = 1,
) -> NeedleResult:
    """Every (length, depth) cell at full precision and every precision in `precisions`, same tokens.
    prefill_mode: how each quantized cache stores the haystack (see `run_cell`); codebooks: a
    `codebooks.Codebooks` for the nuq precisions (default: the model's own). repeats: run the whole grid
    with seeds seed, seed + 1, ... (a new needle each time, e.g. a new passkey), so a found rate rests on
    more than one run per cell; seed by seed, so a cancelled run holds whole grids first.

    `document`: the haystack text (a user document); default: the filler for passkey, the bundled prose
    otherwise. `on_progress(done, total, row)` after every row; `should_stop()` ends the run cleanly
    (the result holds the rows done so far and `stopped="cancelled"`).
    """
    specs = _specs_with_full(precisions)
    lengths = [int(n) for n in lengths]
    depths = [float(d) for d in depths]
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
        if n <= 0 or n + new_tokens > lm.max_context:
            raise NeedleError(
                f"length {n} is not allowed: prompt + {new_tokens} new tokens must fit the model's context "
                f"({lm.max_context}); use 1..{lm.max_context - new_tokens}"
            )
    if document is not None:
        name, hay, joiner = document_name, document, "\n\n"
        if not hay.strip():
            raise NeedleError("the haystack document has no text")
    else:
        name, hay = default_haystack(kind)
        joiner = " " if name == "filler" else "\n\n"
    total = len(lengths) * len(depths) * len(specs) * repeats
    rows: list[NeedleRow] = []
    notes: list[str] = []
    t0 = time.perf_counter()
    stopped = "done"

    finished: list[NeedleRow] = []  # in the order they complete (progress)

    def on_row(row: NeedleRow) -> None:
        finished.append(row)
        if on_progress is not None:
            on_progress(len(finished), total, row)

    for run_seed, length, depth in itertools.product(range(seed, seed + repeats), lengths, depths):  # seed by seed
        if should_stop is not None and should_stop():
            stopped = "cancelled"
            break
        rng = cell_rng(run_seed, length, depth)
        task = make_task(kind, rng, needle, question, answer, num_keys)
        if max_new_tokens:
            task.max_new_tokens = max_new_tokens
        prompt = build_prompt(lm, task, hay, length, depth, rng, joiner)
        if prompt.haystack_copies > 1 and name != "filler":
            note = f"the {name} is shorter than {length} tokens: it was repeated to fill the haystack"
            notes += [note] if note not in notes else []
        done = run_cell(lm, task, prompt, specs, should_stop, on_row, prefill_mode, codebooks, run_seed)
        rows += done
        if len(done) < len(specs):
            stopped = "cancelled"
            break
    return NeedleResult(
        lm.name,
        kind,
        name,
        seed,
        lengths,
        depths,
        [s.label for s in specs],
        rows,
        time.perf_counter() - t0,
        stopped,
        notes,
        prefill_mode,
        books.used_by(lm, specs, codebooks),
        repeats,
    )


# --- files ------------------------------------------------------------------------------------------------

CSV_COLUMNS = list(NeedleRow.__dataclass_fields__)


def save_results(result: NeedleResult | dict, folder: str | Path) -> dict:
    """Write needle.json (everything) and needle.csv (one line per row) into `folder`; return their paths."""
    out = result.to_dict() if hasattr(result, "to_dict") else dict(result)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = folder / "needle.json", folder / "needle.csv"
    json_path.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    with csv_path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(out["rows"])
    return {"json": str(json_path), "csv": str(csv_path)}


# --- settings as text (CLI and needle page) ---------------------------------------------------------------


def parse_numbers(text: str, what: str, cast) -> list:
    """Comma-separated numbers (duplicates dropped, order kept), or a NeedleError naming `what`."""
    items = [t.strip() for t in str(text).replace(";", ",").split(",") if t.strip()]
    try:
        values = [cast(t) for t in items]
    except ValueError:
        raise NeedleError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise NeedleError(f"{what}: give at least one value")
    return list(dict.fromkeys(values))
