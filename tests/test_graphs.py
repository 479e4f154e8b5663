"""Decode steps that a CUDA graph can replay (kvdemo.graphs), checked on the CPU.

`record` stands in for CUDA's capture: the step runs once while every aten op and Triton launch it makes is
recorded with its tensors; `replay` runs the same ops on the same tensors again, writing each functional op's
result into the tensor the capture produced (what a graph's private memory pool does) and keeping every host
value the capture saw (view offsets, sizes, integers), as a graph does. A host read (`.item()`, `bool()`) fails
the recording, as it fails a capture. The Triton kernels run interpreted (TRITON_INTERPRET=1) on CPU tensors.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

pytest.importorskip("triton")
from kvdemo import graphs, runner  # noqa: E402
from kvdemo.models import random_model  # noqa: E402
from kvdemo.quant import triton_decode, triton_quantize  # noqa: E402
from kvdemo.quant.backend import BACKEND_ENV  # noqa: E402

pytestmark = pytest.mark.triton
KERNELS = {
    triton_decode: ("_decode_split_kernel", "_merge_kernel"),
    triton_quantize: ("_quantize_kernel", "_quantize_methods_kernel", "_quantize_nvfp4_kernel"),
}
HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}
SHAPE = {  # a small Llama: 2 layers, GQA 2:1, head_dim 64 (the kernels' smallest supported shapes are larger)
    "name": "tiny",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "layers": 2,
    "attention_heads": 4,
    "kv_heads": 2,
    "head_dim": 64,
    "max_context": 1024,
    "tie_word_embeddings": False,
}


class Tape(TorchDispatchMode):
    """Records the aten ops (views excepted: they only alias) and Triton launches run inside it."""

    active: "Tape | None" = None

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []
        self.paused = False

    def __enter__(self):
        Tape.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        Tape.active = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused and func in HOST_READS:
            raise RuntimeError(f"a host read ({func}) inside a captured step")
        out = func(*args, **kwargs)
        aliases = any(r.alias_info is not None for r in func._schema.returns) and not func._schema.is_mutable
        if not self.paused and not aliases:
            self.ops.append(("aten", func, args, kwargs, out))
        return out


class Launch:
    """Stands in for a Triton kernel: runs it, and records the launch on the active tape."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            tape = Tape.active
            if tape is None:
                return self.kernel[grid](*args, **kwargs)
            tape.paused = True  # the interpreter's own tensor traffic is not the step's
            try:
                self.kernel[grid](*args, **kwargs)
            finally:
                tape.paused = False
            tape.ops.append(("triton", self.kernel, grid, args, kwargs))

        return launch


def replay_tape(tape: Tape) -> None:
    for kind, fn, a, b, c in tape.ops:
        if kind == "triton":
            fn[a](*b, **c)
            continue
        result = fn(*a, **b)
        if not fn._schema.is_mutable:  # write into the tensors the capture made
            for mine, new in zip(tree_leaves(c), tree_leaves(result), strict=True):
                if isinstance(mine, torch.Tensor):
                    mine.copy_(new)


def record(step):
    """The CPU stand-in for `graphs.cuda_capture`: (replay, the step's output)."""
    tape = Tape()
    with tape:
        out = step()
    return (lambda: replay_tape(tape)), out


@pytest.fixture
def triton_on_cpu(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "triton")
    for module, names in KERNELS.items():
        for name in names:
            monkeypatch.setattr(module, name, Launch(getattr(module, name)))


def decode(lm, precision: str, prompt: list[int], new_tokens: int, capture):
    """Greedy decode through `DecodeSteps`; (tokens, logits per step, the steps' counts, the cache)."""
    cache = runner.new_cache(lm, precision)
    logits = runner.prefill(lm, prompt, cache)
    steps = graphs.DecodeSteps(lm, cache, capture, new_tokens)
    tokens, seen = [], []
    for _ in range(new_tokens):
        tokens.append(int(torch.argmax(logits)))
        logits = steps.step(tokens[-1])
        seen.append(logits)
    return tokens, seen, steps.counts, cache


