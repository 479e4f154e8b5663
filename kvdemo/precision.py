"""KV-cache precision: one frozen spec that flows from the sidebar / CLI to the kernels.

A `PrecisionSpec` says how cached keys and values are stored:

- format of keys and of values: ``full`` (the model's dtype) or one of the storage formats of
  kvdemo/formats.py (its registry says each one's names, bits, scales and rules): ``int8`` / ``int4`` /
  ``int2`` (asymmetric: 16-bit scale + 16-bit zero point per group), ``fp8_e4m3`` / ``fp8_e5m2`` (16-bit scale
  per group, no zero point) and the ones below;
- key axis: ``channel`` (default; KIVI / KVQuant: per channel, groups of ``group_size`` tokens) or
  ``token`` (per token, groups of ``group_size`` channels, for comparison with per-token schemes);
  values are always per token, in groups of ``min(group_size, head_dim)`` channels;
- ``residual``: newest tokens held in full precision until ``residual`` of them have collected,
  then every full block of ``group_size`` tokens is quantized (KIVI's residual);
- ``sinks``: the first tokens of the sequence, kept in full precision (StreamingLLM, KVQuant).

Methods that spend the same bits better (KVQuant, QuaRot, today's engines), each an option or a format:

- ``int3``: uniform 3-bit codes, bit-sliced (3 planes of 1-bit codes: no bit wasted);
- ``nuq4`` / ``nuq3`` / ``nuq2``: non-uniform codes, 2^b levels per layer (K and V apart) fitted offline by
  Fisher-weighted k-means (kvdemo/codebooks.py) and rescaled at run time: keys per channel to
  [min, max] of their block (scale + zero), values per token by their absmax (scale only);
- ``nvfp4``: E2M1 codes, one E4M3 scale per 16 channels of a token, one fp32 scale per block of
  ``group_size`` tokens and head (the per-tensor scale, per block because a cache grows);
- ``o<pct>`` (dense-and-sparse): ``pct`` % of the elements stay exact as a sparse fp16 correction
  (``ceil(pct / 100 * head_dim)`` per token and head, with uint8 channel indices); the codes cover the
  narrowed range;
- ``prerope``: keys are quantized before the rotary embedding (undone on append from the model's
  rotary parameters, redone when the keys are read);
- ``hadamard``: keys, queries and values are turned by an orthonormal (sign-randomized) Hadamard matrix
  before quantization; the attention output is turned back.

Strings: a preset name, optionally followed by options, e.g. ``int4``, ``k8v4``,
``int4:g64:r128:s4``, ``k8v4:ktoken``, ``nuq3:o1``, ``int4:prerope``, ``k8v4:hadamard``. Keys and values may
take any two formats, ``k<key>v<value>``: integer codes by their bits (``k8v4``, ``k4v3``), the rest by name
(``knuq4vnuq2``, ``k8vnuq3``, ``kfp8v4``, ``k8vnvfp4``); options apply to both parts. See `parse_precision`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from . import formats

OUTLIER_INDEX_BITS = 8  # a sparse outlier: fp16 correction + uint8 channel index
OUTLIER_BITS = 16  # ... and its fp16 correction
KEY_AXES = ("channel", "token")
GROUP_SIZES = (16, 32, 64, 128, 256)

DEFAULT_GROUP = 128
DEFAULT_RESIDUAL = 128
DEFAULT_SINKS = 0  # `:s4` keeps 4 sink tokens; off by default so the default ratios are the bits alone


def outlier_cap(outliers: float, head_dim: int) -> int:
    """Sparse outliers per token and head at `outliers` percent: ceil(pct / 100 x head_dim), 0 without (the one
    count the spec, the quantizers and the codebook fit share)."""
    return math.ceil(outliers / 100 * head_dim - 1e-9) if outliers else 0


@dataclass(frozen=True)
class PrecisionSpec:
    key_format: str = "full"
    value_format: str = "full"
    key_axis: str = "channel"
    group_size: int = DEFAULT_GROUP
    residual: int = DEFAULT_RESIDUAL
    sinks: int = DEFAULT_SINKS
    outliers: float = 0.0  # percent of elements kept as sparse fp16 corrections (dense-and-sparse)
    pre_rope: bool = False  # keys quantized before the rotary embedding
    hadamard: bool = False  # keys/values (and queries, outputs) turned by a Hadamard matrix
    preset: str = ""  # the preset this spec came from, for labels

    def __post_init__(self):
        for what, fmt in (("key", self.key_format), ("value", self.value_format)):
            if fmt not in formats.names():
                raise ValueError(f"unknown {what} format {fmt!r}; allowed: {', '.join(formats.names())}")
        if (self.key_format == "full") != (self.value_format == "full"):
            raise ValueError("keys and values are either both full precision or both quantized")
        if self.key_axis not in KEY_AXES:
            raise ValueError(f"unknown key axis {self.key_axis!r}; allowed: {', '.join(KEY_AXES)}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group size {self.group_size} not supported; allowed: {', '.join(map(str, GROUP_SIZES))}")
        if self.residual < 0 or self.sinks < 0:
            raise ValueError("residual and sinks must be >= 0")
        if self.is_quantized and (self.residual == 0 or self.residual % self.group_size):
            raise ValueError(
                f"residual ({self.residual}) must be a positive multiple of the group size "
                f"({self.group_size}): keys are quantized in whole blocks of group_size tokens"
            )
        if self.is_quantized and self.sinks >= self.group_size:
            raise ValueError(f"sinks ({self.sinks}) must be smaller than the group size ({self.group_size})")
        if not 0 <= self.outliers < 50:
            raise ValueError(f"outliers ({self.outliers}%) must be in [0, 50)")
        if not self.is_quantized and (self.outliers or self.pre_rope or self.hadamard):
            raise ValueError("full precision stores no codes: outliers, prerope and hadamard need a quantized format")
        for what, fmt in (("key", self.key_format), ("value", self.value_format)):
            if self.outliers and self.is_quantized and not formats.get(fmt).narrowable:
                raise ValueError(
                    f"o<pct> narrows the range of integer and nuq codes; {what} format {fmt} scales by its "
                    "absmax and has no range to narrow"
                )
        if self.is_quantized and self.key.keys_per_token and self.key_axis != "token":
            raise ValueError(
                f"{self.key_format} scales consecutive channels of one token; it has no per-channel key mode"
            )
        if self.pre_rope and self.hadamard:
            raise ValueError(
                "prerope and hadamard do not combine: RoPE must turn the unrotated keys, so every key would be "
                "turned back before RoPE; pick one"
            )

    @property
    def is_quantized(self) -> bool:
        return self.key_format != formats.FULL

    @property
    def key(self) -> formats.Format:
        """The keys' format (ValueError for full precision, which codes nothing)."""
        return formats.get(self.key_format)

    @property
    def value(self) -> formats.Format:
        """The values' format (ValueError for full precision, which codes nothing)."""
        return formats.get(self.value_format)

    @property
    def key_bits(self) -> int:
        return formats.code_bits(self.key_format)

    @property
    def value_bits(self) -> int:
        return formats.code_bits(self.value_format)

    def value_group(self, head_dim: int) -> int:
        """Channels per value group (values are grouped along head_dim, per token)."""
        if not self.is_quantized:
            return min(self.group_size, head_dim)
        return self.value.group(self.group_size, head_dim, "token")

    def key_group(self, head_dim: int) -> int:
        """Tokens per key group (channel axis) or channels per key group (token axis)."""
        if not self.is_quantized:
            return self.group_size if self.key_axis == "channel" else min(self.group_size, head_dim)
        return self.key.group(self.group_size, head_dim, self.key_axis)

    def outlier_cap(self, head_dim: int) -> int:
        """Sparse outliers stored per token and head, for keys and for values alike (0: none)."""
        return outlier_cap(self.outliers, head_dim)

    def codebook_levels(self) -> dict:
        """Codebook entries per layer (fp16 each) of keys and values: 2^bits for codebook formats, else 0."""
        if not self.is_quantized:
            return {"key": 0, "value": 0}
        return {"key": self.key.levels, "value": self.value.levels}

    def bits_per_element(self, head_dim: int, full_bits: int = 16) -> dict:
        """Bits per cached key / value element in the quantized region: code + metadata / group + sparse
        outliers (fp16 correction + uint8 index, per token and head) over head_dim. Per-layer codebooks are a
        fixed cost, not per element (`layout.region_bytes` counts them)."""
        if not self.is_quantized:
            return {"key": float(full_bits), "value": float(full_bits), "mean": float(full_bits)}
        sparse = self.outlier_cap(head_dim) * (OUTLIER_BITS + OUTLIER_INDEX_BITS) / head_dim
        k = self.key_bits + self.key.meta_bits(self.key_axis, self.group_size, head_dim)
        v = self.value_bits + self.value.meta_bits("token", self.group_size, head_dim)
        return {"key": k + sparse, "value": v + sparse, "mean": (k + v) / 2 + sparse}

    @property
    def label(self) -> str:
        """Short name: the preset alone when every option is the default, else with options."""
        base = self.preset or _kv_name(self.key_format, self.value_format)
        if not self.is_quantized:
            return base
        opts = []
        if self.group_size != DEFAULT_GROUP:
            opts.append(f"g{self.group_size}")
        if self.residual != DEFAULT_RESIDUAL:
            opts.append(f"r{self.residual}")
        if self.sinks != DEFAULT_SINKS:
            opts.append(f"s{self.sinks}")
        if self.key_axis != "channel" and not self.key.keys_per_token:
            opts.append("ktoken")
        return ":".join([base, *self._method_options(), *opts])

    def _method_options(self) -> list[str]:
        opts = [f"o{self.outliers:g}"] if self.outliers else []
        return opts + (["prerope"] if self.pre_rope else []) + (["hadamard"] if self.hadamard else [])

    def to_dict(self) -> dict:
        return {
            "label": self.label,
            "key_format": self.key_format,
            "value_format": self.value_format,
            "key_axis": self.key_axis,
            "group_size": self.group_size,
            "residual": self.residual,
            "sinks": self.sinks,
            "outliers": self.outliers,
            "pre_rope": self.pre_rope,
            "hadamard": self.hadamard,
        }


