""" "Take it to production": the nearest KV-cache settings of vLLM, SGLang, TensorRT-LLM, llama.cpp and
transformers for a spec.

`production_settings(spec, head_dim)` maps one `PrecisionSpec` to each engine's closest setting (a line to
copy), how exact the match is, the bits per element that setting stores, what the engine cannot express
of the spec, and (`alternatives`) other settings worth knowing (older releases, options not verified in a
release). Plain data: the CLI prints it, the app shows it, tests check it.

None of the engines can express kvdemo's KVQuant-style methods: per-layer nuq codebooks, dense-and-sparse
outliers (``o<pct>``), pre-RoPE keys, and (except transformers' QuantizedCache) per-channel keys and a
full-precision residual window; sink tokens kept exact are in none of them. Each entry lists what applies.

What each engine offers (the versions this was written against; "not verified" where the sources did not
settle it):

- vLLM (0.25, mid-2026: the ``CacheDType`` list of vllm/config/cache.py on main): ``--kv-cache-dtype``
  ``auto | fp8 (= fp8_e4m3) | fp8_e5m2 | fp8_per_token_head | int8_per_token_head | int4_per_token_head |
  nvfp4 | nvfp4_4over6 | turboquant_k8v4 | turboquant_4bit_nc | turboquant_k3v4_nc | turboquant_3bit_nc``
  (plus the MLA-only ``fp8_ds_mla`` / ``nvfp4_ds_mla`` and Gaudi's ``fp8_inc``), one dtype for K and V.
  ``fp8``: per-tensor scales (per head with llm-compressor calibration), 1.0 unless calibrated or
  ``--calculate-kv-scales``. ``*_per_token_head``: a dynamic scale per token and head, Triton attention
  backend (PR #38378; int8 stores one fp32 scale per token and head, int4's scale width is not verified).
  ``nvfp4``: E2M1 codes, an E4M3 scale per 16 values and a per-tensor fp32 scale, Blackwell (SM100) through
  FlashInfer's trtllm-gen kernels (PR #40177). ``turboquant_*`` (PR #38479): keys turned by a Walsh-Hadamard
  rotation and coded with fixed Lloyd-Max levels plus a norm (``_nc``: norm correction), values uniform
  (``k8v4``: fp8 keys, 4-bit values). The release each of these first shipped in is not verified; older
  releases (e.g. 0.11) have only auto / fp8 / fp8_e5m2, so every entry lists fp8 as the fallback. Docs:
  https://docs.vllm.ai/en/latest/features/quantization/quantized_kvcache/
- SGLang (docs/advanced_features/quantized_kv_cache.md on main, mid-2026): ``--kv-cache-dtype auto |
  fp8_e4m3 | fp8_e5m2 | fp4_e2m1``; fp8 with per-tensor scales (checkpoint or ``--quantization-param-path``,
  else 1.0); fp4_e2m1 (experimental) stores E2M1 codes in blocks of 16 with one 8-bit exponent scale each
  (the docs call it MXFP4 with blocks of 16: not NVFP4's E4M3 scale). The same page documents a phase-1
  ``--int8-kv-cache`` (per token and head, asymmetric; MHA, Triton backend, page size 1): the release
  that has it is not verified, so it is listed as an alternative. No KV rotation option found.
- TensorRT-LLM (1.x, PyTorch backend; docs 1.3/1.4): ``LLM(..., kv_cache_config=KvCacheConfig(dtype=...))``
  with ``auto | fp8 | nvfp4`` (and the MLA-only ``fp8_ds_mla``). NVFP4 KV needs a Blackwell GPU and a
  checkpoint quantized offline with Model Optimizer (``scripts/huggingface_example.sh --quant fp8
  --kv_cache_quant nvfp4``; FP8 weights are the only weight format documented with it). INT8 KV belonged
  to the TensorRT-engine flow removed in 1.2. Model Optimizer lists a rotated ``nvfp4_rotate`` KV format;
  whether TensorRT-LLM serves it is not verified.
- llama.cpp: ``-ctk`` / ``-ctv`` (``--cache-type-k`` / ``--cache-type-v``) in f32, f16, bf16, q8_0, q4_0,
  q4_1, iq4_nl, q5_0, q5_1 (common/arg.cpp): blocks of 32 channels of one token (ggml block quantization,
  fp16 scale, plus an fp16 min for the ``_1`` types; iq4_nl: 16 fixed non-uniform levels). No 3-bit,
  2-bit or FP4 cache type. K and V may differ; a quantized V cache needs flash attention (``-fa on``;
  ``-fa`` in older builds). On CUDA, mixed K/V types need a build with ``GGML_CUDA_FA_ALL_QUANTS=ON``.
  Builds since PR #21038 (merged 2026-04-01) turn Q, K and V by a Hadamard matrix whenever the cache type
  is quantized and head_dim is a multiple of 64 (``LLAMA_ATTN_ROT_DISABLE=1`` turns it off; some
  architectures log ``attn_rot_k = 0``, e.g. Gemma-4, issue #21394). See ggml-org/llama.cpp issue 10373
  and tools/server/README.md.
- transformers (5.23): ``generate(..., cache_implementation="quantized", cache_config={...})`` builds a
  ``QuantizedCache(backend, nbits, axis_key, axis_value, q_group_size, residual_length)``; backends
  ``quanto`` (nbits 2/4, axis 0 = groups along head_dim per token, -1 = groups of tokens per channel),
  ``hqq`` (nbits 1/2/3/4/8, ``pip install hqq``) and ``fp8`` (e4m3, one per-tensor scale frozen at the
  first update, no options). One nbits for K and V; the residual window is re-quantized together with
  the whole cache at every flush, and every decode step dequantizes the whole cache.
"""

