"""Attention-score drift: how far a quantized KV cache moves the model's attention from full precision.

The same prompt (a document plus a question) is prefilled into a full-precision cache and into a
quantized one. Then the same query tokens run on both sides, one at a time: the prompt's last token
(the question's end), then the full-precision model's own greedy continuation, teacher-forced into
both caches so both see identical inputs. For every such query, in every layer and query head, the
observer hook of the "kvdemo" attention (kvdemo/attention.py) records the attention distribution
over all keys and the attention output. Each side captures the query its own run computed, so
errors that accumulate through the layers are part of what is measured.

Metrics, per layer and head and then averaged: KL(full || quantized) and Jensen-Shannon divergence
of the attention distributions, overlap of the top-k attended positions (k = 10), cosine similarity
of the attention outputs; the next-token logit KL for every generated token; and the Jensen-Shannon
divergence split by key position (JS is a sum of non-negative per-key terms, so it decomposes
exactly over positions): attention sinks, early / middle / late thirds of the quantized region,
and the recent tokens the cache still holds in full precision (its residual window).

No eager attention is needed: probabilities come from the packed cache itself
(`reference_attention.past_probabilities`), normalized by the log-sum-exp the attention call used.
References: Lin, "Divergence measures based on the Shannon entropy" (JS, bounded by ln 2);
KIVI (arXiv 2402.02750) and KVQuant (arXiv 2401.18079) on key vs value sensitivity;
StreamingLLM (arXiv 2309.17453) on attention sinks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from . import attention
from .cache import CacheView, QuantizedKVCache
from .models import LoadedModel
from .precision import DEFAULT_RESIDUAL, PrecisionSpec, parse_precision
from .progress import ProgressFn, StopFn, Tracker
from .quant import reference_attention
from .results.drift import DriftReport, PrecisionDrift
from .runner import PREFILL_MODES, chat_ids, new_cache, prefill, stop_token_ids

TOP_K = 10
PROFILE_BINS = 32
SINK_TOKENS = 4  # the first tokens, binned apart as attention sinks (StreamingLLM), stored in full or not
EPS = 1e-30  # floor under probabilities inside a log (float64)
QUESTION = "Summarize the text above in a few sentences: who appears in it and what happens?"
POSITION_BINS = ("sinks", "early", "middle", "late", "recent")


# --- metrics on distributions (last dim) --------------------------------------------------------


def _normalized(p: torch.Tensor) -> torch.Tensor:
    p = p.double().clamp_min(0.0)
    return p / p.sum(-1, keepdim=True).clamp_min(EPS)


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats along the last dim, float64; inputs are renormalized; q floored at EPS."""
    p, q = _normalized(p), _normalized(q)
    kl = (torch.xlogy(p, p) - torch.xlogy(p, q.clamp_min(EPS))).sum(-1)
    return kl.clamp_min(0.0)  # >= 0 in exact arithmetic; removes -1e-17 rounding


def js_terms(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per-element Jensen-Shannon terms (nats), float64, each >= 0; their sum along the last dim is JS(p, q).

    term_i = (p_i log(2 p_i / (p_i + q_i)) + q_i log(2 q_i / (p_i + q_i))) / 2.
    """
    p, q = _normalized(p), _normalized(q)
    s = p + q
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (0.5 * (torch.xlogy(p, 2 * p / s) + torch.xlogy(q, 2 * q / s))).clamp_min(0.0)


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence (nats, symmetric, in [0, ln 2]) along the last dim, float64."""
    return js_terms(p, q).sum(-1)


def topk_overlap(p: torch.Tensor, q: torch.Tensor, k: int = TOP_K) -> torch.Tensor:
    """Fraction of the k most-attended positions of p that are also among the k most-attended of q."""
    k = min(k, p.shape[-1])
    if k <= 0:
        raise ValueError("top-k overlap needs k >= 1 and at least one position")
    top_p = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, p.topk(k, dim=-1).indices, True)
    top_q = torch.zeros_like(q, dtype=torch.bool).scatter_(-1, q.topk(k, dim=-1).indices, True)
    return (top_p & top_q).sum(-1).double() / k


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine of the angle between vectors along the last dim, float64 (1 when both are zero)."""
    a, b = a.double(), b.double()
    na, nb = a.norm(dim=-1), b.norm(dim=-1)
    cos = (a * b).sum(-1) / (na * nb).clamp_min(1e-300)
    return torch.where((na == 0) & (nb == 0), torch.ones_like(cos), cos.clamp(-1.0, 1.0))


def logit_kl(full_logits: torch.Tensor, quant_logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(full) || softmax(quant)) along the last dim, from logits, float64."""
    lp = torch.log_softmax(full_logits.double(), -1)
    lq = torch.log_softmax(quant_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)


