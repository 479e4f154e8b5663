"""Compile every Triton kernel variant for a GPU architecture on a machine without one, and report
registers, spills and shared memory per variant (what Triton's CPU interpreter never sees).

Triton compiles ahead of time for a named target (`GPUTarget`) with the ptxas it ships, so a CPU
machine finds the compile errors, register spills and shared-memory overflows that only a GPU
build has. Arguments are specialized as the JIT specializes real cache tensors: pointers and
strides divisible by 16 (cache rows are whole multiples of 16 bytes), a last-dim stride of 1 (the JIT
turns an argument equal to 1 into a constant), lengths unspecialized.

    python bench/compile_sm90.py               # every variant, a table
    python bench/compile_sm90.py --quick --json /tmp/sm90.json --strict
    python bench/compile_sm90.py --goal-rows --json /tmp/floors.json   # the goal-point floors only

--strict exits 1 if any variant spills registers (or fails to compile, which always exits 1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

import triton  # noqa: E402
from gpu_attention import GOAL_POINT, GOALS  # noqa: E402  (bench/, this script's folder)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvdemo import formats  # noqa: E402
from kvdemo.precision import PrecisionSpec  # noqa: E402
from kvdemo.quant import launch, triton_decode, triton_quantize  # noqa: E402

STRIDE = re.compile(r"^s[a-z]*_[bhtd]$")  # stride arguments: sx_t, skc_h, ...
U8 = {"codes_ptr", "kc_ptr", "vc_ptr", "koi_ptr", "voi_ptr"}
FP32 = {"o_part_ptr", "lse_part_ptr", "out_ptr", "lse_ptr", "qr_ptr", "kts_ptr", "vts_ptr", "cos_ptr", "sin_ptr"}
I32 = {"lens_ptr"}  # the regions' lengths [S, Q, R], read on the device
MODEL_DTYPE = {"q_ptr", "sk_ptr", "sv_ptr", "rk_ptr", "rv_ptr", "x_ptr"}  # other pointers: fp16 scales
# strides that are not multiples of 16 in a real cache: sparse outliers' rows (cap entries), nvfp4 tensor scales,
# the values' scale and zero rows (stored side by side, `reference.paired`: 2 elements per token)
UNALIGNED = {"skod_t", "skoi_t", "svod_t", "svoi_t", "skts_b", "skts_h", "svts_b", "svts_h", "svs_t", "svz_t"}
PLAIN_FORMATS = [f.name for f in formats.all_formats() if "quantize" in f.kernels]  # what the plain kernel codes


def signature(fn, constexprs: dict, half: str = "fp16", pointers: dict | None = None) -> tuple[dict, dict, dict]:
    """(signature, attrs, constexprs) of a kernel's arguments, specialized as the JIT does for real cache
    tensors; `half` is the model's dtype (queries, full-precision keys/values, quantizer input); `pointers`:
    pointer types that differ by variant (nvfp4's uint8 scales). Constexprs left out take
    their defaults (the decode kernel's methods: off)."""
    sig, attrs, constexprs = {}, {}, dict(constexprs)
    for param in fn.params:
        if param.is_constexpr and param.has_default:
            constexprs.setdefault(param.name, param.default)
    for i, name in enumerate(fn.arg_names):
        if STRIDE.match(name) and name.endswith("_d"):  # a contiguous last dim: the JIT specializes 1
            constexprs[name] = 1
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            sig[name] = (pointers or {}).get(name) or (
                "*u8"
                if name in U8
                else "*i32"
                if name in I32
                else "*fp32"
                if name in FP32
                else f"*{half}"
                if name in MODEL_DTYPE
                else "*fp16"
            )
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
        if name.endswith("_ptr") or (STRIDE.match(name) and name not in UNALIGNED):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs, constexprs


def cuda_tool(name: str) -> str:
    """A CUDA binary tool: the one Triton ships, else one on PATH."""
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(bundled) if bundled.exists() else (shutil.which(name) or name)


def resources(cubin: bytes) -> dict:
    """Registers and stack of one compiled kernel, and its spills: local-memory stores/loads in its SASS."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run(
            [cuda_tool("cuobjdump"), "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [cuda_tool("cuobjdump"), "--dump-sass", str(path)], capture_output=True, text=True, check=True
        ).stdout

    def field(name: str) -> int:
        m = re.search(rf"\b{name}:(\d+)", usage)
        return int(m.group(1)) if m else 0

    return {
        "registers": field("REG"),
        "stack_bytes": field("STACK"),
        "spill_stores": len(re.findall(r"\bSTL(?:\.\w+)*\b", sass)),
        "spill_loads": len(re.findall(r"\bLDL(?:\.\w+)*\b", sass)),
    } | main_loop(sass)


def main_loop(sass: str) -> dict:
    """Instructions per iteration of the kernel's largest loop (decode: the quantized-tile loop), per warp, on
    its steady path (`loop_instructions`: a tile inside a key block, away from the cache's ends, whose row
    maxima stay within the softmax's reference). Predicated blocks inside the loop are left out of it when they
    load from global memory (`loop_conditional`: entering a key block, its scales, once per key group), set
    scores to -inf or take an exp2 (`loop_rare`: masking rows outside [S, Q) on the first and last tiles of a
    sequence; moving the plane-split loop's softmax reference, where a row's max passes it by more than
    2^RESCALE_LOG2, which a program's first tile and few others do); other predicated blocks (the lanes of a
    warp that store a cross-warp reduction) are issued on every tile and stay in. Zeros when there is no loop."""
    code = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    branches = []  # (address, target, predicated)
    for addr, text in code:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m:
            branches.append((addr, int(m.group(1), 16), text.startswith("@")))
    loops = [(target, addr) for addr, target, _ in branches if target <= addr]
    if not loops:
        return {"loop_instructions": 0, "loop_conditional": 0, "loop_rare": 0}
    begin, end = max(loops, key=lambda loop: loop[1] - loop[0])
    blocks = [(addr, target) for addr, target, predicated in branches if predicated and begin <= addr < target <= end]
    outer = [(a, t) for a, t in blocks if not any(a2 < a and t <= t2 for a2, t2 in blocks)]  # nested: counted once
    conditional, rare = set(), set()
    for addr, target in outer:
        inside = [(a, text) for a, text in code if addr < a < target]
        if any(loop_mix([text])["global_loads"] for _, text in inside):
            conditional.update(a for a, _ in inside)
        elif any(re.match(r"(@\S+ )?(FSEL\b.*-INF|MUFU\.EX2\b)", text) for _, text in inside):
            rare.update(a for a, _ in inside)
    body = [a for a, _ in code if begin <= a <= end]
    steady = [text for a, text in code if begin <= a <= end and a not in conditional | rare]
    return {
        "loop_instructions": len(body) - len(conditional | rare),
        "loop_conditional": len(conditional),
        "loop_rare": len(rare - conditional),
        "loop_mix": loop_mix(steady),
    }


# the loop's instruction mix: SASS opcodes by what they cost a memory-bound loop (the first word after any
# predicate; LDGSTS is the asynchronous global -> shared copy, LDG a load the warp waits for in registers;
# IMAD.MOV is the register copy ptxas issues on the integer pipe, counted with the moves)
MIX = {
    "moves": ("MOV", "MOV32I", "SHFL", "IMAD.MOV"),
    "prmt": ("PRMT",),
    "shared_loads": ("LDS", "LDSM"),
    "shared_stores": ("STS",),
    "barriers": ("BAR",),
    "mma": ("HMMA", "IMMA", "HGMMA", "QGMMA"),
    "global_loads": ("LDG",),
    "async_copies": ("LDGSTS",),
}


def loop_mix(instructions: list[str]) -> dict:
    """Counts of each `MIX` class among SASS instruction texts (one iteration's steady path)."""
    counts = dict.fromkeys(MIX, 0)
    for text in instructions:
        words = text.split()
        if words and words[0].startswith("@"):
            words = words[1:]
        opcode = words[0].split(".")[0] if words else ""
        if words and words[0].startswith("IMAD.MOV"):
            opcode = "IMAD.MOV"
        for kind, opcodes in MIX.items():
            if opcode in opcodes:
                counts[kind] += 1
    return counts


SM90_LIMITS = {"registers": 65536, "shared_bytes": 228 * 1024, "warps": 64, "blocks": 32}


def warps_per_sm(registers: int, shared_bytes: int, num_warps: int, limits: dict = SM90_LIMITS) -> int:
    """Warps resident on one SM for a kernel of this many registers per thread (allocated in units of 8 per
    thread, 256 per warp) and shared bytes per block: the blocks that fit every limit, times warps per block."""
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = limits["registers"] // (regs_per_warp * num_warps)
    by_shared = limits["shared_bytes"] // max(shared_bytes + 1024, 1)  # 1 KiB a block reserved by the runtime
    blocks = min(by_regs, by_shared, limits["blocks"], limits["warps"] // num_warps)
    return blocks * num_warps


def compile_one(
    fn,
    constexprs: dict,
    arch: int,
    num_warps: int = 4,
    num_stages: int = launch.NUM_STAGES,
    half: str = "fp16",
    pointers: dict | None = None,
    fp_fusion: bool = True,
    maxnreg: int | None = None,
) -> dict:
    """Compile one variant for sm_<arch>; its compile time, shared memory, registers and spills. maxnreg: the
    register cap `past_attention` launches the variant with (`launch.max_registers`)."""
    sig, attrs, constexprs = signature(fn, constexprs, half, pointers)
    started = time.perf_counter()
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": fp_fusion}
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options | {"maxnreg": maxnreg})
    row = {"compile_s": round(time.perf_counter() - started, 2), "shared_bytes": kernel.metadata.shared}
    row |= resources(kernel.asm["cubin"]) | global_loads(kernel.asm["ptx"])
    row["warps_per_sm"] = warps_per_sm(row["registers"], row["shared_bytes"], num_warps)
    return row


def global_loads(ptx: str) -> dict:
    """How the kernel reads global memory: asynchronous copies into shared memory by size in bytes
    (16 is a full vector: coalesced, pipelined), direct loads by width, and tensor-core instructions."""
    copies: dict[str, int] = {}
    for size in re.findall(
        r"cp\.async\.c[ga]\.shared\.global(?:\.\S+)? \[[^\]]*\], \[[^\]]*\], (0x[0-9a-f]+|\d+)", ptx
    ):
        key = str(int(size, 0))
        copies[key] = copies.get(key, 0) + 1
    loads: dict[str, int] = {}
    for op in re.findall(r"\bld\.global(?:\.\w+)*", ptx):
        loads[op] = loads.get(op, 0) + 1
    return {"async_copy_bytes": copies, "global_loads": loads, "mma": len(re.findall(r"\b(?:mma|wgmma)\.", ptx))}


def quantize_variants(quick: bool) -> list[dict]:
    rows = []
    for fmt in ("int8", "int4", "int2", "fp8_e4m3") if quick else PLAIN_FORMATS:
        bits, fp8 = formats.get(fmt).bits, formats.get(fmt).fp8_code
        for head_dim in (128,) if quick else (64, 128):
            for axis, group in (("channel", 128), ("token", min(128, head_dim))):
                dp = head_dim * bits // 8
                channel = axis == "channel"
                consts = {
                    "D": head_dim,
                    "BITS": bits,
                    "FP8": fp8,
                    "CHANNEL": channel,
                    "GROUP": group,
                    "BLOCK_T": group if channel else triton_quantize.QUANT_TILE // head_dim,
                    "BLOCK_J": max(1, min(dp, triton_quantize.QUANT_TILE // (group * (8 // bits)))) if channel else 1,
                }
                rows.append({"kernel": "quantize", "format": fmt, "axis": axis, "head_dim": head_dim, "consts": consts})
    rows.append(rows[2] | {"half": "bf16", "format": rows[2]["format"] + " (bf16 input)"})
    return rows + quantize_method_variants(quick)


# quantize with the methods beyond uniform codes: (format, axis, group, outliers per token), at the tiles and
# warps `triton_quantize.method_tile` picks; codebooks fp16 (as stored), nuq midpoints fp32
QUANTIZE_METHODS = [
    ("int3", "channel", 128, 0),
    ("nuq4", "channel", 128, 0),
    ("nuq3", "channel", 128, 1),
    ("nuq3", "token", 128, 1),
    ("nuq2", "token", 128, 1),
    ("int4", "channel", 128, 4),
    ("nuq4", "channel", 32, 1),
    ("nvfp4", "token", 16, 0),
]
METHOD_QUANT_CODE = {"int4": (4, 0), "int3": (3, 0), "nuq4": (4, 1), "nuq3": (3, 1), "nuq2": (2, 1)}  # bits, CODE


def quantize_method_variants(quick: bool) -> list[dict]:
    """The method quantize kernels (`_quantize_methods_kernel`, `_quantize_nvfp4_kernel`) at head_dim 128
    (and 64 unless quick), compiled without fp fusion as the wrapper launches them."""
    rows = []
    for head_dim in (128,) if quick else (64, 128):
        for fmt, axis, group, cap in QUANTIZE_METHODS:
            group = min(group, head_dim) if axis == "token" else group  # as supports_quantize_methods allows
            block_t, warps = triton_quantize.method_tile(fmt, axis, group, head_dim, bool(cap))
            if formats.get(fmt).family == "nvfp4":
                kernel, consts = "quantize_nvfp4", {"D": head_dim, "CLEAN": True, "BLOCK_T": block_t}
                pointers = {"codes_ptr": "*u8", "scale_ptr": "*u8", "ts_ptr": "*fp32"}
            else:
                kernel = "quantize_methods"
                bits, code = METHOD_QUANT_CODE[fmt]
                consts = {"D": head_dim, "BITS": bits, "CODE": code}
                consts |= {"CHANNEL": axis == "channel", "GROUP": group, "CAP": cap, "CLEAN": True}
                consts |= {"ILP": 4 if head_dim == 16 else 1, "BLOCK_T": block_t}
                pointers = {"codes_ptr": "*u8", "index_ptr": "*u8", "mids_ptr": "*fp32"}
            label = fmt + (f":o{cap}" if cap else "") + f" g{group}"
            rows.append(
                {"kernel": kernel, "format": label, "axis": axis, "head_dim": head_dim, "num_warps": warps}
                | {"consts": consts, "pointers": pointers, "fp_fusion": False}
            )
    return rows


def unit_strides(consts: dict) -> dict:
    """The decode kernel's token strides that are 1 in a real cache, as constexprs: the JIT turns an integer
    argument equal to 1 into the constant 1, so a variant whose metadata has one group per token (values with
    V_GROUP == D whose scales are stored alone: fp8, nuq, nvfp4; per-token keys with K_GROUP == D: rows of one
    element) runs with these strides known. Integer values store a token's scale and zero side by side: 2
    elements, which the plane-split loop is given as its stride in 4-byte words, 1 (`triton_decode._value_planes`)."""
    ones = {}
    if consts["V_GROUP"] == consts["D"] and (consts["V_FP8"] or consts.get("V_CODE", 0)):
        ones |= {"svs_t": 1, "svz_t": 1}
    if consts.get("PLANE_SPLIT") and consts.get("FOLD_ONCE"):  # the loop `_plane_split_tiles` runs
        ones |= {"svs_t": 1}
    if not consts["K_CHANNEL"] and consts["K_GROUP"] == consts["D"]:
        ones |= {"sks_t": 1, "skz_t": 1}
    return ones


def decode_variants(quick: bool, cc: tuple[int, int] = (9, 0)) -> list[dict]:
    """Format pairs x key axis x head_dim x query rows: decode's 16 rows (GQA up to 16) and the most rows
    `supports_attention` lets through for the head_dim (the tile that needs the most registers); where
    `launch.direct_keys_config` gives it, the plane-split loop's direct-keys form too, with that tile, warps and stages
    ("variant", format + " direct keys")."""
    pairs = [("int4", "int4"), ("int8", "int8"), ("int8", "int4"), ("fp8_e4m3", "fp8_e4m3"), ("int2", "int2")]
    if not quick:
        pairs += [("int4", "int8"), ("int8", "int2"), ("fp8_e5m2", "fp8_e5m2")]
    rows = []
    for head_dim in (64, 128) if quick else (16, 32, 64, 128, 256):
        for kf, vf in pairs:
            axes = ("channel", "token") if not quick or (kf, vf) == ("int8", "int4") else ("channel",)
            for key_axis in axes if head_dim in launch.TOKEN_KEY_HEAD_DIMS else ("channel",):
                for block_m in sorted({16, launch.MAX_BLOCK_M[head_dim]}) if not quick or kf == vf == "int8" else (16,):
                    kb, kfp8 = formats.get(kf).bits, formats.get(kf).fp8_code
                    vb, vfp8 = formats.get(vf).bits, formats.get(vf).fp8_code
                    block_n, warps = launch.launch_config(head_dim, block_m, cc)
                    group = min(128, head_dim)
                    consts = {
                        "D": head_dim,
                        "BLOCK_M": block_m,
                        "BLOCK_N": block_n,
                        "K_BITS": kb,
                        "K_FP8": kfp8,
                        "K_CHANNEL": key_axis == "channel",
                        "K_GROUP": 128 if key_axis == "channel" else group,
                        "V_BITS": vb,
                        "V_FP8": vfp8,
                        "V_GROUP": group,
                        "PTX": True,  # the compiled path (the interpreter tests run the Triton-ops twin)
                        "FOLD_ONCE": launch.fold_once(head_dim, cc),
                        "PLANE_SPLIT": launch.plane_split(
                            PrecisionSpec(kf, vf, key_axis, 128 if key_axis == "channel" else group), head_dim
                        ),
                    }
                    consts |= unit_strides(consts)
                    spec = PrecisionSpec(kf, vf, key_axis, 128 if key_axis == "channel" else group)
                    rows.append(
                        {"kernel": "decode", "format": f"k:{kf} v:{vf}", "axis": key_axis, "head_dim": head_dim}
                        | {"block_m": block_m, "num_warps": warps, "consts": consts}
                        | {"maxnreg": launch.max_registers(spec, head_dim, warps)}
                    )
                    direct = launch.direct_keys_config(spec, head_dim, block_m, cc)
                    if direct:  # the loop's other form, a launch setting, with its own tile and warps
                        d_n, d_warps, d_stages = direct
                        rows.append(
                            rows[-1]
                            | {"format": rows[-1]["format"] + " direct keys", "variant": "direct keys"}
                            | {"num_warps": d_warps, "num_stages": d_stages}
                            | {"maxnreg": launch.max_registers(spec, head_dim, d_warps)}
                            | {"consts": consts | {"BLOCK_N": d_n} | launch.form_constants(True, d_warps)}
                        )
    for half in ("bf16", "fp32"):
        rows.append(rows[0] | {"half": half, "format": rows[0]["format"] + f" ({half} query and residual)"})
    rows += method_variants(quick, cc)
    rows.append({"kernel": "merge", "format": "-", "axis": "-", "head_dim": 128, "consts": {"BLOCK_M": 16, "D": 128}})
    return rows


# the methods beyond uniform codes (kvdemo/precision.py) the decode kernel reads: (label, key format, value
# format, key axis, extra constexprs, pointer types). Codebooks are fp16 (as the cache stores them);
# o<cap>: sparse outliers per row.
METHODS = [
    ("", "nuq4", "nuq4", "channel", {}, {}),
    ("", "nuq3", "nuq3", "channel", {}, {}),
    ("", "nuq2", "nuq2", "channel", {}, {}),
    ("", "int3", "int3", "channel", {}, {}),
    ("o2", "nuq3", "nuq3", "channel", {"K_OUTLIERS": 2, "V_OUTLIERS": 2}, {}),
    ("o2", "int4", "int4", "channel", {"K_OUTLIERS": 2, "V_OUTLIERS": 2}, {}),
    ("hadamard", "int4", "int4", "channel", {"K_ROTATED": True}, {}),
    ("prerope", "int4", "int4", "channel", {"ROPE": True}, {}),
    ("o2 prerope", "nuq4", "nuq4", "channel", {"K_OUTLIERS": 2, "V_OUTLIERS": 2, "ROPE": True}, {}),
    ("", "nvfp4", "nvfp4", "token", {}, {"ks_ptr": "*u8", "vs_ptr": "*u8"}),
    ("", "nuq3", "nuq3", "token", {}, {}),
]


def method_variants(quick: bool, cc: tuple[int, int] = (9, 0)) -> list[dict]:
    """The decode variants of `METHODS` at head_dim 64 and 128 (quick: 128), decode rows (block_m 16), with
    the launch settings `past_attention` picks; marked "method" (the goal-point rows are plain codes)."""
    rows = []
    for head_dim in (128,) if quick else (64, 128):
        for label, kf, vf, key_axis, extra, pointers in METHODS:
            if key_axis == "token" and head_dim not in launch.TOKEN_KEY_HEAD_DIMS:
                continue
            (kb, kcode), (vb, vcode) = ((formats.get(f).bits, formats.get(f).code_kind) for f in (kf, vf))
            extra = dict(extra)
            rope = extra.pop("ROPE", False)
            method = "outliers" if "K_OUTLIERS" in extra else "codes" if rope or (kf, vf) != ("int4", "int4") else ""
            block_n, warps = launch.launch_config(
                head_dim, 16, cc, method + ("+rope" if method == "outliers" and rope else "")
            )
            consts = {
                "D": head_dim,
                "BLOCK_M": 16,
                "BLOCK_N": block_n,
                "K_BITS": kb,
                "K_FP8": 0,
                "K_CHANNEL": key_axis == "channel",
                "K_GROUP": 128 if key_axis == "channel" else 16 if kf == "nvfp4" else head_dim,
                "V_BITS": vb,
                "V_FP8": 0,
                "V_GROUP": 16 if vf == "nvfp4" else head_dim,
                "PTX": True,
                "FOLD_ONCE": launch.fold_once(head_dim, cc),
                "K_CODE": kcode,
                "V_CODE": vcode,
                "K_ROPE": head_dim if rope else 0,
            } | extra
            consts |= unit_strides(consts)
            fmt = f"k:{kf} v:{vf}" + (f" {label}" if label else "")
            rows.append(
                {"kernel": "decode", "format": fmt, "axis": key_axis, "head_dim": head_dim, "method": True}
                | {"block_m": 16, "num_warps": warps, "consts": consts, "pointers": pointers}
            )
    return rows


KERNELS = {  # a row's "kernel" -> the @triton.jit function it compiles
    "quantize": triton_quantize._quantize_kernel,
    "quantize_methods": triton_quantize._quantize_methods_kernel,
    "quantize_nvfp4": triton_quantize._quantize_nvfp4_kernel,
    "decode": triton_decode._decode_split_kernel,
    "merge": triton_decode._merge_kernel,
}
# the device machine's H200 as read there (.library/device/KINDS.md): SMs, SM clock under load, and the
# device-to-device copy rate (bytes read + written), used as the HBM rate for both contenders
H200 = {"sms": 132, "clock_hz": 1.98e9, "bytes_per_s": 4.3e12}
LLAMA_8B_KV_HEADS = 8


def is_goal_row(row: dict) -> bool:
    """A decode variant at the goal's shapes: Llama-8B heads (head_dim 128), decode rows, per-channel keys."""
    return (
        row["kernel"] == "decode"
        and "half" not in row
        and "method" not in row
        and (row["head_dim"], row["block_m"], row["axis"]) == (128, 16, "channel")
    )


def issue_per_token(row: dict) -> float:
    """Warp instructions the decode loop issues per cached token of one (batch, kv head): the loop's steady
    path, plus its key-block entry code once per K_GROUP tokens, times the warps, over the tile's tokens (the
    `loop_rare` blocks run on a few tiles per program: nothing per token at long context)."""
    c = row["consts"]
    per_tile = row["loop_instructions"] + row["loop_conditional"] * c["BLOCK_N"] / c["K_GROUP"]
    return row["num_warps"] * per_tile / c["BLOCK_N"]


def packed_bytes_per_token(c: dict) -> float:
    """Bytes of one token's packed K and V for one kv head: codes plus fp16 scales (and zeros, int formats)."""
    meta = {k: 2 * (1 if c[f"{k}_FP8"] else 2) for k in "KV"}  # bytes of metadata per group
    # per-channel keys: one group per channel per K_GROUP tokens; per-token: D / K_GROUP groups per token
    return (
        c["D"] * (c["K_BITS"] + c["V_BITS"]) / 8 + meta["K"] * c["D"] / c["K_GROUP"] + meta["V"] * c["D"] / c["V_GROUP"]
    )


def goal_floors(row: dict, batch: int, context: int, gpu: dict = H200) -> dict:
    """Lower bounds on one decode step's time at Llama-8B shapes: the kernel's issue floor (every scheduler
    issues one warp instruction per cycle; real kernels stall, so real time is longer) and memory floors
    (bytes / HBM rate) for it and for 16-bit SDPA. `ceiling`: the speedup over SDPA if SDPA ran at its
    memory floor and the kernel at the larger of its floors (a slower SDPA would give more)."""
    tokens = batch * LLAMA_8B_KV_HEADS * context
    issue_s = tokens * issue_per_token(row) / (gpu["sms"] * 4 * gpu["clock_hz"])
    memory_s = tokens * packed_bytes_per_token(row["consts"]) / gpu["bytes_per_s"]
    sdpa_s = tokens * 2 * row["consts"]["D"] * 2 / gpu["bytes_per_s"]
    return {
        "issue_ms": issue_s * 1e3,
        "memory_ms": memory_s * 1e3,
        "sdpa_memory_ms": sdpa_s * 1e3,
        "ceiling": sdpa_s / max(issue_s, memory_s),
    }


def goal_budgets(row: dict) -> dict[str, bool]:
    """What a memory-bound decode loop needs, for a goal-point row (its `loop_mix`, `warps_per_sm` and
    `goal_floors`): each budget and whether the loop meets it."""
    mix = row["loop_mix"]
    return {
        "no non-async global load in the loop": mix["global_loads"] == 0,
        "at most 4 barriers per tile": mix["barriers"] <= 4,
        "at least 12 warps per SM": row["warps_per_sm"] >= 12,
        "issue floor at or below the memory floor": row["goal_floors"]["issue_ms"] <= row["goal_floors"]["memory_ms"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability as an integer (90: H100/H200)")
    p.add_argument("--quick", action="store_true", help="a representative subset (the test's)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--strict", action="store_true", help="exit 1 if any variant spills registers")
    p.add_argument("--goal-rows", action="store_true", help="only the decode variants behind the goal-point floors")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # the kernels were built for the interpreter
        sys.exit("error: unset TRITON_INTERPRET; this compiles the kernels, it does not interpret them")
    cc = divmod(args.arch, 10)  # the launch settings `past_attention` picks for this compute capability
    if args.goal_rows:
        rows = [r for r in decode_variants(True, cc) if is_goal_row(r)]
    else:
        rows = quantize_variants(args.quick) + decode_variants(args.quick, cc)
    failed = 0
    print(f"triton {triton.__version__}, sm_{args.arch}")
    for row in rows:
        fn = KERNELS[row["kernel"]]
        try:
            row |= compile_one(
                fn,
                row["consts"],
                args.arch,
                row.get("num_warps", 4),
                row.get("num_stages", launch.NUM_STAGES),
                half=row.get("half", "fp16"),
                pointers=row.get("pointers"),
                fp_fusion=row.get("fp_fusion", True),
                maxnreg=row.get("maxnreg"),
            )
        except Exception as err:  # noqa: BLE001 - every failure is reported, then the exit code says so
            lines = str(err).strip().splitlines() or [""]
            row["error"] = f"{type(err).__name__}: {lines[-1][:300]}"
            failed += 1
        rows_m = f"m{row['block_m']}" if "block_m" in row else ""
        what = f"{row['kernel']:>8} {row['format']:<44} {row['axis']:>7} d{row['head_dim']:<3} {rows_m:>4}"
        if "error" in row:
            print(f"{what} FAILED {row['error']}")
        else:
            copies = ",".join(
                f"{n}x{b}B" for b, n in sorted(row["async_copy_bytes"].items(), key=lambda kv: -int(kv[0]))
            )
            print(
                f"{what} regs {row['registers']:>3}  spill stores {row['spill_stores']:>3}  "
                f"shared {row['shared_bytes'] / 1024:5.1f} KiB  async copies {copies or '-':<14} mma {row['mma']:>3}  "
                f"warps/SM {row['warps_per_sm']:>2}  ({row['compile_s']:.1f} s)"
            )
            if row["kernel"] == "decode" and row["loop_instructions"]:
                mix = row["loop_mix"]
                print(
                    f"{'':>8} loop: {row['loop_instructions']} instructions; moves {mix['moves']}, PRMT {mix['prmt']}, "
                    f"shared loads {mix['shared_loads']} / stores {mix['shared_stores']}, barriers {mix['barriers']}, "
                    f"MMA {mix['mma']}, global loads {mix['global_loads']} (async copies {mix['async_copies']})"
                )
    spilled = [r for r in rows if r.get("spill_stores", 0) > 0]
    batch, context = GOAL_POINT
    print(f"\nDecode at Llama-8B shapes, batch {batch}, context {context}, on an H200 (floors, not measurements):")
    for row in rows:
        if is_goal_row(row) and "error" not in row:
            row["issue_per_token"] = round(issue_per_token(row), 1)
            row["goal_floors"] = {k: round(v, 4) for k, v in goal_floors(row, batch, context).items()}
            f = row["goal_floors"]
            print(
                f"  {row['format']:<22} {row['issue_per_token']:5.1f} warp instructions per token: issue "
                f"{f['issue_ms']:.3f} ms, memory {f['memory_ms']:.3f} ms; 16-bit SDPA memory "
                f"{f['sdpa_memory_ms']:.3f} ms -> speedup at most {f['ceiling']:.2f}x"
            )
    print(f"  goals: int4 >= {GOALS['int4_speedup_64k_b8']}x, int8 >= {GOALS['int8_speedup_64k_b8']}x")
    for row in rows:
        if "goal_floors" in row:
            row["goal_budgets"] = goal_budgets(row)
            missed = [name for name, met in row["goal_budgets"].items() if not met]
            print(f"  {row['format']:<22} budgets missed: {', '.join(missed) or 'none'}")
    print("\nDecode loop of the methods beyond uniform codes (decode rows):")
    for row in rows:
        if "method" in row and "error" not in row:
            row["issue_per_token"] = round(issue_per_token(row), 1)
            print(
                f"  {row['format']:<28} {row['axis']:>7} d{row['head_dim']:<3} regs {row['registers']:>3}  "
                f"spill stores {row['spill_stores']:>3}  {row['issue_per_token']:5.1f} warp instructions per token"
            )
    if args.json:
        provenance = {
            "command": "python bench/compile_sm90.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "date": datetime.date.today().isoformat(),
            "machine": f"a {os.cpu_count()}-core CPU machine (no GPU: ptxas compiles for sm_{args.arch})",
        }
        Path(args.json).write_text(
            json.dumps({"triton": triton.__version__, "arch": args.arch, **provenance, "rows": rows}, indent=2)
        )
    print(f"{len(rows)} variants: {failed} failed to compile, {len(spilled)} spill registers")
    return 1 if failed or (args.strict and spilled) else 0


if __name__ == "__main__":
    sys.exit(main())
