"""Memory and concurrency headroom: formulas, reference configs, GPU presets, edge cases, the measured
live cache vs the formula, the production mapping, the figures and the `headroom` CLI."""

import json
import math
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdemo import configs
from kvdemo.cache import QuantizedKVCache
from kvdemo.cli import memory as memory_cli
from kvdemo.configs import GB, MIB, ModelConfig, get_gpu, get_model_config
from kvdemo.layout import Layout, region_bytes
from kvdemo.measured import prefill_updates
from kvdemo.memory import bytes_per_token, fp16_cache_bytes, headroom, kv_heads_per_gpu, max_tokens, sequence_bytes
from kvdemo.precision import PRESETS, parse_precision
from kvdemo.production import ENGINES, LLAMA_CPP_BITS, production_settings
from kvdemo.results.headroom import Headroom

ROOT = Path(__file__).resolve().parent.parent
ALL = ["full", "fp8", "int8", "k8v4", "k4v8", "int4", "int2"]


def _hr(model="llama-3.1-70b", gpu="h100-80gb", specs=ALL, context=100_000, **kw) -> Headroom:
    return headroom(get_model_config(model), get_gpu(gpu, kw.pop("memory_gb", None)), specs, context, **kw)


def _by(plan: Headroom, figure: str) -> dict:
    """precision -> one figure of a plan (the JSON's map of that name)."""
    return {p.label: getattr(p, figure) for p in plan.precisions}


# --- formulas -------------------------------------------------------------------------------------


def test_llama_70b_16bit_is_327680_bytes_per_token():
    cfg = get_model_config("llama-3.1-70b")
    assert bytes_per_token(cfg, "full") == 327_680
    assert fp16_cache_bytes(cfg.layers, cfg.kv_heads, cfg.head_dim, 1) == 327_680
    assert sequence_bytes(cfg, "full", 131_072) == 327_680 * 131_072  # ~43 GB at the full context
    assert bytes_per_token(get_model_config("smollm2-135m"), "full") == 23_040


def test_bytes_per_token_counts_metadata_per_key_and_value():
    cfg = get_model_config("llama-3.1-70b")  # head_dim 128
    per = 80 * 8 * 128
    assert bytes_per_token(cfg, "int4") == per * (4.25 + 4.25) / 8  # 4 bits + 32 bits of scale+zero / 128
    assert bytes_per_token(cfg, "k8v4") == per * (8.25 + 4.25) / 8
    assert bytes_per_token(cfg, "fp8") == per * (8 + 16 / 128) * 2 / 8  # fp8: a scale, no zero point
    assert bytes_per_token(cfg, "int4:g64") == per * (4.5 + 4.5) / 8
    small = get_model_config("smollm2-135m")  # head_dim 64: value groups are min(128, 64) channels
    assert bytes_per_token(small, "int4") == 30 * 3 * 64 * (4.25 + 4.5) / 8
    for spec in ALL:
        assert bytes_per_token(cfg, spec) <= bytes_per_token(cfg, "full")
    assert bytes_per_token(cfg, "full") / bytes_per_token(cfg, "int4") == pytest.approx(16 / 4.25)


def test_sequence_bytes_keeps_sinks_and_residual_at_16_bits():
    cfg = get_model_config("llama-3.1-8b")
    spec = parse_precision("int4:s4")  # sinks 4, residual 128
    window = spec.sinks + spec.residual
    full_tok, q_tok = bytes_per_token(cfg, "full"), bytes_per_token(cfg, spec)
    for t in (1, 50, window):
        assert sequence_bytes(cfg, spec, t) == t * full_tok  # all inside the full-precision window
    for t in (window + 1, 10_000):
        assert sequence_bytes(cfg, spec, t) == pytest.approx(window * full_tok + (t - window) * q_tok)
    assert sequence_bytes(cfg, "full", 10_000) == 10_000 * full_tok