from __future__ import annotations

from . import engines, formats
from .precision import PrecisionSpec, parse_precision

ENGINES = ("vllm", "sglang", "tensorrt-llm", "llama.cpp", "transformers")

# llama.cpp cache types: bits per element (ggml blocks of 32: codes + fp16 scale [+ fp16 min])
LLAMA_CPP_BITS = {name: t.bits for name, t in engines.CACHE_TYPES.items()}
LLAMA_CPP_BLOCK = 32
LLAMA_CPP_ROT_MULTIPLE = 64  # the Hadamard rotation of a quantized cache needs head_dim % 64 == 0
QUANTO_BITS = (2, 4)
HQQ_BITS = (1, 2, 3, 4, 8)
META_BITS = 16  # transformers stores scale and zero point in the model's dtype (fp16/bf16 on GPU)
_NVFP4 = formats.get("nvfp4")
NVFP4_BITS = _NVFP4.bits + _NVFP4.scale_bits / _NVFP4.fixed_group  # E2M1 code + an E4M3 scale per 16 values

VLLM_FP8 = "--kv-cache-dtype fp8 --calculate-kv-scales"
VLLM_FALLBACK_WHEN = (
    "vLLM releases without the per-token-head, nvfp4 and turboquant dtypes (e.g. 0.11): fp8 is the smallest"
)
# vLLM's TurboQuant presets: (key bits, value bits) -> name; K and V bits per element from PR #38479's slot
# sizes (196 / 136 / 120 / 104 bytes per token and head at head_dim 128), approximate
TURBOQUANT = {
    (8, 4): "turboquant_k8v4",
    (4, 4): "turboquant_4bit_nc",
    (3, 4): "turboquant_k3v4_nc",
    (3, 3): "turboquant_3bit_nc",
}


