"""Batched decode: B sequences of different lengths decoded together, in one cache.

Each sequence keeps its own layer storage (its own length and regions), so its blocks are quantized exactly
as if it ran alone and no padding ever enters the quantization statistics or the attention. What batching
buys is the model's forward pass: the B new tokens run through the weights together (on a GPU, decode at
small batch is bound by reading the weights). Attention then reads each sequence's packed past on its own
(the registered attention function receives a `BatchView` and attends sequence by sequence).

Prefill is per sequence (`runner.prefill` into a cache of its own), as serving engines admit requests;
`BatchedKVCache(caches)` then decodes them together. Works for every format the cache stores.

Sequences of one length can also share one `QuantizedKVCache` ([B, H, T, D] buffers, one set of regions):
`decode_equal` decodes them with `graphs.DecodeSteps`, whose steps are replayed from a CUDA graph where the
backend allows (what a benchmark of batch decode at one context measures).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .cache import BatchView, QuantizedKVCache, QuantizedLayer
from .graphs import DecodeSteps
from .models import LoadedModel
from .runner import stop_token_ids


class BatchedLayer(CacheLayerMixin):
    """One layer of B sequences: each a `QuantizedLayer` with its own length."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, layers: Sequence[QuantizedLayer]):
        super().__init__()
        self.seqs = list(layers)
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the sequences' layers are initialized
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple:
        """key_states, value_states: [B, H, n, D], row b for sequence b. Returns (view, view)."""
        views = [layer.update(key_states[b : b + 1], value_states[b : b + 1])[0] for b, layer in enumerate(self.seqs)]
        view = BatchView(views)
        return view, view

    def get_seq_length(self) -> int:
        return max(layer.length for layer in self.seqs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        for layer in self.seqs:
            layer.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("BatchedKVCache supports greedy / sampling, not beam search")


class BatchedKVCache(Cache):
    """B prefilled `QuantizedKVCache`s (batch 1 each) decoded together; appends go to each sequence's own."""

    def __init__(self, caches: Sequence[QuantizedKVCache]):
        if not caches:
            raise ValueError("a batch needs at least one sequence")
        layers = {len(c.layers) for c in caches}
        if len(layers) != 1:
            raise ValueError(f"the caches hold different numbers of layers: {sorted(layers)}")
        self.caches = list(caches)
        super().__init__(layers=[BatchedLayer([c.layers[i] for c in caches]) for i in range(layers.pop())])

    def lengths(self) -> list[int]:
        return [c.get_seq_length() for c in self.caches]

    def nbytes(self) -> dict:
        out: dict = {}
        for c in self.caches:
            for key, val in c.nbytes().items():
                out[key] = out.get(key, 0) + val
        return out


def _greedy(first: list[int], step, stops: set[int], steps: int) -> dict:
    """Greedy decoding of B sequences together: `first` [B] their first tokens, `step(last) -> next` one forward
    of the batch (token ids in and out, [B] lists), `steps` tokens in all. A sequence that has stopped keeps
    running with the batch (its extra tokens are dropped), so the batch stays B. Returns {"tokens": per
    sequence, up to and including its stop token, "decode_s": the steps' wall time, "steps"}."""
    last = list(first)
    tokens = [[t] for t in last]
    done = [t in stops for t in last]
    start = time.perf_counter()
    for _ in range(steps - 1):
        if all(done):
            break
        last = step(last)
        for b, t in enumerate(last):
            if not done[b]:
                tokens[b].append(t)
                done[b] = t in stops
    return {"tokens": tokens, "decode_s": time.perf_counter() - start, "steps": max(len(t) for t in tokens)}


@torch.no_grad()
def decode_batch(
    lm: LoadedModel, caches: Sequence[QuantizedKVCache], first_logits: Sequence[torch.Tensor], steps: int
) -> dict:
    """Greedy decoding of every sequence together for `steps` tokens (the first from its prefill's logits).

    Returns {"tokens": per sequence, up to and including its stop token, "decode_s", "steps"}. A sequence
    that has stopped keeps running with the batch (its extra tokens are dropped), so the batch stays B.
    """
    batch = BatchedKVCache(caches)

    def step(last: list[int]) -> list[int]:
        ids = torch.tensor([[t] for t in last], device=lm.device)  # [B, 1]
        positions = torch.tensor([[n] for n in batch.lengths()], device=lm.device)  # [B, 1]: each its own
        out = lm.model(input_ids=ids, position_ids=positions, past_key_values=batch, use_cache=True)
        return out.logits[:, -1].float().argmax(-1).tolist()  # [B]

    first = [int(torch.argmax(logits)) for logits in first_logits]
    return _greedy(first, step, stop_token_ids(lm), steps)


@torch.no_grad()
def decode_equal(lm: LoadedModel, cache: QuantizedKVCache, first_logits: torch.Tensor, steps: int) -> dict:
    """Greedy decoding of the B sequences of one length that `cache` holds, for `steps` tokens (the first from
    `first_logits` [B, vocab], the prefill's last row per sequence), one `DecodeSteps.step_batch` per token.

    Returns {"tokens": per sequence, up to and including its stop token, "decode_s", "steps", "graph_steps":
    the DecodeSteps counts (eager, captured, replayed), "graph_blocker": why no step was captured, or None}.
    A sequence that has stopped keeps running with the batch (its extra tokens are dropped).
    """
    decode = DecodeSteps(lm, cache, new_tokens=steps, batch=first_logits.shape[0])
    first = first_logits.argmax(-1).tolist()  # [B]
    run = _greedy(first, lambda last: decode.step_batch(last).argmax(-1).tolist(), stop_token_ids(lm), steps)
    return run | {"graph_steps": dict(decode.counts), "graph_blocker": decode.blocker}