@settings(max_examples=60, deadline=None)
@given(
    spec=st.sampled_from(ALL + ["int4:g64:r64:s4", "int2:g32:r256:s2"]),
    budget=st.floats(min_value=0, max_value=5e11, allow_nan=False),
    heads=st.integers(1, 8),
)
def test_max_tokens_inverts_sequence_bytes(spec, budget, heads):
    cfg = get_model_config("llama-3.1-8b")
    n = max_tokens(cfg, spec, budget, kv_heads=heads)
    assert sequence_bytes(cfg, spec, n, kv_heads=heads) <= budget + 1e-6
    assert sequence_bytes(cfg, spec, n + 1, kv_heads=heads) > budget


def test_reference_configs_cover_the_common_models_and_match_their_architecture():
    names = set(configs.model_configs())
    assert {"llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "mistral-7b-v0.3", "smollm2-135m"} <= names
    for path in sorted((ROOT / "assets" / "model_configs").glob("*.json")):
        d = json.loads(path.read_text())
        assert d["source"].startswith("https://huggingface.co/"), path.name
        assert d["name"] == path.stem
        h, heads, kv, hd = d["hidden_size"], d["attention_heads"], d["kv_heads"], d["head_dim"]
        attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
        if d["name"].startswith("qwen"):  # Qwen2 has q/k/v biases
            attn += heads * hd + 2 * kv * hd
        layer = attn + 3 * h * d["intermediate_size"] + 2 * h
        emb = d["vocab_size"] * h * (1 if d["tie_word_embeddings"] else 2)
        assert d["layers"] * layer + emb + h == d["params"], f"{path.name}: typed params disagree with its shapes"
    assert get_model_config("Mistral-7B") == get_model_config("mistral-7b-v0.3")


def test_gpu_presets_are_driver_mib_printed_as_gb():
    presets = configs.gpu_presets()
    assert set(presets) == {"l4-24gb", "rtx4090-24gb", "a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb"}
    h100 = get_gpu("h100")
    assert h100.memory_bytes == 81_559 * MIB and round(h100.memory_gb, 1) == 85.5
    assert get_gpu("a100-80gb").memory_bytes == 80 * 2**30
    custom = get_gpu("h100-80gb", memory_gb=48)
    assert custom.memory_bytes == 48 * GB and custom.name == "custom-48gb"
    with pytest.raises(ValueError, match="h200-141gb"):
        get_gpu("tpu-v5")
    with pytest.raises(ValueError, match="positive"):
        get_gpu("h100", memory_gb=0)


# --- headroom ---------------------------------------------------------------------------------------


def test_acceptance_int4_gives_at_least_3_5x_the_sequences_of_16_bit():
    out = _hr(specs=["full", "int8", "int4"], gpus=4, context=100_000)
    assert _by(out, "bytes_per_token")["full"] == 327_680
    n16, n4 = _by(out, "max_sequences")["full"], _by(out, "max_sequences")["int4"]
    assert n16 >= 2 and n4 >= 3.5 * n16, (n16, n4)
    assert out.max_sequences_16bit == n16 and _by(out, "sequences_vs_16bit")["int4"] >= 3.5
    # same budget, weights held fixed, for other GPUs and contexts where 16-bit fits two or more
    for gpu, gpus, model in (
        ("h200-141gb", 2, "llama-3.1-70b"),
        ("a100-80gb", 1, "llama-3.1-8b"),
        ("l4", 2, "qwen2.5-7b"),
    ):
        for context in (32_768, 100_000):
            o = _hr(model, gpu, ["full", "int4"], context, gpus=gpus)
            if _by(o, "max_sequences")["full"] >= 2:
                assert _by(o, "max_sequences")["int4"] >= 3.5 * _by(o, "max_sequences")["full"], (
                    gpu,
                    gpus,
                    model,
                    context,
                )


def test_free_memory_formula():
    cfg, gpu = get_model_config("llama-3.1-8b"), get_gpu("a100-80gb")
    out = headroom(cfg, gpu, ["full", "int4"], 32_768, reserve_gb=5)
    free = gpu.memory_bytes - 5 * GB - cfg.params * 2
    assert out.free_kv_bytes == free
    for label in ("full", "int4"):
        seq = sequence_bytes(cfg, label, 32_768)
        assert _by(out, "max_sequences")[label] == math.floor(free / seq)
        assert _by(out, "concurrency")[label] == pytest.approx(free / seq, abs=1e-3)
        assert _by(out, "reason")[label] is None


def test_weights_larger_than_the_gpu_give_zero_sequences_with_a_reason():
    out = _hr("llama-3.1-70b", "l4", ALL, 8192)  # 141 GB of weights on one 24 GB card
    assert not out.fits
    assert set(_by(out, "max_sequences").values()) == {0}
    assert set(_by(out, "max_context_for_users").values()) == {0}
    for label in ALL:
        assert "exceed" in _by(out, "reason")[label] and "no room for a KV cache" in _by(out, "reason")[label]
        split = _by(out, "split")[label]
        assert split.kv == 0 and split.free == 0 and split.over > 0
    # a reserve as large as the GPU leaves nothing either
    big = _hr("llama-3.2-1b", "h100", ["int4"], 4096, reserve_gb=90)
    assert _by(big, "max_sequences")["int4"] == 0 and "exceed" in _by(big, "reason")["int4"]


def test_a_sequence_too_long_for_16_bit_fits_quantized():
    out = _hr("llama-3.1-8b", "l4", ["full", "int4"], 131_072)  # 17 GB of 16-bit KV, ~5.6 GB free
    assert out.fits
    assert _by(out, "max_sequences")["full"] == 0 and "one 131,072-token sequence needs" in _by(out, "reason")["full"]
    assert _by(out, "max_sequences")["int4"] >= 1 and _by(out, "reason")["int4"] is None
    assert out.max_sequences_16bit == 0 and _by(out, "sequences_vs_16bit")["int4"] is None
    # the table's ratio comes from bytes, so it is defined even here: 16-bit bytes of the sequence over int4's
    rows = {r["precision"]: r["x smaller than 16-bit"] for r in out.table_rows()}
    full, int4 = out.by_label()["full"].sequence_bytes, out.by_label()["int4"].sequence_bytes
    assert rows == {"full": "1.00x", "int4": f"{full / int4:.2f}x"} and 3 < full / int4 < 4
    assert "-" not in out.text().split("vs 16-bit")[1].split("\n")[1]


def test_context_beyond_the_model_is_flagged_and_max_context_capped():
    out = _hr("mistral-7b-v0.3", "h200", ["full", "int4"], 65_536)
    assert out.context_exceeds_model
    assert any("exceeds" in w and "32,768" in w for w in out.warnings)
    for label in ("full", "int4"):
        assert _by(out, "max_context_memory")[label] > 32_768
        assert (
            _by(out, "max_context_for_users")[label] == 32_768 and _by(out, "max_context_limited_by")[label] == "model"
        )
    assert not _hr("mistral-7b-v0.3", "h200", ["full"], 32_768).context_exceeds_model


def test_tiny_context_sits_inside_the_full_precision_window():
    out = _hr("llama-3.1-8b", "a100-80gb", ALL, 1)
    assert len(set(_by(out, "sequence_bytes").values())) == 1  # every precision stores 1 token at 16 bits
    assert len(set(_by(out, "max_sequences").values())) == 1
    assert any("full-precision window" in w for w in out.warnings)


def test_multi_gpu_splits_weights_and_kv_heads():
    one = _hr(specs=["full", "int4"], gpus=1, context=32_768)
    two = _hr(specs=["full", "int4"], gpus=2, context=32_768)
    four = _hr(specs=["full", "int4"], gpus=4, context=32_768)
    assert _by(one, "max_sequences")["int4"] == 0 and "over 1 GPU" in _by(one, "reason")["int4"]
    assert 0 < _by(two, "max_sequences")["int4"] < _by(four, "max_sequences")["int4"]
    assert four.kv_heads_per_gpu == 2 and _by(four, "bytes_per_token_per_gpu")["full"] == 327_680 // 4
    assert _by(four, "split")["full"].weights == get_model_config("llama-3.1-70b").params * 2
    assert kv_heads_per_gpu(8, 8) == 1 and kv_heads_per_gpu(8, 16) == 1 and kv_heads_per_gpu(8, 3) == 3
    sixteen = _hr(specs=["full"], gpus=16, context=32_768)
    assert sixteen.kv_heads_per_gpu == 1 and any("replicated" in w for w in sixteen.warnings)
    assert any("evenly" in w for w in _hr(specs=["full"], gpus=3).warnings)


def test_max_context_for_n_users_fits_n_sequences():
    out = _hr("llama-3.1-8b", "h100", ["full", "int8", "int4"], 8192, users=16, memory_gb=40)
    cfg = get_model_config("llama-3.1-8b")
    free = out.free_kv_bytes
    for label, ctx in _by(out, "max_context_memory").items():
        assert 16 * sequence_bytes(cfg, label, ctx) <= free < 16 * sequence_bytes(cfg, label, ctx + 1)
        assert _by(out, "max_context_limited_by")[label] == "memory"
    assert _by(out, "max_context_for_users")["int4"] > 3 * _by(out, "max_context_for_users")["full"]


def test_split_adds_up_and_stacking_orders_weight_bits():
    out = _hr("llama-3.1-70b", "h100", ALL, 32_768, gpus=2)
    for label in ALL:
        s = _by(out, "split")[label]
        assert s.weights + s.kv + s.reserve + s.free - s.over == s.total == out.budget_bytes
        st_ = _by(out, "stacking")[label]
        assert st_["16"] == _by(out, "max_sequences")[label]
        assert st_["4"] >= st_["8"] >= st_["16"]
    eight = _hr("llama-3.1-70b", "h100", ALL, 32_768, gpus=2, weight_bits=8)
    assert _by(eight, "max_sequences") == {k: v["8"] for k, v in _by(out, "stacking").items()}
    assert eight.weights_bytes == out.weights_bytes // 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"weight_bits": 3}, "weight bits"),
        ({"reserve_gb": -1.0}, "reserve"),
        ({"context": 0}, "context"),
        ({"users": 0}, "users"),
        ({"gpus": 0}, "gpus"),
    ],
)
def test_bad_headroom_inputs_are_value_errors(kwargs, match):
    args = {"specs": ["int4"], "context": 4096} | kwargs
    with pytest.raises(ValueError, match=match):
        _hr(**args)


