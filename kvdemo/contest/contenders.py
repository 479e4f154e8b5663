"""Who runs in the benchmark: each cache implementation under test, how to build it, and its bytes as stored.
llama.cpp's caches (``llama.cpp:<type>``, kvdemo/engines.py) run in llama.cpp itself (`kvdemo.contest.llamacpp_rows`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import runner
from ..cache import QuantizedKVCache
from ..engines import CACHE_TYPES, KvTypes, baseline_of, split_contenders
from ..machine import quanto_extension_built
from ..models import LoadedModel
from ..precision import parse_precision
from ..results.bench import FULL, QUICK, Skipped

KVDEMO_PRESETS = ("int8", "k8v4", "k4v8", "int4", "int4:ktoken:g64", "int2", "fp8")
# the methods beyond uniform codes: 3-bit, KVQuant's nuq with outliers (and its fp16 first token), a Hadamard
# rotation, NVFP4
METHOD_PRESETS = ("int3", "nuq4:o1", "nuq3:o1", "nuq2:o1:s1", "int4:hadamard", "nvfp4")
QUICK_PRESETS = ("int4", "int4:ktoken:g64")
HF_DEFAULTS = {"q_group_size": 64, "residual_length": 128, "axis_key": 0, "axis_value": 0}  # transformers' own


@dataclass(frozen=True)
class Contender:
    """One cache implementation under test: how to build it and which attention reads it."""

    name: str  # "full" | "kvdemo-int4" | "hf-quanto-int4" | "llama.cpp:q4_0" | ...
    backend: str  # "dynamic" | "kvdemo" | "quanto" | "hqq" | "fp8" | "llama.cpp"
    bits: int | None = None  # nominal code bits (keys'); None: the model's dtype
    precision: str = ""  # kvdemo precision string, residual included (see `kvdemo_precision`)
    residual: int = HF_DEFAULTS["residual_length"]  # transformers' residual_length (quanto, hqq)
    kv: KvTypes | None = None  # llama.cpp's cache types (backend "llama.cpp")

    @property
    def attention(self) -> str:
        return {"kvdemo": "kvdemo", "llama.cpp": "llama.cpp"}.get(self.backend, "sdpa")

    @property
    def family(self) -> str:
        return {"kvdemo": "kvdemo", "llama.cpp": "llama.cpp"}.get(self.backend, "transformers")

    @property
    def engine(self) -> str:
        """What runs the model: llama.cpp for its own rows, transformers (PyTorch) for every other."""
        return "llama.cpp" if self.backend == "llama.cpp" else "transformers"

    @property
    def baseline(self) -> str:
        """The row this one is read against: its own engine's full row."""
        return baseline_of(self.name)

    def make_cache(self, lm: LoadedModel):
        from transformers import DynamicCache, QuantizedCache

        if self.backend == "kvdemo":
            return runner.new_cache(lm, self.precision)
        if self.backend == "dynamic":
            return DynamicCache(config=lm.config)
        if self.backend == "fp8":
            return QuantizedCache(backend="fp8", config=lm.config)
        return QuantizedCache(backend=self.backend, config=lm.config, nbits=self.bits, **self.hf_options)

    @property
    def hf_options(self) -> dict:
        return HF_DEFAULTS | {"residual_length": self.residual}

    def settings(self, lm: LoadedModel) -> dict:
        if self.backend == "llama.cpp":
            return {"type_k": self.kv.key, "type_v": self.kv.value, "flags": self.kv.flags()}
        if self.backend == "kvdemo":
            return parse_precision(self.precision).to_dict()
        if self.backend == "dynamic":
            return {"dtype": str(lm.dtype).replace("torch.", ""), "attention": "sdpa"}
        if self.backend == "fp8":
            return {"format": "float8_e4m3fn", "scale": "one per tensor, frozen after the first update"}
        return {"nbits": self.bits, **self.hf_options, "metadata_dtype": str(lm.dtype).replace("torch.", "")}


def kvdemo_precision(preset: str, residual: int) -> str:
    """`preset` with a full-precision residual of `residual` tokens: the group shrinks to fit when it must
    (the residual is a whole number of groups), e.g. ("int4", 64) -> "int4:g64:r64"."""
    spec = parse_precision(preset)
    if spec.residual != residual:
        spec = dataclasses.replace(spec, residual=residual, group_size=min(spec.group_size, residual))
    return spec.label


