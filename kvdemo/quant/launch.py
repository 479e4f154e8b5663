"""Which calls the fused decode kernel (`kvdemo.quant.triton_decode`) takes, and its launch settings.

- `supports_attention(query, kv)`: shapes and stored formats the kernel reads: head_dim a power of two in
  [16, 256], query rows per kv head (GQA group x queries, padded) up to `max_block_m` (MAX_BLOCK_M by
  head_dim), per-token keys at TOKEN_KEY_HEAD_DIMS, codes of the registry's decode formats with the methods beyond
  uniform codes (`_decodes`). The rest (more than MAX_OUTLIERS corrections per row, a rotary dim that is
  not a power of two dividing head_dim, the methods at head_dim 256 or beyond 16 query rows at head_dim
  128) goes to the reference.
- launch settings, which change only speed: `launch_config` (tokens per tile and warps by head_dim, query
  rows, compute capability and `method_kind`), `fold_once`, the splits of the sequence (`splits_for`,
  PROGRAMS_PER_SM), NUM_STAGES; `ptx_unpacking` says whether the kernel unpacks codes with its PTX blocks.
- `decode_constants(spec, ...)`: the kernel's format constexprs, among them `plane_split` (which decode loop the
  spec's codes take: the plane-split loop of 8- and 4-bit integer codes, or the first loop); `max_registers`,
  the register cap some of them are compiled with.
The limits sit where sm_90 code would spill registers: `bench/compile_sm90.py` compiles every variant on
a CPU and shows them.
"""

from __future__ import annotations

import functools
import threading

import torch

from .. import formats
from .backend import interpreting
from .reference import QuantizedTensor, values_paired
from .triton_codes import MAX_OUTLIERS, _pow2

PROGRAMS_PER_SM = 4  # decode programs per SM in all (the GPU benchmark sweeps 2-16)
NUM_STAGES = 3  # software-pipeline depth of the decode loop (the GPU benchmark sweeps 2-3)


# Most query rows (GQA group x queries, padded) of one attention program by head_dim, and the head dims
# that take per-token keys: past these, sm_90 code spills registers (bench/compile_sm90.py), and
# `past_attention` hands the call to the reference.
MAX_BLOCK_M = {16: 128, 32: 128, 64: 128, 128: 64, 256: 16}
TOKEN_KEY_HEAD_DIMS = (32, 64, 128)


