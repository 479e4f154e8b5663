"""Model families, for real: tiny random-weight models built from configs (no hub), run through kvdemo.

Each supported family: `full` logits equal the model's own eager forward (prefill rows and every decode
step, fp32), and `int8` greedy output equals `full` for 32 tokens with quantized blocks in the cache.
Sliding-window layers attend only inside their window (a token outside it has no influence), Gemma-2's
logit softcap changes the numbers and is applied, gpt-oss's sinks are applied. A model whose value
head_dim differs from its key head_dim is refused at load with one line. docs/models.md, "Supported
model families", lists the same rows.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kvdemo import attention, models, runner
from kvdemo.cache import QuantizedKVCache
from kvdemo.models import LoadedModel, ModelLoadError

VOCAB, PROMPT, NEW = 32, 48, 32
SPEC = "int8:g16:r16"  # 16-token blocks: a 48-token prompt leaves 48 positions in codes
WINDOW = 8
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=None,  # greedy runs all 32 tokens
    initializer_range=0.2,  # larger than the default: attention scores of a few units, wider greedy margins
    tie_word_embeddings=False,
)
# Random weights leave near-ties in greedy decoding: over 32 steps the smallest top-2 logit gap is 0.01-0.08,
# the size of int8's logit error (0.01-0.1). Each family's prompt seed is one whose full-precision path has
# no near-tie at that error (seeds scanned 1-8; most pass for every family); int8 must then give exactly
# the same 32 tokens, and its logits must stay within INT8_LOGIT_ERROR of full precision at every step.
PROMPT_SEED = {"llama": 3, "mistral": 6, "qwen2": 8, "qwen3": 8, "phi3": 3, "gemma2": 1, "gemma3": 3, "gpt_oss": 7}
INT8_LOGIT_ERROR = 0.2
# family -> (model_type, config overrides): what makes each one special
FAMILIES = {
    "llama": ("llama", dict(head_dim=16)),
    "mistral": ("mistral", dict(head_dim=16, sliding_window=WINDOW)),  # every layer sliding
    "qwen2": ("qwen2", dict()),  # q/k/v bias (head_dim 16 from 64 / 4)
    "qwen3": ("qwen3", dict(head_dim=16)),  # q/k RMSNorm
    "phi3": ("phi3", dict(sliding_window=WINDOW)),  # fused qkv_proj, sliding window
    "gemma2": (
        "gemma2",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,  # small, so the cap changes the numbers (real models: 50)
            final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "gemma3": (
        "gemma3_text",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "gpt_oss": (
        "gpt_oss",
        dict(
            head_dim=16,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
}


class _Tokenizer:
    """What the runner asks of a tokenizer, for models without one."""

    eos_token_id = unk_token_id = pad_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))

    def convert_tokens_to_ids(self, token):
        return None


def _config(family: str, **changes):
    model_type, extra = FAMILIES[family]
    changes = {k: list(v) if isinstance(v, tuple) else v for k, v in changes.items()}  # tuples: hashable keys
    return AutoConfig.for_model(model_type, **(COMMON | extra | changes))


@functools.cache
def _model(family: str, **changes) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family, **changes), dtype=torch.float32).eval()
    if family == "gpt_oss":  # sinks start at zero: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def _lm(model) -> LoadedModel:
    attention.use_kvdemo_attention(model)
    return LoadedModel(model, _Tokenizer(), "tiny", "config", torch.device("cpu"), torch.float32)


def _prompt(seed: int = 1) -> list[int]:
    return torch.randint(3, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _eager_logits(model, ids) -> torch.Tensor:
    """The model's own forward (eager attention, no kvdemo cache): fp32 logits [len(ids), vocab]."""
    model.set_attn_implementation("eager")
    try:
        return model(torch.tensor([ids])).logits[0].float()
    finally:
        attention.use_kvdemo_attention(model)


