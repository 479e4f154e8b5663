"""Shared fixtures: the embedded model is loaded once per test session."""

import os
import tempfile

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton reads this when it is first imported (transformers may import it early): the Triton tests need
# its CPU interpreter, and nothing else runs Triton on CPU (the backend is chosen per device).
os.environ.setdefault("TRITON_INTERPRET", "1")
# time hints learn this machine's speed from runs (kvdemo.rates): the tests' runs go to a file of their own,
# not into the user's cache folder
os.environ.setdefault("KVDEMO_RATES_FILE", os.path.join(tempfile.mkdtemp(prefix="kvdemo-rates-"), "rates.json"))


@pytest.fixture(scope="session")
def lm():
    from kvdemo.models import load_model

    return load_model("embedded", device="cpu", dtype="float32")


def caches_equal(a, b) -> bool:
    """Two QuantizedKVCaches hold the same regions and, dequantized, the same keys and values in every layer."""
    import torch

    for la, lb in zip(a.layers, b.layers, strict=True):
        ka, va = la.packed().dequantized()
        kb, vb = lb.packed().dequantized()
        if la.regions != lb.regions or not (torch.equal(ka, kb) and torch.equal(va, vb)):
            return False
    return True
