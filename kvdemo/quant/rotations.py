"""Rotations around quantization: the model's rotary embedding (for pre-RoPE keys) and a Hadamard matrix.

Pre-RoPE keys (KVQuant): the model hands the cache keys after RoPE; `Rope.undo` turns them back from their
absolute positions and `Rope.apply` turns dequantized keys forward again when they are read. Both use
the model's own rotary module, so its scaling (linear, llama3, yarn, attention_scaling) is whatever the
model does; the rotate-half layout is the one every supported family uses, over the first
`rotary_dim` channels (partial rotary: the rest pass through).

Hadamard (QuaRot, llama.cpp's rotated quantized cache): an orthonormal matrix R = diag(s) H / sqrt(D)
with random signs s (fixed seed). Stored keys and values are x @ R; scores use (q @ R) . (k @ R) = q . k
and the output of rotated values is turned back with R^T. Rotation spreads an outlier channel over all
channels, so the per-group ranges shrink.
"""

from __future__ import annotations

import functools
import inspect

import torch

SIGN_SEED = 0x5EED


@functools.cache
def _hadamard_cpu(d: int) -> torch.Tensor:
    if d < 2 or d & (d - 1):
        raise ValueError(f"hadamard needs a power-of-two head_dim, not {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:  # Sylvester: [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    gen = torch.Generator().manual_seed(SIGN_SEED)
    signs = torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1
    return (signs[:, None] * h) / d**0.5  # diag(s) @ H / sqrt(d): orthonormal


def hadamard(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal rotation R [d, d] fp32 (d a power of two): stored x' = x @ R, x = x' @ R.T."""
    return _hadamard_cpu(d).to(device)


UNSUPPORTED_ROPE = ("dynamic", "longrope")  # their cos/sin depend on the sequence length, not the position alone


class Rope:
    """cos / sin of a model's rotary embedding at absolute positions, to undo and redo it on keys."""

    def __init__(self, rotary_emb: torch.nn.Module):
        self.rotary_emb = rotary_emb
        self._cos = self._sin = None  # fp32 [P, rotary_dim] tables for positions [0, P), grown on demand

    @classmethod
    def from_model(cls, model) -> Rope:
        """The model's rotary embedding, or ValueError saying why pre-RoPE keys cannot be used with it."""
        inner = getattr(model, "model", model)
        if hasattr(inner, "rotary_emb_local") or hasattr(getattr(inner, "language_model", None), "rotary_emb_local"):
            raise ValueError("prerope: this model uses different rotary embeddings per layer type (Gemma-3)")
        emb = getattr(inner, "rotary_emb", None) or getattr(model, "rotary_emb", None)
        if emb is None:
            raise ValueError("prerope: the model has no rotary embedding module (rotary_emb) to undo")
        if "layer_type" in inspect.signature(emb.forward).parameters:  # transformers >= 5: one module, per-type tables
            raise ValueError("prerope: this model uses different rotary embeddings per layer type (Gemma-3)")
        kind = str(getattr(emb, "rope_type", "default"))
        if any(k in kind for k in UNSUPPORTED_ROPE):
            raise ValueError(f"prerope: rope_type {kind!r} depends on the sequence length, so keys cannot be undone")
        return cls(emb)

    def tables(self, start: int, stop: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) fp32 [stop - start, rotary_dim] of positions [start, stop)."""
        if self._cos is None or self._cos.shape[0] < stop or self._cos.device != torch.device(device):
            size = max(stop, 2 * (0 if self._cos is None else self._cos.shape[0]), 256)
            pos = torch.arange(size, device=device)[None]
            probe = torch.zeros(1, dtype=torch.float32, device=device)
            with torch.no_grad():
                cos, sin = self.rotary_emb(probe, pos)
            cos, sin = cos[0].float(), sin[0].float()
            inv_freq = getattr(self.rotary_emb, "inv_freq", None)
            if inv_freq is not None and cos.shape[-1] == inv_freq.numel():  # one entry per frequency (gpt-oss):
                cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # its halves rotation is rotate_half's
            self._cos, self._sin = cos, sin
        return self._cos[start:stop], self._sin[start:stop]

    def _turn(self, x: torch.Tensor, start: int, sign: float) -> torch.Tensor:
        cos, sin = self.tables(start, start + x.shape[-2], x.device)
        rd = cos.shape[-1]
        x = x.float()
        rot, rest = x[..., :rd], x[..., rd:]
        half = rd // 2
        turned_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)  # rotate_half
        out = rot * cos + sign * turned_half * sin
        if sign < 0:  # the model's cos/sin may carry attention_scaling a: R = a * rotation, R^-1 = R^T / a^2
            out = out / (cos * cos + sin * sin)
        return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)

    def apply(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x [..., T, D] fp32 keys at positions [start, start + T) before RoPE -> after (as the model does)."""
        return self._turn(x, start, 1.0)

    def undo(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Inverse of `apply`: keys after RoPE -> before, exactly up to float error."""
        return self._turn(x, start, -1.0)
