"""Batched decode: sequences of different lengths decoded together give each its own greedy tokens."""

import pytest
import torch

from kvdemo import runner
from kvdemo.batch import BatchedKVCache, decode_batch, decode_equal
from kvdemo.cache import QuantizedKVCache
from kvdemo.texts import prose_ids

pytestmark = pytest.mark.model


@pytest.mark.parametrize("spec", ["int8:g16:r16", "int4:g16:r16:s2"])
def test_four_sequences_of_different_lengths_decode_as_alone(lm, spec):
    text = prose_ids(lm, 300)
    prompts = [text[:50], text[100:190], text[:130], text[120:290]]  # 50, 90, 130, 170 tokens
    steps = 20  # crosses a flush (every 16 tokens) in every sequence
    alone = [runner.run_precision(lm, ids, spec, steps).tokens for ids in prompts]
    caches = [runner.new_cache(lm, spec) for _ in prompts]
    first = [runner.prefill(lm, ids, cache) for ids, cache in zip(prompts, caches, strict=True)]
    out = decode_batch(lm, caches, first, steps)
    assert out["tokens"] == alone
    assert [c.get_seq_length() for c in caches] == [len(p) + steps - 1 for p in prompts]  # the last is not fed
    assert all(c.layers[0].regions.has_codes for c in caches)


def test_sequences_of_one_length_in_one_cache_decode_as_alone(lm):
    """decode_equal: two prompts of one length prefilled together into one cache ([2, H, T, D] buffers) give each
    its own greedy tokens, across a flush."""
    spec, steps = "int4:g16:r16", 20
    text = prose_ids(lm, 200)
    prompts = [text[:60], text[100:160]]
    alone = [runner.run_precision(lm, ids, spec, steps).tokens for ids in prompts]
    cache = runner.new_cache(lm, spec)
    with torch.no_grad():
        out = lm.model(input_ids=torch.tensor(prompts), past_key_values=cache, use_cache=True, logits_to_keep=1)
    got = decode_equal(lm, cache, out.logits[:, -1].float(), steps)
    assert got["tokens"] == alone and got["steps"] == steps
    assert cache.get_seq_length() == 60 + steps - 1 and cache.layers[0].regions.has_codes
    assert got["graph_blocker"].startswith("CUDA graphs need a CUDA device")  # eager steps on the CPU


def test_a_batch_needs_caches_of_one_model():
    with pytest.raises(ValueError, match="at least one"):
        BatchedKVCache([])
    a, b = QuantizedKVCache("int4", num_layers=2), QuantizedKVCache("int4", num_layers=3)
    with pytest.raises(ValueError, match="different numbers of layers"):
        BatchedKVCache([a, b])
