"""One findings measurement: a KV precision (under a weight setting) over a `FindingsText`, and the disk
cache that keeps measurements and exact states across runs and processes.

The text's exact keys/values are computed once per weight setting (one full-precision forward in pieces
of 2048 tokens, `kvdemo.ppl.exact_states`). Then, per KV precision, `measure_spec` stores those exact
states into a cache at that precision, checkpoint by checkpoint (a document cached before the user reads
on), and at each checkpoint a fork of the cache is read on:

- perplexity windows: the next `window` tokens of the text are teacher-forced as decoding would feed
  them (`needle.forward_as_decoding`: equal to one token at a time), so every scored token attends over
  the stored (quantized) past; next-token NLL per window, and KL(full || precision) of the next-token
  distributions on every `kl_every`-th scored token. Windows sit at growing positions: NLL by position.
- needles: at each prompt length the question for a needle is asked after the text read so far, and the
  true answer is scored after the needle's own lead-in: log p(answer) near 0 means the needle was found,
  far below means it was lost. The needles sit near the start, so a longer prompt asks across more
  tokens: long-range recall.

Weight quantization (`with_weights`) quantizes a copy of the weights with optimum-quanto (qint8 per output
channel, qint4 in groups of 128; the tied embedding / lm_head is left as loaded) and runs the dequantized
values, the numbers quantized kernels would read.

Results are cached per (model, weights, precision, token sequence, sizes, `CODE_VERSION`) under
`kvdemo.configs.cache_dir() / "findings"`, so a re-run or the page reuses what was measured.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..needle.run import forward_as_decoding
from ..precision import parse_precision
from ..results.findings import Measurement, NeedleAnswer, Window
from .text import FindingsError, FindingsText

CODE_VERSION = "findings-1"  # bump when a measurement changes: cached results under an old version are not reused
WEIGHTS = ("loaded", "int8", "int4")  # weight settings: as loaded, optimum-quanto qint8 / qint4


def with_weights(lm, weights: str):
    """`lm` itself ("loaded") or a copy whose Linear weights were quantized by optimum-quanto (qint8 / qint4)
    and dequantized back (the tied embedding / lm_head stays as loaded)."""
    if weights == "loaded":
        return lm
    if weights not in WEIGHTS:
        raise FindingsError(f"unknown weights {weights!r}; allowed: {', '.join(WEIGHTS)}")
    import torch
    from optimum.quanto import freeze, qint4, qint8, quantize

    model = copy.deepcopy(lm.model)
    quantize(model, weights={"int8": qint8, "int4": qint4}[weights], exclude=["lm_head"])
    freeze(model)
    for name, module in list(model.named_modules()):
        if hasattr(module, "qweight") and module.weight is not None:
            plain = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            plain.weight = torch.nn.Parameter(module.qweight.dequantize().to(lm.dtype), requires_grad=False)
            if module.bias is not None:
                plain.bias = torch.nn.Parameter(module.bias.detach().clone(), requires_grad=False)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, plain.to(lm.device))
    model.eval()
    return replace(lm, model=model, name=f"{lm.name} [weights {weights}]")


_weights_cache: dict = {}


def weights_model(lm, weights: str):
    """`with_weights(lm, weights)`, the last one kept (a quantized copy takes seconds to make)."""
    if weights == "loaded":
        return lm
    hit = _weights_cache.get(weights)
    if hit is None or hit[0] is not lm:
        _weights_cache.clear()
        hit = (lm, with_weights(lm, weights))
        _weights_cache[weights] = hit
    return hit[1]


def measure_spec(
    lm,
    text: FindingsText,
    states,
    spec,
    window: int,
    kl_every: int,
    reference: dict | None = None,
    weights: str = "loaded",
    check: Callable[[], None] | None = None,
) -> tuple[Measurement, dict | None]:
    """One precision over the shared text (module docstring): windows, needles, live cache bytes.

    `states`: the text's exact (keys, values) per layer [1, Hkv, n, D]. `reference`: the full-precision
    run's kept log-softmax rows per window start (for KL). Returns (the measurement, its own rows when it
    is a full-precision run, else None). `check()` is called at every checkpoint (it raises to stop).
    """
    import torch
    import torch.nn.functional as F

    from ..runner import fork, new_cache

    spec = parse_precision(spec)
    t0 = time.perf_counter()
    cache = new_cache(lm, spec)
    at, updates = 0, []
    windows, needles, rows = [], [], {}
    by_context = {}
    for p in text.prompts:
        by_context.setdefault(p.context, []).append(p)
    with torch.no_grad():
        for point in text.checkpoints():
            if check is not None:
                check()
            if point > at:
                for i, (k, v) in enumerate(states):
                    cache.update(k[:, :, at:point], v[:, :, at:point], i)
                updates.append(point - at)
                at = point
            if point in text.windows:
                probe = fork(cache)
                feed = text.ids[point : point + window]
                logits = forward_as_decoding(lm, feed, probe).float()  # [W, V]: row i predicts ids[point + 1 + i]
                del probe
                target = torch.tensor(text.ids[point + 1 : point + 1 + window], device=logits.device)
                nll = F.cross_entropy(logits, target, reduction="none")
                lp = torch.log_softmax(logits[::kl_every], -1)
                kl = None
                if not spec.is_quantized:
                    rows[point] = lp.to(torch.float16)
                    kl = 0.0
                elif reference is not None and point in reference:
                    ref = reference[point].float()
                    kl = round(float((ref.exp() * (ref - lp)).sum(-1).clamp_min(0).mean()), 6)
                windows.append(Window(point, window, round(float(nll.mean()), 5), kl))
            for p in by_context.get(point, []):
                probe = fork(cache)
                feed = p.suffix + p.answer[:-1]
                logits = forward_as_decoding(lm, feed, probe).float()[len(p.suffix) - 1 :]  # [A, V]
                del probe
                answer = torch.tensor(p.answer, device=logits.device)
                lp = torch.log_softmax(logits, -1)[torch.arange(len(answer)), answer]
                needles.append(
                    NeedleAnswer(
                        length=p.length,
                        tokens=p.tokens,
                        key=p.key,
                        distance=p.distance,
                        logprob=round(float(lp.sum()), 4),
                        found=bool((logits.argmax(-1) == answer).all()),
                    )
                )
        if at < len(text.ids):
            for i, (k, v) in enumerate(states):
                cache.update(k[:, :, at:], v[:, :, at:], i)
            updates.append(len(text.ids) - at)
    nb = cache.nbytes()
    m = Measurement(
        precision=spec.label,
        spec=spec.to_dict(),
        windows=windows,
        needles=needles,
        cache_bytes=int(nb["total"]),
        cache_tokens=len(text.ids),
        updates=updates,
        seconds=round(time.perf_counter() - t0, 2),
        weights=weights,
    )
    return m, (rows or None)


# --- the disk cache --------------------------------------------------------------------------------------


def cache_path(model: str, weights: str, label: str, text: FindingsText, sizes: dict) -> Path:
    """Where a measurement is cached: keyed by the code version, model, weights, precision, text and sizes."""
    from ..configs import cache_dir

    key = json.dumps([CODE_VERSION, model, weights, label, text.digest, sizes], sort_keys=True)
    return cache_dir() / "findings" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def load_cached(path: Path, need_rows: bool) -> tuple[Measurement, dict | None] | None:
    """(the cached measurement, its full-precision rows when `need_rows`); None when not cached (or rows
    are needed and not there)."""
    import torch

    if not path.is_file():
        return None
    try:
        m = Measurement.from_json(json.loads(path.read_text(encoding="utf-8")))
        rows = None
        if need_rows:
            rows_path = path.with_suffix(".pt")
            if not rows_path.is_file():
                return None
            rows = torch.load(rows_path)
        return m, rows
    except (OSError, ValueError, KeyError, RuntimeError):
        return None


def save_cached(path: Path, m: Measurement, rows: dict | None) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    if rows is not None:
        torch.save(rows, path.with_suffix(".pt"))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(m.to_json()), encoding="utf-8")
    tmp.replace(path)


def cached_states(lm, weights: str, text: FindingsText, use_cache: bool, wait_s: float = 0.0):
    """Exact states of `text` for `weights`: from the disk cache (shared by shards; waits up to `wait_s` for
    another process to write them), else computed (and saved)."""
    import torch

    from ..configs import cache_dir
    from ..ppl import exact_states

    path = (
        cache_dir()
        / "findings"
        / f"states-{CODE_VERSION}-{hashlib.sha256((lm.name + weights).encode()).hexdigest()[:12]}-{text.digest}.pt"
    )
    deadline = time.monotonic() + wait_s
    while use_cache and not path.is_file() and time.monotonic() < deadline:
        time.sleep(5)
    if use_cache and path.is_file():
        try:
            return torch.load(path)
        except (OSError, RuntimeError, EOFError):
            pass
    states, _ = exact_states(lm, text.ids, chunk=2048)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(states, tmp)
        tmp.replace(path)
    return states
