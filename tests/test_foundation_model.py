"""The quantized cache on the embedded model: exactness at full precision, int8 fidelity, bytes."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

from kvdemo.measured import measure_memory
from kvdemo.runner import chat_ids, compare, new_cache, prefill, run_precision

pytestmark = pytest.mark.model

CHAT = [{"role": "user", "content": "Give me three tips for writing clear technical documentation."}]


def _logits(lm, ids, cache, attn):
    lm.model.set_attn_implementation(attn)
    try:
        with torch.no_grad():
            first = lm.model(input_ids=torch.tensor([ids]), past_key_values=cache).logits[0]
            steps = [first]
            nxt = int(first[-1].argmax())
            for _ in range(6):
                out = lm.model(input_ids=torch.tensor([[nxt]]), past_key_values=cache).logits[0]
                steps.append(out)
                nxt = int(out[-1].argmax())
        return torch.cat(steps)
    finally:
        lm.model.set_attn_implementation("kvdemo")


def test_full_precision_logits_equal_dynamic_cache(lm):
    ids = chat_ids(lm, CHAT)
    ref = _logits(lm, ids, DynamicCache(), "sdpa")
    ours = _logits(lm, ids, new_cache(lm, "full"), "kvdemo")
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_int8_greedy_equals_full_precision_for_32_tokens(lm):
    ids = chat_ids(lm, CHAT)
    full = run_precision(lm, ids, "full", 32)
    int8 = run_precision(lm, ids, "int8:g16:r16:s4", 32)  # small blocks: the short prompt really is quantized
    assert int8.cache_bytes["codes"] > 0
    assert int8.tokens == full.tokens


def test_model_generate_accepts_the_cache(lm):
    ids = torch.tensor([chat_ids(lm, CHAT)])
    cache = new_cache(lm, "int4:g16:r16")
    out = lm.model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 12 or int(out[0, -1]) in (lm.tokenizer.eos_token_id,)
    assert cache.get_seq_length() >= ids.shape[1] + 11
    assert cache.nbytes()["codes"] > 0


def test_quantized_cache_is_smaller_and_tracks_the_formula(lm):
    ids = lm.tokenizer("The committee met on Tuesday to discuss the budget. " * 80)["input_ids"][:512]
    out = measure_memory(lm, ids, ["full", "int8", "k8v4", "int4", "int2"])
    ratio = {r.precision: r.ratio_vs_fp16 for r in out.results}
    assert ratio["full"] == pytest.approx(1.0)  # full-precision parts counted at 16 bits: a 16-bit cache itself
    assert ratio["int2"] > ratio["int4"] > ratio["k8v4"] > ratio["int8"] > 1.8
    for r in out.results:
        assert r.bytes_fp16 == 2 * 30 * 3 * 64 * 2 * 512


def test_chunked_prefill_matches_single_prefill(lm):
    ids = lm.tokenizer("Rivers carry sediment to the sea, where deltas form. " * 40)["input_ids"][:300]
    one, chunked = new_cache(lm, "int4"), new_cache(lm, "int4")
    a = prefill(lm, ids, one)
    b = prefill(lm, ids, chunked, chunk=64)  # later chunks attend over the stored (quantized) past
    assert one.nbytes()["total"] == chunked.nbytes()["total"]
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99


def test_compare_reports_divergence_and_speed(lm):
    ids = chat_ids(lm, CHAT)
    out = compare(lm, ids, ["int2:g16:r16"], 16)
    full, int2 = out["results"]
    assert full["precision"] == "full" and int2["precision"] == "int2:g16:r16"
    assert int2["decode_tok_s"] > 0 and int2["decode_speed_vs_full"] > 0
    assert int2["first_divergence"] is None or 0 <= int2["first_divergence"] < 16


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvdemo", *args], capture_output=True, text=True, timeout=600)


def test_cli_info_and_bad_input():
    info = _cli("info", "--json")
    assert info.returncode == 0, info.stderr
    data = json.loads(info.stdout)
    assert (data["layers"], data["kv_heads"], data["head_dim"], data["max_context"]) == (30, 3, 64, 8192)
    bad = _cli("memory", "--precision", "int5", "--tokens", "64")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "presets" in bad.stderr
    missing = _cli("info", "--model", "./no-such-folder")
    assert missing.returncode == 2 and "not found" in missing.stderr


def test_cli_generate_side_by_side(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Name three primary colors.")
    run = _cli("generate", "--precision", "int4", "--prompt-file", str(prompt), "--max-new-tokens", "8", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert [r["precision"] for r in out["results"]] == ["full", "int4"]
    assert all(len(r["tokens"]) >= 1 and (r["decode_tok_s"] > 0 or len(r["tokens"]) == 1) for r in out["results"])


def test_hub_id_without_network_is_one_line_and_a_cached_hub_model_loads_offline(tmp_path):
    """No network: a hub id not in the local cache fails at once with one line (no retry noise); a hub id
    that is in the Hugging Face cache (what a user who downloaded it before has) loads without network."""
    import os
    import shutil

    from kvdemo.models import _converted_default

    env = os.environ | {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}

    def info(model):
        cmd = [sys.executable, "-m", "kvdemo", "info", "--json", "--model", model]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)

    missing = info("HuggingFaceTB/SmolLM2-360M-Instruct")
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.count("\n") == 1 and "no network access" in missing.stderr, missing.stderr
    invalid = info("not a model id!")
    assert invalid.returncode == 2 and "neither an existing folder nor a valid model id" in invalid.stderr

    snapshot = tmp_path / "hub" / "models--kvdemo-test--tiny-smollm2" / "snapshots" / ("0" * 40)
    shutil.copytree(_converted_default(), snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    cached = info("kvdemo-test/tiny-smollm2")
    assert cached.returncode == 0, cached.stderr
    assert json.loads(cached.stdout)["layers"] == 30


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, MemoryError])
def test_cli_out_of_memory_is_one_line_and_exit_2(monkeypatch, capsys, error):
    from kvdemo import cli

    def oom(args):
        raise error("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(cli, "cmd_info", oom)
    assert cli.main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: out of memory") and "lower precision" in err