def production_settings(spec: PrecisionSpec | str, head_dim: int = 128) -> dict:
    """{"vllm", "sglang", "tensorrt-llm", "llama.cpp", "transformers"} settings for `spec` on a model with
    `head_dim`, beside "precision" and our "bits_per_element".

    Each entry: `setting` (what to type), `match` ("exact" | "nearest" | "none"), `bits_per_element`
    ({"key", "value"} of that setting), `cannot_express` (what of the spec the engine has no knob for),
    `notes` and `alternatives` ([{setting, match, bits_per_element, when}]: other settings of the engine).
    """
    spec = parse_precision(spec)
    ours = spec.bits_per_element(head_dim)
    return {
        "precision": spec.label,
        "bits_per_element": {"key": ours["key"], "value": ours["value"]},
        "vllm": _vllm(spec, head_dim),
        "sglang": _sglang(spec, head_dim),
        "tensorrt-llm": _trtllm(spec),
        "llama.cpp": _llama_cpp(spec, head_dim),
        "transformers": _transformers(spec, head_dim),
    }


def _method_gaps(spec: PrecisionSpec, engine: str, channel_keys: bool = False, residual: bool = False) -> list[str]:
    """What of `spec` no knob of `engine` expresses, of kvdemo's methods and options (the rotation and the
    formats are each engine's own). `channel_keys` / `residual`: the engine has per-channel keys / a
    full-precision residual window."""
    if not spec.is_quantized:
        return []
    gaps = []
    if spec.key.codebook or spec.value.codebook:
        gaps.append(
            f"nuq codebooks (per-layer levels fitted to the model by Fisher-weighted k-means, KVQuant): {engine} "
            "has no calibrated non-uniform KV codes"
        )
    if spec.outliers:
        gaps.append(
            f"dense-and-sparse outliers ({spec.outliers:g}% of the elements kept exact as sparse fp16 "
            f"corrections): {engine} quantizes every element"
        )
    if spec.pre_rope:
        gaps.append(f"pre-RoPE keys (quantized before the rotary embedding): {engine} caches keys after RoPE")
    if spec.key_axis == "channel" and not spec.key.keys_per_token and not channel_keys:
        gaps.append(f"per-channel key quantization (KIVI/KVQuant): {engine} scales keys per token or per tensor")
    if not residual:
        gaps.append(f"a full-precision residual window ({spec.residual} newest tokens): {engine} quantizes on write")
    if spec.sinks:
        gaps.append(f"{spec.sinks} attention-sink tokens kept in full precision ({engine} quantizes every token)")
    return gaps


def _mixed_gap(spec: PrecisionSpec) -> str:
    return f"different key and value formats ({spec.key_format} keys, {spec.value_format} values): one dtype for both"


def _group_gap(spec: PrecisionSpec, theirs: str) -> str:
    return f"group-wise scales (ours: one scale per {spec.group_size}-element group; {theirs})"


def _formats(spec: PrecisionSpec) -> set[str]:
    return {spec.key_format, spec.value_format}


def _families(spec: PrecisionSpec) -> set[str]:
    """The codec families of the spec's key and value formats ("int", "fp8", "nuq", "nvfp4")."""
    return {spec.key.family, spec.value.family}


def _int8(spec: PrecisionSpec) -> bool:
    """Keys or values in 8-bit integer codes."""
    return any(f.family == "int" and f.bits == 8 for f in (spec.key, spec.value))


def _llama_cpp_type(fmt: str) -> str:
    """The llama.cpp cache type closest in structure to one of our formats: asymmetric int -> the "_1" types
    where they exist; non-uniform levels (codebooks, FP4) -> iq4_nl; below 4 bits -> the smallest type, q4_0."""
    if fmt == formats.FULL:
        return "f16"
    f = formats.get(fmt)
    if f.family in ("fp8",) or (f.family == "int" and f.bits == 8):
        return "q8_0"
    if f.family in ("nuq", "nvfp4"):
        return "iq4_nl"
    return "q4_1" if f.bits >= 4 else "q4_0"