def test_unknown_model_config_lists_the_choices():
    with pytest.raises(ValueError, match="llama-3.1-70b"):
        get_model_config("gpt-5")
    with pytest.raises(ValueError, match="kv_heads"):
        ModelConfig("x", "x", 2, 6, 4, 64, 384, 10, 100, "https://huggingface.co/x")


# --- the live cache vs the formula ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", ["full", "int8", "k8v4", "int4", "int2", "fp8", "int4:ktoken", "int4:g64:r64", "int4:s4", "k8v2:s4:ktoken"]
)
@pytest.mark.parametrize("updates", [[300], [128], [2048, 100], [200, 1, 1, 1, 60, 5, 1, 1]])
def test_layout_formula_matches_the_cache_accounting(spec, updates):
    layers, heads, dim = 2, 3, 64
    cache = QuantizedKVCache(spec, num_layers=layers)
    torch.manual_seed(0)
    for n in updates:
        for layer in cache.layers:
            layer.update(torch.randn(1, heads, n, dim), torch.randn(1, heads, n, dim))  # [B, H, n, D] fp32
    regions = Layout(spec).regions(updates)
    want = region_bytes(regions, layers, heads, dim, spec, full_bits=32)
    got = cache.nbytes()
    assert got["total"] == want["total"]
    assert got["codes"] + got["scales"] == want["quantized"]
    assert got["sinks"] == want["sinks"] and got["residual"] == want["residual"]
    assert cache.layers[0].regions == regions


