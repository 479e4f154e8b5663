"""No kernel variant is compiled after the first decode step.

Triton compiles one variant of a kernel per specialization key: the constexprs, the launch options, and for
every other argument its type and value class (an integer equal to 1, or divisible by 16; a pointer aligned to
16 bytes), unless the kernel says not to specialize it. A decode step whose lengths cross one of those classes
compiles a new variant (seconds on a GPU) inside the timed decode. Here the launcher's arguments are replayed on
the CPU, the kernels themselves stubbed: a cache is prefilled, then decoded 256 tokens (crossing flushes) at
several prompt lengths and precisions, and every launch's key is computed the way Triton's launcher computes it.
"""

import inspect

import pytest
import torch

pytest.importorskip("triton")
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.jit import native_specialize_impl  # noqa: E402

from kvdemo.cache import QuantizedLayer  # noqa: E402
from kvdemo.precision import parse_precision  # noqa: E402
from kvdemo.quant import triton_decode, triton_quantize  # noqa: E402
from kvdemo.quant.backend import BACKEND_ENV  # noqa: E402

pytestmark = pytest.mark.triton
B, HKV, HQ, D = 1, 2, 8, 64
KERNELS = {
    triton_decode: ("_decode_split_kernel", "_merge_kernel"),
    triton_quantize: ("_quantize_kernel", "_quantize_methods_kernel", "_quantize_nvfp4_kernel"),
}


def _jit_parts(kernel) -> tuple:
    """(python function, names not specialized) of a JITFunction or of the interpreter's stand-in."""
    fn = kernel.fn
    dns = getattr(kernel, "do_not_specialize", None)
    if dns is None:  # triton.runtime.interpreter.InterpretedFunction keeps the decorator's keywords
        dns = kernel.kwargs.get("do_not_specialize") or ()
    params = list(inspect.signature(fn).parameters)
    return fn, {params[i] if isinstance(i, int) else i for i in dns}


def specialization_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """The key Triton's launcher compiles a variant for: constexprs by value, launch options, and each other
    argument's type and value class, not specialized where the kernel says so (`do_not_specialize`)."""
    fn, dns = _jit_parts(kernel)
    sig = inspect.signature(fn)
    options = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k not in options})
    bound.apply_defaults()
    key = []
    for name, value in bound.arguments.items():
        annotation = sig.parameters[name].annotation
        if "constexpr" in str(annotation):
            key.append((name, "constexpr", value))
        elif isinstance(value, float):
            key.append((name, "fp32"))
        else:
            key.append((name, *native_specialize_impl(BaseBackend, value, False, name not in dns, True)))
    return tuple(key), tuple(sorted(options.items()))


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch's key instead of running."""

    def __init__(self, name: str, kernel, launches: list):
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.name, specialization_key(self.kernel, args, kwargs)))

        return launch


@pytest.fixture
def launches(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "triton")  # the Triton launchers on CPU tensors (TRITON_INTERPRET=1)
    seen: list = []
    for module, names in KERNELS.items():
        for name in names:
            monkeypatch.setattr(module, name, Recorder(name, getattr(module, name), seen))
    return seen


@pytest.mark.parametrize("precision", ["int4", "k8v4", "int2:s4", "fp8", "int4:ktoken:g64"])
@pytest.mark.parametrize("prompt", [100, 1000, 1537])
def test_decode_steps_launch_no_new_variant_after_the_first(launches, precision, prompt):
    g = torch.Generator().manual_seed(prompt)
    layer = QuantizedLayer(parse_precision(precision))
    layer.update(torch.randn(B, HKV, prompt, D, generator=g), torch.randn(B, HKV, prompt, D, generator=g))
    layer.warm_up()  # what runner.prefill does on CUDA: the flushes' variants, compiled before decoding
    prefill = set(launches)
    flushes = 0
    seen_by_step = []
    for _ in range(256):
        before = layer.regions.quantized
        layer.update(torch.randn(B, HKV, 1, D, generator=g), torch.randn(B, HKV, 1, D, generator=g))
        flushes += layer.regions.quantized > before
        triton_decode.past_attention(torch.randn(B, HQ, 1, D, generator=g), layer.packed(), D**-0.5)
        seen_by_step.append(set(launches))
        launches.clear()
    assert flushes >= 1  # the steps cross at least one flush of a block into codes
    warm = prefill | seen_by_step[0]
    assert {name for name, _ in seen_by_step[0]} >= {"_decode_split_kernel", "_merge_kernel"}
    for step, seen in enumerate(seen_by_step[1:], start=1):
        new = {name for name, key in seen if (name, key) not in warm}
        assert not new, f"step {step} of {precision} after {prompt} tokens launches a new variant of {new}"


def test_without_the_warm_up_the_first_flush_compiles_inside_the_decode(launches):
    """A prompt shorter than the residual window codes nothing while it is prefilled: its first flush, some
    steps into the decode, is the first launch of the quantize kernels (what `warm_up` moves before it)."""
    g = torch.Generator().manual_seed(0)
    layer = QuantizedLayer(parse_precision("int4"))
    layer.update(torch.randn(B, HKV, 100, D, generator=g), torch.randn(B, HKV, 100, D, generator=g))
    assert not launches
    for _ in range(28):  # 128 tokens: the residual fills and its block is coded
        layer.update(torch.randn(B, HKV, 1, D, generator=g), torch.randn(B, HKV, 1, D, generator=g))
    assert {name for name, _ in launches} == {"_quantize_kernel"}


def test_the_key_sees_what_triton_specializes():
    """The key follows Triton's rules: an integer 1 is a constant, one divisible by 16 another class, and the
    names a kernel does not specialize keep one class whatever their value."""
    kernel = triton_decode._merge_kernel
    out = torch.empty(64)
    args = lambda parts, m: (out, out, out, out, parts, m)  # noqa: E731
    kw = {"BLOCK_M": 16, "D": 64, "num_warps": 4}
    keys = {specialization_key(kernel, args(p, 16), kw) for p in (1, 2, 16, 17)}
    assert len(keys) == 1  # n_parts is not specialized
    m_keys = {specialization_key(kernel, args(3, m), kw) for m in (1, 2, 16, 17)}
    assert len(m_keys) == 3  # M is: 1, divisible by 16, neither
