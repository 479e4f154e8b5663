"""Shared fixtures: the embedded model is loaded once per test session."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton reads this when it is first imported (transformers may import it early): the Triton tests need
# its CPU interpreter, and nothing else runs Triton on CPU (the backend is chosen per device).
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def lm():
    from kvdemo.models import load_model

    return load_model("embedded", device="cpu", dtype="float32")