def _vllm(spec: PrecisionSpec, head_dim: int) -> dict:
    if not spec.is_quantized:
        return _entry("--kv-cache-dtype auto", "exact", 16, 16, [], ["the model's dtype (fp16/bf16): vLLM's default"])
    fmts, kb, vb = _formats(spec), spec.key_bits, spec.value_bits
    gaps, notes = [], []
    per_head = 32 / head_dim  # one fp32 scale per token and head
    if _families(spec) == {"nvfp4"}:
        out = _entry("--kv-cache-dtype nvfp4", "exact", NVFP4_BITS, NVFP4_BITS, gaps, notes)
        notes.append(
            "E2M1 codes with an E4M3 scale per 16 values, as ours; the second-level fp32 scale is per tensor "
            f"(ours: per block of {spec.group_size} tokens and head, since a cache grows)"
        )
        notes.append(
            "Blackwell (SM100) through FlashInfer's trtllm-gen kernels; nvfp4_4over6 picks max/6 or max/4 scales"
        )
    elif fmts == {"fp8_e5m2"}:
        out = _entry("--kv-cache-dtype fp8_e5m2", "nearest", 8, 8, gaps, notes)
        notes.append("e5m2 keeps fp16's exponent range: usable without calibrated scales")
    elif fmts == {"fp8_e4m3"}:
        out = _entry(VLLM_FP8, "nearest", 8, 8, gaps, notes)
        notes.append("e4m3 needs scales: calibrated ones (llm-compressor checkpoint) or --calculate-kv-scales")
        out["alternatives"].append(
            _alt(
                "--kv-cache-dtype fp8_per_token_head",
                8 + per_head,
                8 + per_head,
                "dynamic scales per token and head, no calibration (Triton backend)",
            )
        )
    else:
        turbo = _turboquant(spec)
        if turbo is not None:
            (tk, tv), name = turbo
            out = _entry(
                f"--kv-cache-dtype {name}",
                "nearest",
                _tq_bits(tk, head_dim, True),
                _tq_bits(tv, head_dim, False),
                gaps,
                notes,
            )
            if tk == 8:
                notes.append("TurboQuant k8v4: fp8 keys, 4-bit uniform values (which of them it rotates: not verified)")
            else:
                notes.append(
                    "TurboQuant: keys turned by a Walsh-Hadamard rotation and coded with fixed Lloyd-Max levels "
                    "(non-uniform like nuq's, but for a Gaussian, not fitted per layer), values uniform"
                    + ("" if spec.hadamard else "; it rotates where this spec does not")
                )
            if tk != kb or tv != vb:
                gaps.append(f"{kb}-bit keys / {vb}-bit values: the nearest TurboQuant preset stores {tk} / {tv} bits")
        else:
            bits = max(kb, vb)
            dtype = "int8" if bits == 8 and _int8(spec) else ("fp8" if bits == 8 else "int4")
            if dtype == "fp8":
                out = _entry(VLLM_FP8, "nearest", 8, 8, gaps, notes)
            else:
                b = 8 if dtype == "int8" else 4
                out = _entry(
                    f"--kv-cache-dtype {dtype}_per_token_head", "nearest", b + per_head, b + per_head, gaps, notes
                )
                notes.append(
                    "a dynamic scale per token and head (Triton attention backend; add --attention-backend "
                    "TRITON_ATTN if vLLM does not pick it: not verified)"
                )
            if kb != vb:
                gaps.append(_mixed_gap(spec))
            if min(kb, vb) < 4 and dtype == "int4":
                gaps.append(f"{min(kb, vb)}-bit KV: vLLM's smallest integer KV dtype is 4-bit")
            if "fp8" in _families(spec) and dtype != "fp8":
                gaps.append("fp8 codes: the per-token-head integer dtypes store integers")
    if _families(spec) != {"fp8"}:
        out["alternatives"].append(_alt(VLLM_FP8, 8, 8, VLLM_FALLBACK_WHEN))
    if spec.hadamard and "turboquant" not in out["setting"]:
        gaps.append("Hadamard rotation: vLLM rotates only inside its turboquant_* presets (4/3-bit keys)")
    if not spec.key.keys_per_token:
        gaps.insert(0, _group_gap(spec, "vLLM: per tensor, per head or per token and head"))
    gaps.extend(_method_gaps(spec, "vLLM"))
    return out


