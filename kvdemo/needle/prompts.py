"""Needle prompts: what is hidden and asked (tasks), the haystack it hides in, and the prompt of one cell at a
length and depth, token for token.

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
- Score: exact match (the expected answer appears in the generated text, both normalised: NFKC, case,
  digit separators, punctuation).
"""

from __future__ import annotations

import bisect
import random
import re
import unicodedata
from dataclasses import dataclass, field

from .. import texts
from ..models import LoadedModel
from ..runner import chat_ids

KINDS = ("passkey", "multikey", "custom")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
# RULER's multikey texts: the instruction, a needle, the question about one key and the reply's lead-in
MULTIKEY_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the numbers afterwards."
)
MULTIKEY_NEEDLE = "One of the special magic numbers for {key} is: {value}."
MULTIKEY_QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
MULTIKEY_LEAD_IN = "The special magic number for {key} mentioned in the provided text is"
INSTRUCTIONS = {
    "passkey": "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there.",
    "multikey": MULTIKEY_INSTRUCTION,
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
            MULTIKEY_QUESTION.format(key=keys[0]),
            str(values[0]),
            INSTRUCTIONS[kind],
            MULTIKEY_LEAD_IN.format(key=keys[0]),
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


def cell_rng(seed: int, length: int, depth: float) -> random.Random:
    """The random source of one cell: the same needle for the same (seed, length, depth) in any grid."""
    return random.Random(f"kvdemo-needle:{seed}:{length}:{float(depth)}")


def choose_haystack(kind: str, document: str | None = None, document_name: str = "document") -> tuple[str, str, str]:
    """(name, text, joiner) of the haystack: the user's `document`, else the kind's default (`default_haystack`).
    The joiner repeats a text too short for the length: a space inside the filler, a paragraph break in prose."""
    if document is None:
        name, text = default_haystack(kind)
        return name, text, " " if name == "filler" else "\n\n"
    if not document.strip():
        raise NeedleError("the haystack document has no text")
    return document_name, document, "\n\n"


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
        offsets = token_offsets(tokenizer, piece)
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


def token_offsets(tokenizer, text: str) -> list[tuple[int, int]]:
    """Character span of every token of `text` (no special tokens)."""
    return [tuple(o) for o in tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]


def nearest_boundary(text: str, offsets: list[tuple[int, int]], fraction: float) -> int:
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
            cut = insert_at(cut, nearest_boundary(cut, token_offsets(tok, cut), frac), needle)[0]
        body, needle_at = insert_at(cut, nearest_boundary(cut, token_offsets(tok, cut), depth / 100), task.needle)
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
