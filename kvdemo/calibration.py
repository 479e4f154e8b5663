"""Fit a model's nuq codebooks and write them where kvdemo finds them: `python -m kvdemo calibrate` and the
sidebar's "Calibrate codebooks for this model" button both go through `calibrate_to_file`.

The fit (`calibrate`): one forward and one backward pass of the model
over calibration text (Pride and Prejudice, not the held-out text the perplexity is scored on) capture
every layer's keys and values as the cache receives them and the gradient of the loss with respect to
each; the Fisher information of an element is its squared gradient. Each element is normalized as the
quantizer normalizes it at run time (`reference._ranges` / `_nuq_scale`: keys per channel over blocks
of `group` tokens to [-1, 1] by their [min, max]; values per token by their absmax; the outlier
variants with the narrowed ranges, clipped outliers left out since the sparse corrections hold them),
and the levels are the weighted k-means of those samples (1-D Lloyd from weighted quantiles), each weighted
by its Fisher information times its group's scale squared (an error in normalized units is that much
in the cache), clipped at its 99th percentile (a single pass gives a noisy per-element Fisher; unclipped, a
few elements pull the levels to themselves and the fit does worse on other text): levels go where the
loss is sensitive, not only where the values are many.

Around the fit, how many tokens (at most the model's context, at least one key block),
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
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from . import codebooks
from .codebooks import Codebooks, tensor_name
from .documents import extract_file, token_ids
from .models import IdsOnlyTokenizer
from .precision import outlier_cap
from .progress import ProgressFn, StopFn, Tracker
from .quant.reference import _grouped, _mask, _nuq_scale, _ranges, outlier_picks
from .quant.rotations import Rope
from .runner import attention_impl
from .texts import held_out_ids, prose_ids

BITS = (2, 3, 4)
CALIB_TOKENS = 2048
GROUP = 128  # key blocks of the default spec (the levels are in normalized units: the group matters little)
OUTLIER_PCT = 1.0  # the `.o` codebooks are fitted at o1
ITERATIONS = 40
FISHER_CLIP = 0.99  # weights are clipped at this quantile: one pass gives a noisy per-element Fisher
MIN_TOKENS = GROUP  # keys are fitted over whole blocks of GROUP tokens
RANDOM_SEED = 0


# --- the fit -------------------------------------------------------------------------------------------


def weighted_kmeans(
    samples: torch.Tensor, weights: torch.Tensor, n: int, iterations: int = ITERATIONS, ends: bool = True
) -> torch.Tensor:
    """1-D k-means of `samples` [N] in [-1, 1] with `weights` [N] >= 0 -> n ascending levels (Lloyd from
    weighted quantiles). ends: the outer levels stay at -1 and 1, where every group's extremes land after
    normalization (its min and max, or its absmax), so those are stored exactly as uniform codes store them.

    Samples are sorted once; each iteration finds the cells' boundaries by binary search and their weight
    and weighted sum from prefix sums (O(n log N) per iteration, not O(N))."""
    order = samples.argsort()
    s, w = samples[order].double(), weights[order].double() + 1e-12
    cw = torch.cat([torch.zeros(1, dtype=torch.float64), w.cumsum(0)])  # prefix sums: cell [i, j) = c[j] - c[i]
    cws = torch.cat([torch.zeros(1, dtype=torch.float64), (w * s).cumsum(0)])
    levels = s[
        torch.searchsorted(cw[1:] / cw[-1], (torch.arange(n, dtype=torch.float64) + 0.5) / n).clamp(max=len(s) - 1)
    ]
    if ends:
        levels[0], levels[-1] = -1.0, 1.0
    for _ in range(iterations):
        cuts = torch.searchsorted(s, (levels[1:] + levels[:-1]) / 2)  # cell k: samples [cuts[k-1], cuts[k])
        edges = torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.tensor([len(s)])])
        mass = cw[edges[1:]] - cw[edges[:-1]]
        total = cws[edges[1:]] - cws[edges[:-1]]
        new = torch.where(mass > 1e-30, total / mass.clamp(min=1e-30), levels)
        if ends:
            new[0], new[-1] = -1.0, 1.0
        new, _ = new.sort()
        if torch.allclose(new, levels, atol=1e-7):
            break
        levels = new
    return levels.float()


def normalized_samples(x: torch.Tensor, fisher: torch.Tensor, part: str, outliers: float, group: int = GROUP):
    """x, fisher [B, H, T, D] -> (samples, weights) [N]: x normalized as the nuq quantizer does at run time
    (keys per channel over `group`-token blocks, values per token), the outlier picks and elements outside
    [-1, 1] dropped; weights: Fisher x the group's scale squared."""

    d = x.shape[-1]
    cap = outlier_cap(outliers, d)
    x = x.float()
    if part == "key":
        t = x.shape[-2] // group * group
        x, fisher = x[:, :, :t], fisher[:, :, :t]
        axis, g, red = "channel", group, -2
    else:
        axis, g, red = "token", min(group, d), -1
    picked = _mask(x, outlier_picks(x, axis, g, cap)) if cap else torch.zeros(x.shape, dtype=torch.bool)
    xg = _grouped(x, axis, g)
    lo, hi = _ranges(xg, red, _grouped(picked, axis, g) if cap else None)
    scale, zero = _nuq_scale(lo, hi, axis)
    norm = ((xg - (0.0 if zero is None else zero)) / scale).reshape(-1)
    keep = (norm.abs() <= 1.0) & ~picked.reshape(-1)  # the picked ones are held by the sparse corrections
    # an error e in normalized units is scale * e in the cache: weight by Fisher x scale^2, so the k-means
    # minimizes the Fisher-weighted squared error of the stored values themselves
    weight = (_grouped(fisher.float(), axis, g) * scale.square()).reshape(-1)[keep]
    if len(weight) > 1:  # unclipped, a handful of elements pull the levels to themselves (held-out error grows)
        weight = weight.clamp(max=weight.kthvalue(max(1, int(FISHER_CLIP * len(weight)))).values)
    return norm[keep], weight