def _turboquant(spec: PrecisionSpec) -> tuple[tuple[int, int], str] | None:
    """The vLLM TurboQuant preset nearest to `spec`, or None where a plain dtype is nearer: 8-bit keys with
    fewer value bits (k8v4), and at 4 bits or less the rotated specs, the nuq formats (non-uniform levels, as
    TurboQuant's keys) and the sub-4-bit ones (3-bit is vLLM's smallest KV)."""
    kb, vb = spec.key_bits, spec.value_bits
    if _families(spec) & {"fp8", "nvfp4"}:
        return None
    if kb == 8 and vb < 8:
        return (8, 4), TURBOQUANT[(8, 4)]
    nuq = spec.key.codebook or spec.value.codebook
    if max(kb, vb) > 4 or not (spec.hadamard or nuq or max(kb, vb) < 4):
        return None
    key = (min(max(kb, 3), 4), min(max(vb, 3), 4))
    if key == (4, 3):  # no such preset: keep the keys' bits
        key = (4, 4)
    return key, TURBOQUANT[key]


def _tq_bits(bits: int, head_dim: int, key: bool) -> float:
    if bits == 8:
        return 8.0
    return bits + (16 if key else 32) / head_dim  # keys: a fp16 norm; values: fp16 min and max


def _sglang(spec: PrecisionSpec, head_dim: int) -> dict:
    if not spec.is_quantized:
        return _entry("--kv-cache-dtype auto", "exact", 16, 16, [], ["the model's dtype: SGLang's default"])
    fmts, kb, vb = _formats(spec), spec.key_bits, spec.value_bits
    gaps, notes = [], []
    bits = max(kb, vb)
    if fmts == {"fp8_e5m2"}:
        out = _entry("--kv-cache-dtype fp8_e5m2", "nearest", 8, 8, gaps, notes)
    elif bits == 8:
        out = _entry("--kv-cache-dtype fp8_e4m3", "nearest", 8, 8, gaps, notes)
        notes.append("per-tensor scales from the checkpoint or --quantization-param-path (1.0 otherwise)")
        if _int8(spec):
            gaps.append("int8 codes: SGLang's 8-bit KV dtypes are fp8")
            zp = 32 / head_dim  # fp16 scale + zero point per token and head
            out["alternatives"].append(
                _alt(
                    "--int8-kv-cache --attention-backend triton --page-size 1",
                    8 + zp,
                    8 + zp,
                    "phase-1 INT8 KV (per token and head, scale + zero point, MHA models only) documented on "
                    "SGLang's main branch: the release that has it is not verified",
                )
            )
    else:
        out = _entry("--kv-cache-dtype fp4_e2m1", "nearest", NVFP4_BITS, NVFP4_BITS, gaps, notes)
        notes.append("experimental: check that the attention backend fuses the FP4 dequantization")
        if _families(spec) == {"nvfp4"}:
            gaps.append(
                "NVFP4's E4M3 block scales: SGLang's fp4_e2m1 keeps E2M1 codes in blocks of 16 with an 8-bit "
                "exponent (power-of-two) scale per its docs"
            )
        else:
            gaps.append(f"{'/'.join(sorted(fmts))} codes: SGLang's only KV dtype below 8 bits is fp4_e2m1")
        if min(kb, vb) < 4:
            gaps.append(f"{min(kb, vb)}-bit KV: SGLang's smallest KV dtype is 4-bit (fp4_e2m1)")
    if kb != vb:
        gaps.append(_mixed_gap(spec))
    if not spec.key.keys_per_token:
        gaps.insert(0, _group_gap(spec, "SGLang: per tensor or per 16 values"))
    if spec.hadamard:
        gaps.append("Hadamard rotation: no KV rotation option found in SGLang (not verified)")
    gaps.extend(_method_gaps(spec, "SGLang"))
    return out


