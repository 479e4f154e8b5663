"""Prefill modes (exact / chunked) on the embedded model."""

import pytest
import torch
from conftest import caches_equal

from kvdemo import runner
from kvdemo.texts import prose_ids

pytestmark = pytest.mark.model


def test_exact_mode_stores_the_full_precision_prefill_and_chunked_compounds(lm):
    ids = prose_ids(lm, 300)
    full = runner.new_cache(lm, "full")
    full_logits = runner.prefill(lm, ids, full, chunk=64)
    exact = runner.new_cache(lm, "int4:g32:r32")
    exact_logits = runner.prefill(lm, ids, exact, chunk=64, mode="exact")
    assert torch.equal(exact_logits, full_logits)  # the prompt itself ran at full precision
    assert caches_equal(exact, runner.transplant(full, runner.new_cache(lm, "int4:g32:r32")))
    chunked = runner.new_cache(lm, "int4:g32:r32")
    chunked_logits = runner.prefill(lm, ids, chunked, chunk=64, mode="chunked")
    assert chunked.layers[0].regions == exact.layers[0].regions
    assert not caches_equal(chunked, exact)  # later chunks attended over quantized earlier ones
    assert float((chunked_logits - full_logits).abs().max()) > 0
    same = runner.new_cache(lm, "full")  # full precision: the two modes are one
    assert torch.equal(runner.prefill(lm, ids, same, chunk=64, mode="exact"), full_logits)
    with pytest.raises(ValueError, match="prefill mode"):
        runner.prefill(lm, ids, runner.new_cache(lm, "int4"), mode="fast")


def test_prefill_takes_a_transformers_cache_too(lm):
    """The bench prefills transformers' own caches through runner.prefill: no kvdemo-only call on them."""
    from transformers import DynamicCache

    ids = prose_ids(lm, 200)
    ours = runner.prefill(lm, ids, runner.new_cache(lm, "full"), chunk=64)
    theirs = DynamicCache()
    assert torch.allclose(runner.prefill(lm, ids, theirs, chunk=64), ours, atol=1e-4)
    assert theirs.get_seq_length() == len(ids)
