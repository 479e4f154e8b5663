""" "Take it to production": the nearest KV-cache settings of vLLM, llama.cpp and transformers for a spec.

`production_settings(spec, head_dim)` maps one `PrecisionSpec` to each engine's closest setting (a line to
copy), how exact the match is, the bits per element that setting stores, and what the engine cannot
express of the spec. Plain data: the CLI prints it, the app shows it, tests check it.

What each engine offers (the versions this was written against):

- vLLM (0.11): ``--kv-cache-dtype auto | fp8 (= fp8_e4m3) | fp8_e5m2``, one dtype for K and V. Scales are
  per tensor (or per attention head with the FlashAttention backend and llm-compressor calibration),
  1.0 unless calibrated or ``--calculate-kv-scales``. No int8/int4/int2 KV cache. Docs:
  https://docs.vllm.ai/en/latest/features/quantization/quantized_kvcache/
- llama.cpp: ``-ctk`` / ``-ctv`` (``--cache-type-k`` / ``--cache-type-v``) in f32, f16, bf16, q8_0, q4_0,
  q4_1, iq4_nl, q5_0, q5_1: blocks of 32 channels of one token (ggml block quantization, fp16 scale,
  plus an fp16 min for the ``_1`` types). K and V may differ; a quantized V cache needs flash attention
  (``-fa on``; ``-fa`` in older builds). On CUDA, mixed K/V types need a build with
  ``GGML_CUDA_FA_ALL_QUANTS=ON``. See ggml-org/llama.cpp issue 10373 and tools/server/README.md.
- transformers (5.23): ``generate(..., cache_implementation="quantized", cache_config={...})`` builds a
  ``QuantizedCache(backend, nbits, axis_key, axis_value, q_group_size, residual_length)``; backends
  ``quanto`` (nbits 2/4, axis 0 = groups along head_dim per token, -1 = groups of tokens per channel),
  ``hqq`` (nbits 1/2/3/4/8, ``pip install hqq``) and ``fp8`` (e4m3, one per-tensor scale frozen at the
  first update, no options). One nbits for K and V; the residual window is re-quantized together with
  the whole cache at every flush, and every decode step dequantizes the whole cache.
"""

from __future__ import annotations

from .precision import PrecisionSpec, parse_precision

# llama.cpp cache types: bits per element (ggml blocks of 32: codes + fp16 scale [+ fp16 min])
LLAMA_CPP_BITS = {"f16": 16.0, "q8_0": 8.5, "q5_1": 6.0, "q5_0": 5.5, "q4_1": 5.0, "q4_0": 4.5, "iq4_nl": 4.5}
LLAMA_CPP_BLOCK = 32
# our format -> the llama.cpp type closest in structure (asymmetric int -> the "_1" types where they exist)
_LLAMA_CPP_TYPE = {
    "full": "f16",
    "int8": "q8_0",
    "int4": "q4_1",
    "int2": "q4_0",
    "fp8_e4m3": "q8_0",
    "fp8_e5m2": "q8_0",
}
QUANTO_BITS = (2, 4)
HQQ_BITS = (1, 2, 3, 4, 8)
META_BITS = 16  # transformers stores scale and zero point in the model's dtype (fp16/bf16 on GPU)


def production_settings(spec: PrecisionSpec | str, head_dim: int = 128) -> dict:
    """{"vllm": {...}, "llama.cpp": {...}, "transformers": {...}} for `spec` on a model with `head_dim`.

    Each entry: `setting` (what to type), `match` ("exact" | "nearest" | "none"), `bits_per_element`
    ({"key", "value"} of that setting), `cannot_express` (what of the spec the engine has no knob for)
    and `notes`.
    """
    spec = parse_precision(spec)
    ours = spec.bits_per_element(head_dim)
    return {
        "precision": spec.label,
        "bits_per_element": {"key": ours["key"], "value": ours["value"]},
        "vllm": _vllm(spec),
        "llama.cpp": _llama_cpp(spec),
        "transformers": _transformers(spec, head_dim),
    }