def test_prefill_updates_follow_the_runner_chunks():
    assert prefill_updates(5000, 2048) == [2048, 2048, 904]
    assert prefill_updates(100) == [100]


@pytest.mark.model
def test_loaded_model_headroom_measures_the_live_cache(lm, monkeypatch):
    """`--model-config loaded`: measured bytes of the embedded model's live cache beside the formulas."""
    import kvdemo.models

    monkeypatch.setattr(kvdemo.models, "load_model", lambda *a, **k: lm)
    args = Namespace(
        model_config="loaded",
        gpu="l4-24gb",
        gpu_memory_gb=None,
        gpus=1,
        context=128,
        users=None,
        weight_bits=16,
        reserve_gb=None,
        precision="full,int4:g64:r64,int4:g64:r64:s4",
        json=True,
    )
    out = memory_cli.run_headroom_cli(args)
    assert out.model_config == "loaded" and out.model["layers"] == 30 and out.model["kv_heads"] == 3
    assert _by(out, "bytes_per_token")["full"] == 23_040  # planning: 16-bit
    rows = {r.precision: r.to_json() for r in out.measured.results}
    assert out.measured.tokens == 128 and out.measured.dtype == "float32"
    for label, r in rows.items():
        assert r["bytes"] == r["formula_bytes"], label  # regions replayed exactly
    # residual empty and no sinks: bytes/token x tokens is the live cache, within 1% (exactly, here)
    assert rows["full"]["error_vs_plain"] == 0  # a full-precision cache is bytes/token x tokens
    assert rows["int4:g64:r64"]["layout"] == {"tokens": 128, "quantized": 128, "sinks": 0, "residual": 0}
    assert abs(rows["int4:g64:r64"]["error_vs_plain"]) < 0.01
    # the plain formula misses the 4 sink tokens kept at fp32 (K and V, 4 bytes each) beside their dummy codes
    sinks = rows["int4:g64:r64:s4"]
    assert sinks["bytes"] - sinks["formula_plain_bytes"] == 4 * 30 * 3 * 64 * 2 * 4
    assert "measured live cache" in memory_cli.format_headroom(out)