# --- capture --------------------------------------------------------------------------------------


def attention_probabilities(
    view: CacheView, query: torch.Tensor, scaling: float, mask: torch.Tensor | None, lse: torch.Tensor
) -> torch.Tensor:
    """The whole attention distribution of a decode-path call: query [B, Hq, n, D] over the packed past
    and this call's exact keys (causal), normalized by the call's log-sum-exp lse [B, Hq, n].
    Returns fp32 [B, Hq, n, past + n]."""
    b, hq, n, _ = query.shape
    past = view.past_len
    past_mask = None if mask is None else mask[..., :past]
    probs_past = reference_attention.past_probabilities(
        query, view.packed(), scaling, past_mask, lse
    )  # [B, Hq, n, past]
    grp = hq // view.keys.shape[1]
    keys = view.keys.float().repeat_interleave(grp, dim=1)  # [B, Hq, n, D]: head h reads kv head h // grp
    logits = (query.float() @ keys.transpose(-1, -2)) * scaling  # [B, Hq, n, n]
    allowed = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()  # [n, n]
    if mask is not None:
        allowed = allowed & mask[..., past : past + n]  # [B, 1|Hq, n, n]
    probs_new = torch.exp(logits - lse.float().unsqueeze(-1)).masked_fill(~allowed, 0.0)  # [B, Hq, n, n]
    return torch.cat([probs_past, probs_new], dim=-1)


@dataclass
class StepCapture:
    """One query token's attention in every layer, and the logits it produced."""

    position: int  # index of the query token in the sequence
    probs: torch.Tensor  # fp32 [layers, Hq, position + 1]: distribution over keys [0, position]
    outputs: torch.Tensor  # fp32 [layers, Hq, D]: attention outputs (before o_proj)
    logits: torch.Tensor  # fp32 [V]: next-token logits
    quant_len: int  # keys [sinks, quant_len) were read from quantized codes (0: none)
    coded_keys: int  # how many keys were read from codes (kvdemo.layout.Regions.coded)


class AttentionCapture:
    """Context manager: while active, records the last query's attention distribution and output in
    every layer of `cache` that the "kvdemo" attention runs over its packed past (batch size 1)."""

    def __init__(self, cache: QuantizedKVCache):
        self.cache = cache
        self._probs: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._quant_len = self._coded = 0

    def __enter__(self) -> AttentionCapture:
        attention.observers.append(self._observe)
        return self

    def __exit__(self, *exc) -> None:
        attention.observers.remove(self._observe)

    def _layer_index(self, layer) -> int | None:
        for i, candidate in enumerate(self.cache.layers):
            if candidate is layer:
                return i
        return None

    def _observe(self, view: CacheView, query, scaling, mask, out, lse) -> None:
        idx = self._layer_index(view.layer)
        if idx is None:  # another cache's attention
            return
        if query.shape[0] != 1:
            raise ValueError(f"attention capture takes batch size 1, got {query.shape[0]}")
        probs = attention_probabilities(view, query, scaling, mask, lse)  # [1, Hq, n, past + n]
        self._probs[idx] = probs[0, :, -1].cpu()  # [Hq, keys]
        self._outputs[idx] = out[0, :, -1].float().cpu()  # [Hq, D]
        if idx == 0:
            regions = view.packed().regions
            self._quant_len, self._coded = regions.quantized, regions.coded

    def take(self, position: int, logits: torch.Tensor) -> StepCapture:
        """What the last forward step recorded, stacked over layers; resets the recorder."""
        n_layers = len(self.cache.layers)
        if len(self._probs) != n_layers:
            raise RuntimeError(
                f"captured attention in {len(self._probs)} of {n_layers} layers: the model must run with the "
                "'kvdemo' attention (kvdemo.attention.use_kvdemo_attention) over a QuantizedKVCache"
            )
        probs = torch.stack([self._probs[i] for i in range(n_layers)])  # [layers, Hq, keys]
        outputs = torch.stack([self._outputs[i] for i in range(n_layers)])  # [layers, Hq, D]
        step = StepCapture(position, probs, outputs, logits.float().cpu(), self._quant_len, self._coded)
        self._probs, self._outputs = {}, {}
        return step


