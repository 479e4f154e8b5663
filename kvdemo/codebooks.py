"""nuq codebooks: per layer, for keys and values, 2^b levels in [-1, 1] fitted offline (KVQuant's "nuq").

Fitting them is kvdemo/calibration.py's work. One file per model, safetensors (never pickle), tensors named
``layers.{i}.{key|value}.nuq{b}[.o][.prerope]`` (``.o``: fitted for outlier runs, ``.prerope``: keys before
RoPE); the embedded model's ships in assets/codebooks. A model without a file gets NormalFloat levels
(normal quantiles scaled to [-1, 1], QLoRA's NF construction) until it is calibrated.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import torch

from .configs import cache_dir
from .precision import PrecisionSpec

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "codebooks"


def tensor_name(layer: int, part: str, bits: int, outliers: bool, pre_rope: bool) -> str:
    return f"layers.{layer}.{part}.nuq{bits}" + (".o" if outliers else "") + (".prerope" if pre_rope else "")


def normal_float(bits: int) -> torch.Tensor:
    """2^bits levels at the normal quantiles (i + 1/2) / 2^bits, scaled so the outermost are -1 and 1."""
    n = 1 << bits
    p = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    v = torch.distributions.Normal(0.0, 1.0).icdf(p)
    return (v / v.abs().max()).float()


class Codebooks:
    """A model's fitted levels by tensor name, or none (NormalFloat for every layer)."""

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: dict | None = None):
        self.tensors, self.metadata = tensors, dict(metadata or {})

    @classmethod
    def normal_float(cls) -> Codebooks:
        return cls({}, {"source": "normalfloat"})

    @property
    def fitted(self) -> bool:
        return bool(self.tensors)

    def levels(self, layer: int, part: str, spec: PrecisionSpec) -> torch.Tensor:
        """fp16 levels for `part` of `layer` under `spec` (fitted if present, else NormalFloat rounded to fp16): the
        quantizer picks codes with the very levels the cache stores and the kernels read."""
        b = (spec.key if part == "key" else spec.value).bits
        name = tensor_name(layer, part, b, spec.outliers > 0, spec.pre_rope and part == "key")
        found = self.tensors.get(name)
        return (normal_float(b) if found is None else found).half()

    def save(self, path: Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(path), metadata=self.metadata)
        return path

    @classmethod
    def load(cls, path: Path) -> Codebooks:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return cls({k: f.get_tensor(k) for k in f.keys()}, f.metadata())


def file_name(source: str) -> str:
    """The codebook file of a model source (`embedded`, a hub id, a folder)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", source.strip("/")).strip("_") + ".safetensors"


def user_dir() -> Path:
    return cache_dir() / "codebooks"


def find(source: str) -> Path | None:
    """The codebook file of `source`: calibrated by the user (cache dir) first, then the shipped ones."""
    for folder in (user_dir(), ASSET_DIR):
        path = folder / file_name(source)
        if path.exists():
            return path
    return None


def for_model(lm) -> Codebooks:
    """The model's fitted codebooks when a file exists (and matches its layer count), else NormalFloat."""
    path = find(lm.source)
    if path is None:
        return Codebooks.normal_float()
    books = Codebooks.load(path)
    if books.metadata.get("layers") not in (None, str(lm.num_layers)):
        return Codebooks.normal_float()
    return books


def from_file(lm, path: str | Path) -> Codebooks:
    """The codebooks in the file at `path` for `lm` (ValueError with the reason when the file is missing, is
    not a codebook file, or was fitted on a model with another layer count)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"codebook file not found: {path}")
    try:
        books = Codebooks.load(path)
    except Exception as err:  # safetensors raises its own error types for a file that is not one of its
        raise ValueError(f"{path} is not a codebook file (safetensors): {err}") from err
    layers = books.metadata.get("layers")
    if not books.fitted:
        raise ValueError(f"{path} holds no codebooks")
    if layers not in (None, str(lm.num_layers)):
        raise ValueError(f"{path} holds codebooks of a {layers}-layer model; {lm.name} has {lm.num_layers} layers")
    return books


def used_by(lm, specs: Sequence[PrecisionSpec], books: Codebooks | None = None) -> str | None:
    """For a report: what the nuq precisions among `specs` read their levels from (`books`, default the model's
    own: `describe`), or None when none of them takes a codebook."""
    if not any(any(s.codebook_levels().values()) for s in specs):
        return None
    return describe(books if books is not None else for_model(lm))


def describe(books: Codebooks) -> str:
    if not books.fitted:
        return "NormalFloat levels (no calibration file for this model)"
    m = books.metadata
    text = f" of {m['calibration_text']}" if m.get("calibration_text") else ""
    return (
        f"fitted on {m.get('calibration_tokens', '?')} tokens{text}, {m.get('date', '?')} ({m.get('seconds', '?')} s)"
    )
