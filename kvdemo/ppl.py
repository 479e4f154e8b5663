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
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from . import codebooks as books
from . import runner
from .attention import DECODE_MAX_QUERIES
from .models import LoadedModel
from .precision import PrecisionSpec, parse_precision
from .results.ppl import HELD_OUT_NAME, interval_text


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
    on_step: Callable[[float], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Negative log-likelihood [len(ids) - start] of ids[start:], the cache holding ids[:start], and the
    log-softmax rows [ceil((len(ids) - start) / keep_every), V] of every `keep_every`-th prediction (None
    when 0): what `logit_kl` compares.

    ids[start] is scored by `first_logits`; then ids[start:-1] are fed `chunk` at a time, so each
    prediction attends over what the cache stored. on_step: the fraction of them fed so far, after each chunk.
    """
    ids = list(ids)
    first = first_logits.float()[None]  # [1, V]: predicts ids[start]
    nll = [F.cross_entropy(first, torch.tensor([ids[start]], device=first.device))[None]]
    kept = [torch.log_softmax(first, -1)]  # scored index 0
    for s in range(start, len(ids) - 1, chunk):
        piece = ids[s : min(s + chunk, len(ids) - 1)]
        logits = runner.forward(lm, piece, cache).float()  # [n, V]: row i predicts ids[s + 1 + i]
        targets = torch.tensor(ids[s + 1 : s + 1 + len(piece)], device=logits.device)  # [n]
        nll.append(F.cross_entropy(logits, targets, reduction="none"))
        if keep_every:
            rows = [i for i in range(len(piece)) if (s + 1 - start + i) % keep_every == 0]  # scored index % k
            kept.append(torch.log_softmax(logits[rows], -1))
        if on_step is not None:
            on_step((s + len(piece) - start) / (len(ids) - 1 - start))
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
    on_progress: Callable[[str], None] | None = None,
    on_step: Callable[[float], None] | None = None,
):
    """Score `text` (at least max(lengths) tokens) through each cache of `caches`: (name, attention
    implementation, make_cache), full precision first (the KL reference). Yields (name, Scored), one
    cache at a time, so a caller can measure each cache before the next is built. on_step: `token_nll`'s,
    the fraction of the current cache's text fed."""
    if not 0 < prefix <= min(lengths) // 2:
        raise ValueError(f"every length must be at least 2 x the exact prefix ({prefix}), got {list(lengths)}")
    if not 1 <= chunk <= DECODE_MAX_QUERIES:
        raise ValueError(f"chunk must be 1..{DECODE_MAX_QUERIES} (kvdemo's decode path), got {chunk}")
    text = list(text)[: max(lengths)]
    states, first = exact_states(lm, text[:prefix])
    reference = None  # log-softmax [n_kept, V] of full precision
    for name, impl, make_cache in caches:
        if on_progress is not None:
            on_progress(f"perplexity {prefix}..{len(text)}: {name}")
        with runner.attention_impl(lm, impl):
            cache = make_cache()
            store_states(cache, states, residual)
            nll, kept = token_nll(lm, cache, first, text, prefix, chunk, kl_every, on_step)
        reference = kept if reference is None else reference
        kl = logit_kl(reference, kept)  # [n_kept]; zeros for the reference itself
        ppl, kls = {}, {}
        for n in lengths:
            lo, hi = n // 2 - prefix, n - prefix  # scored indices of positions [N/2, N)
            ppl[str(n)] = math.exp(float(nll[lo:hi].mean()))
            kls[str(n)] = float(kl[-(-lo // kl_every) : -(-hi // kl_every)].mean())
        yield name, Scored(ppl, kls, cache, nll.double().cpu(), kl.double().cpu())
        del cache, kept


def run_ppl(
    lm: LoadedModel,
    precisions: Sequence[PrecisionSpec | str],
    tokens: int = 4096,
    prefix: int = 1024,
    chunk: int = DECODE_MAX_QUERIES,
    kl_every: int = 4,
    on_progress: Callable[[str], None] | None = None,
    codebooks=None,
    text: tuple[str, Sequence[int]] | None = None,
    on_row: Callable[[dict], None] | None = None,
    on_step: Callable[[float], None] | None = None,
) -> dict:
    """Perplexity at `tokens` tokens of a text at each KV precision (full precision always runs first, as the
    reference), with the cache's size after scoring on the 16-bit basis (kvdemo.sizes): {"model", "text",
    "tokens", "prefix", "chunk", "basis", "results": [{"precision", "ppl", "delta_vs_full", "logit_kl",
    "bits_per_element", "ratio_vs_fp16", "live_bytes"}]}, and "codebooks" (what the nuq precisions' levels
    were fitted on) when there are any. text: (name, token ids) to score, default the held-out prose.
    codebooks: a `codebooks.Codebooks` for the nuq precisions (default: the model's own). on_row: each
    result row as its cache finishes (its delta set, its intervals not yet: they need every cache). on_step: the
    fraction of the current cache's text fed so far (`token_nll`)."""
    from .memory import fp16_cache_bytes
    from .sizes import SERVE_BITS, dtype_name, from_nbytes
    from .texts import held_out_ids

    if tokens > lm.max_context:
        raise ValueError(f"--tokens {tokens} exceeds the model's context ({lm.max_context})")
    text_name, ids = text if text is not None else (HELD_OUT_NAME, held_out_ids(lm, tokens))
    if len(ids) < tokens:
        raise ValueError(f"{text_name} has {len(ids):,} tokens; scoring {tokens:,} needs a longer text or fewer tokens")
    specs = [parse_precision("full")] + [s for s in map(parse_precision, precisions) if s.label != "full"]
    caches = [(s.label, "kvdemo", lambda s=s: runner.new_cache(lm, s, codebooks)) for s in specs]
    text = list(ids[:tokens])
    results = []
    lo, hi = tokens // 2 - prefix, tokens - prefix  # scored indices of positions [tokens/2, tokens)
    blocks = {"size": BLOCK, "resamples": RESAMPLES, "seed": SEED, "nll": {}, "logit_kl": {}}
    scoring = score_caches(lm, caches, text, prefix, [tokens], chunk, None, kl_every, on_progress, on_step)
    for name, scored in scoring:
        nll_index = torch.arange(len(scored.nll))
        blocks["nll"][name], blocks["nll_counts"] = block_means(scored.nll, nll_index, lo, hi)
        blocks["logit_kl"][name], blocks["kl_counts"] = block_means(scored.kl, nll_index[::kl_every], lo, hi)
        stored = scored.cache.get_seq_length()
        size = from_nbytes(scored.cache.nbytes(), lm.dtype)
        fp16 = fp16_cache_bytes(lm.num_layers, lm.kv_heads, lm.head_dim, stored)
        perplexity = round(scored.ppl[str(tokens)], 4)
        results.append(
            {
                "precision": name,
                "ppl": perplexity,
                "delta_vs_full": round(perplexity - (results[0]["ppl"] if results else perplexity), 4),
                "logit_kl": float(f"{scored.logit_kl[str(tokens)]:.4g}"),
                "bits_per_element": round(SERVE_BITS * size.at16 / fp16, 3),
                "ratio_vs_fp16": round(fp16 / size.at16, 4),
                "live_bytes": int(size.live),
                "stored_tokens": stored,
            }
        )
        if on_row is not None:
            on_row(dict(results[-1]))
    drawn = resampled_figures(blocks)
    for r in results:
        for measure in ("delta_vs_full", "logit_kl"):
            r[f"{measure}_ci95"] = interval95(drawn[measure][r["precision"]])
    out = {
        "model": lm.name,
        "text": text_name,
        "tokens": tokens,
        "prefix": prefix,
        "chunk": chunk,
        "scored_positions": [tokens // 2, tokens],
        "basis": f"bits and ratios at 16 bits for the full-precision parts (the model runs in {dtype_name(lm.dtype)}); "
        "live_bytes as stored",
        "results": results,
        "blocks": blocks,
    }
    described = books.used_by(lm, specs, codebooks)
    if described is not None:
        out["codebooks"] = described
    return out


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
    """Tokens of model work in one run (for time hints, kvdemo.progress): the exact prefix once, then the rest
    decoded through full precision and each of `quantized` caches."""
    return prefix + (tokens - prefix) * (quantized + 1)


def result_rows(results: Sequence[dict]) -> list[dict]:
    """run_ppl's result rows as the app's table shows them (a row without its intervals, as `on_row` gives
    it, shows none)."""
    rows = []
    for r in results:
        rows.append(
            {
                "precision": r["precision"],
                "perplexity": round(r["ppl"], 3),
                "delta vs full": round(r["delta_vs_full"], 3),
                "delta 95%": interval_text(r.get("delta_vs_full_ci95")),
                "logit KL": float(f"{r['logit_kl']:.3g}"),
                "KL 95%": interval_text(r.get("logit_kl_ci95"), ".3g"),
                "bits/element": r["bits_per_element"],
                "x smaller than fp16": round(r["ratio_vs_fp16"], 2),
            }
        )
    return rows


def interval_note(report: dict) -> str:
    """What a run_ppl report's intervals rest on, and where they are too thin to rank anything."""
    lo, hi = report["scored_positions"]
    blocks = len(report["blocks"]["nll_counts"])
    note = (
        f"Perplexity over tokens {lo:,} to {hi:,} ({hi - lo:,} scored, the first {report['prefix']:,} stored exactly). "
        f"95% intervals: {report['blocks']['resamples']:,} resamples of {blocks} blocks of {report['blocks']['size']} "
        "tokens; two precisions differ beyond doubt on a measure only where their intervals of the difference exclude "
        "zero, so overlapping intervals here rank nothing. Bits and ratios count every stored byte (codes, scales, "
        "outliers, sinks, residual window) at 16 bits for full-precision parts."
    )
    if blocks < 8:
        note += f" With {blocks} blocks the intervals are rough: score more tokens for intervals worth reading."
    return note


# --- the methods ablation (issue 17): KVQuant's table, on this model --------------------------------

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


ABLATION_REPORT = Path(__file__).resolve().parent.parent / "assets" / "reports" / "ablation.json"  # the shipped run


def load_ablation(path: Path = ABLATION_REPORT) -> dict | None:
    """The ablation report at `path` (the shipped one by default), or None when there is none."""
    return json.loads(path.read_text()) if path.is_file() else None


def ablation_cell_rows(report: dict) -> list[dict]:
    """One row per cell of an ablation report, for a table: bits, column, precision and its figures."""
    rows = []
    for row in report["rows"]:
        for col in report["columns"]:
            r = row["cells"][col]
            if r is not None:
                rows.append(
                    {
                        "bits": row["bits"],
                        "method": col,
                        "precision": r["precision"],
                        "ppl delta": f"{r['delta_vs_full']:+.3f}",
                        "delta 95%": interval_text(r.get("delta_vs_full_ci95")),
                        "logit KL": f"{r['logit_kl']:.2e}",
                        "bits/element": r["bits_per_element"],
                        "x smaller than fp16": r["ratio_vs_fp16"],
                    }
                )
    return rows


def ablation_cost_rows(report: dict) -> list[dict]:
    """What each measured format costs and buys, from an ablation report's `memory` (the live cache at
    `tokens`, to the byte) and `decode` (tok/s in one interleaved run) parts: one row per precision in
    either, first-seen order; a figure the report did not measure is None."""
    memory = {r["precision"]: r for r in report["memory"]["results"]}
    decode = {r["precision"]: r for r in report["decode"]["results"]}
    base = report["decode"]["results"][0]["precision"]
    rows = []
    for name in dict.fromkeys([*memory, *decode]):
        m, d = memory.get(name), decode.get(name)
        rows.append(
            {
                "precision": name,
                f"x smaller than fp16 @{report['memory']['tokens']}": None
                if m is None
                else round(m["ratio_vs_fp16"], 2),
                "bits/element": None if m is None else m["bits_per_element"],
                f"decode tok/s @{report['decode']['context']}": None if d is None else d["tokens_per_s"],
                f"decode vs {base}": None if d is None else d["vs_first"],
            }
        )
    return rows


def ablation_claim_rows(report: dict) -> list[dict]:
    """One row per claim of an ablation report: the verdict on this text's figures and over resampled text."""
    return [
        {
            "claim": c["claim"],
            "figures": f"{c['values'][0]:.4g} vs {c['values'][1]:.4g}",
            "on this text": "holds" if c["holds"] else "does not hold",
            "over resampled text": c.get("verdict", ""),
            "difference 95%": interval_text(c.get("difference_ci95"), "+.3g"),
        }
        for c in report["checks"]
    ]


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
    on_progress: Callable[[str], None] | None = None,
    codebooks=None,
) -> dict:
    """`run_ppl` over every cell of the ablation grid in one run (full precision first), and the grid:
    {"columns", "rows": [{"bits", "cells": {column: result row or None}}], "checks"} besides run_ppl's keys.
    checks: the issue's claims on this model, each with the figures it compares and whether it holds."""
    grid = ablation_precisions(bits)
    names = [p for row in grid.values() for p in row.values() if p is not None]
    out = run_ppl(lm, names, tokens, prefix, on_progress=on_progress, codebooks=codebooks)
    by_name = {r["precision"]: r for r in out["results"]}
    out["columns"] = list(ABLATION_COLUMNS)
    out["rows"] = [
        {
            "bits": b,
            "cells": {col: (None if p is None else by_name[parse_precision(p).label]) for col, p in row.items()},
        }
        for b, row in grid.items()
    ]
    out["checks"] = ablation_checks(by_name, out["blocks"])
    return out


def ablation_checks(by_name: dict, blocks: dict | None = None) -> list[dict]:
    """The issue's perplexity claims, measured: fewer bits no worse, and 2 bits made usable (as the issue states
    it, with KVQuant's fp16 first token added, against uniform codes given the same sink, and with KVQuant's
    whole recipe: outliers, pre-RoPE keys and the sink). Each claim is checked on the perplexity delta (the
    issue's measure) and again on the logit KL vs full precision over the same positions: the delta of one
    text moves with small changes of the codes, the KL (every kept position's whole next-token distribution)
    less so, so a claim that holds on both is the one to quote.

    blocks (a report's "blocks"): each check also gets the 95% interval of the difference (figure minus its
    bar) over resampled text, and a verdict: "holds" or "does not hold" when the interval excludes zero,
    "not settled by this text" when it straddles it."""
    drawn = None if blocks is None else resampled_figures(blocks)
    checks = []
    claims = (  # (precision, the one it is held to, share of that one's figure it may reach)
        ("nuq3:o1", "int4", 1.0),
        ("nuq3:o1:prerope:s1", "int4", 1.0),
        ("nuq2:o1", "int2", 0.2),
        ("nuq2:o1:s1", "int2", 0.2),
        ("nuq2:o1:s1", "int2:s1", 0.2),
        ("nuq2:o1:prerope:s1", "int2", 0.2),
    )
    for measure, name in (("delta_vs_full", "delta"), ("logit_kl", "logit KL")):
        for nuq, uniform, share in claims:
            a, b = (by_name.get(p, {}).get(measure) for p in (nuq, uniform))
            if a is not None and b is not None:
                bar = f"{uniform} {name}" if share == 1.0 else f"{share:.0%} of {uniform} {name}"
                check = {"claim": f"{nuq} {name} <= {bar}", "values": [a, b], "holds": a <= share * b}
                if drawn is not None and nuq in drawn[measure] and uniform in drawn[measure]:
                    low, high = check["difference_ci95"] = interval95(
                        drawn[measure][nuq] - share * drawn[measure][uniform]
                    )
                    check["verdict"] = (
                        "holds" if high < 0 else "does not hold" if low > 0 else "not settled by this text"
                    )
                checks.append(check)
    return checks


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


def resampled_figures(blocks: dict) -> dict[str, dict[str, torch.Tensor]]:
    """A report's "blocks" -> {"delta_vs_full" | "logit_kl": {precision: [RESAMPLES] figure on each draw}}:
    the same seeded draws of blocks (with replacement) for every cache; the delta is against the first cache
    (full precision)."""
    gen = torch.Generator().manual_seed(blocks["seed"])
    n_blocks = len(blocks["nll_counts"])
    draws = torch.randint(0, n_blocks, (blocks["resamples"], n_blocks), generator=gen)
    times = torch.zeros(blocks["resamples"], n_blocks, dtype=torch.float64)
    times.scatter_add_(1, draws, torch.ones(draws.shape, dtype=torch.float64))  # [R, blocks] times each is drawn

    def means(per_block: dict, counts: list) -> dict[str, torch.Tensor]:
        w = times * torch.tensor(counts, dtype=torch.float64)
        total = w.sum(1).clamp(min=1)
        return {name: w @ torch.tensor(m, dtype=torch.float64) / total for name, m in per_block.items()}

    ppl = {name: nll.exp() for name, nll in means(blocks["nll"], blocks["nll_counts"]).items()}
    full = next(iter(ppl.values()))
    return {
        "delta_vs_full": {name: p - full for name, p in ppl.items()},
        "logit_kl": means(blocks["logit_kl"], blocks["kl_counts"]),
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
    on_progress: Callable[[str], None] | None = None,
    codebooks=None,
    text: tuple[str, Sequence[int]] | None = None,
) -> dict:
    """`run_ppl` over each quantized precision's `kv_split_precisions` in one run (full precision runs first as
    always), and per precision a `split_summary` ("splits")."""
    splits = [kv_split_precisions(p) for p in map(parse_precision, precisions) if p.is_quantized]
    if not splits:
        raise ValueError("--kv-split needs a quantized precision: full precision has no loss to split")
    names = list(dict.fromkeys(label for roles in splits for label in roles.values()))
    out = run_ppl(lm, names, tokens, prefix, on_progress=on_progress, codebooks=codebooks, text=text)
    out["splits"] = [split_summary(out, roles) for roles in splits]
    return out


def split_summary(report: dict, roles: dict[str, str]) -> dict:
    """One precision's split from a report holding its roles' rows: {"precision", "roles", "kl_share": {"keys
    alone", "values alone"}, "comparisons": [role vs "as given" on the logit KL]}."""
    by_name = {r["precision"]: r for r in report["results"]}
    given = roles["as given"]
    kl = by_name[given]["logit_kl"]
    drawn = resampled_figures(report["blocks"])["logit_kl"]
    comparisons = []
    for role, label in roles.items():
        if role != "as given":
            low, high = interval95(drawn[label] - drawn[given])
            verdict = "lower" if high < 0 else "higher" if low > 0 else "not settled by this text"
            comparisons.append(
                {
                    "role": role,
                    "precision": label,
                    "difference": float(f"{by_name[label]['logit_kl'] - kl:.4g}"),
                    "difference_ci95": [low, high],
                    "verdict": verdict,
                }
            )
    share = {  # a part alone over the whole: k8v4's values alone are k8v4 itself (share 1)
        role: round(by_name[roles.get(role, given)]["logit_kl"] / kl, 4) if kl > 0 else None
        for role in ("keys alone", "values alone")
    }
    return {"precision": given, "roles": roles, "kl_share": share, "comparisons": comparisons}


KV_SPLIT_REPORT = ABLATION_REPORT.with_name("ppl_kv_split.json")  # the shipped `ppl --kv-split` run


def load_kv_split(path: Path = KV_SPLIT_REPORT) -> dict | None:
    """The `ppl --kv-split` report at `path` (the shipped one by default), or None when there is none."""
    return json.loads(path.read_text()) if path.is_file() else None


def split_rows(report: dict) -> list[dict]:
    """One row per precision and role of a `ppl --kv-split` report: what it stores, its bits, delta and logit KL,
    and its KL minus the precision's as given with the 95% interval over resampled text and the verdict."""
    by_name = {r["precision"]: r for r in report["results"]}
    rows = []
    for split in report["splits"]:
        against = {c["role"]: c for c in split["comparisons"]}
        for role, label in split["roles"].items():
            r, c = by_name[label], against.get(role)
            rows.append(
                {
                    "precision": split["precision"],
                    "role": role,
                    "stored as": label,
                    "bits/element": f"{r['bits_per_element']:.2f}",
                    "delta vs full": f"{r['delta_vs_full']:+.3f}",
                    "logit KL": f"{r['logit_kl']:.2e}",
                    "KL minus as given, 95%": ""
                    if c is None
                    else f"{c['difference']:+.3g} [{c['difference_ci95'][0]:+.3g}, {c['difference_ci95'][1]:+.3g}]",
                    "verdict": "" if c is None else c["verdict"],
                }
            )
    return rows


def split_sentence(split: dict) -> str:
    """One precision of a `ppl --kv-split` report in words: how much of its logit KL its keys alone and its
    values alone reach, and what moving a bit between them does."""
    share = split["kl_share"]
    if share["keys alone"] is None:
        return f"{split['precision']}: no logit KL to split"
    text = (
        f"{split['precision']}: its keys alone reach {share['keys alone']:.0%} of its logit KL, its values alone "
        f"{share['values alone']:.0%}"
    )
    for c in split["comparisons"]:
        if c["role"].startswith("a bit"):
            low, high = c["difference_ci95"]
            text += f"; {c['role']} ({c['precision']}): KL {c['difference']:+.3g} (95% {low:+.3g}..{high:+.3g}), {c['verdict']}"
    return text
