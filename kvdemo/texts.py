"""Real English prose bundled with kvdemo, for haystacks, long prompts and held-out perplexity.

Two public-domain novels by Jane Austen, from the Debian package `r-cran-janeaustenr` (MIT; the texts are
Project Gutenberg's), unwrapped into one paragraph per line; see assets/texts/SOURCES.md:

- `prose()`: *Pride and Prejudice*, Chapters 1-19 (~109k characters, 25.6k SmolLM2 tokens).
- `held_out()`: *Sense and Sensibility*, Chapters 1-9 (~78k characters, 17.2k SmolLM2 tokens): a different
  book, so nothing `prose_ids` returns (at any length) overlaps it. Perplexity runs use this one.

Token helpers cut exactly `n_tokens` ids from the start of the tokenized text (no special tokens). A text
shorter than asked for is repeated, the copies joined by a paragraph break, and the repeat tokenized
as a whole, so the ids are always a real tokenization of some text.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

TEXTS_DIR = Path(__file__).resolve().parent.parent / "assets" / "texts"
PROSE_FILE = "pride_and_prejudice.txt"
HELD_OUT_FILE = "sense_and_sensibility.txt"
PARAGRAPH_BREAK = "\n\n"

_ids_cache: dict[tuple[int, str, int], tuple[object, list[int]]] = {}  # (id(tokenizer), file, copies)


class TextLengthError(ValueError):
    """A token count that cannot be served (not a positive integer)."""


@cache
def _read(name: str) -> str:
    path = TEXTS_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"bundled text missing: {path} (reinstall kvdemo with its assets/ folder)")
    return path.read_text(encoding="utf-8").strip()


def prose() -> str:
    """The bundled prose (Pride and Prejudice, Chapters 1-19): paragraphs separated by a blank line."""
    return _read(PROSE_FILE)


def held_out() -> str:
    """Held-out prose (Sense and Sensibility, Chapters 1-9), never part of `prose()` / `prose_ids()`."""
    return _read(HELD_OUT_FILE)


def _tokenizer(lm_or_tokenizer):
    return getattr(lm_or_tokenizer, "tokenizer", lm_or_tokenizer)


def _ids(tokenizer, name: str, copies: int) -> list[int]:
    key = (id(tokenizer), name, copies)
    hit = _ids_cache.get(key)
    if hit is None or hit[0] is not tokenizer:
        text = PARAGRAPH_BREAK.join([_read(name)] * copies)
        hit = (tokenizer, list(tokenizer(text, add_special_tokens=False)["input_ids"]))
        _ids_cache[key] = hit
    return hit[1]


def text_ids(lm_or_tokenizer, name: str, n_tokens: int) -> list[int]:
    """Exactly `n_tokens` ids of the bundled file `name`, from its start, repeated if it is too short."""
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens <= 0:
        raise TextLengthError(f"n_tokens must be a positive integer, got {n_tokens!r}")
    tok = _tokenizer(lm_or_tokenizer)
    copies = 1
    ids = _ids(tok, name, copies)
    if len(ids) < n_tokens:
        copies = -(-n_tokens // max(len(ids), 1)) + 1  # one spare copy: joins can merge tokens
        ids = _ids(tok, name, copies)
    return list(ids[:n_tokens])


def prose_ids(lm_or_tokenizer, n_tokens: int) -> list[int]:
    """Exactly `n_tokens` token ids of `prose()` (a `LoadedModel` or a tokenizer), no special tokens.

    Cut from the start of the tokenized prose; past its 25.6k SmolLM2 tokens the prose is repeated with
    a paragraph break between copies.
    """
    return text_ids(lm_or_tokenizer, PROSE_FILE, n_tokens)


def held_out_ids(lm_or_tokenizer, n_tokens: int) -> list[int]:
    """Exactly `n_tokens` token ids of `held_out()`, no special tokens (repeated past its 17.2k tokens)."""
    return text_ids(lm_or_tokenizer, HELD_OUT_FILE, n_tokens)