TOLERANCE = 1e-4  # fp32: measured max |diff| is ~1e-6 (docs/models.md)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_full_logits_equal_eager_and_int8_greedy_equals_full(family):
    model = _model(family)
    lm, prompt = _lm(model), _prompt(PROMPT_SEED[family])
    prefill_rows = runner.forward(lm, prompt, runner.new_cache(lm, "full"))  # [PROMPT, V]
    full = runner.run_precision(lm, prompt, "full", NEW, keep_logits=True)
    assert len(full.tokens) == NEW
    want = _eager_logits(model, prompt + full.tokens[:-1])  # teacher-forced on full's own tokens
    got = torch.cat([prefill_rows, torch.stack(full.logits[1:])])  # prompt rows, then each decode step
    diff = float((got - want).abs().max())
    assert diff < TOLERANCE, f"{family}: max |logit diff| {diff:.2e} vs eager"

    quant = runner.run_precision(lm, prompt, SPEC, NEW, keep_logits=True)
    assert quant.cache_bytes["codes"] > 0  # the past really sits in quantized blocks
    assert quant.tokens == full.tokens, (
        f"{family}: int8 diverges at {runner.first_divergence(quant.tokens, full.tokens)}"
    )
    int8_err = float((torch.stack(quant.logits) - torch.stack(full.logits)).abs().max())
    assert int8_err < INT8_LOGIT_ERROR, f"{family}: int8 logits {int8_err:.3f} from full precision"
    print(f"{family}: full vs eager {diff:.1e}, int8 vs full {int8_err:.3f}")


def test_gemma2_softcap_changes_the_logits_and_is_applied():
    """The softcap test above is not vacuous: without the cap the eager logits differ by far more than
    the tolerance; kvdemo matches the capped ones (prefill, and decode over int8 codes)."""
    capped, uncapped = _model("gemma2"), _model("gemma2", attn_logit_softcapping=None)
    prompt = _prompt()
    want = _eager_logits(capped, prompt)
    assert float((want - _eager_logits(uncapped, prompt)).abs().max()) > 1.0  # measured: 3.4
    lm = _lm(capped)
    cache = runner.new_cache(lm, SPEC)
    got = runner.forward(lm, prompt[:20], cache)
    got = torch.cat([got, *(runner.forward(lm, [t], cache) for t in prompt[20:])])  # decode over codes
    assert float((got - want).abs().max()) < 0.05  # int8 codes (measured 0.016): not a missing cap
    assert float((got[:20] - want[:20]).abs().max()) < TOLERANCE  # prefill: exact


def test_gpt_oss_sinks_change_the_logits_and_are_applied():
    model = _model("gpt_oss")
    prompt = _prompt()
    want = _eager_logits(model, prompt)
    saved = [layer.self_attn.sinks.detach().clone() for layer in model.model.layers]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # sinks off
        off = _eager_logits(model, prompt)
        for layer, s in zip(model.model.layers, saved, strict=True):
            layer.self_attn.sinks.copy_(s)
    assert float((want - off).abs().max()) > 1.0  # measured: 4.3; kvdemo matches `want` (the family test)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_sliding_window_token_outside_the_window_has_no_influence(family):
    """All-sliding Mistral: position 0 reaches at most 2 x (window - 1) positions ahead through 2 layers, so
    changing it must leave every later logit unchanged, prefill and int8 decode alike. Gemma-2/3 (a full
    layer after a sliding one): the same model with a global first layer must see the change."""
    changes = {} if family == "mistral" else {"layer_types": ("sliding_attention", "sliding_attention")}
    lm = _lm(_model(family, **changes))
    prompt = _prompt()
    other = [(prompt[0] + 1) % VOCAB or 3, *prompt[1:]]
    reach = 2 * (WINDOW - 1)
    rows = []
    for ids in (prompt, other):
        cache = runner.new_cache(lm, SPEC)
        logits = runner.forward(lm, ids[:24], cache)
        rows.append(torch.cat([logits, *(runner.forward(lm, [t], cache) for t in ids[24:])]))
    torch.testing.assert_close(rows[0][reach + 1 :], rows[1][reach + 1 :], rtol=0, atol=1e-5)
    assert float((rows[0][0] - rows[1][0]).abs().max()) > 1e-3  # the change is visible where it may be

    no_window = {"sliding_window": None} if family == "mistral" else {"layer_types": ("full_attention",) * 2}
    lm_full = _lm(_model(family, **no_window))
    last = [runner.prefill(lm_full, ids, runner.new_cache(lm_full, SPEC)) for ids in (prompt, other)]
    assert float((last[0] - last[1]).abs().max()) > 1e-4  # without the window it would reach the end