@torch.enable_grad()
def capture(lm, ids: Sequence[int]) -> list[dict]:
    """Per layer {"key", "value", "key_grad", "value_grad"} [1, Hkv, T, D] fp32: the keys (after RoPE) and
    values the model's attention receives over `ids`, and the loss gradients with respect to them (one backward)."""
    layers: dict[int, dict] = {}

    def hooked(module, query, key, value, attention_mask, **kwargs):
        slot = layers.setdefault(module.layer_idx, {})
        slot["key"], slot["value"] = key.detach().float(), value.detach().float()
        key.register_hook(lambda g: slot.__setitem__("key_grad", g.detach().float()))
        value.register_hook(lambda g: slot.__setitem__("value_grad", g.detach().float()))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvdemo_calibrate", hooked)
    ALL_MASK_ATTENTION_FUNCTIONS.register("kvdemo_calibrate", sdpa_mask)
    embed = lm.model.get_input_embeddings()
    handle = embed.register_forward_hook(lambda m, i, out: out.detach().requires_grad_(True))
    trained = [p for p in lm.model.parameters() if p.requires_grad]
    for p in trained:  # gradients flow to the activations only; the weights get none
        p.requires_grad_(False)
    try:
        with attention_impl(lm, "kvdemo_calibrate"):
            x = torch.tensor([list(ids)], device=lm.device)
            logits = lm.model(input_ids=x, use_cache=False).logits[0, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits, x[0, 1:])
            loss.backward()
    finally:
        handle.remove()
        for p in trained:
            p.requires_grad_(True)
    return [layers[i] for i in sorted(layers)]


