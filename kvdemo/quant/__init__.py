"""Quantized-cache kernels and where they run: Triton on CUDA, the PyTorch reference elsewhere.

`backend.backend_for(device)` is the one place that decides (``KVDEMO_BACKEND=torch|triton`` forces either).
`quantize(x, fmt, axis, group, **methods)` dispatches quantize-on-append (kvdemo/cache.py), methods
(nuq, outliers, rotation, pre-RoPE, nvfp4) included; attention over the
packed cache dispatches in kvdemo/attention.py through the same `backend_for`. Triton is imported
only when it is used, so this package imports on machines without it.
"""

from __future__ import annotations

import torch

from . import reference
from .backend import backend_for
from .reference import QuantizedTensor


def quantize(x: torch.Tensor, fmt: str, axis: str, group: int, **methods) -> QuantizedTensor:
    """x [B, H, T, D] -> QuantizedTensor (see reference.quantize): the Triton kernels where they run and
    take the call, the PyTorch reference otherwise. Both give the same bytes (triton_quantize's docstring
    states the one documented exception: ties among outlier scores).
    `methods` are reference.quantize's keywords (nuq levels, outliers, rotation, rope, start, block): plain
    int8/int4/int2/fp8 calls run the plain kernel where `supports_quantize` takes the head_dim; calls with
    methods or the other formats (int3, nuq*, nvfp4) run the method kernels where
    `supports_quantize_methods` takes them (fp8 with methods, more than MAX_OUTLIERS outliers per token,
    ... go to the reference)."""
    if backend_for(x.device) == "triton":
        from . import triton_quantize

        plain = not methods.get("outliers") and all(methods.get(k) is None for k in ("levels", "rotation", "rope"))
        if plain and triton_quantize.supports_quantize(fmt, x.shape[-1]):
            return triton_quantize.quantize(x, fmt, axis, group)
        if x.dim() == 4 and triton_quantize.supports_quantize_methods(fmt, axis, group, x.shape[-1], **methods):
            return triton_quantize.quantize(x, fmt, axis, group, **methods)
    return reference.quantize(x, fmt, axis, group, **methods)