@pytest.mark.parametrize("spec", ["full", SPEC])
def test_sliding_window_is_honoured_without_a_mask(spec):
    """The attention function applies `sliding_window` itself (a caller that passes no mask), over a past
    in full precision or in int8 codes: equal to exact attention inside the window, blind to keys outside
    it. (In int8, a key group of 16 tokens that straddles the window edge shares its scales, so only whole
    groups outside the window are changed there.)"""
    torch.manual_seed(0)
    b, hq, hkv, d, past = 1, 4, 2, 16, 48
    keys, values = torch.randn(b, hkv, past + 1, d), torch.randn(b, hkv, past + 1, d)
    query = torch.randn(b, hq, 1, d)

    def decode(keys, values):
        layer = QuantizedKVCache(spec, num_layers=1).layers[0]
        layer.update(keys[:, :, :past], values[:, :, :past])
        view, _ = layer.update(keys[:, :, past:], values[:, :, past:])
        return layer, attention.attend(query, view, d**-0.5, None, sliding_window=WINDOW)

    layer, out = decode(keys, values)
    outside = past + 1 - WINDOW  # positions [0, outside) are outside the window of the query at `past`
    if spec != "full":
        assert layer.packed(past).quant_len > outside  # part of the window is read from codes
        outside -= outside % 16
    far_k, far_v = keys.clone(), values.clone()
    far_k[:, :, :outside] += 100.0
    far_v[:, :, :outside] -= 100.0
    torch.testing.assert_close(decode(far_k, far_v)[1], out, rtol=0, atol=1e-6)
    inside = slice(past + 1 - WINDOW, past + 1)
    exact = torch.nn.functional.scaled_dot_product_attention(
        query, keys[:, :, inside], values[:, :, inside], scale=d**-0.5, enable_gqa=True
    )
    torch.testing.assert_close(out, exact, rtol=0, atol=1e-6 if spec == "full" else 0.05)


def _deepseek_config():
    return AutoConfig.for_model(
        "deepseek_v3",
        **(COMMON | dict(num_key_value_heads=4, intermediate_size=64)),
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
    )


def test_value_dim_unequal_to_key_dim_is_refused_at_load(tmp_path):
    config = _deepseek_config()
    with pytest.raises(ModelLoadError, match="value head_dim") as err:
        attention.check_supported(config)
    assert "\n" not in str(err.value)
    config.save_pretrained(tmp_path)  # a local folder: refused from its config, before any weight loads
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="value head_dim"):
        models.load_model(str(tmp_path), device="cpu")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with pytest.raises(ModelLoadError, match="value head_dim"):  # a model that came another way
        attention.use_kvdemo_attention(model)


def test_supported_families_pass_the_load_check():
    for family in FAMILIES:
        attention.check_supported(_model(family))


def test_unknown_layer_types_are_refused():
    config = _config("qwen3")
    config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ModelLoadError, match="linear_attention"):
        attention.check_supported(config)


def test_cuda_default_dtype_is_the_checkpoints_own(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    bf16, fp32, fp16 = (_config("llama", dtype=dt) for dt in ("bfloat16", "float32", "float16"))
    assert models.pick_dtype("auto", cuda, bf16) == torch.bfloat16
    assert models.pick_dtype("auto", cuda, fp16) == torch.float16
    assert models.pick_dtype("auto", cuda, fp32) == torch.float16  # fp32 checkpoints: half the memory
    assert models.pick_dtype("auto", cpu, bf16) == torch.float32
    assert models.pick_dtype("float32", cuda, bf16) == torch.float32
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # no bf16 (T4)
    assert models.pick_dtype("auto", cuda, bf16) == torch.float16


def test_bf16_states_cast_to_fp16_clamp_instead_of_inf():
    big = torch.tensor([1e5, -3e38, 1.5, float("inf")], dtype=torch.bfloat16)
    assert torch.isinf(big.to(torch.float16)).any()  # what a plain cast does
    clamped = models.clamp_to_fp16(big.to(torch.float16))
    assert clamped.tolist() == [65504.0, -65504.0, 1.5, 65504.0]

    layer = QuantizedKVCache("full", num_layers=1).layers[0]
    states = torch.randn(1, 2, 5, 16, dtype=torch.bfloat16)
    states[0, 1, 2, 3] = 2e5
    layer.update(states, -states)
    packed = attention.fp16_clamped(layer.packed())  # what the Triton kernel is handed
    for part in (packed.keys.residual, packed.values.residual):
        assert torch.isfinite(part.to(torch.float16)).all()
        assert float(part.float().abs().max()) == attention.BF16_BELOW_FP16_MAX
    torch.testing.assert_close(packed.keys.residual[0, 0], states[0, 0])  # values in range are untouched
