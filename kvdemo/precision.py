"""KV-cache precision: one frozen spec that flows from the sidebar / CLI to the kernels.

A `PrecisionSpec` says how cached keys and values are stored:

- format of keys and of values: ``full`` (the model's dtype), ``int8`` / ``int4`` / ``int2``
  (asymmetric: 16-bit scale + 16-bit zero point per group) or ``fp8_e4m3`` / ``fp8_e5m2``
  (16-bit scale per group, no zero point);
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

FORMATS = ("full", "int8", "int4", "int3", "int2", "fp8_e4m3", "fp8_e5m2", "nuq4", "nuq3", "nuq2", "nvfp4")
CODE_BITS = {
    "int8": 8,
    "int4": 4,
    "int3": 3,
    "int2": 2,
    "fp8_e4m3": 8,
    "fp8_e5m2": 8,
    "nuq4": 4,
    "nuq3": 3,
    "nuq2": 2,
    "nvfp4": 4,
}
NVFP4_GROUP = 16  # channels per E4M3 scale
OUTLIER_INDEX_BITS = 8  # a sparse outlier: fp16 correction + uint8 channel index
KEY_AXES = ("channel", "token")
GROUP_SIZES = (16, 32, 64, 128, 256)
META_BITS = 16  # every scale and every zero point is stored in 16 bits (fp16)

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
            if fmt not in FORMATS:
                raise ValueError(f"unknown {what} format {fmt!r}; allowed: {', '.join(FORMATS)}")
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
            if self.outliers and not fmt.startswith(("int", "nuq")):
                raise ValueError(
                    f"o<pct> narrows the range of integer and nuq codes; {what} format {fmt} scales by its "
                    "absmax and has no range to narrow"
                )
        if self.key_format == "nvfp4" and self.key_axis != "token":
            raise ValueError("nvfp4 scales 16 consecutive channels of one token; it has no per-channel key mode")
        if self.pre_rope and self.hadamard:
            raise ValueError(
                "prerope and hadamard do not combine: RoPE must turn the unrotated keys, so every key would be "
                "turned back before RoPE; pick one"
            )

    @property
    def is_quantized(self) -> bool:
        return self.key_format != "full"

    @property
    def key_bits(self) -> int:
        return CODE_BITS.get(self.key_format, 16)

    @property
    def value_bits(self) -> int:
        return CODE_BITS.get(self.value_format, 16)

    def value_group(self, head_dim: int) -> int:
        """Channels per value group (values are grouped along head_dim, per token)."""
        return NVFP4_GROUP if self.value_format == "nvfp4" else min(self.group_size, head_dim)

    def key_group(self, head_dim: int) -> int:
        """Tokens per key group (channel axis) or channels per key group (token axis)."""
        if self.key_format == "nvfp4":
            return NVFP4_GROUP
        return self.group_size if self.key_axis == "channel" else min(self.group_size, head_dim)

    def outlier_cap(self, head_dim: int) -> int:
        """Sparse outliers stored per token and head, for keys and for values alike (0: none)."""
        return outlier_cap(self.outliers, head_dim)

    def codebook_levels(self) -> dict:
        """Codebook entries per layer (fp16 each) of keys and values: 2^bits for nuq formats, else 0."""
        return {
            part: (1 << CODE_BITS[fmt]) if fmt.startswith("nuq") else 0
            for part, fmt in (("key", self.key_format), ("value", self.value_format))
        }

    def bits_per_element(self, head_dim: int, full_bits: int = 16) -> dict:
        """Bits per cached key / value element in the quantized region: code + metadata / group + sparse
        outliers (fp16 correction + uint8 index, per token and head) over head_dim. Per-layer codebooks are a
        fixed cost, not per element (`layout.region_bytes` counts them)."""
        if not self.is_quantized:
            return {"key": float(full_bits), "value": float(full_bits), "mean": float(full_bits)}
        sparse = self.outlier_cap(head_dim) * (META_BITS + OUTLIER_INDEX_BITS) / head_dim
        k = self.key_bits + self._meta_per_element(self.key_format, self.key_axis, self.key_group(head_dim), head_dim)
        v = self.value_bits + self._meta_per_element(self.value_format, "token", self.value_group(head_dim), head_dim)
        return {"key": k + sparse, "value": v + sparse, "mean": (k + v) / 2 + sparse}

    def _meta_per_element(self, fmt: str, axis: str, group: int, head_dim: int) -> float:
        if fmt == "nvfp4":  # E4M3 per 16 channels + fp32 per block of group_size tokens and head
            return 8 / NVFP4_GROUP + 32 / (self.group_size * head_dim)
        return META_BITS * (1 + has_zero(fmt, axis)) / group

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
        if self.key_axis != "channel" and self.key_format != "nvfp4":
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


def has_zero(fmt: str, axis: str) -> bool:
    """Whether groups of `fmt` along `axis` store a zero point besides their scale: integer codes always
    (asymmetric); nuq along tokens (keys per channel: [min, max]); fp8, nvfp4 and nuq per token: absmax only."""
    return fmt.startswith("int") or (fmt.startswith("nuq") and axis == "channel")


# a part's format in a mixed name `k<key>v<value>`: integer codes by their bits, the rest by name
PART_NAMES = {"int8": "8", "int4": "4", "int3": "3", "int2": "2", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8-e5m2"}
PART_FORMATS = {**{v: k for k, v in PART_NAMES.items()}, **{f: f for f in FORMATS if f != "full"}}


def _kv_name(key_format: str, value_format: str) -> str:
    """`int4`, `fp8` when keys and values share a format, else `k<key>v<value>`: `k8v4`, `knuq4vnuq2`, `k8vnvfp4`."""
    if key_format == value_format:
        return {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8-e5m2"}.get(key_format, key_format)
    return f"k{PART_NAMES.get(key_format, key_format)}v{PART_NAMES.get(value_format, value_format)}"


def _mixed(name: str) -> PrecisionSpec | None:
    """`k<key>v<value>` -> the spec with those formats (PART_FORMATS: `8`, `int8`, `nuq3`, `fp8`, `nvfp4`, ...),
    None when `name` is not one. nvfp4 keys are scaled per token, so they set the key axis."""
    if not name.startswith("k"):
        return None
    for at in (i for i, c in enumerate(name) if c == "v" and i > 1):
        key, value = PART_FORMATS.get(name[1:at]), PART_FORMATS.get(name[at + 1 :])
        if key and value:
            axis = "token" if key == "nvfp4" else "channel"
            preset = [p for p in PRESETS.values() if (p.key_format, p.value_format, p.key_axis) == (key, value, axis)]
            return preset[0] if preset else PrecisionSpec(key, value, key_axis=axis)
    return None


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
    spec = PRESETS.get(name) or _mixed(name)
    if spec is None:
        raise ValueError(
            f"unknown precision {text!r}; presets: {', '.join(PRESETS)}; or k<key>v<value> with keys and values "
            f"each one of {', '.join(PART_NAMES.get(f, f) for f in FORMATS[1:])} (e.g. knuq4vnuq2, k8vnuq3) "
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
    if key_axis != "channel" and keys != "nvfp4":
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
