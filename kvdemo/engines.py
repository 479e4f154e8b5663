"""Other engines' KV caches as kvdemo names them: llama.cpp's cache types (``-ctk/-ctv``), their sizes, and the
contender grammar ``llama.cpp:<type>`` / ``llama.cpp:<key type>/<value type>`` that the perplexity, needle and
probe commands read beside kvdemo's precision strings.

Data only: running llama.cpp is kvdemo/llamacpp.py. ``llama.cpp:f16`` is llama.cpp's own full row; a llama.cpp
row is read against it (`baseline_of`), never against kvdemo's full row, since the two engines' kernels differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PREFIX = "llama.cpp:"  # a row of another engine: llama.cpp's own KV cache

FULL = "f16"


@dataclass(frozen=True)
class CacheType:
    """One of llama.cpp's KV cache types: its ggml type id and block layout (ggml-common.h)."""

    name: str
    ggml_type: int  # enum ggml_type
    code_bits: int  # bits per code (16: f16, no codes)
    block: int  # elements per block
    block_bytes: int  # bytes per block: codes, scale(s) and, for q*_1, a minimum

    @property
    def bits(self) -> float:
        return 8 * self.block_bytes / self.block


CACHE_TYPES = {
    t.name: t
    for t in (
        CacheType("f16", 1, 16, 1, 2),
        CacheType("q8_0", 8, 8, 32, 34),  # fp16 scale + 32 int8
        CacheType("q5_1", 7, 5, 32, 24),  # fp16 scale, fp16 min, 32 high bits, 16 bytes of nibbles
        CacheType("q5_0", 6, 5, 32, 22),
        CacheType("q4_1", 3, 4, 32, 20),  # fp16 scale, fp16 min, 16 bytes of nibbles
        CacheType("iq4_nl", 20, 4, 32, 18),  # fp16 scale, 16 nibbles indexing a fixed non-uniform table
        CacheType("q4_0", 2, 4, 32, 18),  # fp16 scale, 16 bytes of nibbles
    )
}


class LlamaCppError(ValueError):
    """A llama.cpp contender that cannot run: the binding missing, a model without a GGUF file, a bad type."""


@dataclass(frozen=True)
class KvTypes:
    """A llama.cpp contender: the cache types of its keys and values."""

    key: str
    value: str

    @property
    def label(self) -> str:
        return PREFIX + (self.key if self.key == self.value else f"{self.key}/{self.value}")

    @property
    def is_quantized(self) -> bool:
        return (self.key, self.value) != (FULL, FULL)

    @property
    def bits_per_element(self) -> float:
        return (CACHE_TYPES[self.key].bits + CACHE_TYPES[self.value].bits) / 2

    def flags(self) -> str:
        """The llama.cpp command-line flags that select this cache (llama-server, llama-cli)."""
        return f"-ctk {self.key} -ctv {self.value} -fa on"


def baseline_of(precision: str) -> str:
    """The row a result row is read against: its own engine's full row ("full", or llama.cpp's f16 row)."""
    return PREFIX + FULL if is_llamacpp(precision) else "full"


def is_llamacpp(text: str) -> bool:
    return str(text).strip().lower().startswith(PREFIX)


def parse_kv(text: str) -> KvTypes:
    """``llama.cpp:q4_0`` or ``llama.cpp:q8_0/q4_0`` (keys/values) -> KvTypes, or a LlamaCppError naming the types."""
    body = str(text).strip().lower()
    if not body.startswith(PREFIX):
        raise LlamaCppError(f"{text!r} is not a llama.cpp contender (write llama.cpp:<type>, e.g. llama.cpp:q4_0)")
    parts = body[len(PREFIX) :].split("/")
    if len(parts) not in (1, 2) or not all(p in CACHE_TYPES for p in parts):
        raise LlamaCppError(
            f"unknown llama.cpp cache type in {text!r}; types: {', '.join(CACHE_TYPES)} "
            "(llama.cpp:<type> or llama.cpp:<key type>/<value type>)"
        )
    return KvTypes(parts[0], parts[-1])


def split_contenders(text: str | Sequence) -> tuple[list, list[KvTypes]]:
    """A precision list (``full,int4,llama.cpp:q4_0``, or a sequence of strings and kvdemo precision objects) ->
    (kvdemo precisions as given, llama.cpp contenders); llama.cpp's own f16 row comes first among its contenders
    whenever any is given (their reference)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    items = [t.strip() if isinstance(t, str) else t for t in items if not isinstance(t, str) or t.strip()]
    named = [t for t in items if isinstance(t, str) and is_llamacpp(t)]
    ours = [t for t in items if not (isinstance(t, str) and is_llamacpp(t))]
    theirs = list(dict.fromkeys(parse_kv(t) for t in named))
    if theirs:
        theirs = [KvTypes(FULL, FULL)] + [k for k in theirs if k.is_quantized]
    return ours, theirs


def kv_bytes(n_layers: int, kv_width: int, tokens: int, kv: KvTypes) -> int:
    """Bytes of llama.cpp's cache holding `tokens` tokens: per layer and token a row of `kv_width` (kv heads x
    head dim) elements for keys and one for values, each a whole number of its type's blocks."""
    rows = 0
    for name in (kv.key, kv.value):
        t = CACHE_TYPES[name]
        if kv_width % t.block:
            raise LlamaCppError(f"llama.cpp's {name} cache needs rows of a multiple of {t.block} elements")
        rows += kv_width // t.block * t.block_bytes
    return n_layers * tokens * rows
