"""Findings: the claims about KV-cache quantization, measured on the loaded model, with computed verdicts.

Each claim is a section of a report (`python -m kvdemo findings`, the Findings page): the claim, its
verdict on this model, a figure and how it was measured. Verdicts are computed by the `verdict_*`
functions from the numbers in the findings dict, against the one `THRESHOLDS` dict: nothing is written
by hand, and a claim that does not hold on a model says so.

One measurement, shared by every claim (`measure_spec`): a single token sequence of up to the model's
context is built once per model (`build_sequence`): the chat template's user turn with a RULER-style
instruction, then held-out prose (`kvdemo.texts.held_out`, a book no other measurement uses) with
multikey needles ("One of the special magic numbers for {key} is: {7 digits}.", Hsieh et al., RULER,
arXiv 2404.06654) placed near its start. Its exact keys/values are computed once per weight setting
(one full-precision forward in pieces of 2048 tokens, `kvdemo.ppl.exact_states`). Then, per KV
precision, a sweep stores those exact states into a cache at that precision, checkpoint by checkpoint
(a document cached before the user reads on), and at each checkpoint a fork of the cache is read on:

- perplexity windows: the next `window` tokens of the text are teacher-forced as decoding would feed
  them (`needle.forward_as_decoding`: equal to one token at a time), so every scored token attends over
  the stored (quantized) past; next-token NLL per window, and KL(full || precision) of the next-token
  distributions on every `kl_every`-th scored token. Windows sit at growing positions: NLL by position.
- needles: at each prompt length the user turn is closed after the text read so far, the question for a
  needle is asked, and the true answer is scored after the needle's own lead-in ("The special magic
  number for {key} mentioned in the provided text is", as RULER puts it in the prompt): log p(answer)
  near 0 means the needle was found, far below means it was lost. The needles sit near the start, so a
  longer prompt asks across more tokens: long-range recall.

Weight quantization (claim 6) quantizes a copy of the weights with optimum-quanto (qint8 per output
channel, qint4 in groups of 128; the tied embedding / lm_head is left as loaded) and runs the dequantized
values, the numbers quantized kernels would read. The embedded model's weights already come from a
Q4_1 GGUF (dequantized to fp32 at load): "as loaded" is itself 4-bit-derived.

Results are cached per (model, weights, precision, token sequence, sizes, `CODE_VERSION`) under
`kvdemo.configs.cache_dir() / "findings"`, so a re-run or the page reuses what was measured.

References: KIVI (arXiv 2402.02750; per-channel keys, residual window), KVQuant (arXiv 2401.18079;
per-channel pre-RoPE keys, sinks), StreamingLLM (arXiv 2309.17453; attention sinks), llama.cpp's
K/V perplexity tables (keys more sensitive), vLLM's "Maximum concurrency" (capacity).
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .precision import PRESETS, parse_precision
from .results.findings import (
    DEFAULT_CONFIG,
    THRESHOLDS,
    capacity,
    mean_kl,
    mean_needle_delta,
    needle_deltas,
    nll_delta,
    runs,
    tradeoff,
    window_deltas,
)

CODE_VERSION = "findings-1"  # bump when a measurement changes: cached results under an old version are not reused
REPORT_DIR = Path(__file__).resolve().parent.parent / "assets" / "reports" / "findings"
WEIGHT_NOTE = (
    "The embedded SmolLM2-135M weights come from a Q4_1 GGUF (4-bit blocks of 32 with a scale and a minimum), "
    "dequantized to fp32 at load: 'as loaded' is already 4-bit-derived, and int8 / int4 re-quantize those values."
)

KEY_VALUE = ("k4v8", "k8v4", "k8v2")  # 4-bit keys, 4-bit values, 2-bit values
AXIS = {4: ("int4", "int4:ktoken"), 2: ("int2", "int2:ktoken")}  # per channel vs per token keys
SINKS = ("int2", "int2:s4")
RESIDUAL = ("int2:g32:r32", "int2:g32")  # residual 32 vs 128 tokens (group 32 allows a 32-token window)
STACK_KV = ("full", "int8", "int4", "int2")
WEIGHTS = ("loaded", "int8", "int4")
INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards."
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
LEAD_IN = "The special magic number for {key} mentioned in the provided text is"
ASKED_KEYS = 2  # needles asked about at every length; 2 more are distractors
NEEDLE_FRACTIONS = (0.15, 0.35, 0.6, 0.8)  # of the shortest prompt's text: asked, distractor, asked, distractor


class FindingsError(ValueError):
    """Settings a findings run cannot use (sizes beyond the model's context, unknown weights)."""


@dataclass(frozen=True)
class Sizes:
    tokens: int = 8192  # the text's length (capped at the model's context)
    window: int = 128  # scored tokens per perplexity window
    window_fractions: tuple[float, ...] = (0.05, 0.125, 0.22, 0.5, 1.0)  # window starts, share of `tokens`
    needle_lengths: tuple[int, ...] = (512, 2048, 4096, 8000)  # prompt lengths (capped at the context)
    kl_every: int = 4  # KL on every kl_every-th scored token
    stack_tokens: int = 2048  # text length of the weight x KV grid
    weights: tuple[str, ...] = WEIGHTS
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


FULL = Sizes()
MEDIUM = Sizes(  # a quarter of the full context: what a busy 2-core machine measures in ~30 minutes
    tokens=2048,
    window=64,
    window_fractions=(0.05, 0.22, 0.5, 1.0),
    needle_lengths=(512, 1024, 2000),
    stack_tokens=1024,
    weights=("loaded", "int8"),
)
QUICK = Sizes(
    tokens=768, window=32, needle_lengths=(256, 768), kl_every=2, stack_tokens=384, weights=("loaded", "int8")
)

TINY = Sizes(  # tests: seconds per measurement
    tokens=320, window=32, window_fractions=(0.1, 1.0), needle_lengths=(256, 320), kl_every=2, weights=("loaded",)
)
SIZES = {"full": FULL, "medium": MEDIUM, "quick": QUICK, "tiny": TINY}


def default_precisions(quick: bool = False) -> list[str]:
    """Every preset the build has (new formats appear here by themselves), then the claims' variants."""
    names = list(PRESETS)
    for extra in ("int4:ktoken", "int2:ktoken", "int2:s4", *RESIDUAL):
        if extra not in names:
            names.append(extra)
    return names


def claim_precisions() -> list[str]:
    """The precisions claims 3-6 need whatever the user asks for."""
    return list(dict.fromkeys(["full", *KEY_VALUE, *AXIS[4], *AXIS[2], *SINKS, *RESIDUAL, *STACK_KV]))


# --- the token sequence --------------------------------------------------------------------------------


@dataclass
class Sequence_:
    """The shared text: ids, where each prompt length's context ends and what is asked there."""

    ids: list[int]
    head: int  # tokens before the text (template + instruction)
    needles: list[dict]  # {"key", "value", "position"} (token index of the needle's first token)
    prompts: list[dict]  # {"length", "context", "key", "suffix", "answer"}: context = tokens of ids reused
    windows: list[int]  # checkpoints where a perplexity window starts
    digest: str

    def checkpoints(self) -> list[int]:
        return sorted({*self.windows, *(p["context"] for p in self.prompts)})


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


def build_sequence(lm, tokens: int, needle_lengths: Sequence[int], windows: Sequence[int], seed: int = 0) -> Sequence_:
    """The held-out text with needles near its start, cut to `tokens` ids, and the prompts asked of it."""
    from . import texts
    from .needle import _nearest_boundary, _offsets, insert_at, split_answer

    tok = lm.tokenizer
    rng = random.Random(f"kvdemo-findings:{seed}")
    keys = [f"{a}-{n}" for a, n in rng.sample([(a, n) for a in _ADJ for n in _NOUN], len(NEEDLE_FRACTIONS))]
    values = rng.sample(range(1_000_000, 10_000_000), len(keys))
    head_text, _, special = _template_parts(lm, INSTRUCTION + "\n\n", QUESTION.format(key=keys[0]))
    head_ids = _ids(tok, head_text, special)
    shortest = min(needle_lengths)
    budget = max(shortest - len(head_ids) - 160, 32)  # room for the needles, the question and the answer
    source = texts.held_out()
    offsets = _offsets(tok, source[: 16 * (budget + 64)])
    piece, rest = source[: offsets[budget - 1][1]], source[offsets[budget - 1][1] :]
    for frac, key, value in sorted(zip(NEEDLE_FRACTIONS, keys, values, strict=True), reverse=True):
        piece = insert_at(
            piece, _nearest_boundary(piece, _offsets(tok, piece), frac), NEEDLE.format(key=key, value=value)
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
                {
                    "length": length,
                    "tokens": cut + len(suffix) + len(answer_ids),
                    "context": cut,
                    "key": needle["key"],
                    "distance": cut - needle["position"],
                    "suffix": suffix,
                    "answer": answer_ids,
                }
            )
    windows = sorted({w for w in windows if 32 <= w and w + 2 <= len(ids)})
    digest = hashlib.sha256(json.dumps([ids, [p["suffix"] + p["answer"] for p in prompts]]).encode()).hexdigest()[:16]
    return Sequence_(ids, len(head_ids), needles, prompts, windows, digest)


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


# --- weights -------------------------------------------------------------------------------------------


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


# --- measuring one precision ---------------------------------------------------------------------------


def measure_spec(
    lm, seq: Sequence_, states, spec, window: int, kl_every: int, reference=None, should_stop=None
) -> dict | None:
    """One precision over the shared sequence (module docstring): windows, needles, live cache bytes.

    `reference`: the full-precision run's kept log-softmax rows per window (for KL); the result of a
    full-precision run carries its own under "_rows". None when `should_stop()` said so.
    """
    import torch
    import torch.nn.functional as F

    from .needle import forward_as_decoding
    from .runner import fork, new_cache

    spec = parse_precision(spec)
    t0 = time.perf_counter()
    cache = new_cache(lm, spec)
    at, updates = 0, []
    windows, needles, rows = [], [], {}
    by_context = {}
    for p in seq.prompts:
        by_context.setdefault(p["context"], []).append(p)
    with torch.no_grad():
        for point in seq.checkpoints():
            if should_stop is not None and should_stop():
                return None
            if point > at:
                for i, (k, v) in enumerate(states):
                    cache.update(k[:, :, at:point], v[:, :, at:point], i)
                updates.append(point - at)
                at = point
            if point in seq.windows:
                probe = fork(cache)
                feed = seq.ids[point : point + window]
                logits = forward_as_decoding(lm, feed, probe).float()  # [W, V]: row i predicts ids[point + 1 + i]
                del probe
                target = torch.tensor(seq.ids[point + 1 : point + 1 + window], device=logits.device)
                nll = F.cross_entropy(logits, target, reduction="none")
                lp = torch.log_softmax(logits[::kl_every], -1)
                entry = {"start": point, "tokens": window, "nll": round(float(nll.mean()), 5)}
                if not spec.is_quantized:
                    rows[point] = lp.to(torch.float16)
                    entry["kl"] = 0.0
                elif reference is not None and point in reference:
                    ref = reference[point].float()
                    entry["kl"] = round(float((ref.exp() * (ref - lp)).sum(-1).clamp_min(0).mean()), 6)
                windows.append(entry)
            for p in by_context.get(point, []):
                probe = fork(cache)
                feed = p["suffix"] + p["answer"][:-1]
                logits = forward_as_decoding(lm, feed, probe).float()[len(p["suffix"]) - 1 :]  # [A, V]
                del probe
                answer = torch.tensor(p["answer"], device=logits.device)
                lp = torch.log_softmax(logits, -1)[torch.arange(len(answer)), answer]
                needles.append(
                    {
                        "length": p["length"],
                        "tokens": p["tokens"],
                        "key": p["key"],
                        "distance": p["distance"],
                        "logprob": round(float(lp.sum()), 4),
                        "found": bool((logits.argmax(-1) == answer).all()),
                    }
                )
        if at < len(seq.ids):
            for i, (k, v) in enumerate(states):
                cache.update(k[:, :, at:], v[:, :, at:], i)
            updates.append(len(seq.ids) - at)
    nb = cache.nbytes()
    out = {
        "precision": spec.label,
        "spec": spec.to_dict(),
        "windows": windows,
        "needles": needles,
        "cache_bytes": int(nb["total"]),
        "cache_tokens": len(seq.ids),
        "updates": updates,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if rows:
        out["_rows"] = rows
    return out


# --- the cache of measurements -------------------------------------------------------------------------


def _cache_path(model: str, weights: str, label: str, seq: Sequence_, sizes: dict) -> Path:
    from .configs import cache_dir

    key = json.dumps([CODE_VERSION, model, weights, label, seq.digest, sizes], sort_keys=True)
    return cache_dir() / "findings" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def _load_cached(path: Path, need_rows: bool):
    import torch

    if not path.is_file():
        return None
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
        if need_rows:
            rows_path = path.with_suffix(".pt")
            if not rows_path.is_file():
                return None
            out["_rows"] = torch.load(rows_path)
        return out
    except (OSError, ValueError, RuntimeError):
        return None


def _save_cached(path: Path, out: dict) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    if "_rows" in out:
        torch.save(out["_rows"], path.with_suffix(".pt"))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({k: v for k, v in out.items() if k != "_rows"}), encoding="utf-8")
    tmp.replace(path)


# --- the run -------------------------------------------------------------------------------------------


def plan(precisions: Sequence[str], sizes: Sizes, claims: bool = True) -> list[tuple[str, str, str]]:
    """(weights, precision, text) units in the order they run: full precision first (KL needs it), the
    claims' pairs next (`claims`), then the rest of `precisions`, then the weight x KV grid."""
    labels = [parse_precision(p).label for p in precisions]
    needed = [parse_precision(p).label for p in claim_precisions()] if claims else ["full"]
    first = ["full", "int8", "int4", "int2", "k8v4", "k4v8"]
    order = list(dict.fromkeys([p for p in first if p in labels or p in needed] + needed + labels))
    units = [("loaded", p, "main") for p in order]
    for w in sizes.weights:
        if w != "loaded":
            units += [(w, p, "stack") for p in STACK_KV if p in order]
    return units


def parse_shard(text: str) -> tuple[int, int]:
    """ "k/N" -> (k, N): this process measures every N-th unit from the k-th (0 <= k < N)."""
    try:
        k, n = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise FindingsError(f"--shard must look like 0/2, got {text!r}") from None
    if not 0 <= k < n:
        raise FindingsError(f"--shard {text}: need 0 <= k < N")
    return k, n


def _cached_states(lm, weights: str, seq: Sequence_, use_cache: bool, wait_s: float = 0.0):
    """Exact states of `seq` for `weights`: from the disk cache (shared by shards), else computed (and saved)."""
    import torch

    from .configs import cache_dir
    from .ppl import exact_states

    path = (
        cache_dir()
        / "findings"
        / f"states-{CODE_VERSION}-{hashlib.sha256((lm.name + weights).encode()).hexdigest()[:12]}-{seq.digest}.pt"
    )
    deadline = time.monotonic() + wait_s
    while use_cache and not path.is_file() and time.monotonic() < deadline:
        time.sleep(5)
    if use_cache and path.is_file():
        try:
            return torch.load(path)
        except (OSError, RuntimeError, EOFError):
            pass
    states, _ = exact_states(lm, seq.ids, chunk=2048)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(states, tmp)
        tmp.replace(path)
    return states


def run_findings(
    lm,
    precisions: Sequence[str] | None = None,
    quick: bool = False,
    sizes: Sizes | None = None,
    config: dict | None = None,
    on_progress: Callable[[int, int, str], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_partial: Callable[[dict], None] | None = None,
    use_cache: bool = True,
    claims: bool = True,
    shard: tuple[int, int] = (0, 1),
    reverse: bool = False,
    cached_only: bool = False,
) -> dict:
    """Measure every claim on `lm`; the findings dict (verdicts included, `evaluate`). `on_progress(done,
    total, message)` per measurement; `should_stop()` ends the run after the running measurement (the
    dict holds what finished, stopped="cancelled"); `on_partial(findings)` after every measurement.
    `claims=False` measures `precisions` only (tests); `shard=(k, N)` measures every N-th unit (parallel
    processes sharing the cache; the others wait for shard 0's exact states and full-precision runs);
    `reverse` takes a shard's units from its last (a second process per shard meets the first halfway);
    `cached_only` collects what the cache holds and measures nothing (a report from shards' results)."""
    sizes = sizes or (QUICK if quick else FULL)
    precisions = [parse_precision(p).label for p in (precisions or default_precisions(quick))]
    if "full" not in precisions:
        precisions = ["full", *precisions]
    tokens = min(sizes.tokens, lm.max_context)
    lengths = sorted({min(n, lm.max_context - 16, tokens) for n in sizes.needle_lengths})
    if tokens < 2 * sizes.window + 64:
        raise FindingsError(f"the text ({tokens} tokens) is too short for windows of {sizes.window}")
    t0 = time.perf_counter()
    units = plan(precisions, sizes, claims)
    windows = window_starts(tokens, sizes.window, sizes.window_fractions)
    main_seq = build_sequence(lm, tokens, lengths, windows, sizes.seed)
    stack_tokens = min(sizes.stack_tokens, tokens)
    stack_lengths = [n for n in lengths if n <= stack_tokens] or [lengths[0]]
    stack_windows = [w for w in windows if w + sizes.window + 1 <= stack_tokens] or windows[:1]
    stack_seq = build_sequence(lm, stack_tokens, stack_lengths, stack_windows, sizes.seed)
    found = _skeleton(lm, sizes, precisions, config, main_seq, stack_seq)
    found["precisions"] = list(dict.fromkeys([*precisions, *(u[1] for u in units if u[0] == "loaded")]))
    measured = found["measurements"]
    total = len(units)
    states_for: dict[tuple[str, str], object] = {}
    reference: dict[str, dict] = {}
    stopped = "done"
    k, n_shards = shard
    order = sorted(range(total), key=lambda i: (units[i][1:] != ("full", "main"), -i if reverse else i))
    for done in order:
        weights, label, text = units[done]
        if should_stop is not None and should_stop():
            stopped = "cancelled"
            break
        seq = main_seq if text == "main" else stack_seq
        size_key = {"window": sizes.window, "kl_every": sizes.kl_every}
        path = _cache_path(lm.name, weights, label, seq, size_key)
        is_full = not parse_precision(label).is_quantized
        mine = done % n_shards == k or (is_full and k == 0)
        if not mine and not is_full:
            continue
        wait = 4 * 3600.0 if k != 0 and text == "main" else 0.0  # shard 0 makes the main text's states and full run
        out = _load_cached(path, need_rows=is_full) if use_cache else None
        if (
            out is None and is_full and wait and not cached_only
        ):  # the full-precision reference (KL) comes from shard 0: wait for it
            deadline = time.monotonic() + wait
            while out is None and time.monotonic() < deadline:
                time.sleep(5)
                out = _load_cached(path, need_rows=True)
        if out is None and (not mine or cached_only):
            continue
        ref_key = f"{weights}:{text}"
        if out is None:
            if on_progress is not None:
                what = f"weights {weights}, " if weights != "loaded" else ""
                on_progress(done, total, f"measuring {label} ({what}{len(seq.ids):,} tokens)")
            model = _weights_model(lm, weights, states_for)
            key = (weights, text)
            if key not in states_for:
                states_for.clear()
                states_for[key] = _cached_states(model, weights, seq, use_cache, wait)
            out = measure_spec(
                model, seq, states_for[key], label, sizes.window, sizes.kl_every, reference.get(ref_key), should_stop
            )
            if out is None:
                stopped = "cancelled"
                break
            out["weights"] = weights
            if use_cache:
                _save_cached(path, out)
        if "_rows" in out:
            reference[ref_key] = out.pop("_rows")
        out["weights"] = weights
        measured.setdefault(f"{weights}:{text}", {})[label] = out
        found["seconds"] = round(time.perf_counter() - t0, 1)
        found["claims"] = evaluate(found)
        if on_progress is not None:
            on_progress(done + 1, total, f"{label} done ({out['seconds']:.0f} s)")
        if on_partial is not None:
            on_partial(found)
    found["stopped"] = stopped
    found["seconds"] = round(time.perf_counter() - t0, 1)
    found["claims"] = evaluate(found)
    return found


_weights_cache: dict = {}


def _weights_model(lm, weights: str, states_for: dict):
    if weights == "loaded":
        return lm
    hit = _weights_cache.get(weights)
    if hit is None or hit[0] is not lm:
        _weights_cache.clear()
        hit = (lm, with_weights(lm, weights))
        _weights_cache[weights] = hit
    return hit[1]


def _skeleton(
    lm, sizes: Sizes, precisions: list[str], config: dict | None, main_seq: Sequence_, stack_seq: Sequence_
) -> dict:
    info = lm.info()
    return {
        "version": CODE_VERSION,
        "created": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "model": lm.name,
        "model_info": info,
        "embedded": lm.source == "embedded",
        "weights_note": WEIGHT_NOTE if lm.source == "embedded" else "",
        "sizes": sizes.to_dict() | {"tokens": len(main_seq.ids), "stack_tokens": len(stack_seq.ids)},
        "quick": sizes == QUICK,
        "sizes_name": next((n for n, v in SIZES.items() if v == sizes), "custom"),
        "precisions": precisions,
        "thresholds": dict(THRESHOLDS),
        "config": dict(config or DEFAULT_CONFIG),
        "text": {
            "head_tokens": main_seq.head,
            "needles": main_seq.needles,
            "windows": main_seq.windows,
            "prompts": [{k: p[k] for k in ("length", "tokens", "key", "distance")} for p in main_seq.prompts],
            "stack_windows": stack_seq.windows,
            "stack_prompts": [{k: p[k] for k in ("length", "tokens", "key", "distance")} for p in stack_seq.prompts],
        },
        "measurements": {},
        "claims": [],
        "seconds": 0.0,
        "stopped": "running",
    }


# --- verdicts --------------------------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 3, signed: bool = True) -> str:
    if x is None:
        return "n/a"
    return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"


def _verdict(holds: bool | None, text: str) -> dict:
    word = {True: "holds", False: "does not hold", None: "not measured"}[holds]
    return {"holds": holds, "word": word, "text": text}


def verdict_capacity(found: dict, config: dict | None = None) -> dict:
    th = found.get("thresholds", THRESHOLDS)
    cap = capacity(found, config)
    mult = {k: v for k, v in cap["multiplier"].items() if k != "full" and v is not None}
    if not mult:
        return _verdict(None, "no quantized precision was measured") | {"capacity": cap}
    worst_live = max((abs(r["error_vs_formula"]) for r in cap["live"]), default=None)
    best = max(mult, key=mult.get)
    holds = min(mult.values()) > 1.0 and (worst_live is None or worst_live <= th["capacity_formula_tolerance"])
    c = cap["config"]
    text = (
        f"{c['model_config']} on {c['gpus']} x {c['gpu']} at {int(c['context']):,} tokens: {cap['sequences_16bit']} "
        f"sequences at 16 bits; {best} fits {mult[best]:.2f}x as many ({cap['sequences'][best]})"
        + ("" if "int4" not in mult or best == "int4" else f", int4 {mult['int4']:.2f}x")
        + (
            f"; live cache of the loaded model within {100 * worst_live:.2f}% of the formula"
            if worst_live is not None
            else ""
        )
    )
    return _verdict(holds, text) | {"capacity": cap}


def verdict_long_range(found: dict) -> dict:
    th = found.get("thresholds", THRESHOLDS)
    short = th["short_tokens"]
    rows = []
    for label in found.get("precisions", []):
        if label == "full" or label not in runs(found):
            continue
        w = window_deltas(found, label)
        n = needle_deltas(found, label)
        if not w and not n:
            continue
        short_w = [x["delta"] for x in w if x["end"] <= short] or ([w[0]["delta"]] if w else [])
        long_w = w[-1]["delta"] if w else None
        short_n = n[0]["delta"] if n else None
        long_n = n[-1]["delta"] if n else None
        s_nll = sum(short_w) / len(short_w) if short_w else None
        short_pass = (s_nll is None or s_nll <= th["nll_ok_nats"]) and (
            short_n is None or short_n >= -th["needle_ok_nats"]
        )
        long_fail = (long_w is not None and long_w > th["nll_ok_nats"]) or (
            long_n is not None and long_n < -th["needle_ok_nats"]
        )
        rows.append(
            {
                "precision": label,
                "short_nll_delta": s_nll,
                "long_nll_delta": long_w,
                "short_needle_delta": short_n,
                "long_needle_delta": long_n,
                "short_length": n[0]["length"] if n else None,
                "long_length": n[-1]["length"] if n else None,
                "short_pass": short_pass,
                "long_fail": long_fail,
                "holds": short_pass and long_fail,
            }
        )
    if not rows:
        return _verdict(None, "no quantized precision was measured") | {"rows": []}
    holding = [r for r in rows if r["holds"]]
    fine = [r["precision"] for r in rows if r["short_pass"] and not r["long_fail"]]
    broken = [r["precision"] for r in rows if not r["short_pass"]]
    parts = []
    for r in holding:
        parts.append(
            f"{r['precision']}: NLL {_fmt(r['short_nll_delta'])} at <= {short} tokens vs {_fmt(r['long_nll_delta'])} at the end, "
            f"needle log p {_fmt(r['short_needle_delta'], 2)} at {r['short_length']} vs {_fmt(r['long_needle_delta'], 2)} at {r['long_length']}"
        )
    text = (
        ("a short eval passes while long recall degrades for " + "; ".join(parts))
        if holding
        else "no precision passes the short eval and then degrades at length"
    )
    if fine:
        text += f". Pass at both ends: {', '.join(fine)}"
    if broken:
        text += f". Fail already when short: {', '.join(broken)}"
    return _verdict(bool(holding), text) | {"rows": rows}


def _losses(found: dict, label: str) -> dict:
    nd = mean_needle_delta(found, label)
    return {"kl": mean_kl(found, label), "nll": nll_delta(found, label), "needle": None if nd is None else -nd}


def verdict_keys(found: dict) -> dict:
    th = found.get("thresholds", THRESHOLDS)
    noise = {"kl": th["noise_kl_nats"], "nll": th["noise_nll_nats"], "needle": th["noise_needle_nats"]}
    k4v8, k8v4, k8v2 = (_losses(found, p) for p in KEY_VALUE)
    measures = [m for m in noise if k4v8[m] is not None and k8v4[m] is not None]
    if not measures:
        return _verdict(None, "k4v8 and k8v4 were not both measured") | {"losses": {}}
    keys_worse = [m for m in measures if k4v8[m] - k8v4[m] > noise[m]]
    holds = len(keys_worse) >= min(th["key_value_measures_needed"], len(measures))
    names = {"kl": "logit KL", "nll": "NLL delta", "needle": "needle log p loss"}
    text = "4-bit keys (k4v8) vs 4-bit values (k8v4): " + ", ".join(
        f"{names[m]} {_fmt(k4v8[m], 4, False)} vs {_fmt(k8v4[m], 4, False)}" for m in measures
    )
    text += f"; keys are the sensitive half on {len(keys_worse)} of {len(measures)} measures"
    two = [m for m in measures if k8v2[m] is not None]
    if two:
        better = [m for m in two if k8v2[m] < k4v8[m]]
        text += f"; even 2-bit values (k8v2) lose less than 4-bit keys on {len(better)} of {len(two)}"
    return _verdict(holds, text) | {"losses": {"k4v8": k4v8, "k8v4": k8v4, "k8v2": k8v2}}


def verdict_axis(found: dict) -> dict:
    th = found.get("thresholds", THRESHOLDS)
    rows, parts = [], []
    for bits, (chan, tokn) in AXIS.items():
        a, b = nll_delta(found, chan), nll_delta(found, tokn)
        ka, kb = mean_kl(found, chan), mean_kl(found, tokn)
        if a is None or b is None:
            continue
        wins = b - a > th["noise_nll_nats"] or (
            ka is not None and kb is not None and kb - ka > th["noise_kl_nats"] and b >= a
        )
        rows.append(
            {
                "bits": bits,
                "channel": chan,
                "token": tokn,
                "nll_channel": a,
                "nll_token": b,
                "kl_channel": ka,
                "kl_token": kb,
                "channel_wins": wins,
            }
        )
        parts.append(
            f"{bits}-bit: NLL delta {_fmt(a, 4)} per channel vs {_fmt(b, 4)} per token, KL {_fmt(ka, 4, False)} vs {_fmt(kb, 4, False)}"
        )
    if not rows:
        return _verdict(None, "per-channel and per-token keys were not both measured") | {"rows": []}
    holds = all(r["channel_wins"] for r in rows)
    return _verdict(holds, "; ".join(parts)) | {"rows": rows}


def verdict_sinks(found: dict) -> dict:
    th = found.get("thresholds", THRESHOLDS)
    rows = []
    for what, (without, with_) in (("4 sink tokens", SINKS), ("residual 128 vs 32", RESIDUAL)):
        a, b = nll_delta(found, without), nll_delta(found, with_)
        if a is None or b is None:
            continue
        cut = a - b
        matters = cut > th["noise_nll_nats"] and (a <= 0 or cut / a >= th["matters_fraction"])
        rows.append(
            {
                "what": what,
                "without": without,
                "with": with_,
                "nll_without": a,
                "nll_with": b,
                "cut": cut,
                "matters": matters,
            }
        )
    if not rows:
        return _verdict(None, "the sink / residual variants were not measured") | {"rows": []}
    text = "; ".join(
        f"{r['what']}: NLL delta {_fmt(r['nll_without'], 4)} ({r['without']}) -> {_fmt(r['nll_with'], 4)} ({r['with']})"
        + (" matters" if r["matters"] else " within noise / below the threshold")
        for r in rows
    )
    return _verdict(all(r["matters"] for r in rows), text) | {"rows": rows}


def stacking_grid(found: dict) -> list[dict]:
    """Weights x KV cells on the stack text: NLL delta and needle log p delta vs (loaded, full), and the
    sequences per GPU of that combination for the findings' config."""
    try:
        stacking = capacity(found)["stacking"]
    except (ValueError, KeyError):
        stacking = {}
    end = found.get("sizes", {}).get("stack_tokens")
    lengths = {p["length"] for p in found.get("text", {}).get("stack_prompts", [])} or None
    bits = {"loaded": 16, "int8": 8, "int4": 4}
    rows = []
    for w in found.get("sizes", {}).get("weights", WEIGHTS):
        for kv in STACK_KV:
            rows.append(
                {
                    "weights": w,
                    "kv": kv,
                    "nll_delta": nll_delta(found, kv, w, max_end=end),
                    "needle_delta": mean_needle_delta(found, kv, w, lengths),
                    "sequences": stacking.get(kv, {}).get(str(bits[w])),
                    "weight_bits": bits[w],
                }
            )
    return rows


def verdict_stacking(found: dict) -> dict:
    th = found.get("thresholds", THRESHOLDS)
    grid = stacking_grid(found)
    cell = {(r["weights"], r["kv"]): r["nll_delta"] for r in grid}
    ratios = []
    for r in grid:
        if r["weights"] == "loaded" or r["kv"] == "full" or r["nll_delta"] is None:
            continue
        w, kv = cell.get((r["weights"], "full")), cell.get(("loaded", r["kv"]))
        if w is None or kv is None or w + kv < th["stack_min_loss_nats"]:
            continue
        ratios.append(
            {
                "weights": r["weights"],
                "kv": r["kv"],
                "combined": r["nll_delta"],
                "sum": w + kv,
                "ratio": r["nll_delta"] / (w + kv),
            }
        )
    measured = sum(r["nll_delta"] is not None for r in grid if r["weights"] != "loaded")
    if not ratios:
        return _verdict(
            None, f"{measured} weight-quantized cells measured; none with a loss above the noise to judge"
        ) | {"grid": grid, "ratios": []}
    lo, hi = th["stack_ratio_range"]
    inside = [r for r in ratios if lo <= r["ratio"] <= hi]
    worst = max(ratios, key=lambda r: r["combined"])
    text = (
        f"combined loss / (weights alone + KV alone) within [{lo}, {hi}] in {len(inside)} of {len(ratios)} cells; "
        f"worst cell weights {worst['weights']} x KV {worst['kv']}: NLL delta {_fmt(worst['combined'], 4)} "
        f"vs {_fmt(worst['sum'], 4)} summed"
    )
    return _verdict(len(inside) * 2 > len(ratios), text) | {"grid": grid, "ratios": ratios}


def verdict_tradeoff(found: dict, budget: float | None = None, config: dict | None = None) -> dict:
    t = tradeoff(found, budget, config)
    if not t["points"]:
        return _verdict(None, "no precision measured") | {"tradeoff": t}
    pick = t["pick"]
    front = [p["precision"] for p in sorted(t["points"], key=lambda p: p["multiplier"] or 0) if p["pareto"]]
    if pick is None:
        text = f"no precision stays within {t['budget']:g} nats/token"
    else:
        text = (
            f"within {t['budget']:g} nats/token the cheapest is {pick['precision']}: {pick['multiplier']:.2f}x the sequences "
            f"of 16-bit ({pick['sequences']} on {t['config']['gpu']}), NLL delta {_fmt(pick['nll_delta'], 4)}"
        )
    text += f"; Pareto front: {', '.join(front)}"
    return _verdict(pick is not None and pick["precision"] != "full", text) | {"tradeoff": t}


CLAIMS = [
    {
        "id": "capacity",
        "title": "1. Capacity",
        "claim": "A quantized KV cache multiplies the sequences a GPU serves at once, close to the bits ratio.",
        "verdict": verdict_capacity,
        "method": "kvdemo.memory.headroom for the chosen model config, GPU(s) and context (16-bit weights, 10% reserve); "
        "beside it the live cache bytes of the loaded model after storing the whole text, against the layout formula.",
        "page": "app_pages/memory.py",
    },
    {
        "id": "long_range",
        "title": "2. Long-range recall breaks before short chat",
        "claim": "A 500-token eval passes while long recall degrades: quality loss grows with context length.",
        "verdict": verdict_long_range,
        "method": "(a) NLL delta vs full precision in windows at growing positions of held-out prose, each scored "
        "token attending over the stored quantized past; (b) needle answer log-prob delta vs prompt length "
        "(needles near the start, asked after the whole prompt).",
        "page": "app_pages/needle.py",
    },
    {
        "id": "keys",
        "title": "3. Keys are more sensitive than values",
        "claim": "4-bit keys cost more than 4-bit values (k4v8 worse than k8v4), end to end.",
        "verdict": verdict_keys,
        "method": "k4v8 vs k8v4 (and k8v2) on logit KL vs full, NLL delta and needle answer log-prob loss, "
        "averaged over every window and prompt length.",
        "page": "app_pages/drift.py",
    },
    {
        "id": "axis",
        "title": "4. Per-channel keys beat per-token keys",
        "claim": "Keys quantized per channel (KIVI / KVQuant) lose less than keys quantized per token, at 4 and 2 bits.",
        "verdict": verdict_axis,
        "method": "int4 vs int4:ktoken and int2 vs int2:ktoken (per-token groups of 64 channels: slightly more "
        "metadata), NLL delta and logit KL.",
        "page": "app_pages/drift.py",
    },
    {
        "id": "sinks",
        "title": "5. Sinks and the residual window matter at low bits",
        "claim": "At 2 bits, keeping 4 sink tokens and a 128-token residual window in full precision cuts the loss.",
        "verdict": verdict_sinks,
        "method": "int2 vs int2:s4 (sinks) and int2:g32:r32 vs int2:g32 (residual 32 vs 128 tokens; the smallest "
        "window is one group), NLL delta.",
        "page": "app_pages/drift.py",
    },
    {
        "id": "stacking",
        "title": "6. Stacking weight and KV quantization",
        "claim": "The losses of weight quantization and KV quantization add up when both are applied.",
        "verdict": verdict_stacking,
        "method": "weights as loaded, int8 and int4 (optimum-quanto, dequantized) x KV full/int8/int4/int2 on the "
        "first part of the text: NLL delta and needle log-prob vs (as loaded, full); sequences per GPU beside.",
        "page": "app_pages/memory.py",
    },
    {
        "id": "tradeoff",
        "title": "7. The trade-off and a recommendation",
        "claim": "Some quantized precision buys capacity within a small quality budget.",
        "verdict": verdict_tradeoff,
        "method": "every measured precision as (capacity multiplier for the chosen config, mean NLL delta); the "
        "Pareto front; the cheapest precision within the budget that also keeps the needle loss under the threshold.",
        "page": "app_pages/memory.py",
    },
]


def evaluate(found: dict, config: dict | None = None, budget: float | None = None) -> list[dict]:
    """Every claim's section: {"id", "title", "claim", "method", "page", "verdict": {"holds", "word", "text"}, ...}."""
    out = []
    for c in CLAIMS:
        fn = c["verdict"]
        if c["id"] == "capacity":
            v = fn(found, config)
        elif c["id"] == "tradeoff":
            v = fn(found, budget, config)
        else:
            v = fn(found)
        data = {k: v[k] for k in v if k not in ("holds", "word", "text")}
        out.append(
            {k: c[k] for k in ("id", "title", "claim", "method", "page")}
            | {"verdict": {k: v[k] for k in ("holds", "word", "text")}}
            | {"data": _jsonable(data)}
        )
    return out


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return None if not math.isfinite(x) else round(x, 6)
    return x


CAPTION = (
    "{model}: {n} precisions measured on {tokens:,} tokens of held-out prose. A {size} model with a "
    "{ctx:,}-token context is a weak retriever: every number is a difference from its own full precision, on the "
    "same tokens; what fails at full precision says nothing about quantization."
)


def caption(found: dict) -> str:
    info = found.get("model_info", {})
    params = "135M" if found.get("embedded") else "loaded"
    return CAPTION.format(
        model=found.get("model", "?"),
        n=len(runs(found)),
        tokens=found.get("sizes", {}).get("tokens", 0),
        size=params,
        ctx=info.get("max_context", 0),
    )


# --- files -----------------------------------------------------------------------------------------------


def save(found: dict, out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "findings.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_jsonable(found), indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def load(path: str | Path = REPORT_DIR / "findings.json") -> dict | None:
    path = Path(path)
    if path.is_dir():
        path = path / "findings.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))