def calibrate(
    lm,
    ids: Sequence[int] | None = None,
    bits: Sequence[int] = BITS,
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
) -> Codebooks:
    """Fit every codebook of a model (nuq2/3/4, plain and `.o`, keys also before RoPE where the model allows).
    Progress counts steps: the forward and backward pass, then one per layer."""
    t0 = time.perf_counter()
    ids = list(ids) if ids is not None else prose_ids(lm, CALIB_TOKENS)
    track = Tracker(lm.num_layers + 1, "steps", on_progress, should_stop)
    track.report("forward and backward pass")
    captured = capture(lm, ids)
    track.advance("forward and backward pass")
    try:
        rope = Rope.from_model(lm.model)
    except ValueError:
        rope = None
    tensors = {}
    for i, layer in enumerate(captured):
        track.check("calibration")
        parts = [
            ("value", layer["value"], layer["value_grad"] ** 2, False),
            ("key", layer["key"], layer["key_grad"] ** 2, False),
        ]
        if rope is not None:  # gradients turn like the keys: dL/dk_pre = A^T dL/dk_post, A^T = a^2 A^-1 (a constant)
            pre_grad = rope.undo(layer["key_grad"], 0)
            parts.append(("key", rope.undo(layer["key"], 0), pre_grad**2, True))
        for part, x, fisher, pre_rope in parts:
            for outliers in (False, True):
                samples, weights = normalized_samples(x, fisher, part, OUTLIER_PCT if outliers else 0.0)
                for b in bits:  # 2 bits: 4 levels, two pinned to the ends would leave 2 for the bulk
                    levels = weighted_kmeans(samples, weights, 1 << b, ends=b > 2)
                    tensors[tensor_name(i, part, b, outliers, pre_rope)] = levels.half()
        track.advance(f"k-means of layer {i + 1} of {len(captured)}")
    meta = {
        "model": lm.name,
        "source": lm.source,
        "calibration_tokens": str(len(ids)),
        "calibration_text": "kvdemo.texts.prose (Pride and Prejudice)",
        "seconds": f"{time.perf_counter() - t0:.1f}",
        "date": time.strftime("%Y-%m-%d"),
        "layers": str(len(captured)),
    }
    return Codebooks(tensors, meta)


# --- around the fit --------------------------------------------------------------------------------------


def default_path(lm) -> Path:
    """Where a model's calibrated codebooks go: the user's codebook folder, found before the shipped files."""
    return codebooks.user_dir() / codebooks.file_name(lm.source)


def default_tokens(lm) -> int:
    return min(CALIB_TOKENS, lm.max_context)


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
    text = text or PROSE
    if text not in TEXT_LABELS:
        return _document_ids(lm, tokens, text)
    tokens = default_tokens(lm) if tokens is None else int(tokens)
    _check_length(lm, tokens)
    if isinstance(lm.tokenizer, IdsOnlyTokenizer):
        vocab = int(lm.config.vocab_size)
        gen = torch.Generator().manual_seed(RANDOM_SEED)
        return torch.randint(1, vocab, (tokens,), generator=gen).tolist(), f"random ids (seed {RANDOM_SEED})"
    return (prose_ids if text == PROSE else held_out_ids)(lm, tokens), TEXT_LABELS[text]


def _document_ids(lm, tokens: int | None, path: str) -> tuple[list[int], str]:
    """The first `tokens` tokens of the document at `path` (all of it, up to `default_tokens`, when None)."""
    _needs_tokenizer(lm)
    doc = extract_file(path)  # DocumentError (a ValueError) for a missing, oversized or unreadable file
    return document_ids(lm, tokens, doc.name, doc.text)


def document_ids(lm, tokens: int | None, name: str, text: str) -> tuple[list[int], str]:
    """(ids, label) of a document's text already in memory (the app's upload): its first `tokens` tokens."""
    _needs_tokenizer(lm)
    ids = token_ids(text, lm.tokenizer)
    want = min(default_tokens(lm), len(ids)) if tokens is None else int(tokens)
    if len(ids) < want:
        raise ValueError(f"{name} has {len(ids):,} tokens; {want:,} calibration tokens were asked for")
    _check_length(lm, want)
    return ids[:want], f"{name} (a document, its first {want:,} tokens)"


def _needs_tokenizer(lm) -> None:
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
    on_progress: ProgressFn | None = None,
    text: str = PROSE,
    document: tuple[str, str] | None = None,
) -> dict:
    """Fit every nuq codebook of `lm` over `tokens` tokens of `text` (`calibration_ids`; default: 2,048 of the
    bundled prose, or the model's context) and save them to `out` (default `default_path(lm)`) -> {"model",
    "source", "path", "tensors", "bytes", "seconds", "tokens", "layers", "text"}. document: (name, text) of a
    document in memory (the app's upload), in place of `text`. The model's weights take no gradients
    (`capture`), only the keys and values."""
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
    try:  # capture takes dL/dK and dL/dV only: the weights get no gradients and are left as found
        books = calibrate(lm, ids=ids, on_progress=on_progress)
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
