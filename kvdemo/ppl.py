"""Perplexity of held-out text with every scored token attending over a stored cache: the benchmark's
protocol, and `python -m kvdemo ppl`.

The text's first `prefix` tokens go through one exact forward (`exact_states`) and are stored into each
cache as the model's own prefill would store them (`store_states`, split at a multiple of the residual
window, so transformers' QuantizedCache quantizes the same tokens kvdemo does). The rest is fed `chunk`
(<= 16, kvdemo's decode path) tokens at a time, so every prediction attends over what the cache stored,
quantized past included (`token_nll`). ppl[N] = exp(mean NLL) over positions [N/2, N); logit KL against
full precision's next-token distributions on every `kl_every`-th scored position.

How far one text's figures carry (`resampled_figures`): a paired block bootstrap. The scored positions are
cut into blocks of `BLOCK` tokens (neighbouring tokens' losses are correlated, so blocks, not tokens, are
the units); `RESAMPLES` seeded draws of as many blocks, with replacement, are taken once and shared by every
cache, and each draw gives every cache's perplexity delta and KL. A figure's 95% interval is the middle 95%
of its draws; a claim comparing two caches is settled when the interval of its difference excludes zero.
The report keeps the per-block means (`blocks`), so the intervals can be recomputed from it. This is the
spread over text like this text, not over other models, other kinds of text or other codebooks.

`run_ablation` scores KVQuant's methods grid in one run and checks the claims about it; `run_kv_split` scores each
precision beside its keys alone and its values alone. The reports are `kvdemo.results.ppl.PplReport`,
`kvdemo.results.ablation.AblationReport` and `kvdemo.results.kv_split.KvSplitReport`; every run counts its
progress in tokens of model work (`work_tokens`) and stops on request between chunks (`kvdemo.progress`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from . import codebooks as books
from . import engines, llamacpp, runner
from .attention import DECODE_MAX_QUERIES
from .models import LoadedModel
from .precision import PrecisionSpec, parse_precision
from .progress import ProgressFn, StopFn, Tracker
from .results import ablation, kv_split
from .results.ablation import AblationReport, AblationRow, Check
from .results.kv_split import KvSplitReport, Split
from .results.ppl import HELD_OUT_NAME, Blocks, PplReport, PplRow


@dataclass(frozen=True)
class Scored:
    """One cache's scores over the held-out text (keyed by N as a string, as the reports are)."""

    ppl: dict[str, float]  # N -> exp(mean NLL) over positions [N/2, N)
    logit_kl: dict[str, float]  # N -> mean KL(full || this) over the kept positions in [N/2, N); 0 for full
    cache: object  # the cache after scoring (it holds every token but the last)
    nll: torch.Tensor  # [len(text) - prefix] NLL at each scored index i (position prefix + i)
    kl: torch.Tensor  # [ceil((len(text) - prefix) / kl_every)] KL(full || this) at scored indices 0, kl_every, ...


@torch.no_grad()
def exact_states(
    lm: LoadedModel, ids: Sequence[int], chunk: int | None = None
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """An exact full-precision forward of `ids` (SDPA, a DynamicCache), in pieces of `chunk` tokens (None:
    one forward): per layer (keys, values) [1, Hkv, n, D], and the last logits [V]."""
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.config)
    ids = list(ids)
    step = chunk or len(ids)
    with runner.attention_impl(lm, "sdpa"):
        for s in range(0, len(ids), step):
            x = torch.tensor([ids[s : s + step]], device=lm.device)  # [1, n]
            logits = lm.model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    return [(layer.keys, layer.values) for layer in cache.layers], logits.float()


def store_states(cache, states: Sequence[tuple[torch.Tensor, torch.Tensor]], residual: int | None = None) -> None:
    """Append exact per-layer states to a fresh cache: what the model's own prefill forward does (each
    attention layer calls `cache.update(k, v, layer_idx)`; a first prefill attends over the exact states).

    With `residual` R the T states go in as two updates, [0, T // R * R) then the rest: transformers'
    QuantizedCache quantizes all of a first update and keeps a later short one exact, as kvdemo's residual
    window keeps the last T mod R tokens, so every contender stores the same tokens quantized.
    """
    for i, (k, v) in enumerate(states):  # k, v: [1, Hkv, T, D]
        split = k.shape[-2] // residual * residual if residual else 0
        if 0 < split < k.shape[-2]:
            cache.update(k[:, :, :split], v[:, :, :split], i)
            cache.update(k[:, :, split:], v[:, :, split:], i)
        else:
            cache.update(k, v, i)