def supports_attention(query: torch.Tensor, kv) -> bool:
    """Shapes and stored formats the decode kernel handles: head_dim a power of two in [16, 256], query rows
    per kv head (GQA group x queries) up to MAX_BLOCK_M, per-token keys at TOKEN_KEY_HEAD_DIMS, codes of the
    formats whose registry entry lists the "decode" kernel, with the methods `_decodes` accepts."""
    b, hq, n, d = query.shape
    hkv, spec = kv.kv_heads, kv.spec
    fmts_ok = True
    if kv.regions.has_codes:
        keys, values = kv.keys.quantized, kv.values.quantized
        fmts_ok = _decodes(keys, d, True) and _decodes(values, d, False) and keys.start == values.start
    if not (fmts_ok and _pow2(d) and 16 <= d <= 256 and hq % hkv == 0):
        return False
    if kv.regions.has_codes and spec.key_axis == "token" and d not in TOKEN_KEY_HEAD_DIMS:
        return False
    if d > 128 and method_kind(kv):  # the methods' tiles spill registers at head_dim 256
        return False
    return _block_m((hq // hkv) * n) <= max_block_m(d, kv)


def _decodes(q: QuantizedTensor, d: int, keys: bool) -> bool:
    """Whether the decode kernel reads this stored part: its format, its methods (outliers up to
    MAX_OUTLIERS per row, a rotation, pre-RoPE keys with a rotary dim that is a power of two dividing d)."""
    f = formats.get(q.fmt)
    if "decode" not in f.kernels or (q.levels is not None) != f.codebook:
        return False
    if q.outlier_index is not None and q.outlier_index.shape[-1] > MAX_OUTLIERS:
        return False
    if q.rope is not None:
        if not keys or q.rotation is not None:  # values are never pre-RoPE; RoPE would need the unrotated keys
            return False
        rotary = q.rope.tables(q.start, q.start + 1, q.codes.device)[0].shape[-1]
        return rotary >= 2 and _pow2(rotary) and d % rotary == 0
    return True


def _block_m(rows: int) -> int:
    return max(16, 1 << (rows - 1).bit_length())


def max_block_m(head_dim: int, kv) -> int:
    """Most query rows (GQA group x queries, padded) of one program over `kv`: MAX_BLOCK_M, but 16 for the
    methods beyond uniform codes at head_dim 128 (more rows spill registers there; bench/compile_sm90.py)."""
    return 16 if head_dim > 64 and method_kind(kv) else MAX_BLOCK_M.get(head_dim, 16)


def method_kind(kv) -> str:
    """What the spec's codes ask of the decode loop beyond uniform codes: "" (none; a Hadamard rotation turns
    only the query and the partial outputs), "codes" (looked-up, bit-sliced or nvfp4 codes, pre-RoPE keys),
    "outliers" (sparse corrections), "outliers+rope" (both with pre-RoPE keys). Read from the spec, not from
    the codes stored so far, so a cache gets the same kernel variant before its first block is coded and after."""
    spec = kv.spec
    if not spec.is_quantized:
        return ""
    if spec.outliers:
        return "outliers+rope" if spec.pre_rope else "outliers"
    plain = spec.key.planar and spec.value.planar and not spec.pre_rope
    return "" if plain else "codes"


# Integer arguments of the decode kernels that may change from one call to the next: Triton would otherwise
# compile a variant per value class (== 1, divisible by 16), inside the timed decode.
DECODE_STEP_INTS = ("row0",)  # the lengths are read from the device (lens_ptr), the grid is fixed
MERGE_STEP_INTS = ("n_parts",)


@functools.lru_cache(maxsize=256)
def row_widths(spec, head_dim: int) -> dict[str, int]:
    """Elements per token row of each coded tensor the decode kernel reads, as a cache at `spec` stores them
    (codes, scale, zero of keys and values; sparse corrections): the row stride a stand-in passes before the
    first block is coded, so the kernel sees the same stride classes (Triton specializes a stride of 1, or
    divisible by 16) before and after."""
    if not spec.is_quantized:
        return dict.fromkeys(("kc", "ks", "kz", "vc", "vs", "vz", "ko", "vo"), head_dim)
    k_meta = head_dim if spec.key_axis == "channel" else head_dim // spec.key_group(head_dim)
    v_meta = head_dim // spec.value_group(head_dim)
    if values_paired(spec):  # values' scales and zeros share rows (`reference.paired`)
        v_meta *= 2
    cap = max(spec.outlier_cap(head_dim), 1)
    k_codes, v_codes = spec.key.packed_width(head_dim), spec.value.packed_width(head_dim)
    return {"kc": k_codes, "ks": k_meta, "kz": k_meta, "vc": v_codes, "vs": v_meta, "vz": v_meta, "ko": cap, "vo": cap}


@functools.lru_cache(maxsize=256)
def plane_split(spec, head_dim: int) -> bool:
    """Whether the decode loop takes the plane-split path (`triton_decode._plane_split_tiles`): 8- and 4-bit
    integer keys per channel and values per token in one group of head_dim channels (the default group
    covers head_dim up to 128), no method beyond uniform codes, head_dim >= 32 (a 4-bit plane of 16
    channels is a whole dot operand)."""
    return (
        spec.is_quantized
        and spec.key_axis == "channel"
        and not (spec.outliers or spec.pre_rope or spec.hadamard)
        and all(f.planar and f.fp8_code == 0 and f.bits in (8, 4) for f in (spec.key, spec.value))
        and spec.value_group(head_dim) == head_dim
        and head_dim >= 32
    )


MAX_REGISTERS = 168  # per thread: 3 blocks of 4 warps per SM (65,536 registers), 12 warps to hide latency


def max_registers(spec, head_dim: int, num_warps: int) -> int | None:
    """The register cap the decode kernel is compiled with (`maxnreg`), or None: plane-split variants of 4 warps
    (3 blocks) or of one warp (12 blocks) at head_dim 64 and up take MAX_REGISTERS, 12 warps per SM; uncapped,
    int4, int8 and k8v4 at head_dim 128 take 187-212 registers on 4 warps (8 warps per SM; triton 3.6 gave int8
    181). Blocks of 8 warps (more query rows) reach no more warps per SM under any cap above 128, and at head_dim
    32 the cap spills (`bench/compile_sm90.py` shows each variant)."""
    capped = plane_split(spec, head_dim) and num_warps in (1, 4) and head_dim >= 64
    return MAX_REGISTERS if capped else None


def direct_keys_allowed(spec, head_dim: int, num_warps: int) -> bool:
    """Whether the plane-split loop can take its direct-keys form (`triton_decode._plane_split_tiles`, DIRECT): 4-bit
    values on 4 warps, and any plane-split format on one warp (on 4 warps, 8-bit values spill registers under
    the cap; `bench/compile_sm90.py` shows each variant)."""
    return plane_split(spec, head_dim) and (num_warps == 1 or (spec.value.bits == 4 and num_warps == 4))


def form_constants(direct: bool, num_warps: int) -> dict:
    """The decode kernel's constexprs for the loop's form and the program's size: DIRECT_KEYS where the direct-keys
    form runs, ONE_WARP for a program of one warp; each left out when off, so other variants compile as before."""
    return ({"DIRECT_KEYS": True} if direct else {}) | ({"ONE_WARP": True} if num_warps == 1 else {})


# pipeline depth of one-warp programs: as deep as 12 of them fit an SM's shared memory (8-bit codes: 2; 4-bit
# keys and values take half the bytes a tile: 3, so about as many bytes are in flight)
ONE_WARP_STAGES = {4: 3, 8: 2}


def direct_keys_config(spec, head_dim: int, block_m: int, cc: tuple[int, int] = (9, 0)) -> tuple[int, int, int] | None:
    """(tokens per tile, warps, pipeline stages) of the direct-keys form for decode rows (block_m 16), or None where
    it is not taken. At head_dim 128 it runs one warp per program on 16-token tiles, ONE_WARP_STAGES deep: the
    softmax's row maximum and sums stay inside the warp (no exchange across warps: 2 barriers a tile), the query
    is rounded to fp16 once and q . z comes from the tensor cores, and the loop issues fewer instructions per
    token than on 4 warps (`bench/compile_sm90.py`). Elsewhere, 4-bit values keep the default tile on 4 warps."""
    if block_m != 16 or not fold_once(head_dim, cc):
        return None
    if head_dim == 128 and direct_keys_allowed(spec, head_dim, 1):
        return 16, 1, ONE_WARP_STAGES[max(spec.key.bits, spec.value.bits)]
    block_n, warps = launch_config(head_dim, block_m, cc)
    return (block_n, warps, NUM_STAGES) if direct_keys_allowed(spec, head_dim, warps) else None


def decode_constants(spec, head_dim: int, block_n: int, rope_dim: int) -> dict:
    """The decode kernel's format constexprs for a cache at `spec`, from the spec alone (full precision: the
    int8 defaults, never read), so every step of a cache launches the same variant, codes stored yet or not.
    Cached: the launcher reads them on every call (callers do not change the dict)."""
    if not spec.is_quantized:
        return dict(K_BITS=8, K_FP8=0, K_CHANNEL=spec.key_axis == "channel", K_GROUP=block_n, V_BITS=8, V_FP8=0,
                    V_GROUP=head_dim, K_CODE=0, V_CODE=0, K_OUTLIERS=0, V_OUTLIERS=0, K_ROTATED=False, K_ROPE=0)  # fmt: skip
    cap = spec.outlier_cap(head_dim)
    return dict(
        K_BITS=spec.key.bits,
        K_FP8=spec.key.fp8_code,
        K_CHANNEL=spec.key_axis == "channel",
        K_GROUP=spec.key_group(head_dim),
        V_BITS=spec.value.bits,
        V_FP8=spec.value.fp8_code,
        V_GROUP=spec.value_group(head_dim),
        K_CODE=spec.key.code_kind,
        V_CODE=spec.value.code_kind,
        K_OUTLIERS=cap,
        V_OUTLIERS=cap,
        K_ROTATED=spec.hadamard,
        K_ROPE=rope_dim if spec.pre_rope else 0,
        PLANE_SPLIT=plane_split(spec, head_dim),
    )


def launch_config(head_dim: int, block_m: int, cc: tuple[int, int] = (9, 0), method: str = "") -> tuple[int, int]:
    """(tokens per attention tile, warps) for a program of block_m query rows on compute capability cc: the
    largest settings that compile without register spills (`python bench/compile_sm90.py [--arch 75]`
    shows each variant). Decode rows (block_m 16) get tiles of 64 tokens: the fewest instructions per
    token that do not spill. Before sm_80 Triton's dots run on FMAs: 16 tokens, 8 warps.
    method (`method_kind`): the methods beyond uniform codes hold more per tile (looked-up or turned
    keys, sparse corrections), so at head_dim 128 their decode rows take 32-token tiles (with outliers on
    8 warps), and outliers with pre-RoPE keys at head_dim 64 too."""
    if cc < (8, 0):
        return 16, 8
    if head_dim > 128:
        return 16, 4
    if block_m > 16:
        return 32, 8
    if head_dim > 64 and method:
        return (32, 8) if method.startswith("outliers") else (32, 4)
    return (32, 4) if method == "outliers+rope" else (64, 4)


def fold_once(head_dim: int, cc: tuple[int, int] = (9, 0)) -> bool:
    """Whether the decode loop keeps the query folded with a key block's scales across the block's tiles:
    yes where Triton's dots run on tensor cores (sm_80 and later) up to head_dim 128; at head_dim 256,
    or with plain FMA dots (sm_75 and earlier), keeping it spills registers."""
    return head_dim <= 128 and cc >= (8, 0)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (2 stand in on the CPU), read once per device."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def splits_for(heads: int, device: torch.device, programs_per_sm: int = PROGRAMS_PER_SM, num_warps: int = 4) -> int:
    """Splits of the sequence per (batch, kv head) for about `programs_per_sm` programs per SM in all, counted in
    programs of 4 warps (one-warp programs: 4 times as many, the same warps in flight)."""
    return max(1, -(-programs_per_sm * max(1, 4 // num_warps) * _sm_count(device) // heads))


MIN_TILES_PER_SPLIT = 4  # by default a program takes at least this many tiles (fewer programs on a short past)


def ptx_unpacking() -> bool:
    """True where the decode kernel unpacks codes with its PTX blocks: compiled for NVIDIA (not the
    interpreter, not ROCm); elsewhere the same arithmetic runs as Triton ops."""
    return not interpreting() and torch.version.hip is None


@functools.cache
def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability the kernels are tuned for on `device` (read once per device); the
    interpreter runs sm_90's."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (9, 0)


_SCRATCH = threading.local()  # per thread: device -> a flat fp32 buffer the launcher reuses


def scratch(device: torch.device, numel: int) -> torch.Tensor:
    """A flat fp32 buffer of at least `numel` elements on `device`, reused across calls of this thread (grown
    as needed): the split kernel's partial outputs, written and merged within one call, so the decode step
    allocates no new buffer for them. Not for results a caller keeps."""
    pool = getattr(_SCRATCH, "pool", None)
    if pool is None:
        pool = _SCRATCH.pool = {}
    buf = pool.get(device)
    if buf is None or buf.numel() < numel:
        buf = pool[device] = torch.empty(max(numel, 2 * (0 if buf is None else buf.numel())), device=device)
    return buf[:numel]


@functools.lru_cache(maxsize=16)
def stand_ins(device: torch.device) -> dict[str, torch.Tensor]:
    """One-element tensors passed where a cache holds no such tensor (the kernel never reads them), by dtype:
    made once per device, not per call. "fp16_unaligned" stands in for the zeros of values whose scales and
    zeros share rows (`reference.paired`): their address is a scale row's width past an aligned one, and Triton
    compiles a variant per pointer alignment (16 bytes or not)."""
    made = {name: torch.empty(1, dtype=dtype, device=device) for name, dtype in
            (("u8", torch.uint8), ("fp16", torch.float16), ("fp32", torch.float32))}  # fmt: skip
    return made | {"fp16_unaligned": torch.empty(2, dtype=torch.float16, device=device)[1:]}