def _trtllm(spec: PrecisionSpec) -> dict:
    llm = 'LLM(model, kv_cache_config=KvCacheConfig(dtype="{}"))'
    if not spec.is_quantized:
        return _entry(llm.format("auto"), "exact", 16, 16, [], ["the model's dtype: TensorRT-LLM's default"])
    fmts, kb, vb = _formats(spec), spec.key_bits, spec.value_bits
    gaps, notes = [], []
    bits = max(kb, vb)
    if bits == 8:
        out = _entry(llm.format("fp8"), "nearest", 8, 8, gaps, notes)
        notes.append("per-tensor scales from the checkpoint (Model Optimizer), 1.0 otherwise")
        if "fp8_e5m2" in fmts:
            gaps.append("fp8 e5m2: TensorRT-LLM's fp8 KV is e4m3")
        if _int8(spec):
            gaps.append(
                "int8 codes: TensorRT-LLM 1.2+ (PyTorch backend) has fp8 and nvfp4 KV only "
                "(INT8 KV left with the TensorRT-engine flow)"
            )
    else:
        out = _entry(
            llm.format("nvfp4"),
            "exact" if _families(spec) == {"nvfp4"} else "nearest",
            NVFP4_BITS,
            NVFP4_BITS,
            gaps,
            notes,
        )
        notes.append(
            "needs a Blackwell GPU and a checkpoint quantized with Model Optimizer: "
            "scripts/huggingface_example.sh --model M --quant fp8 --kv_cache_quant nvfp4 (FP8 weights)"
        )
        if _families(spec) == {"nvfp4"}:
            notes.append(
                f"the second-level fp32 scale is per tensor (ours: per block of {spec.group_size} tokens and head)"
            )
        else:
            gaps.append(f"{'/'.join(sorted(fmts))} codes: TensorRT-LLM's only KV dtype below 8 bits is nvfp4 (E2M1)")
        if min(kb, vb) < 4:
            gaps.append(f"{min(kb, vb)}-bit KV: TensorRT-LLM's smallest KV dtype is 4-bit (nvfp4)")
    if kb != vb:
        gaps.append(_mixed_gap(spec))
    if not spec.key.keys_per_token:
        gaps.insert(0, _group_gap(spec, "TensorRT-LLM: per tensor, or per 16 values in nvfp4"))
    if spec.hadamard:
        gaps.append(
            "Hadamard rotation: no rotated KV cache in TensorRT-LLM's KvCacheConfig (Model Optimizer lists an "
            "nvfp4_rotate KV format; whether TensorRT-LLM serves it is not verified)"
        )
    gaps.extend(_method_gaps(spec, "TensorRT-LLM"))
    return out


def _llama_cpp(spec: PrecisionSpec, head_dim: int) -> dict:
    k_type, v_type = _llama_cpp_type(spec.key_format), _llama_cpp_type(spec.value_format)
    if not spec.is_quantized:
        return _entry("-ctk f16 -ctv f16", "exact", 16, 16, [], ["llama.cpp's default cache types"])
    setting = f"-ctk {k_type} -ctv {v_type} -fa on"
    gaps = []
    if not spec.key.keys_per_token:
        gaps.append(f"group size {spec.group_size}: ggml blocks are always {LLAMA_CPP_BLOCK} channels of one token")
    notes = ["a quantized V cache needs flash attention (-fa on; plain -fa in older builds)"]
    for fmt in sorted(_formats(spec)):
        f = formats.get(fmt)
        if f.bits < 4:
            gaps.append(f"{f.bits}-bit KV: llama.cpp's smallest cache types are 4.5 bits (q4_0, iq4_nl)")
        elif f.family == "fp8":
            gaps.append(f"{fmt}: llama.cpp has no fp8 cache type; q8_0 is 8-bit integer with a scale per 32")
        elif f.family == "nvfp4":
            gaps.append(
                "nvfp4: llama.cpp has no FP4 cache type; iq4_nl (16 fixed non-uniform levels, an fp16 scale per 32) "
                "is the nearest"
            )
        elif f.family == "int" and f.bits == 8:
            notes.append("q8_0 is symmetric (scale only); ours is asymmetric (scale + zero)")
        elif f.family == "int" and f.bits == 4:
            notes.append("q4_1 is asymmetric (scale + min) like ours; q4_0 / iq4_nl save 0.5 bit with a scale only")
        if f.codebook:
            notes.append("iq4_nl's levels are non-uniform like nuq's, but fixed for every model (not fitted)")
    rotates = head_dim % LLAMA_CPP_ROT_MULTIPLE == 0
    if spec.hadamard and rotates:
        notes.append(
            "the Hadamard rotation is built in: builds since PR #21038 (April 2026) turn Q, K and V whenever the "
            "cache is quantized (plain Sylvester matrix; ours adds random signs; some architectures skip it)"
        )
    elif spec.hadamard:
        gaps.append(
            f"Hadamard rotation: llama.cpp rotates only when head_dim is a multiple of {LLAMA_CPP_ROT_MULTIPLE} "
            f"(this model: {head_dim})"
        )
    elif rotates:
        notes.append(
            "recent builds (PR #21038, April 2026) rotate a quantized cache by a Hadamard matrix anyway: "
            "LLAMA_ATTN_ROT_DISABLE=1 gives the unrotated cache this spec stores"
        )
    if k_type != v_type:
        notes.append("mixed K/V types on CUDA need a build with GGML_CUDA_FA_ALL_QUANTS=ON")
    gaps.extend(_method_gaps(spec, "llama.cpp"))
    return _entry(setting, "nearest", LLAMA_CPP_BITS[k_type], LLAMA_CPP_BITS[v_type], gaps, notes)


