"""Where the quantized-cache kernels run: Triton on CUDA, the PyTorch reference elsewhere.

`backend_for(device)` is the one place that decides, for quantize-on-append (kvdemo/quant/__init__.py) and
for attention over the packed cache (kvdemo/attention.py). ``KVDEMO_BACKEND=torch|triton`` forces either
(``triton`` on CPU tensors needs ``TRITON_INTERPRET=1``, Triton's interpreter, as in the tests).
"""

from __future__ import annotations

import functools
import os

import torch

BACKEND_ENV = "KVDEMO_BACKEND"  # "torch" | "triton" | unset (auto: triton on CUDA when importable)
BACKENDS = ("torch", "triton")


class BackendError(ValueError):
    """A KVDEMO_BACKEND setting that cannot work here, with what is allowed."""


@functools.cache
def triton_available() -> bool:
    """True when Triton imports (probed once; the kernels import wherever Triton does)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def backend_for(device: torch.device | str) -> str:
    """Backend name, "triton" or "torch", for tensors on `device` (KVDEMO_BACKEND forces; auto: triton on CUDA)."""
    device = torch.device(device)
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced and forced not in BACKENDS:
        raise BackendError(f"{BACKEND_ENV}={forced!r}; allowed: torch, triton")
    if forced == "torch":
        return "torch"
    if forced == "triton":
        if not triton_available():
            raise BackendError(f"{BACKEND_ENV}=triton but Triton is not importable; allowed here: torch")
        if device.type != "cuda" and not interpreting():
            raise BackendError(
                f"{BACKEND_ENV}=triton on {device.type} tensors needs TRITON_INTERPRET=1; else use torch or a CUDA device"
            )
        return "triton"
    return "triton" if device.type == "cuda" and triton_available() else "torch"