# --- production mapping ----------------------------------------------------------------------------


def test_full_precision_is_each_engine_default():
    p = production_settings("full")
    assert p["vllm"]["setting"] == "--kv-cache-dtype auto"
    assert p["sglang"]["setting"] == "--kv-cache-dtype auto"
    assert p["tensorrt-llm"]["setting"] == 'LLM(model, kv_cache_config=KvCacheConfig(dtype="auto"))'
    assert p["llama.cpp"]["setting"] == "-ctk f16 -ctv f16"
    assert all(p[e]["match"] == "exact" and not p[e]["cannot_express"] for e in ENGINES)


def test_vllm_maps_to_its_recent_kv_dtypes_and_fp8_for_older_releases():
    """vLLM 0.25 (CacheDType on main): per-token-head int8/int4, TurboQuant presets below 4 bits and for
    k8v4; every sub-fp8 choice names fp8 as the fallback for releases that lack them."""
    want = {
        "int8": "int8_per_token_head",
        "int4": "int4_per_token_head",
        "k4v8": "int8_per_token_head",
        "k8v4": "turboquant_k8v4",
        "int3": "turboquant_3bit_nc",
        "int2": "turboquant_3bit_nc",
        "nuq4": "turboquant_4bit_nc",
        "nuq3": "turboquant_3bit_nc",
        "int4:hadamard": "turboquant_4bit_nc",
        "nvfp4": "nvfp4",
    }
    for spec, dtype in want.items():
        v = production_settings(spec)["vllm"]
        assert v["setting"] == f"--kv-cache-dtype {dtype}", spec
        assert [a["setting"] for a in v["alternatives"]] == ["--kv-cache-dtype fp8 --calculate-kv-scales"], spec
    assert production_settings("fp8")["vllm"]["setting"] == "--kv-cache-dtype fp8 --calculate-kv-scales"
    assert production_settings("fp8-e5m2")["vllm"]["setting"] == "--kv-cache-dtype fp8_e5m2"
    assert production_settings("nvfp4")["vllm"]["match"] == "exact"
    gaps = " ".join(production_settings("int4:s4")["vllm"]["cannot_express"])
    assert "sink" in gaps and "residual" in gaps and "per-channel" in gaps and "group-wise" in gaps
    assert "sink" not in " ".join(production_settings("int4:s0")["vllm"]["cannot_express"])
    assert "2-bit" in " ".join(production_settings("int2")["vllm"]["cannot_express"])
    assert "one dtype for both" in " ".join(production_settings("k4v8")["vllm"]["cannot_express"])
    assert "2-bit values" in " ".join(production_settings("k8v2")["vllm"]["cannot_express"])
    rot = " ".join(production_settings("int8:hadamard")["vllm"]["cannot_express"])
    assert "Hadamard" in rot and "Hadamard" not in " ".join(
        production_settings("int4:hadamard")["vllm"]["cannot_express"]
    )


