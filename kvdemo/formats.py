"""The KV storage formats: one entry per format, read by everything that depends on one.

A `Format` says, in one place, what the rest of kvdemo needs to know about a way of storing cached keys or
values:

- its names: in precision strings (``int4``), as one part of ``k<key>v<value>`` (``4``), as a preset when keys
  and values share it (``fp8`` for ``fp8_e4m3``) -- the parser (kvdemo/precision.py) reads these;
- its size: code bits, how its group scales and zero points are stored, a second-level block scale, a
  per-layer codebook -- `bits_per_element` (the size formulas, kvdemo/layout.py, kvdemo/memory.py) reads these;
- its rules: whether keys may be scaled per channel, whether sparse outliers (``o<pct>``) can narrow its range;
- its reference codec: ``family`` names the PyTorch encoder/decoder in kvdemo/quant/codecs.py, the ground
  truth the cache falls back to wherever no kernel takes the format;
- what the Triton kernels need: which kernels read it (``kernels``) and the constexpr ids they dispatch on.

docs/adding-a-format.md walks through adding one. `registered` adds formats for a while (the tests add a toy
1-bit format that way and run it through a cache, the size formula and a perplexity call).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

FAMILIES = ("int", "fp8", "nuq", "nvfp4")  # the reference codecs (kvdemo/quant/codecs.py)
ZEROS = ("always", "along-tokens", "never")  # where a group stores a zero point besides its scale
KERNELS = ("quantize", "quantize-methods", "decode")  # Triton kernels that may read a format


@dataclass(frozen=True)
class Format:
    """One way of storing cached keys or values (module docstring)."""

    name: str  # in precision strings: "int4"
    family: str  # FAMILIES: the reference codec that encodes and decodes it
    bits: int  # bits per code (3: bit-sliced, three planes of 1-bit codes)
    part: str  # its name as one part of k<key>v<value>: "4", "fp8", "nuq3"
    preset: str = ""  # the preset name when keys and values share it, if not `name` ("fp8" for fp8_e4m3)
    zero: str = "never"  # ZEROS: "always" (asymmetric codes), "along-tokens" (only groups along tokens, i.e.
    # per-channel keys: [min, max]), "never" (absmax scaling)
    scale_bits: int = 16  # bits of each group's scale (an fp16; nvfp4: an E4M3 byte); a zero point is 16 bits
    fixed_group: int = 0  # channels per scale whatever the spec's group size (nvfp4: 16); 0: the spec's group
    block_scale_bits: int = 0  # a second-level scale per block of group_size tokens and head (nvfp4: fp32)
    keys_per_token: bool = False  # it scales along channels only: keys are quantized per token too
    narrowable: bool = False  # o<pct> keeps outliers exact and narrows the codes' range to the rest
    codebook: bool = False  # per-layer levels fitted offline: 2^bits fp16 levels per layer and part
    kernels: frozenset[str] = frozenset()  # KERNELS that read it; the rest of the work goes to the reference
    fp8_code: int = 0  # the kernels' constexpr id of an fp8 format (0: not fp8)
    fp8_dtype: str = ""  # fp8 codes: the torch dtype they are ("float8_e4m3fn") and its largest value
    fp8_max: float = 0.0
    code_kind: int = 0  # the decode kernel's K_CODE / V_CODE: 0 integer or fp8 codes, 1 codebook, 2 nvfp4

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"format {self.name!r}: unknown family {self.family!r}; allowed: {', '.join(FAMILIES)}")
        if self.zero not in ZEROS:
            raise ValueError(f"format {self.name!r}: unknown zero rule {self.zero!r}; allowed: {', '.join(ZEROS)}")
        if not 1 <= self.bits <= 8 or (8 % self.bits and self.bits != 3):
            raise ValueError(f"format {self.name!r}: {self.bits}-bit codes cannot be packed (1, 2, 3, 4 or 8 bits)")
        if not set(self.kernels) <= set(KERNELS):
            raise ValueError(f"format {self.name!r}: unknown kernels {sorted(set(self.kernels) - set(KERNELS))}")

    @property
    def label(self) -> str:
        """Its name as a precision when keys and values share it: `int4`, `fp8`."""
        return self.preset or self.name

    @property
    def planar(self) -> bool:
        """Uniform integer or fp8 codes packed planar, 8 // bits per byte (not bit-sliced): what the plain
        fast paths read."""
        return self.family in ("int", "fp8") and self.bits != 3

    @property
    def levels(self) -> int:
        """Codebook entries per layer and part (2^bits for codebook formats, else 0)."""
        return 1 << self.bits if self.codebook else 0

    def has_zero(self, axis: str) -> bool:
        """Whether its groups along `axis` ("channel": groups of tokens, per-channel keys; "token": groups of
        channels) store a zero point besides their scale."""
        return self.zero == "always" or (self.zero == "along-tokens" and axis == "channel")

    def group(self, group_size: int, head_dim: int, axis: str) -> int:
        """Elements per scale: tokens per group along "channel", channels per group along "token"."""
        if self.fixed_group:
            return self.fixed_group
        return group_size if axis == "channel" else min(group_size, head_dim)

    def meta_bits(self, axis: str, group_size: int, head_dim: int) -> float:
        """Metadata bits per element: the group's scale (and zero point) over its elements, plus a block scale
        over the group_size x head_dim elements of its block."""
        group = self.group(group_size, head_dim, axis)
        per_group = self.scale_bits + 16 * self.has_zero(axis)
        return per_group / group + self.block_scale_bits / (group_size * head_dim)

    def packed_width(self, head_dim: int) -> int:
        """Bytes of one stored row of `head_dim` codes (ValueError when head_dim cannot be packed)."""
        unit = 8 if self.bits == 3 else 8 // self.bits  # 3-bit: 1-bit planes of 8 channels per byte
        if head_dim % unit:
            raise ValueError(
                f"head_dim {head_dim} cannot be packed {self.bits} bits per code (needs a multiple of {unit})"
            )
        return head_dim * self.bits // 8


def _int(bits: int, kernels: tuple[str, ...]) -> Format:
    return Format(f"int{bits}", "int", bits, str(bits), zero="always", narrowable=True, kernels=frozenset(kernels))


def _nuq(bits: int) -> Format:
    kernels = frozenset({"quantize-methods", "decode"})
    return Format(f"nuq{bits}", "nuq", bits, f"nuq{bits}", zero="along-tokens", narrowable=True, codebook=True,
                  kernels=kernels, code_kind=1)  # fmt: skip


_ALL_KERNELS = ("quantize", "quantize-methods", "decode")
BUILT_IN = (
    _int(8, _ALL_KERNELS),
    _int(4, _ALL_KERNELS),
    _int(3, ("quantize-methods", "decode")),
    _int(2, _ALL_KERNELS),
    Format(
        "fp8_e4m3",
        "fp8",
        8,
        "fp8",
        preset="fp8",
        kernels=frozenset({"quantize", "decode"}),
        fp8_code=1,
        fp8_dtype="float8_e4m3fn",
        fp8_max=448.0,
    ),  # fmt: skip
    Format(
        "fp8_e5m2",
        "fp8",
        8,
        "fp8-e5m2",
        preset="fp8-e5m2",
        kernels=frozenset({"quantize", "decode"}),
        fp8_code=2,
        fp8_dtype="float8_e5m2",
        fp8_max=57344.0,
    ),  # fmt: skip
    _nuq(4),
    _nuq(3),
    _nuq(2),
    Format(
        "nvfp4",
        "nvfp4",
        4,
        "nvfp4",
        scale_bits=8,
        fixed_group=16,
        block_scale_bits=32,
        keys_per_token=True,
        kernels=frozenset({"quantize-methods", "decode"}),
        code_kind=2,
    ),  # fmt: skip
)
FULL = "full"  # not a Format: the model's own dtype, nothing coded
_REGISTRY: dict[str, Format] = {f.name: f for f in BUILT_IN}


def get(name: str) -> Format:
    """The format named `name` (ValueError listing the formats when there is none)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; formats: {', '.join(names())}") from None


def names() -> list[str]:
    """Every format's name, full precision first: the order pickers and error messages list them in."""
    return [FULL, *_REGISTRY]


def all_formats() -> list[Format]:
    return list(_REGISTRY.values())


def by_part(part: str) -> Format | None:
    """The format a part of `k<key>v<value>` names: its part name (`8`, `fp8`) or its own name (`int8`)."""
    for f in _REGISTRY.values():
        if part in (f.part, f.name):
            return f
    return None


def code_bits(name: str) -> int:
    """Bits per code of a format; 16 for full precision (the model's 16-bit serving dtype)."""
    return 16 if name == FULL else get(name).bits


@contextlib.contextmanager
def registered(*formats: Format) -> Iterator[None]:
    """Add `formats` while the block runs (a test's toy format); the registry is restored afterwards."""
    clash = [f.name for f in formats if f.name in _REGISTRY or f.name == FULL]
    if clash:
        raise ValueError(f"formats already registered: {', '.join(clash)}")
    for f in formats:
        _REGISTRY[f.name] = f
    try:
        yield
    finally:
        for f in formats:
            _REGISTRY.pop(f.name, None)