@pytest.mark.parametrize("precision", ["int4:g16:r16", "k8v4:g16:r16", "full"])
def test_replayed_steps_decode_what_eager_steps_decode(triton_on_cpu, precision):
    """Decoding across flushes with steps replayed from a recording gives the eager decode's tokens and logits,
    bit for bit, and the same cache: the replayed step's writes land at the rows the lengths on the device say."""
    torch.manual_seed(0)
    lm = random_model(SHAPE)
    prompt = torch.randint(1, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    eager_tokens, eager_logits, eager_counts, eager_cache = decode(lm, precision, prompt, 36, None)
    tokens, logits, counts, cache = decode(lm, precision, prompt, 36, record)
    assert eager_counts == {"eager": 36, "captured": 0, "replayed": 0}
    assert counts["captured"] == 1 and counts["replayed"] >= 28, counts  # flushes and the first step: eager
    assert tokens == eager_tokens
    for step, (a, b) in enumerate(zip(logits, eager_logits, strict=True)):
        assert torch.equal(a, b), f"step {step}: logits differ"
    for mine, theirs in zip(cache.layers, eager_cache.layers, strict=True):
        assert mine.regions == theirs.regions
        assert torch.equal(mine.lengths, theirs.lengths)
        for a, b in zip(mine.packed().dequantized(), theirs.packed().dequantized(), strict=True):
            assert torch.equal(a, b)


def _launch_signature(tape: Tape) -> list:
    """Each Triton launch of a recorded step: grid, integers, and each tensor as its address, or, for a tensor
    the step made itself (from a graph's pool on a GPU), which of the step's ops made it."""
    made = {}
    for i, entry in enumerate(tape.ops):
        if entry[0] == "aten":
            for t in tree_leaves(entry[4]):
                if isinstance(t, torch.Tensor):
                    made.setdefault(t.untyped_storage().data_ptr(), i)
    out = []
    for _kind, kernel, grid, args, kwargs in (e for e in tape.ops if e[0] == "triton"):
        keys = []
        for a in [*args, *sorted(kwargs.items())]:
            if isinstance(a, torch.Tensor):
                ptr = a.untyped_storage().data_ptr()
                keys.append(("made", made[ptr]) if ptr in made else ("at", a.data_ptr()))
            else:
                keys.append(a)
        out.append((kernel.fn.__name__, grid, tuple(keys)))
    return out


def test_two_consecutive_steps_launch_the_same_pointers_and_integers(triton_on_cpu):
    """What a graph replays: two static steps in a row launch the same kernels on the same grid with the same
    integers and the same cache addresses (and scratch); and the step makes no host read."""
    torch.manual_seed(0)
    lm = random_model(SHAPE)
    cache = runner.new_cache(lm, "int4:g16:r16")
    logits = runner.prefill(lm, list(range(1, 41)), cache)
    steps = graphs.DecodeSteps(lm, cache, None)
    logits = steps.step(int(torch.argmax(logits)))  # the first step after the prefill
    tapes = []
    for _ in range(2):
        assert all(layer.next_is_static() for layer in cache.layers)
        token = int(torch.argmax(logits))  # sampling's host read, outside the step
        tape = Tape()
        with tape:
            logits = steps.step(token)
        tapes.append(tape)
    first, second = (_launch_signature(t) for t in tapes)
    assert {name for name, _, _ in first} == {"_decode_split_kernel", "_merge_kernel"}
    assert first == second


def test_the_step_before_a_flush_is_not_static(triton_on_cpu):
    """A step that would code a block (a flush) runs eagerly: `next_is_static` is False exactly there."""
    lm = random_model(SHAPE)
    cache = runner.new_cache(lm, "int4:g16:r16")
    runner.prefill(lm, list(range(1, 41)), cache)
    cache.reserve(80)  # room for the appends below: no growth, so only a flush makes a step not static
    layout, layer = cache.layers[0].layout, cache.layers[0]
    for _token in range(40):
        flushes = layout.after_append(layer.regions, 1).quantized > layer.regions.quantized
        assert layer.next_is_static() == (not flushes)
        cache.update(*(torch.zeros(1, 2, 1, 64) for _ in range(2)), 0)


def test_graphs_are_off_where_they_cannot_work(monkeypatch):
    lm = random_model(SHAPE)
    assert "CUDA" in graphs.graphs_blocker(lm, runner.new_cache(lm, "int4"))
    assert graphs.DecodeSteps(lm, runner.new_cache(lm, "int4")).capture is None
    monkeypatch.setenv(graphs.GRAPHS_ENV, "0")
    assert graphs.graphs_blocker(lm, runner.new_cache(lm, "int4")) == f"{graphs.GRAPHS_ENV}=0"


def test_a_failed_capture_leaves_an_eager_decode_with_the_same_tokens(triton_on_cpu):
    """A capture that fails is undone: the step runs eagerly, capture stays off (the reason kept), and the decode's
    tokens are the eager decode's."""
    lm = random_model(SHAPE)
    prompt = list(range(1, 41))

    def broken(step):
        raise RuntimeError("operation not permitted when stream is capturing")

    tokens, _, counts, _ = decode(lm, "int4:g16:r16", prompt, 8, broken)
    eager_tokens, _, _, _ = decode(lm, "int4:g16:r16", prompt, 8, None)
    assert tokens == eager_tokens
    assert counts == {"eager": 8, "captured": 0, "replayed": 0}
