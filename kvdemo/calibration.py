"""Fit a model's nuq codebooks and write them where kvdemo finds them: `python -m kvdemo calibrate` and the
sidebar's "Calibrate codebooks for this model" button both go through `calibrate_to_file`.

The fitting itself is `codebooks.calibrate` (one forward and one backward pass over calibration text);
this adds the choices around it: how many tokens (at most the model's context, at least one key block),
which text (`text`: the bundled prose by default; a document of the user's own, txt / md / pdf / docx / html,
so the levels fit the kind of text the model will hold; or HELD_OUT, the bench's held-out text, the very
text `kvdemo ppl` scores: codebooks fitted there are the best any calibration could give that score, which
tells whether the calibration or the format limits a nuq precision), random ids for a random-weights model
(its tokenizer has no text), where the file goes
(`codebooks.user_dir()`, searched before the shipped files), and a model left as it was found (no weight
gradients kept). Mistakes a user can make raise ValueError with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from . import codebooks

MIN_TOKENS = codebooks.GROUP  # keys are fitted over whole blocks of GROUP tokens
RANDOM_SEED = 0


def default_path(lm) -> Path:
    """Where a model's calibrated codebooks go: the user's codebook folder, found before the shipped files."""
    return codebooks.user_dir() / codebooks.file_name(lm.source)


def default_tokens(lm) -> int:
    return min(codebooks.CALIB_TOKENS, lm.max_context)


PROSE = "prose"  # the default calibration text
HELD_OUT = "held-out"  # the perplexity's scored text: an oracle fit, not a calibration to ship
TEXT_LABELS = {
    PROSE: "kvdemo.texts.prose (Pride and Prejudice)",
    HELD_OUT: "kvdemo.texts.held_out (Sense and Sensibility): the text kvdemo ppl scores, an oracle fit",
}


def calibration_ids(lm, tokens: int | None, text: str = PROSE) -> tuple[list[int], str]:
    """(token ids, what they are) of the calibration text: `tokens` of them (None: `default_tokens`, or the whole
    document when it is shorter). text: PROSE, HELD_OUT, or the path of a document (its first `tokens` tokens);
    seeded random ids for a random-weights model, whose ids stand for no text."""
    from .models import IdsOnlyTokenizer

    text = text or PROSE
    if text not in TEXT_LABELS:
        return _document_ids(lm, tokens, text)
    tokens = default_tokens(lm) if tokens is None else int(tokens)
    _check_length(lm, tokens)
    if isinstance(lm.tokenizer, IdsOnlyTokenizer):
        vocab = int(lm.config.vocab_size)
        gen = torch.Generator().manual_seed(RANDOM_SEED)
        return torch.randint(1, vocab, (tokens,), generator=gen).tolist(), f"random ids (seed {RANDOM_SEED})"
    from .texts import held_out_ids, prose_ids

    return (prose_ids if text == PROSE else held_out_ids)(lm, tokens), TEXT_LABELS[text]


def _document_ids(lm, tokens: int | None, path: str) -> tuple[list[int], str]:
    """The first `tokens` tokens of the document at `path` (all of it, up to `default_tokens`, when None)."""
    from .documents import extract_file

    _needs_tokenizer(lm)
    doc = extract_file(path)  # DocumentError (a ValueError) for a missing, oversized or unreadable file
    return document_ids(lm, tokens, doc.name, doc.text)


def document_ids(lm, tokens: int | None, name: str, text: str) -> tuple[list[int], str]:
    """(ids, label) of a document's text already in memory (the app's upload): its first `tokens` tokens."""
    from .documents import token_ids

    _needs_tokenizer(lm)
    ids = token_ids(text, lm.tokenizer)
    want = min(default_tokens(lm), len(ids)) if tokens is None else int(tokens)
    if len(ids) < want:
        raise ValueError(f"{name} has {len(ids):,} tokens; {want:,} calibration tokens were asked for")
    _check_length(lm, want)
    return ids[:want], f"{name} (a document, its first {want:,} tokens)"


def _needs_tokenizer(lm) -> None:
    from .models import IdsOnlyTokenizer

    if isinstance(lm.tokenizer, IdsOnlyTokenizer):
        raise ValueError(f"{lm.name} has random weights and no tokenizer: it cannot calibrate on a document")


def _check_length(lm, tokens: int) -> None:
    if tokens < MIN_TOKENS:
        raise ValueError(f"calibration needs at least {MIN_TOKENS} tokens (one block of keys), got {tokens}")
    if tokens > lm.max_context:
        raise ValueError(f"{tokens} calibration tokens exceed the model's context ({lm.max_context})")


def calibrate_to_file(
    lm,
    tokens: int | None = None,
    out: str | Path | None = None,
    on_progress: Callable[[str, float], None] | None = None,
    text: str = PROSE,
    document: tuple[str, str] | None = None,
) -> dict:
    """Fit every nuq codebook of `lm` over `tokens` tokens of `text` (`calibration_ids`; default: 2,048 of the
    bundled prose, or the model's context) and save them to `out` (default `default_path(lm)`) -> {"model",
    "source", "path", "tensors", "bytes", "seconds", "tokens", "layers", "text"}. document: (name, text) of a
    document in memory (the app's upload), in place of `text`. The model's weights take no gradients
    (`codebooks.capture`), only the keys and values."""
    if text == HELD_OUT and not out:
        raise ValueError(
            "the held-out text is what kvdemo ppl scores (an oracle fit): give an output file, so the fit does "
            "not replace the model's codebooks"
        )
    ids, label = document_ids(lm, tokens, *document) if document else calibration_ids(lm, tokens, text)
    path = Path(out).expanduser() if out else default_path(lm)
    if path.exists() and path.is_dir():
        raise ValueError(f"{path} is a folder: give a file name (e.g. {path / codebooks.file_name(lm.source)})")
    t0 = time.perf_counter()
    try:  # codebooks.capture takes dL/dK and dL/dV only: the weights get no gradients and are left as found
        books = codebooks.calibrate(lm, ids=ids, on_progress=on_progress)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, KeyError, IndexError) as err:  # an architecture the capture hook does not fit
        raise ValueError(f"calibration failed on {lm.name}: {err}") from err
    seconds = time.perf_counter() - t0
    books.metadata["calibration_text"] = label
    try:
        books.save(path)
    except OSError as err:
        raise ValueError(f"cannot write the codebooks to {path}: {err.strerror or err}") from err
    return {
        "model": lm.name,
        "source": lm.source,
        "path": str(path),
        "tensors": len(books.tensors),
        "bytes": path.stat().st_size,
        "seconds": round(seconds, 2),
        "tokens": len(ids),
        "layers": lm.num_layers,
        "text": label,
    }


def forget_calibration(lm) -> Path | None:
    """Delete the user's codebook file of `lm` (`default_path`), so nuq caches go back to the shipped file (or to
    NormalFloat levels when none ships); -> the deleted path, or None when there was none."""
    path = default_path(lm)
    if not path.is_file():
        return None
    path.unlink()
    return path