@torch.no_grad()
def captured_steps(
    lm: LoadedModel,
    prompt_ids: Sequence[int],
    spec: PrecisionSpec | str,
    steps: int,
    feed: Sequence[int] | None = None,
    prefill_mode: str = "chunked",
) -> Iterator[StepCapture]:
    """Prefill `prompt_ids[:-1]` at `spec`, then run the prompt's last token and up to `steps - 1` more
    tokens one at a time, yielding each query's `StepCapture`.

    feed: the tokens to run after the prompt (teacher forcing); None = this run's own greedy tokens.
    prefill_mode: how the prompt is stored (runner.PREFILL_MODES).
    Stops early at a stop token (it is predicted, never fed) or when `feed` runs out.
    """
    ids = list(prompt_ids)
    if len(ids) < 2:
        raise ValueError("drift needs a prompt of at least 2 tokens")
    cache = new_cache(lm, spec)
    prefill(lm, ids[:-1], cache, mode=prefill_mode)
    stops = stop_token_ids(lm)
    token, position = ids[-1], len(ids) - 1
    with AttentionCapture(cache) as rec:
        for i in range(steps):
            logits = prefill(lm, [token], cache)  # [V]
            yield rec.take(position, logits)
            if i + 1 == steps:
                break
            if feed is None:
                token = int(torch.argmax(logits))
                if token in stops:
                    break
            elif i < len(feed):
                token = int(feed[i])
            else:
                break
            position += 1


@dataclass
class Reference:
    """The full-precision side: every captured step, and the greedy tokens it generated."""

    steps: list[StepCapture]
    tokens: list[int]  # argmax of each step's logits (the generated tokens; all but the last are fed)
    seconds: float


def capture_reference(lm: LoadedModel, prompt_ids: Sequence[int], new_tokens: int) -> Reference:
    """Run the prompt at full precision and greedily continue it, capturing `new_tokens` query steps."""
    t0 = time.perf_counter()
    steps = list(captured_steps(lm, prompt_ids, "full", new_tokens))
    tokens = [int(torch.argmax(s.logits)) for s in steps]
    return Reference(steps, tokens, time.perf_counter() - t0)


# --- drift of one precision against the reference -------------------------------------------------


