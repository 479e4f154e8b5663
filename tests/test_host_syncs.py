"""A decode step makes no host sync but the sampled token's.

On a GPU, reading a tensor's value on the host (`.item()`, `int(t)`, `bool(t)`, `t.tolist()`) waits for every
kernel queued before it, so one such read per layer would leave the GPU idle between layers. Here every op that
reads a value back (`aten._local_scalar_dense` and friends) is counted while the runner decodes, through the
PyTorch reference and through the Triton launchers (under the CPU interpreter, whose own reads go through numpy,
not these ops): greedy decoding's one `int(argmax)` per token is the only read.
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvdemo import runner
from kvdemo.measured import SCALE_MODEL
from kvdemo.models import random_model
from kvdemo.quant.backend import BACKEND_ENV

READS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.equal", "aten.item", "aten.allclose")


class HostReads(TorchDispatchMode):
    """Counts the ops that bring a tensor's value to the host."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in READS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def lm():
    return random_model(SCALE_MODEL, "cpu")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("precision", ["int4:g32:r32", "k8v4:g32:r32:s4", "full"])
def test_a_decode_step_reads_back_only_its_token(lm, monkeypatch, backend, precision):
    monkeypatch.setenv(BACKEND_ENV, backend)
    cache = runner.new_cache(lm, precision)
    first = runner.prefill(lm, list(range(1, 101)), cache)
    steps = 40  # at a 32-token residual: a block is coded along the way
    with HostReads() as reads:
        tokens, _, reason, _ = runner.generate(lm, cache, first, steps)
    assert reason == "length" and len(tokens) == steps  # random weights never stop early (no eos)
    assert dict(reads.counts) == {"aten._local_scalar_dense": steps}, reads.counts  # int(argmax), once a token
    assert cache.get_seq_length() == 100 + steps - 1


def test_the_counter_sees_a_read(lm):
    with HostReads() as reads:
        bool(torch.ones(3).all())
        torch.tensor([2.0]).item()
    assert reads.counts["aten._local_scalar_dense"] == 2