def _transformers(spec: PrecisionSpec, head_dim: int) -> dict:
    if not spec.is_quantized:
        return _entry("model.generate(**inputs)", "exact", 16, 16, [], ["the default DynamicCache"])
    fmts = _formats(spec)
    gaps = []
    notes = ["every decode step dequantizes the whole cache (the slow path kvdemo's kernel avoids)"]
    method = _method_gaps(spec, "QuantizedCache", channel_keys=True, residual=True)
    if spec.hadamard:
        method.insert(0, "Hadamard rotation: QuantizedCache stores keys and values as they come")
    if _families(spec) == {"fp8"}:
        gaps.append("group-wise fp8 scales: the fp8 backend keeps one per-tensor scale, frozen at the first update")
        if "fp8_e5m2" in fmts:
            gaps.append("fp8 e5m2: the fp8 backend stores e4m3 only")
        gaps.append(f"a full-precision residual window ({spec.residual} tokens): the fp8 backend has none")
        gaps.extend(method)
        setting = 'model.generate(**inputs, cache_implementation="quantized", cache_config={"backend": "fp8"})'
        return _entry(setting, "nearest", 8, 8, gaps, notes)
    if spec.key_bits != spec.value_bits:
        gaps.append(f"different key and value bits ({spec.key_bits}/{spec.value_bits}): one nbits for both")
    if "fp8" in _families(spec):
        gaps.append("fp8 mixed with integer codes: backends are all-fp8 or all-integer")
    if "nvfp4" in _families(spec):
        gaps.append("nvfp4's E2M1 codes with E4M3 scales: quanto/hqq store integer codes with a scale and zero point")
    nbits = max(spec.key_bits, spec.value_bits)  # keep the more precise side rather than lose quality
    backend = "quanto" if nbits in QUANTO_BITS else "hqq"
    if backend == "hqq":
        notes.append(f"quanto takes nbits 2 or 4 only: {nbits}-bit needs the hqq backend (pip install hqq)")
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
    gaps.extend(method)
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


def _alt(setting: str, key_bits: float, value_bits: float, when: str, match: str = "nearest") -> dict:
    return {
        "setting": setting,
        "match": match,
        "bits_per_element": {"key": float(key_bits), "value": float(value_bits)},
        "when": when,
    }


def _entry(setting: str, match: str, key_bits: float, value_bits: float, gaps: list[str], notes: list[str]) -> dict:
    return {
        "setting": setting,
        "match": match,
        "bits_per_element": {"key": float(key_bits), "value": float(value_bits)},
        "cannot_express": gaps,
        "notes": notes,
        "alternatives": [],
    }