def position_edges(keys: int, sinks: int, quant_len: int) -> list[int]:
    """Edges of the named key-position bins (sinks, early, middle, late, recent) for `keys` keys.

    sinks = [0, sinks); recent = [quant_len, keys), the tokens the quantized cache holds in full
    precision (when nothing is quantized, the last DEFAULT_RESIDUAL keys); early / middle / late
    split what lies between into thirds.
    """
    s = min(sinks, keys)
    q = quant_len if quant_len > s else max(s, keys - DEFAULT_RESIDUAL)
    q = min(q, keys)
    span = q - s
    return [0, s, s + span // 3, s + (2 * span) // 3, q, keys]


def profile_edges(max_keys: int, sinks: int, bins: int = PROFILE_BINS) -> list[int]:
    """Edges of the fine position profile: the sink tokens as one bin, then `bins` equal bins up to max_keys."""
    s = min(sinks, max_keys)
    edges = [0] + ([s] if s else [])
    edges += [s + round(j * (max_keys - s) / bins) for j in range(1, bins + 1)]
    return sorted(set(edges))


class _BinAccumulator:
    """Sums, over steps, of per-bin JS contribution, attention mass and |p - q| (means over layers x heads)."""

    def __init__(self, n_bins: int):
        self.js = torch.zeros(n_bins, dtype=torch.float64)
        self.mass_full = torch.zeros(n_bins, dtype=torch.float64)
        self.mass_quant = torch.zeros(n_bins, dtype=torch.float64)
        self.abs_diff = torch.zeros(n_bins, dtype=torch.float64)
        self.keys = torch.zeros(n_bins, dtype=torch.float64)
        self.steps = 0

    def add(self, edges: Sequence[int], terms: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
        """terms, p, q: float64 [keys], already averaged over layers and heads."""
        keys = terms.shape[-1]
        bounds = [min(e, keys) for e in edges]
        for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            if hi > lo:
                self.js[b] += terms[lo:hi].sum()
                self.mass_full[b] += p[lo:hi].sum()
                self.mass_quant[b] += q[lo:hi].sum()
                self.abs_diff[b] += (p[lo:hi] - q[lo:hi]).abs().sum()
                self.keys[b] += hi - lo
        self.steps += 1

    def rows(self, edges: Sequence[int], names: Sequence[str] | None = None) -> list[dict]:
        n = max(self.steps, 1)
        total = float(self.js.sum()) / n
        out = []
        for b, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
            js = float(self.js[b]) / n
            row = {
                "start": int(lo),
                "end": int(hi),
                "js": js,
                "js_share": js / total if total > 0 else 0.0,
                "js_per_key": float(self.js[b] / self.keys[b]) if self.keys[b] else 0.0,
                "mass_full": float(self.mass_full[b]) / n,
                "mass_quant": float(self.mass_quant[b]) / n,
                "abs_diff": float(self.abs_diff[b]) / n,
            }
            out.append(({"bin": names[b]} if names else {}) | row)
        return out


def measure_drift(
    lm: LoadedModel,
    prompt_ids: Sequence[int],
    spec: PrecisionSpec | str,
    ref: Reference,
    top_k: int = TOP_K,
    prefill_mode: str = "chunked",
) -> PrecisionDrift:
    """Run `spec` on the reference's prompt and teacher-forced tokens; compare every step to `ref`."""
    spec = parse_precision(spec)
    t0 = time.perf_counter()
    sinks = max(spec.sinks, SINK_TOKENS)
    max_keys = ref.steps[-1].position + 1
    prof_edges = profile_edges(max_keys, sinks)
    named, profile = _BinAccumulator(len(POSITION_BINS)), _BinAccumulator(len(prof_edges) - 1)
    sums = {name: None for name in ("js", "kl", "topk", "cos")}
    per_query, logit_kls, agree, first_edges = [], [], 0, None
    feed = ref.tokens[:-1]
    for i, got in enumerate(captured_steps(lm, prompt_ids, spec, len(ref.steps), feed, prefill_mode)):
        want = ref.steps[i]
        p, q = want.probs.double(), got.probs.double()  # [layers, Hq, keys]
        terms = js_terms(p, q)  # [layers, Hq, keys]
        step = {
            "js": terms.sum(-1),  # [layers, Hq]
            "kl": kl_divergence(p, q),
            "topk": topk_overlap(p, q, top_k),
            "cos": cosine_similarity(want.outputs, got.outputs),
        }
        for name, val in step.items():
            sums[name] = val if sums[name] is None else sums[name] + val
        edges = position_edges(p.shape[-1], sinks, got.quant_len)
        first_edges = first_edges or edges
        named.add(edges, terms.mean((0, 1)), p.mean((0, 1)), q.mean((0, 1)))
        profile.add(prof_edges, terms.mean((0, 1)), p.mean((0, 1)), q.mean((0, 1)))
        kl_tok = float(logit_kl(want.logits, got.logits))
        logit_kls.append(kl_tok)
        agree += int(torch.argmax(want.logits) == torch.argmax(got.logits))
        per_query.append(
            {"step": i, "position": want.position, "logit_kl": kl_tok}
            | {name: float(val.mean()) for name, val in step.items()}
        )
    n = len(per_query)
    if n != len(ref.steps):
        raise RuntimeError(f"{spec.label}: captured {n} of {len(ref.steps)} reference steps")
    mean = {name: val / n for name, val in sums.items()}  # each [layers, Hq]
    per_layer = [
        {
            "layer": layer,
            "js": float(mean["js"][layer].mean()),
            "kl": float(mean["kl"][layer].mean()),
            "topk_overlap": float(mean["topk"][layer].mean()),
            "output_cosine": float(mean["cos"][layer].mean()),
            "js_per_head": [float(x) for x in mean["js"][layer]],
        }
        for layer in range(mean["js"].shape[0])
    ]
    by_position = named.rows(first_edges, POSITION_BINS)
    bits = spec.bits_per_element(lm.head_dim, full_bits=8 * lm.dtype.itemsize)["mean"]
    return PrecisionDrift(
        precision=spec.label,
        spec=spec.to_dict(),
        bits_per_element=round(bits, 4),
        mean_js=float(mean["js"].mean()),
        mean_kl=float(mean["kl"].mean()),
        topk_overlap=float(mean["topk"].mean()),
        output_cosine=float(mean["cos"].mean()),
        top1_agreement=agree / n,
        coded_keys=got.coded_keys,
        per_layer=per_layer,
        by_position=by_position,
        position_profile=profile.rows(prof_edges),
        logit_kl=logit_kls,
        per_query=per_query,
        seconds=time.perf_counter() - t0,
    )


# --- prompts and the whole run --------------------------------------------------------------------


def document_prompt(lm: LoadedModel, document: str, question: str = QUESTION) -> list[int]:
    """Chat-template ids of one user turn: the document, a blank line, the question."""
    if not document.strip():
        raise ValueError("the document is empty: give some text")
    return chat_ids(lm, [{"role": "user", "content": f"{document.strip()}\n\n{question}"}])


QUESTION_TOKENS = 32  # the question and chat template around a document (a rough count, for time hints)


def work_tokens(prompt_tokens: int, new_tokens: int, quantized: int, reference: bool = True) -> int:
    """Tokens of model work of a drift run, its progress unit and its time hint's (task "drift"): the prompt and
    the query steps, once per quantized precision and once for the full-precision reference."""
    return (prompt_tokens + new_tokens) * (quantized + int(reference))


def planned_work_tokens(document_tokens: int, new_tokens: int, quantized: int) -> int:
    """`work_tokens` before the prompt is built: a document of `document_tokens` plus `QUESTION_TOKENS`."""
    return work_tokens(document_tokens + QUESTION_TOKENS, new_tokens, quantized)


def run_drift(
    lm: LoadedModel,
    prompt_ids: Sequence[int],
    specs: Sequence[PrecisionSpec | str],
    new_tokens: int = 16,
    top_k: int = TOP_K,
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
    reference: Reference | None = None,
    prefill_mode: str = "chunked",
) -> DriftReport:
    """Full precision once, then each spec against it on the same prompt and teacher-forced tokens.

    reference: a `capture_reference(lm, prompt_ids, new_tokens)` to reuse (e.g. when the page adds a precision).
    prefill_mode: how each quantized cache stores the prompt (runner.PREFILL_MODES; the reference is exact).
    on_progress: a `Progress` in tokens of work (`work_tokens`) after the reference and after each precision
    (its `PrecisionDrift` in `Progress.row`); should_stop: polled before each, raises `Cancelled` with the
    precisions finished.
    """
    if prefill_mode not in PREFILL_MODES:
        raise ValueError(f"unknown prefill mode {prefill_mode!r}; allowed: {', '.join(PREFILL_MODES)}")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    if len(prompt_ids) + new_tokens > lm.max_context:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + {new_tokens} new tokens exceed the model's context ({lm.max_context})"
        )
    specs = [parse_precision(s) for s in specs]
    per_run = len(prompt_ids) + new_tokens
    total = work_tokens(len(prompt_ids), new_tokens, len(specs), reference is None)
    track = Tracker(total, "tokens", on_progress, should_stop)
    ref = reference
    if ref is None:
        track.check("the full-precision reference")
        track.report("full precision (the reference)")
        ref = capture_reference(lm, prompt_ids, new_tokens)
        track.advance("full precision (the reference)", per_run)
    elif ref.steps[0].position != len(prompt_ids) - 1:
        raise ValueError("the reference was captured on a different prompt")
    results = []
    for spec in specs:
        track.check(spec.label)
        track.report(spec.label)
        results.append(measure_drift(lm, prompt_ids, spec, ref, top_k, prefill_mode))
        track.advance(spec.label, per_run, results[-1])
    return DriftReport(
        model=lm.name,
        prompt_tokens=len(prompt_ids),
        new_tokens=len(ref.steps),
        top_k=top_k,
        prefill_mode=prefill_mode,
        generated=lm.tokenizer.decode(ref.tokens, skip_special_tokens=True),
        reference_seconds=ref.seconds,
        results=results,
    )


def document_text(lm: LoadedModel, tokens: int, document: str = "") -> tuple[str, int]:
    """(text, its token count): the first `tokens` tokens of the bundled prose, or of the file `document`
    (cut at a paragraph / sentence boundary within the budget)."""
    if document:
        from .documents import extract_file, fit_to_context

        text, n, _ = fit_to_context(extract_file(Path(document)).text, lm.tokenizer, tokens)
        if not text.strip():
            raise ValueError(f"{document} has no text to use as the document")
        return text, n
    from .texts import prose_ids

    return lm.tokenizer.decode(prose_ids(lm, tokens)), tokens
