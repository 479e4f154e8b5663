"""Shared fixtures: the embedded model is loaded once per test session."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def lm():
    from kvdemo.models import load_model

    return load_model("embedded", device="cpu", dtype="float32")