def _common_gaps(spec: PrecisionSpec, engine: str) -> list[str]:
    """What per-group schemes with a residual window and sinks carry that a plain cache dtype does not."""
    if not spec.is_quantized:
        return []
    gaps = []
    if spec.sinks:
        gaps.append(f"{spec.sinks} attention-sink tokens kept in full precision ({engine} quantizes every token)")
    return gaps


def _vllm(spec: PrecisionSpec) -> dict:
    if not spec.is_quantized:
        return _entry("--kv-cache-dtype auto", "exact", 16, 16, [], ["the model's dtype (fp16/bf16): vLLM's default"])
    fmts = {spec.key_format, spec.value_format}
    gaps = _common_gaps(spec, "vLLM")
    gaps.append(
        f"group-wise scales (ours: one scale per {spec.group_size}-element group; vLLM: per tensor or per head)"
    )
    if spec.key_axis == "channel":
        gaps.append("per-channel key quantization (KIVI/KVQuant): vLLM scales whole tensors")
    gaps.append(f"a full-precision residual window ({spec.residual} newest tokens): vLLM quantizes on write")
    notes = []
    if fmts == {"fp8_e5m2"}:
        setting, match = "--kv-cache-dtype fp8_e5m2", "nearest"
        notes.append("e5m2 keeps fp16's exponent range: usable without calibrated scales")
    elif fmts == {"fp8_e4m3"}:
        setting, match = "--kv-cache-dtype fp8 --calculate-kv-scales", "nearest"
        notes.append("e4m3 needs scales: calibrated ones (llm-compressor checkpoint) or --calculate-kv-scales")
    else:
        setting, match = "--kv-cache-dtype fp8 --calculate-kv-scales", "nearest"
        if len(fmts) > 1:
            gaps.append(f"different key and value formats ({spec.key_format} keys, {spec.value_format} values)")
        low = sorted(f for f in fmts if f in ("int4", "int2"))
        if low:
            gaps.append(f"{'/'.join(low)} KV: vLLM has no KV dtype below 8 bits; fp8 is its smallest")
        if "int8" in fmts:
            notes.append("vLLM has no int8 KV cache: fp8 stores the same 8 bits as floating-point codes")
    return _entry(setting, match, 8, 8, gaps, notes)


def _llama_cpp(spec: PrecisionSpec) -> dict:
    k_type, v_type = _LLAMA_CPP_TYPE[spec.key_format], _LLAMA_CPP_TYPE[spec.value_format]
    if not spec.is_quantized:
        return _entry("-ctk f16 -ctv f16", "exact", 16, 16, [], ["llama.cpp's default cache types"])
    setting = f"-ctk {k_type} -ctv {v_type} -fa on"
    gaps = _common_gaps(spec, "llama.cpp")
    gaps.append(f"group size {spec.group_size}: ggml blocks are always {LLAMA_CPP_BLOCK} channels of one token")
    if spec.key_axis == "channel":
        gaps.append("per-channel keys: llama.cpp groups keys per token, like values")
    gaps.append(f"a full-precision residual window ({spec.residual} newest tokens): llama.cpp quantizes on write")
    notes = ["a quantized V cache needs flash attention (-fa on; plain -fa in older builds)"]
    for fmt in sorted({spec.key_format, spec.value_format}):
        if fmt == "int2":
            gaps.append("2-bit KV: llama.cpp's smallest cache types are 4.5 bits (q4_0, iq4_nl)")
        elif fmt.startswith("fp8"):
            gaps.append(f"{fmt}: llama.cpp has no fp8 cache type; q8_0 is 8-bit integer with a scale per 32")
        elif fmt == "int8":
            notes.append("q8_0 is symmetric (scale only); ours is asymmetric (scale + zero)")
        elif fmt == "int4":
            notes.append("q4_1 is asymmetric (scale + min) like ours; q4_0 / iq4_nl save 0.5 bit with a scale only")
    if k_type != v_type:
        notes.append("mixed K/V types on CUDA need a build with GGML_CUDA_FA_ALL_QUANTS=ON")
    return _entry(setting, "nearest", LLAMA_CPP_BITS[k_type], LLAMA_CPP_BITS[v_type], gaps, notes)


