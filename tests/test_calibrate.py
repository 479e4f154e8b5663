"""`python -m kvdemo calibrate` and `kvdemo.calibration` on a tiny random-weights model (2 layers,
head_dim 64): the file lands where nuq caches look first, with every codebook, and the model keeps no
weight gradients; mistakes print one line and exit 2."""

from __future__ import annotations

import json

import pytest
import torch

from kvdemo import codebooks
from kvdemo.calibration import calibrate_to_file, default_path
from kvdemo.cli import main
from kvdemo.models import random_model
from kvdemo.scale import SCALE_MODEL

TOKENS = 128  # one key block: the smallest calibration
PER_LAYER = 18  # (K, K pre-RoPE, V) x (plain, .o) x nuq2/3/4


def test_calibrate_to_the_user_folder_is_what_nuq_caches_find(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDEMO_CACHE_DIR", str(tmp_path))
    lm = random_model(SCALE_MODEL, "cpu")
    assert not codebooks.for_model(lm).fitted
    seen = []
    out = calibrate_to_file(lm, tokens=TOKENS, on_progress=lambda what, frac: seen.append(frac))
    path = tmp_path / "codebooks" / "random_small-llama.safetensors"
    assert out["path"] == str(path) == str(default_path(lm)) and path.is_file()
    assert out["tensors"] == 2 * PER_LAYER and out["bytes"] == path.stat().st_size and out["tokens"] == TOKENS
    assert seen[0] == 0.0 and seen[-1] == 1.0
    books = codebooks.for_model(lm)  # the runner's lookup: the user's file, found by the model's source
    assert books.fitted and books.metadata["layers"] == "2" and books.metadata["calibration_tokens"] == str(TOKENS)
    assert codebooks.find(lm.source) == path
    params = list(lm.model.parameters())
    assert all(p.grad is None for p in params) and all(p.requires_grad for p in params)


def test_cli_writes_the_file_and_reports_it(tmp_path, capsys):
    target = tmp_path / "books.safetensors"
    rc = main(
        ["calibrate", "--model", "random", "--device", "cpu", "--tokens", str(TOKENS), "--out", str(target), "--json"]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    out = json.loads(captured.out)
    assert out["path"] == str(target) and target.stat().st_size == out["bytes"] > 0
    assert out["tensors"] == 2 * PER_LAYER and out["seconds"] > 0 and out["layers"] == 2
    assert "forward and backward pass" in captured.err and "[100%] done" in captured.err  # progress on stderr
    books = codebooks.Codebooks.load(target)
    assert len(books.tensors) == 2 * PER_LAYER
    for name, levels in books.tensors.items():
        assert levels.dtype == torch.float16 and (levels[1:] > levels[:-1]).all(), name


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tokens", "64"], "at least 128 tokens"),
        (["--out", "{tmp}"], "is a folder"),
        (["--device", "tpu"], "unknown device"),
    ],
)
def test_cli_mistakes_print_one_line_and_exit_2(tmp_path, capsys, argv, message):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["calibrate", "--model", "random", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