def _kv_name(key_format: str, value_format: str) -> str:
    """`int4`, `fp8` when keys and values share a format, else `k<key>v<value>`: `k8v4`, `knuq4vnuq2`, `k8vnvfp4`."""
    if key_format == value_format:
        return formats.get(key_format).label
    return f"k{formats.get(key_format).part}v{formats.get(value_format).part}"


def _mixed(name: str) -> PrecisionSpec | None:
    """`k<key>v<value>` -> the spec with those formats (PART_FORMATS: `8`, `int8`, `nuq3`, `fp8`, `nvfp4`, ...),
    None when `name` is not one. nvfp4 keys are scaled per token, so they set the key axis."""
    if not name.startswith("k"):
        return None
    for at in (i for i, c in enumerate(name) if c == "v" and i > 1):
        key, value = formats.by_part(name[1:at]), formats.by_part(name[at + 1 :])
        if key and value:
            return _both(key, value)
    return None


def _both(key: formats.Format, value: formats.Format) -> PrecisionSpec:
    """Keys in `key`, values in `value`: the preset when one matches, else a spec with every option at its
    default (keys per token when their format scales along channels only)."""
    axis = "token" if key.keys_per_token else "channel"
    preset = [p for p in PRESETS.values() if (p.key_format, p.value_format, p.key_axis) == (key.name, value.name, axis)]
    return preset[0] if preset else PrecisionSpec(key.name, value.name, key_axis=axis)