@torch.no_grad()
def token_nll(
    lm: LoadedModel,
    cache,
    first_logits: torch.Tensor,
    ids: Sequence[int],
    start: int,
    chunk: int,
    keep_every: int = 0,
    track: Tracker | None = None,
    what: str = "",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Negative log-likelihood [len(ids) - start] of ids[start:], the cache holding ids[:start], and the
    log-softmax rows [ceil((len(ids) - start) / keep_every), V] of every `keep_every`-th prediction (None
    when 0): what `logit_kl` compares.

    ids[start] is scored by `first_logits`; then ids[start:-1] are fed `chunk` at a time, so each
    prediction attends over what the cache stored. `track` counts the scored tokens (len(ids) - start) as
    they are done, under `what`, and may stop the run before each chunk.
    """
    ids = list(ids)
    first = first_logits.float()[None]  # [1, V]: predicts ids[start]
    nll = [F.cross_entropy(first, torch.tensor([ids[start]], device=first.device))[None]]
    kept = [torch.log_softmax(first, -1)]  # scored index 0
    if track is not None:
        track.advance(what)
    for s in range(start, len(ids) - 1, chunk):
        if track is not None:
            track.check(what)
        piece = ids[s : min(s + chunk, len(ids) - 1)]
        logits = runner.forward(lm, piece, cache).float()  # [n, V]: row i predicts ids[s + 1 + i]
        targets = torch.tensor(ids[s + 1 : s + 1 + len(piece)], device=logits.device)  # [n]
        nll.append(F.cross_entropy(logits, targets, reduction="none"))
        if keep_every:
            rows = [i for i in range(len(piece)) if (s + 1 - start + i) % keep_every == 0]  # scored index % k
            kept.append(torch.log_softmax(logits[rows], -1))
        if track is not None:
            track.advance(what, len(piece))
    return torch.cat(nll), (torch.cat(kept) if keep_every else None)


def logit_kl(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(reference || other) [N] between rows of log-softmax [N, V] (nats)."""
    return (reference.exp() * (reference - other)).sum(-1)


def score_caches(
    lm: LoadedModel,
    caches: Sequence[tuple[str, str, Callable[[], object]]],
    text: Sequence[int],
    prefix: int,
    lengths: Sequence[int],
    chunk: int = DECODE_MAX_QUERIES,
    residual: int | None = None,
    kl_every: int = 4,
    track: Tracker | None = None,
):
    """Score `text` (at least max(lengths) tokens) through each cache of `caches`: (name, attention
    implementation, make_cache), full precision first (the KL reference). Yields (name, Scored), one
    cache at a time, so a caller can measure each cache before the next is built. `track` (the caller's
    run) counts tokens of model work: the exact prefix once, then each cache's scored tokens
    (`work_tokens`)."""
    if not 0 < prefix <= min(lengths) // 2:
        raise ValueError(f"every length must be at least 2 x the exact prefix ({prefix}), got {list(lengths)}")
    if not 1 <= chunk <= DECODE_MAX_QUERIES:
        raise ValueError(f"chunk must be 1..{DECODE_MAX_QUERIES} (kvdemo's decode path), got {chunk}")
    text = list(text)[: max(lengths)]
    if track is not None:
        track.check("perplexity")
    states, first = exact_states(lm, text[:prefix])
    if track is not None:
        track.advance(f"the exact prefix ({prefix:,} tokens)", prefix)
    reference = None  # log-softmax [n_kept, V] of full precision
    for name, impl, make_cache in caches:
        with runner.attention_impl(lm, impl):
            cache = make_cache()
            store_states(cache, states, residual)
            nll, kept = token_nll(lm, cache, first, text, prefix, chunk, kl_every, track, name)
        reference = kept if reference is None else reference
        kl = logit_kl(reference, kept)  # [n_kept]; zeros for the reference itself
        ppl, kls = per_length(nll, kl, prefix, lengths, kl_every)
        yield name, Scored(ppl, kls, cache, nll.double().cpu(), kl.double().cpu())
        del cache, kept


def per_length(
    nll: torch.Tensor, kl: torch.Tensor, prefix: int, lengths: Sequence[int], kl_every: int
) -> tuple[dict[str, float], dict[str, float]]:
    """({"N": perplexity of positions [N/2, N)}, {"N": mean KL over the kept rows of those positions}) from the
    NLL [n] of the positions from `prefix` on and the KL [ceil(n / kl_every)] of every `kl_every`-th of them."""
    ppl, kls = {}, {}
    for n in lengths:
        lo, hi = n // 2 - prefix, n - prefix  # scored indices of positions [N/2, N)
        ppl[str(n)] = math.exp(float(nll[lo:hi].mean()))
        kls[str(n)] = float(kl[-(-lo // kl_every) : -(-hi // kl_every)].mean())
    return ppl, kls


def run_ppl(
    lm: LoadedModel,
    precisions: Sequence[PrecisionSpec | str],
    tokens: int = 4096,
    prefix: int = 1024,
    chunk: int = DECODE_MAX_QUERIES,
    kl_every: int = 4,
    codebooks=None,
    text: tuple[str, Sequence[int]] | None = None,
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
) -> PplReport:
    """Perplexity at `tokens` tokens of a text at each KV precision (full precision always runs first, as the
    reference), with the cache's size after scoring on the 16-bit basis (kvdemo.sizes), the per-block means and
    each row's 95% intervals, and what the nuq precisions' levels were fitted on when there are any.
    text: (name, token ids) to score, default the held-out prose. codebooks: a `codebooks.Codebooks` for the nuq
    precisions (default: the model's own). Progress in tokens of model work (`work_tokens`); each finished
    cache's row comes in `Progress.row` (its delta set, its intervals not yet: they need every cache), and
    `Cancelled` carries those rows. A precision written ``llama.cpp:<type>`` runs llama.cpp on the model's GGUF
    file (kvdemo.llamacpp: its f16 row first, each of its rows read against that one), after kvdemo's rows."""
    from .memory import fp16_cache_bytes
    from .sizes import SERVE_BITS, dtype_name, from_nbytes
    from .texts import held_out_ids

    if tokens > lm.max_context:
        raise ValueError(f"--tokens {tokens} exceeds the model's context ({lm.max_context})")
    ours, theirs = engines.split_contenders(precisions)
    engine_path = llamacpp.gguf_path(lm) if theirs else None  # refused before any work when there is none
    if theirs:
        llamacpp.require()
    text_name, ids = text if text is not None else (HELD_OUT_NAME, held_out_ids(lm, tokens))
    if len(ids) < tokens:
        raise ValueError(f"{text_name} has {len(ids):,} tokens; scoring {tokens:,} needs a longer text or fewer tokens")
    specs = [parse_precision("full")] + [s for s in map(parse_precision, ours) if s.label != "full"]
    caches = [(s.label, "kvdemo", lambda s=s: runner.new_cache(lm, s, codebooks)) for s in specs]
    text = list(ids[:tokens])
    work = work_tokens(tokens, prefix, len(specs) - 1) + tokens * len(theirs)
    track = Tracker(work, "tokens", on_progress, should_stop)
    results: list[PplRow] = []
    lo, hi = tokens // 2 - prefix, tokens - prefix  # scored indices of positions [tokens/2, tokens)
    blocks = Blocks(BLOCK, RESAMPLES, SEED)

    def add_row(name: str, nll: torch.Tensor, kl: torch.Tensor, stored: int, live: int, at16: float) -> None:
        fp16 = fp16_cache_bytes(lm.num_layers, lm.kv_heads, lm.head_dim, stored)
        nll_index = torch.arange(len(nll))
        blocks.nll[name], blocks.nll_counts = block_means(nll, nll_index, lo, hi)
        blocks.logit_kl[name], blocks.kl_counts = block_means(kl, nll_index[::kl_every], lo, hi)
        perplexity = round(math.exp(float(nll[lo:hi].mean())), 4)
        base = next((r.ppl for r in results if r.precision == engines.baseline_of(name)), perplexity)
        row = PplRow(
            precision=name,
            ppl=perplexity,
            delta_vs_full=round(perplexity - base, 4),
            logit_kl=float(f"{float(kl[-(-lo // kl_every) : -(-hi // kl_every)].mean()):.4g}"),
            bits_per_element=round(SERVE_BITS * at16 / fp16, 3),
            ratio_vs_fp16=round(fp16 / at16, 4),
            live_bytes=int(live),
            stored_tokens=stored,
        )
        results.append(row)
        track.advance(f"{name} scored", 0, row=replace(row))

    for name, scored in score_caches(lm, caches, text, prefix, [tokens], chunk, None, kl_every, track):
        size = from_nbytes(scored.cache.nbytes(), lm.dtype)
        add_row(name, scored.nll, scored.kl, scored.cache.get_seq_length(), size.live, size.at16)
    reference = None  # llama.cpp's f16 log-softmax rows: the KL reference of its quantized rows
    for kv in theirs:
        track.check(kv.label)
        engine = llamacpp.Engine(engine_path, kv, n_ctx=tokens)
        try:
            nll, kept = llamacpp.score_text(
                engine, text, prefix, chunk, kl_every, lambda n, what=kv.label: _count(track, what, n)
            )
            stored, live = engine.n_tokens, engine.kv_bytes()
        finally:
            engine.close()
        reference = kept if reference is None else reference
        add_row(kv.label, nll.double(), logit_kl(reference, kept).double(), stored, live, live)
        del kept
    drawn = resampled_figures(blocks)
    for r in results:
        r.delta_vs_full_ci95 = interval95(drawn["delta_vs_full"][r.precision])
        r.logit_kl_ci95 = interval95(drawn["logit_kl"][r.precision])
    basis = (
        f"bits and ratios at 16 bits for the full-precision parts (the model runs in {dtype_name(lm.dtype)}); "
        "live_bytes as stored"
    )
    if theirs:
        basis += "; llama.cpp rows: its cache rows as allocated (ggml blocks), read against llama.cpp's own f16 row"
    return PplReport(
        model=lm.name,
        text=text_name,
        tokens=tokens,
        prefix=prefix,
        chunk=chunk,
        scored_positions=[tokens // 2, tokens],
        basis=basis,
        results=results,
        blocks=blocks,
        codebooks=books.used_by(lm, specs, codebooks),
        engine=llamacpp.engine_note(engine_path) if theirs else None,
    )


def _count(track: Tracker, what: str, n: int) -> None:
    """One llama.cpp call's tokens counted, and a stop requested before the next."""
    track.advance(what, n)
    track.check(what)


HELD_OUT_TOKENS = 16384  # the most the held-out prose gives before it repeats (17.2k SmolLM2 tokens)
MIN_TOKENS = 256  # the shortest text worth scoring: 64 stored exactly, 128 scored (two blocks of BLOCK)


def default_prefix(tokens: int) -> int:
    """The exact prefix for a `tokens`-token run: a quarter, as the CLI's 1024 of 4096."""
    return max(tokens // 4, 1)


def longest_text(lm: LoadedModel, document_tokens: int | None = None) -> int:
    """The most tokens one run scores: the model's context, and the document's length when it scores one
    (the held-out prose: HELD_OUT_TOKENS)."""
    return min(lm.max_context, HELD_OUT_TOKENS if document_tokens is None else document_tokens)


def work_tokens(tokens: int, prefix: int, quantized: int) -> int:
    """Tokens of model work in one run (its progress units, and time hints: kvdemo.progress): the exact prefix
    once, then the rest decoded through full precision and each of `quantized` caches."""
    return prefix + (tokens - prefix) * (quantized + 1)


# --- the methods ablation: KVQuant's table, on this model -------------------------------------------

ABLATION_BITS = (4, 3, 2)
ABLATION_COLUMNS = {  # column -> precision at {b} bits (None: the column has no format at that width)
    "int": "int{b}",
    "+ pre-RoPE": "int{b}:prerope",
    "int + fp16 sink": "int{b}:s1",
    "nuq": "nuq{b}",
    "nuq + 1% outliers": "nuq{b}:o1",
    "nuq + 1% + pre-RoPE": "nuq{b}:o1:prerope",
    "nuq + 1% + fp16 sink": "nuq{b}:o1:s1",
    "nuq + 1% + pre-RoPE + sink": "nuq{b}:o1:prerope:s1",
    "Hadamard + int": "int{b}:hadamard",
    "NVFP4": "nvfp4",
}
# "fp16 sink": the first token of the sequence kept in full precision (`:s1`), KVQuant's attention-sink-aware
# quantization; the "int + fp16 sink" column shows what the sink alone buys uniform codes, and
# "nuq + 1% + pre-RoPE + sink" is KVQuant's whole recipe


def ablation_precisions(bits: Sequence[int] = ABLATION_BITS) -> dict[int, dict[str, str | None]]:
    """{bits: {column: precision or None}}: NVFP4 is a 4-bit format only."""
    return {
        b: {col: (None if col == "NVFP4" and b != 4 else spec.format(b=b)) for col, spec in ABLATION_COLUMNS.items()}
        for b in bits
    }


def run_ablation(
    lm: LoadedModel,
    tokens: int = 4096,
    prefix: int = 1024,
    bits: Sequence[int] = ABLATION_BITS,
    codebooks=None,
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
) -> AblationReport:
    """`run_ppl` over every cell of the ablation grid in one run (full precision first), the grid, and the claims
    checked on this model (`ablation_checks`). The live memory and decode speed parts are the CLI's to add."""
    grid = ablation_precisions(bits)
    names = [p for row in grid.values() for p in row.values() if p is not None]
    scores = run_ppl(lm, names, tokens, prefix, codebooks=codebooks, on_progress=on_progress, should_stop=should_stop)
    by_name = {r.precision: r for r in scores.results}
    rows = [
        AblationRow(b, {col: (None if p is None else by_name[parse_precision(p).label]) for col, p in row.items()})
        for b, row in grid.items()
    ]
    return AblationReport(scores, list(ABLATION_COLUMNS), rows, ablation_checks(scores.results, scores.blocks))


def ablation_checks(rows: Sequence[PplRow], blocks: Blocks | None = None) -> list[Check]:
    """The perplexity claims (`kvdemo.results.ablation.CLAIMS`), measured: each on the perplexity delta and on the
    logit KL, with, when `blocks` (a report's) are given, the 95% interval of the difference (figure minus its
    bar) over resampled text and its verdict: "holds" or "does not hold" when the interval excludes zero, "not
    settled by this text" when it straddles it."""
    if blocks is None:
        return ablation.checks(rows)
    drawn = resampled_figures(blocks)

    def difference(measure: str, precision: str, bar: str, share: float) -> list[float]:
        return interval95(drawn[measure][precision] - share * drawn[measure][bar])

    return ablation.checks(rows, difference)


# --- how far one text's figures carry: a paired block bootstrap (module docstring) ------------------

BLOCK = 64  # scored positions per block
RESAMPLES = 2000
SEED = 0


def block_means(values: torch.Tensor, index: torch.Tensor, lo: int, hi: int, block: int = BLOCK):
    """values [n] at scored indices `index` [n] -> (mean of those in each `block`-index block of [lo, hi), rounded
    to 6 significant digits; how many each block holds): the per-block figures a report keeps."""
    keep = (index >= lo) & (index < hi)
    which = (index[keep] - lo) // block
    n_blocks = -(-(hi - lo) // block)
    sums = torch.zeros(n_blocks, dtype=torch.float64).index_add_(0, which, values[keep].double())
    counts = torch.zeros(n_blocks, dtype=torch.float64).index_add_(
        0, which, torch.ones(len(which), dtype=torch.float64)
    )
    means = sums / counts.clamp(min=1)
    return [float(f"{m:.6g}") for m in means], [int(c) for c in counts]


def resampled_figures(blocks: Blocks) -> dict[str, dict[str, torch.Tensor]]:
    """A report's blocks -> {"delta_vs_full" | "logit_kl": {precision: [RESAMPLES] figure on each draw}}:
    the same seeded draws of blocks (with replacement) for every cache; the delta is against the first cache
    (full precision), a llama.cpp row's against llama.cpp's own f16 row."""
    gen = torch.Generator().manual_seed(blocks.seed)
    n_blocks = len(blocks.nll_counts)
    draws = torch.randint(0, n_blocks, (blocks.resamples, n_blocks), generator=gen)
    times = torch.zeros(blocks.resamples, n_blocks, dtype=torch.float64)
    times.scatter_add_(1, draws, torch.ones(draws.shape, dtype=torch.float64))  # [R, blocks] times each is drawn

    def means(per_block: dict, counts: list) -> dict[str, torch.Tensor]:
        w = times * torch.tensor(counts, dtype=torch.float64)
        total = w.sum(1).clamp(min=1)
        return {name: w @ torch.tensor(m, dtype=torch.float64) / total for name, m in per_block.items()}

    ppl = {name: nll.exp() for name, nll in means(blocks.nll, blocks.nll_counts).items()}
    first = next(iter(ppl.values()))
    return {
        "delta_vs_full": {name: p - ppl.get(engines.baseline_of(name), first) for name, p in ppl.items()},
        "logit_kl": means(blocks.logit_kl, blocks.kl_counts),
    }


def interval95(draws: torch.Tensor) -> list[float]:
    """The middle 95% of `draws` [R]: [2.5th, 97.5th percentile], 4 significant digits."""
    low, high = torch.quantile(draws, torch.tensor([0.025, 0.975], dtype=draws.dtype)).tolist()
    return [float(f"{low:.4g}"), float(f"{high:.4g}")]


# --- keys or values: where a precision's loss sits ---------------------------------------------------

WIDTHS = {"int": (2, 3, 4, 8), "nuq": (2, 3, 4)}  # code widths of each family, for a bit moved between K and V


def kv_split_precisions(spec: PrecisionSpec | str) -> dict[str, str]:
    """role -> precision label: "as given" (`spec` itself), "keys alone" and "values alone" (that part as `spec`
    stores it, the other at int8, near exact), "both at int8" (the floor those two stand on), and, where the
    format's family has the widths, "a bit to the keys" / "a bit to the values": the same mean bits with keys one
    width wider and values one narrower, or the reverse (nuq3 -> knuq4vnuq2 and knuq2vnuq4). Options (outliers,
    sinks, ...) stay. A role that is `spec` itself is left out (k8v4's values alone)."""
    from .formats import code_bits
    from .precision import with_formats

    s = parse_precision(spec)
    if not s.is_quantized:
        raise ValueError("full precision stores no codes: there is no loss to split between keys and values")
    k, v = s.key_format, s.value_format
    roles = {
        "as given": s,
        "keys alone": with_formats(s, k, "int8"),
        "values alone": with_formats(s, "int8", v),
        "both at int8": with_formats(s, "int8", "int8"),
    }
    family = next((f for f in WIDTHS if k.startswith(f) and v.startswith(f)), None)
    if family is not None:
        widths = WIDTHS[family]
        for role, dk in (("a bit to the keys", 1), ("a bit to the values", -1)):
            kb, vb = code_bits(k) + dk, code_bits(v) - dk
            if kb in widths and vb in widths:
                roles[role] = with_formats(s, f"{family}{kb}", f"{family}{vb}")
    return {role: r.label for role, r in roles.items() if role == "as given" or r != s}


def run_kv_split(
    lm: LoadedModel,
    precisions: Sequence[PrecisionSpec | str],
    tokens: int = 4096,
    prefix: int = 1024,
    codebooks=None,
    text: tuple[str, Sequence[int]] | None = None,
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
) -> KvSplitReport:
    """`run_ppl` over each quantized precision's `kv_split_precisions` in one run (full precision runs first as
    always), and per precision its `split_summary`."""
    splits = [kv_split_precisions(p) for p in map(parse_precision, precisions) if p.is_quantized]
    if not splits:
        raise ValueError("--kv-split needs a quantized precision: full precision has no loss to split")
    names = list(dict.fromkeys(label for roles in splits for label in roles.values()))
    scores = run_ppl(
        lm, names, tokens, prefix, codebooks=codebooks, text=text, on_progress=on_progress, should_stop=should_stop
    )
    return KvSplitReport(scores, [split_summary(scores, roles) for roles in splits])


def split_summary(report: PplReport, roles: dict[str, str]) -> Split:
    """One precision's split from a report holding its roles' rows (`kvdemo.results.kv_split.summarize`), each
    role's logit KL against the precision's over the report's resampled blocks."""
    drawn = resampled_figures(report.blocks)["logit_kl"]
    return kv_split.summarize(report.results, roles, lambda label, given: interval95(drawn[label] - drawn[given]))