def contenders(
    quick: bool = False, residual: int | None = None, precisions: str | Sequence | None = None
) -> tuple[list[Contender], list[Skipped]]:
    """(contenders that can run here, those skipped with the reason). Every quantized contender keeps the same
    full-precision residual window: `residual` (default: QUICK's or FULL's). `precisions` (the grammar of
    `kvdemo ppl --precision`, `engines.split_contenders`): kvdemo's precisions to run in place of the presets, and
    llama.cpp contenders, its f16 row first, after every other row."""
    from transformers.utils import is_hqq_available, is_optimum_quanto_available

    residual = residual or (QUICK if quick else FULL).residual
    presets = QUICK_PRESETS if quick else KVDEMO_PRESETS + METHOD_PRESETS
    theirs: list[KvTypes] = []
    if precisions is not None:
        ours, theirs = split_contenders(precisions)
        named = [p if isinstance(p, str) else p.label for p in ours]
        presets = tuple(dict.fromkeys(p for p in named if parse_precision(p).label != "full")) if ours else presets
    run = [Contender("full", "dynamic")]
    run += [
        Contender(f"kvdemo-{p}", "kvdemo", parse_precision(p).key_bits, kvdemo_precision(p, residual), residual)
        for p in presets
    ]
    hf = [Contender("hf-quanto-int4", "quanto", 4, residual=residual)]
    hf += [Contender("hf-quanto-int2", "quanto", 2, residual=residual)]
    hf += [Contender("hf-hqq-int4", "hqq", 4, residual=residual), Contender("hf-hqq-int2", "hqq", 2, residual=residual)]
    hf += [Contender("hf-fp8", "fp8", 8)]
    if quick:
        hf = [c for c in hf if c.name in ("hf-quanto-int4", "hf-fp8")]
    skipped = []
    for c in hf:
        reason = None
        if c.backend == "quanto" and not is_optimum_quanto_available():
            reason = "optimum-quanto is not installed (pip install optimum-quanto)"
        elif c.backend == "quanto" and quick and not quanto_extension_built():
            reason = (
                "quick mode: optimum-quanto's C++ extension is not built yet (its first call builds it, "
                "70-240 s on 2 cores); the full bench measures that set-up"
            )
        elif c.backend == "hqq" and not is_hqq_available():
            reason = "hqq is not installed (pip install hqq; CPU torch is enough)"
        if reason:
            skipped.append(Skipped(c.name, reason))
        else:
            run.append(c)
    run += [Contender(kv.label, "llama.cpp", CACHE_TYPES[kv.key].code_bits, kv=kv) for kv in theirs]
    return run, skipped


# --- bytes -----------------------------------------------------------------------------------------


def tensor_bytes(obj) -> int:
    """Bytes of the tensors held by `obj`: a tensor, a tensor subclass (its inner tensors, e.g. quanto's
    packed data + scale + shift), or tuples / lists / dicts of them (HQQ's (codes, meta))."""
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x) for x in obj.values())
    return 0


def cache_bytes(cache) -> dict:
    """{"live", "allocated"} bytes of a cache: kvdemo counts itself; a transformers cache is counted
    tensor by tensor over every attribute of every layer (quantized states, residual, scales)."""
    if isinstance(cache, QuantizedKVCache):
        nb = cache.nbytes()
        return {"live": nb["total"], "allocated": nb["allocated"]}
    live = sum(tensor_bytes(v) for layer in cache.layers for v in vars(layer).values())
    return {"live": live, "allocated": live}


def held_exact(cache) -> int | None:
    """How much a cache holds outside its quantized store (kvdemo: residual bytes; transformers'
    QuantizedCache: residual tokens of layer 0); it drops at a flush. None: a cache that never flushes."""
    if isinstance(cache, QuantizedKVCache):
        return cache.nbytes()["residual"]
    layer = cache.layers[0]
    if not hasattr(layer, "residual_length"):  # DynamicCache, the fp8 backend: appended as they come
        return None
    keys = getattr(layer, "keys", None)
    return keys.shape[-2] if keys is not None and keys.dim() == 4 else 0