def _by_format(name: str) -> PrecisionSpec | None:
    """A format's own name or label (`fp8_e4m3`, `int1` of a registered toy format): keys and values in it."""
    found = next((f for f in formats.all_formats() if name in (f.name, f.label)), None)
    return _both(found, found) if found else None


PRESETS: dict[str, PrecisionSpec] = {
    "full": PrecisionSpec("full", "full", residual=0, sinks=0, preset="full"),
    "fp8": PrecisionSpec("fp8_e4m3", "fp8_e4m3", preset="fp8"),
    "fp8-e5m2": PrecisionSpec("fp8_e5m2", "fp8_e5m2", preset="fp8-e5m2"),
    "int8": PrecisionSpec("int8", "int8", preset="int8"),
    "int4": PrecisionSpec("int4", "int4", preset="int4"),
    "int2": PrecisionSpec("int2", "int2", preset="int2"),
    "k8v4": PrecisionSpec("int8", "int4", preset="k8v4"),
    "k4v8": PrecisionSpec("int4", "int8", preset="k4v8"),
    "k8v2": PrecisionSpec("int8", "int2", preset="k8v2"),
    "k4v2": PrecisionSpec("int4", "int2", preset="k4v2"),
    "int3": PrecisionSpec("int3", "int3", preset="int3"),
    "nuq4": PrecisionSpec("nuq4", "nuq4", preset="nuq4"),
    "nuq3": PrecisionSpec("nuq3", "nuq3", preset="nuq3"),
    "nuq2": PrecisionSpec("nuq2", "nuq2", preset="nuq2"),
    "nvfp4": PrecisionSpec("nvfp4", "nvfp4", key_axis="token", preset="nvfp4"),
}
ALIASES = {"fp16": "full", "bf16": "full", "baseline": "full", "fp8-e4m3": "fp8", "k8v8": "int8", "k4v4": "int4"}