def test_every_format_and_option_maps_on_every_engine():
    specs = [*PRESETS, "int4:hadamard", "k8v4:hadamard", "nuq3:o1", "nuq2:o1:s4", "int4:prerope", "int3:ktoken"]
    for name in specs:
        p = production_settings(name, head_dim=64)
        assert p["precision"] == parse_precision(name).label
        for engine in ENGINES:
            e = p[engine]
            assert {"setting", "match", "bits_per_element", "cannot_express", "notes", "alternatives"} <= set(e)
            assert e["setting"] and e["match"] in ("exact", "nearest", "none"), (name, engine)
            assert 2 <= e["bits_per_element"]["key"] <= 16 and 2 <= e["bits_per_element"]["value"] <= 16
            assert all(a["setting"] and a["when"] for a in e["alternatives"])
        k, v = p["llama.cpp"]["setting"].split()[1], p["llama.cpp"]["setting"].split()[3]
        assert k in LLAMA_CPP_BITS and v in LLAMA_CPP_BITS, name
        assert p["sglang"]["setting"].split()[1] in ("auto", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"), name
        assert any(f'dtype="{d}"' in p["tensorrt-llm"]["setting"] for d in ("auto", "fp8", "nvfp4")), name


def test_what_no_engine_can_express_is_listed_for_each():
    """nuq codebooks, dense-and-sparse outliers and pre-RoPE keys: no engine; per-channel keys and the
    residual window: only transformers' QuantizedCache."""
    p = production_settings("nuq3:o1:prerope")
    for engine in ENGINES:
        gaps = " ".join(p[engine]["cannot_express"])
        assert "nuq codebooks" in gaps and "outliers (1%" in gaps and "pre-RoPE" in gaps, engine
        if engine != "transformers":
            assert "per-channel key" in gaps and "residual window" in gaps, engine
    assert "per-channel key quantization" not in " ".join(p["transformers"]["cannot_express"])
    plain = " ".join(g for e in ENGINES for g in production_settings("int4")[e]["cannot_express"])
    assert "nuq" not in plain and "outliers" not in plain and "pre-RoPE" not in plain
    nvfp4 = production_settings("nvfp4")  # per token by construction: no per-channel gap
    assert not any("per-channel" in g for e in ENGINES for g in nvfp4[e]["cannot_express"])


def test_nvfp4_is_exact_where_an_engine_has_it_and_nearest_elsewhere():
    p = production_settings("nvfp4")
    assert p["vllm"]["setting"] == "--kv-cache-dtype nvfp4" and p["vllm"]["match"] == "exact"
    assert p["tensorrt-llm"]["setting"] == 'LLM(model, kv_cache_config=KvCacheConfig(dtype="nvfp4"))'
    assert p["tensorrt-llm"]["match"] == "exact" and "--kv_cache_quant nvfp4" in " ".join(p["tensorrt-llm"]["notes"])
    assert p["vllm"]["bits_per_element"] == {"key": 4.5, "value": 4.5}
    # SGLang's fp4_e2m1 keeps E2M1 codes in blocks of 16 but (per its docs) an 8-bit exponent scale
    assert p["sglang"]["setting"] == "--kv-cache-dtype fp4_e2m1" and p["sglang"]["match"] == "nearest"
    assert "E4M3" in " ".join(p["sglang"]["cannot_express"])
    assert p["llama.cpp"]["setting"] == "-ctk iq4_nl -ctv iq4_nl -fa on"
    assert (
        p["transformers"]["cache_config"]["q_group_size"] == 16 and p["transformers"]["cache_config"]["axis_key"] == 0
    )


def test_three_bit_and_nuq_formats_take_the_nearest_setting():
    assert production_settings("int3")["transformers"]["cache_config"]["backend"] == "hqq"
    assert production_settings("int3")["transformers"]["cache_config"]["nbits"] == 3
    assert production_settings("nuq3")["transformers"]["cache_config"]["nbits"] == 3
    assert production_settings("nuq4")["transformers"]["cache_config"]["backend"] == "quanto"
    three = production_settings("int3")["llama.cpp"]
    assert three["setting"] == "-ctk q4_0 -ctv q4_0 -fa on" and "3-bit KV" in " ".join(three["cannot_express"])
    assert production_settings("nuq4")["llama.cpp"]["setting"] == "-ctk iq4_nl -ctv iq4_nl -fa on"
    assert "3-bit" in " ".join(production_settings("nuq3")["sglang"]["cannot_express"])
    assert "3-bit" in " ".join(production_settings("int3")["tensorrt-llm"]["cannot_express"])


def test_hadamard_maps_to_rotated_settings_or_says_it_cannot():
    p = production_settings("int4:hadamard", head_dim=128)
    assert "built in" in " ".join(p["llama.cpp"]["notes"])  # llama.cpp rotates a quantized cache (PR #21038)
    assert not any("Hadamard" in g for g in p["llama.cpp"]["cannot_express"])
    odd = production_settings("int4:hadamard", head_dim=96)["llama.cpp"]
    assert any("multiple of 64" in g for g in odd["cannot_express"])
    assert "LLAMA_ATTN_ROT_DISABLE=1" in " ".join(production_settings("int4")["llama.cpp"]["notes"])
    for engine in ("sglang", "tensorrt-llm", "transformers"):
        assert any("Hadamard" in g for g in p[engine]["cannot_express"]), engine
    assert production_settings("k8v4:hadamard")["vllm"]["setting"] == "--kv-cache-dtype turboquant_k8v4"


def test_llama_cpp_types_and_flash_attention():
    assert production_settings("k8v4")["llama.cpp"]["setting"] == "-ctk q8_0 -ctv q4_1 -fa on"
    assert "GGML_CUDA_FA_ALL_QUANTS" in " ".join(production_settings("k8v4")["llama.cpp"]["notes"])
    assert production_settings("int8")["llama.cpp"]["setting"] == "-ctk q8_0 -ctv q8_0 -fa on"
    two = production_settings("int2")["llama.cpp"]
    assert "2-bit" in " ".join(two["cannot_express"]) and two["bits_per_element"]["key"] == 4.5
    for spec in ALL:
        e = production_settings(spec)["llama.cpp"]
        k, v = e["setting"].split()[1], e["setting"].split()[3]
        assert k in LLAMA_CPP_BITS and v in LLAMA_CPP_BITS
        assert spec == "full" or "flash attention" in " ".join(e["notes"])


def test_transformers_quantized_cache_settings_are_accepted_by_transformers():
    from transformers import LlamaConfig
    from transformers.cache_utils import QuantizedCache

    config = LlamaConfig(
        num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=64
    )
    t = production_settings("int4", head_dim=64)["transformers"]
    assert t["cache_config"] == {
        "backend": "quanto",
        "nbits": 4,
        "axis_key": -1,
        "axis_value": 0,
        "q_group_size": 64,
        "residual_length": 128,
    }
    assert production_settings("int4:ktoken")["transformers"]["cache_config"]["axis_key"] == 0
    assert production_settings("int2:r256")["transformers"]["cache_config"]["residual_length"] == 256
    for spec in ("int4", "int2", "int4:ktoken", "k4v2", "nvfp4", "nuq4", "nuq2:o1"):
        cfg = dict(production_settings(spec, head_dim=64)["transformers"]["cache_config"])
        QuantizedCache(backend=cfg.pop("backend"), config=config, **cfg)  # raises if transformers rejects it
    assert '"backend": "fp8"' in production_settings("fp8")["transformers"]["setting"]
    QuantizedCache(backend="fp8", config=config)
    eight = production_settings("k8v4")["transformers"]
    assert eight["cache_config"]["backend"] == "hqq" and eight["cache_config"]["nbits"] == 8
    assert "one nbits for both" in " ".join(eight["cannot_express"])


# --- figures -----------------------------------------------------------------------------------------


def test_figures_build_with_the_expected_traces():
    from kvdemo.figures.memory import (
        headroom_concurrency_figure,
        headroom_memory_figure,
        headroom_split_figure,
        headroom_stacking_figure,
    )

    out = _hr(specs=["full", "int8", "int4", "int2"], gpus=4, context=100_000, users=4)
    mem = headroom_memory_figure(out)
    names = [t.name for t in mem.data]
    assert names[:4] == ["full", "int8", "int4", "int2"] and "GPU budget" in names
    budget = next(t for t in mem.data if t.name == "GPU budget")
    assert set(budget.y) == {out.curve.budget_gb}
    full = mem.data[0]
    assert list(full.y) == sorted(full.y) and out.context in full.x
    conc = headroom_concurrency_figure(out)
    assert list(conc.data[0].y) == list(_by(out, "max_sequences").values())
    split = headroom_split_figure(out)
    assert [t.name for t in split.data] == ["weights", "KV cache", "reserve", "unused"]
    for i in range(4):
        assert sum(t.x[i] for t in split.data) == pytest.approx(out.budget_bytes / GB)
    heat = headroom_stacking_figure(out)
    assert [list(r) for r in heat.data[0].z] == [
        [_by(out, "stacking")[k][b] for b in ("16", "8", "4")] for k in _by(out, "stacking")
    ]
    over = headroom_split_figure(_hr(specs=["int4"], gpus=1))
    assert "over budget" in [t.name for t in over.data]


# --- CLI ---------------------------------------------------------------------------------------------


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvdemo", "headroom", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_cli_headroom_json_end_to_end():
    r = _cli(
        "--model-config", "llama-3.1-70b", "--gpu", "h100-80gb", "--gpus", "4", "--context", "100000",
        "--precision", "full,int8,int4", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("model_config", "gpu", "gpus", "context", "bytes_per_token", "max_sequences", "max_context_for_users"):
        assert key in out
    for key in ("split", "reason", "production", "stacking"):
        assert set(out[key]) == {"full", "int8", "int4"}
    assert out["bytes_per_token"] == {"full": 327_680, "int8": 168_960, "int4": 87_040}
    assert out["max_sequences"]["int4"] >= 3.5 * out["max_sequences"]["full"] > 0


def test_cli_headroom_text_and_errors():
    r = _cli("--model-config", "qwen2.5-7b", "--gpu", "l4", "--context", "32768", "--weight-bits", "8")
    assert r.returncode == 0, r.stderr
    assert "Qwen2.5-7B" in r.stdout and "max seqs" in r.stdout and "--kv-cache-dtype" in r.stdout
    bad = _cli("--model-config", "gpt-5")
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown model config") and bad.stdout == ""
    assert len(bad.stderr.strip().splitlines()) == 1
    custom = _cli("--model-config", "llama-3.1-8b", "--gpu-memory-gb", "10", "--context", "4096", "--json")
    out = json.loads(custom.stdout)
    assert out["gpu"] == "custom-10gb" and set(out["max_sequences"].values()) == {0}