def _transformers(spec: PrecisionSpec, head_dim: int) -> dict:
    if not spec.is_quantized:
        return _entry("model.generate(**inputs)", "exact", 16, 16, [], ["the default DynamicCache"])
    fmts = {spec.key_format, spec.value_format}
    gaps = _common_gaps(spec, "QuantizedCache")
    notes = ["every decode step dequantizes the whole cache (the slow path kvdemo's kernel avoids)"]
    if fmts <= {"fp8_e4m3", "fp8_e5m2"}:
        gaps.append("group-wise fp8 scales: the fp8 backend keeps one per-tensor scale, frozen at the first update")
        if "fp8_e5m2" in fmts:
            gaps.append("fp8 e5m2: the fp8 backend stores e4m3 only")
        gaps.append(f"a full-precision residual window ({spec.residual} tokens): the fp8 backend has none")
        setting = 'model.generate(**inputs, cache_implementation="quantized", cache_config={"backend": "fp8"})'
        return _entry(setting, "nearest", 8, 8, gaps, notes)
    if len(fmts) > 1:
        gaps.append(f"different key and value bits ({spec.key_bits}/{spec.value_bits}): one nbits for both")
    if fmts & {"fp8_e4m3", "fp8_e5m2"}:
        gaps.append("fp8 mixed with integer codes: backends are all-fp8 or all-integer")
    nbits = max(spec.key_bits, spec.value_bits)  # keep the more precise side rather than lose quality
    backend = "quanto" if nbits in QUANTO_BITS else "hqq"
    if backend == "hqq":
        notes.append("quanto takes nbits 2 or 4 only: 8-bit needs the hqq backend (pip install hqq)")
    value_group = spec.value_group(head_dim)
    axis_key = -1 if spec.key_axis == "channel" else 0
    if backend == "hqq" and spec.key_axis == "channel":
        axis_key = 1
        gaps.append("per-channel keys with hqq: axis 1 groups along head_dim, axis 0 strides across the whole tensor")
    q_group = value_group
    if spec.key_group(head_dim) != value_group:
        gaps.append(
            f"separate key/value group sizes (ours: {spec.key_group(head_dim)} for keys, {value_group} for values;"
            " q_group_size is shared)"
        )
    if spec.key_axis == "channel" and backend == "quanto":
        notes.append("quanto axis -1 groups q_group_size consecutive positions of each channel (across heads)")
    gaps.append("quantize-once blocks: at every flush QuantizedCache re-quantizes the whole cache, regrouping it")
    notes.append("residual_length newest tokens stay in full precision, as ours")
    config = {
        "backend": backend,
        "nbits": nbits,
        "axis_key": axis_key,
        "axis_value": 0 if backend == "quanto" else 1,
        "q_group_size": q_group,
        "residual_length": spec.residual,
    }
    args = ", ".join(f'"{k}": {v!r}' if not isinstance(v, str) else f'"{k}": "{v}"' for k, v in config.items())
    setting = f'model.generate(**inputs, cache_implementation="quantized", cache_config={{{args}}})'
    bits = nbits + 2 * META_BITS / q_group
    out = _entry(setting, "nearest", bits, bits, gaps, notes)
    out["cache_config"] = config
    return out


def _entry(setting: str, match: str, key_bits: float, value_bits: float, gaps: list[str], notes: list[str]) -> dict:
    return {
        "setting": setting,
        "match": match,
        "bits_per_element": {"key": float(key_bits), "value": float(value_bits)},
        "cannot_express": gaps,
        "notes": notes,
    }