def parse_precision(text: str | PrecisionSpec) -> PrecisionSpec:
    """`int4`, `k8v4`, `int4:g64:r128:s4`, `k8v4:ktoken`, `nuq2:o1:s1`, `int4:prerope`, `k8v4:hadamard`,
    `knuq4vnuq2:o1` -> PrecisionSpec (ValueError with the reason)."""
    if isinstance(text, PrecisionSpec):
        return text
    parts = [p.strip() for p in str(text).strip().lower().split(":")]
    name = ALIASES.get(parts[0], parts[0])
    spec = PRESETS.get(name) or _by_format(name) or _mixed(name)
    if spec is None:
        raise ValueError(
            f"unknown precision {text!r}; presets: {', '.join(PRESETS)}; or k<key>v<value> with keys and values "
            f"each one of {', '.join(f.part for f in formats.all_formats())} (e.g. knuq4vnuq2, k8vnuq3) "
            "(options: g<group> r<residual> s<sinks> ktoken o<pct> prerope hadamard, e.g. int4:g64:r128:s4, nuq3:o1)"
        )
    options = {}
    for opt in parts[1:]:
        if opt in ("ktoken", "kchannel"):
            options["key_axis"] = opt[1:]
        elif len(opt) > 1 and opt[0] in "grs" and opt[1:].isdigit():
            options[{"g": "group_size", "r": "residual", "s": "sinks"}[opt[0]]] = int(opt[1:])
        elif len(opt) > 1 and opt[0] == "o" and opt[1:].replace(".", "", 1).isdigit():
            options["outliers"] = float(opt[1:])
        elif opt in ("prerope", "hadamard"):
            options["pre_rope" if opt == "prerope" else "hadamard"] = True
        else:
            raise ValueError(
                f"unknown precision option {opt!r} in {text!r}; options: g<N> r<N> s<N> ktoken o<pct> prerope hadamard"
            )
    if options and not spec.is_quantized:
        raise ValueError(f"{name!r} stores the cache unquantized and takes no options")
    if "group_size" in options and "residual" not in options:
        options["residual"] = max(spec.residual, options["group_size"])
        options["residual"] -= options["residual"] % options["group_size"]
    return replace(spec, **options)


def with_formats(spec: PrecisionSpec | str, key_format: str, value_format: str) -> PrecisionSpec:
    """`spec` with keys and values stored in these formats, every option kept (`nuq3:o1` with nuq4 keys and
    nuq2 values: `knuq4vnuq2:o1`); ValueError when the options do not fit the formats."""
    options = parse_precision(spec).label.split(":")[1:]
    return parse_precision(":".join([_kv_name(key_format, value_format), *options]))


def spec_from_options(
    preset: str,
    group_size: int = DEFAULT_GROUP,
    key_axis: str = "channel",
    residual: int = DEFAULT_RESIDUAL,
    sinks: int = DEFAULT_SINKS,
    outliers: float = 0.0,
    pre_rope: bool = False,
    hadamard: bool = False,
    key_format: str | None = None,
    value_format: str | None = None,
) -> PrecisionSpec:
    """The sidebar's settings -> the spec their precision string gives on the CLI: options at their
    default are left out of the string, so the same rules apply (group 256 alone raises the residual
    to 256, as `int4:g256` does). key_format / value_format (FORMATS; None: the preset's) give keys and
    values their own formats, `k<key>v<value>`."""
    base = parse_precision(preset)
    keys, values = key_format or base.key_format, value_format or base.value_format
    opts = [preset if (keys, values) == (base.key_format, base.value_format) else _kv_name(keys, values)]
    if outliers:
        opts.append(f"o{outliers:g}")
    if pre_rope:
        opts.append("prerope")
    if hadamard:
        opts.append("hadamard")
    if group_size != DEFAULT_GROUP:
        opts.append(f"g{group_size}")
    if residual != DEFAULT_RESIDUAL:
        opts.append(f"r{residual}")
    if sinks != DEFAULT_SINKS:
        opts.append(f"s{sinks}")
    if key_axis != "channel" and not formats.get(keys).keys_per_token:
        opts.append("ktoken")
    return parse_precision(":".join(opts))


def parse_precision_list(text: str) -> list[PrecisionSpec]:
    """`full,int8,k8v4` -> [PrecisionSpec, ...] (duplicates removed, order kept)."""
    specs, seen = [], set()
    for item in str(text).split(","):
        if item.strip():
            spec = parse_precision(item)
            if spec.label not in seen:
                specs.append(spec)
                seen.add(spec.label)
    if not specs:
        raise ValueError("no precision given; presets: " + ", ".join(PRESETS))
    return specs
