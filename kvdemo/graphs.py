"""Decode steps replayed from a captured CUDA graph.

A decode step launches a few hundred small kernels (each layer: projections, RoPE, the cache append, the split
and merge attention kernels); on a GPU the host's time to issue them, not the GPU, sets the pace of a small model
or a short context. A CUDA graph records the step's launches once and replays them with one call. That is only
right if the next step launches the same kernels with the same pointers and integers, and between flushes
kvdemo's cache makes it so (`QuantizedLayer.next_is_static`):

- the new token's key/value is written at the residual length held on the device (`_Growable.append_at`), and
  that length is advanced on the device: the host's length is never baked into the graph;
- the decode kernel reads the regions' lengths from the device and runs on a fixed grid (programs with no
  work exit), so its arguments do not depend on the length;
- buffers are reserved, so they do not move; a step that would flush a block, fill a sink or grow a buffer
  runs eagerly, and a buffer that moved (`QuantizedLayer.buffers`) discards the graph, captured again at the
  next static step.

The host's part of a replayed step (the regions, the buffers' lengths) is `QuantizedLayer.advance`. The model
is called with its token and position in static tensors (written before each replay). `DecodeSteps` is the
loop's step: eager, capture or replay; `capture` is a parameter so tests can stand a CPU recorder in for CUDA.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from .cache import QuantizedKVCache
from .models import LoadedModel
from .quant.backend import backend_for

GRAPHS_ENV = "KVDEMO_CUDA_GRAPHS"  # "0" decodes eagerly on CUDA too


def graphs_blocker(lm: LoadedModel, cache) -> str | None:
    """Why decode steps of `cache` on `lm` cannot be captured (None when they can): CUDA, the Triton backend,
    kvdemo's cache, and a format whose decode arguments do not depend on the length."""
    if os.environ.get(GRAPHS_ENV, "").strip() == "0":
        return f"{GRAPHS_ENV}=0"
    if lm.device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {lm.device.type}"
    if any(p.device != lm.device for p in lm.model.parameters()):  # a graph would skip the other device's work
        return "the model is split across devices"
    if not isinstance(cache, QuantizedKVCache):
        return "only kvdemo's cache keeps its lengths on the device"
    if backend_for(lm.device) != "triton":
        return "the PyTorch reference reads the cache with host lengths"
    return static_format_blocker(cache)


def static_format_blocker(cache: QuantizedKVCache) -> str | None:
    """Formats whose decode launch depends on the length on the host: value rotations (the quantized splits'
    outputs are turned back on the host's split count), pre-RoPE keys (cos/sin tables of the coded rows), a
    bf16 model (its exact rows are clamped to fp16 by a copy sized by the length)."""
    spec = cache.spec
    if spec.hadamard:
        return "Hadamard-rotated values are turned back by a host-sized slice"
    if spec.pre_rope:
        return "pre-RoPE keys read cos/sin tables sized by the length"
    dtypes = {layer.dtype for layer in cache.layers if layer.is_initialized}
    if torch.bfloat16 in dtypes:
        return "bf16 exact rows are clamped to fp16 by a copy sized by the length"
    return None


def cuda_capture(step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """Capture `step` as a CUDA graph; return (replay, the step's output tensor, refreshed by each replay).
    Capturing records without running, so the graph is replayed once here: the captured step happens."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        out = step()
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    return graph.replay, out


class DecodeSteps:
    """The steps of one greedy decode over `cache`: `step(token)` appends `token` and returns the float32 logits
    [vocab] of the next one, eagerly or by replaying a captured step. With `batch` B > 1 the cache holds B
    sequences of one length ([B, H, T, D] buffers): `step_batch(tokens)` appends one token to each and returns
    logits [B, vocab].

    capture: `cuda_capture` (the default where `graphs_blocker` says nothing), None for eager steps only, or a
    stand-in with the same contract (tests). new_tokens: the most tokens the decode appends; with capture on,
    the cache reserves room for them (a buffer that grows moves, and the graph is captured again). Counts of
    each kind of step are kept for reports.
    """

    def __init__(
        self, lm: LoadedModel, cache, capture: Callable | None | str = "auto", new_tokens: int = 0, batch: int = 1
    ):
        self.lm, self.cache = lm, cache
        if capture == "auto":
            self.blocker = graphs_blocker(lm, cache)
            capture = None if self.blocker else cuda_capture
        else:
            self.blocker = None if capture is not None else "capture off"
        self.capture = capture
        if capture is not None and new_tokens:  # buffers sized for the whole decode: no growth moves them
            cache.reserve(cache.get_seq_length() + new_tokens)
        self.token = torch.zeros((batch, 1), dtype=torch.long, device=lm.device)  # static inputs of the step
        self.position = torch.zeros(1, dtype=torch.long, device=lm.device)
        self.replay, self.logits, self.buffers = None, None, None
        self.counts = {"eager": 0, "captured": 0, "replayed": 0}

    def _forward(self) -> torch.Tensor:
        out = self.lm.model(
            input_ids=self.token,
            position_ids=self.position[None],
            cache_position=self.position,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()  # [B, vocab]

    def _static(self) -> bool:
        return self.capture is not None and all(layer.next_is_static() for layer in self.cache.layers)

    def _buffers(self) -> tuple:
        return tuple(layer.buffers() for layer in self.cache.layers)

    def step(self, token: int) -> torch.Tensor:
        return self.step_batch([token])[0]

    @torch.no_grad()
    def step_batch(self, tokens) -> torch.Tensor:
        """tokens: one per sequence, ints or an int64 tensor [B] on the device. Returns logits [B, vocab]."""
        if isinstance(tokens, torch.Tensor):
            self.token.copy_(tokens.view(-1, 1))
        elif len(tokens) == 1:
            self.token.fill_(int(tokens[0]))
        else:
            self.token.copy_(torch.tensor(tokens, dtype=torch.long).view(-1, 1))
        self.position.fill_(self.cache.get_seq_length())
        if not self._static():
            self.counts["eager"] += 1
            logits = self._forward()
            if self.replay is not None and self._buffers() != self.buffers:
                self.replay = None  # a buffer moved (a growth): capture again at the next static step
            return logits
        if self.replay is None:
            if not self.counts["eager"]:  # the first step runs eagerly: kernels compiled, scratch allocated
                self.counts["eager"] += 1
                return self._forward()
            return self._capture()
        self.replay()
        for layer in self.cache.layers:
            layer.advance()
        self.counts["replayed"] += 1
        return self.logits.clone()

    def _capture(self) -> torch.Tensor:
        """Capture this step (its host part happens while capturing); on failure, undo the host part and run
        the step eagerly, with capture off for the rest of the decode (the reason kept in `blocker`)."""
        saved = [_host_state(layer) for layer in self.cache.layers]
        try:
            self.replay, self.logits = self.capture(self._forward)
        except Exception as err:  # noqa: BLE001 - any capture failure leaves eager decoding, which works
            for layer, state in zip(self.cache.layers, saved, strict=True):
                _restore_host_state(layer, state)
            self.capture, self.replay, self.blocker = None, None, f"capture failed: {err}"
            self.counts["eager"] += 1
            return self._forward()
        self.buffers = self._buffers()
        self.counts["captured"] += 1
        return self.logits.clone()


def _host_state(layer) -> tuple:
    return layer.regions, layer.keys.residual.length, layer.values.residual.length


def _restore_host_state(layer, state: tuple) -> None:
    layer.regions, layer.keys.residual.length, layer.values.residual.length = state
