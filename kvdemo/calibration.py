"""Fit a model's nuq codebooks and write them where kvdemo finds them: `python -m kvdemo calibrate` and the
sidebar's "Calibrate codebooks for this model" button both go through `calibrate_to_file`.

The fitting itself is `codebooks.calibrate` (one forward and one backward pass over the bundled prose);
this adds the choices around it: how many tokens (at most the model's context, at least one key block),
which ids (random ones for a random-weights model, whose tokenizer has no text), where the file goes
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


def calibration_ids(lm, tokens: int) -> list[int]:
    """`tokens` token ids of the calibration text (the bundled prose, not the held-out perplexity text);
    seeded random ids for a random-weights model, whose ids stand for no text."""
    from .models import IdsOnlyTokenizer

    if tokens < MIN_TOKENS:
        raise ValueError(f"calibration needs at least {MIN_TOKENS} tokens (one block of keys), got {tokens}")
    if tokens > lm.max_context:
        raise ValueError(f"{tokens} calibration tokens exceed the model's context ({lm.max_context})")
    if isinstance(lm.tokenizer, IdsOnlyTokenizer):
        vocab = int(lm.config.vocab_size)
        gen = torch.Generator().manual_seed(RANDOM_SEED)
        return torch.randint(1, vocab, (tokens,), generator=gen).tolist()
    from .texts import prose_ids

    return prose_ids(lm, tokens)


def calibrate_to_file(
    lm,
    tokens: int | None = None,
    out: str | Path | None = None,
    on_progress: Callable[[str, float], None] | None = None,
) -> dict:
    """Fit every nuq codebook of `lm` over `tokens` tokens (default: 2,048 or the model's context) and save
    them to `out` (default `default_path(lm)`) -> {"model", "source", "path", "tensors", "bytes", "seconds",
    "tokens", "layers"}. The model's weights take no gradients (`codebooks.capture`), only the keys and values."""
    tokens = default_tokens(lm) if tokens is None else int(tokens)
    ids = calibration_ids(lm, tokens)
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
    }
