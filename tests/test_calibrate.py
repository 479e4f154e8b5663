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
from kvdemo.measured import SCALE_MODEL
from kvdemo.models import random_model

TOKENS = 128  # one key block: the smallest calibration
PER_LAYER = 18  # (K, K pre-RoPE, V) x (plain, .o) x nuq2/3/4


def test_calibrate_to_the_user_folder_is_what_nuq_caches_find(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDEMO_CACHE_DIR", str(tmp_path))
    lm = random_model(SCALE_MODEL, "cpu")
    assert not codebooks.for_model(lm).fitted
    seen = []
    out = calibrate_to_file(lm, tokens=TOKENS, on_progress=lambda p: seen.append(p.fraction))
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
    assert (
        "forward and backward pass" in captured.err and "[100%] 3/3 steps: k-means of layer 2" in captured.err
    )  # progress on stderr
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


def test_held_out_needs_an_out_file_and_a_random_model_no_document(tmp_path, capsys):
    """The held-out text is what `ppl` scores: its fit must not replace the model's codebooks silently; a
    random-weights model has no tokenizer to read a document with."""
    assert main(["calibrate", "--model", "random", "--text", "held-out"]) == 2
    assert "give an output file" in capsys.readouterr().err
    doc = tmp_path / "notes.txt"
    doc.write_text("Some text of the user's own. " * 100)
    assert main(["calibrate", "--model", "random", "--text", str(doc), "--out", str(tmp_path / "b.safetensors")]) == 2
    assert "cannot calibrate on a document" in capsys.readouterr().err


@pytest.mark.model
def test_calibration_texts_of_the_embedded_model(lm, tmp_path):
    """prose (default), held-out (the scored text itself) and a document: each gives its own ids and says which;
    a document too short for the tokens asked, or for one key block, is refused with its length."""
    from kvdemo.calibration import calibration_ids
    from kvdemo.texts import held_out_ids, prose_ids

    ids, label = calibration_ids(lm, 256)
    assert ids == prose_ids(lm, 256) and "Pride and Prejudice" in label
    ids, label = calibration_ids(lm, 256, "held-out")
    assert ids == held_out_ids(lm, 256) and "oracle" in label
    doc = tmp_path / "report.md"
    doc.write_text(("Quarterly figures rose in every region we serve. " * 40).strip())
    ids, label = calibration_ids(lm, None, str(doc))  # no --tokens: the whole document (it is under 2048)
    assert ids == lm.tokenizer(doc.read_text(), add_special_tokens=False)["input_ids"] and len(ids) > 256
    assert label == f"report.md (a document, its first {len(ids):,} tokens)"
    assert calibration_ids(lm, 128, str(doc))[0] == ids[:128]
    with pytest.raises(ValueError, match=f"report.md has {len(ids):,} tokens; 4,000"):
        calibration_ids(lm, 4000, str(doc))
    doc.write_text("Too short.")
    with pytest.raises(ValueError, match="at least 128 tokens"):
        calibration_ids(lm, None, str(doc))
    with pytest.raises(ValueError, match="file not found"):
        calibration_ids(lm, None, str(tmp_path / "missing.pdf"))


@pytest.mark.model
def test_calibrating_on_a_document_fits_other_levels_and_says_so(lm, tmp_path, capsys):
    """The CLI on a document: the file records the text it was fitted on, and the levels are the document's
    (fitted on other text they differ from the prose's fit over as many tokens)."""
    doc = tmp_path / "contract.txt"
    doc.write_text(
        " ".join(f"Clause {i}: the supplier shall deliver {i * 7} units by day {i % 28 + 1}." for i in range(60))
    )
    target = tmp_path / "doc.safetensors"
    rc = main(["calibrate", "--text", str(doc), "--tokens", "256", "--out", str(target), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    out = json.loads(captured.out)
    assert out["tokens"] == 256 and out["text"] == "contract.txt (a document, its first 256 tokens)"
    books = codebooks.Codebooks.load(target)
    assert books.metadata["calibration_text"] == out["text"]
    assert codebooks.describe(books).startswith("fitted on 256 tokens of contract.txt (a document")
    prose = calibrate_to_file(lm, tokens=256, out=tmp_path / "prose.safetensors")
    assert "Pride and Prejudice" in prose["text"]
    other = codebooks.Codebooks.load(tmp_path / "prose.safetensors")
    assert set(other.tensors) == set(books.tensors)
    assert any(not torch.equal(books.tensors[k], other.tensors[k]) for k in books.tensors)
