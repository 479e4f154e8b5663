"""GPU benchmark of the Triton quantized-cache kernels : one script, one device call, one JSON.

Measured in the same run, on one GPU:

1. copy bandwidth: a device-to-device copy of a large fp16 buffer, (bytes read + written) / time;
2. quantize-and-pack throughput per format, keys per channel (groups of 128 tokens) and values per
   token, as (bytes read + written) / time and as a fraction of (1);
3. decode attention time per step: `triton_decode.past_attention` over packed K/V against torch
   SDPA over a 16-bit cache of the same tokens, Llama-3.1-8B head shapes (32 query heads, 8 kv heads,
   head_dim 128), contexts 4k-128k, batch 1-16. SDPA runs twice, with `enable_gqa=True` and with
   the 4 query heads of a group folded into 4 query rows (the same math for decode, one K/V read),
   and the faster counts. Each is also timed as GRAPH_CALLS calls captured in one CUDA graph and replayed
   (`*_graph_us`, `speedup_graph`: the host's launch gaps removed; the eager time, with the reason in
   `*_graph_fallback`, where capture fails or there is no CUDA device). Also: the memory-bound limit (16-bit bytes / packed bytes read) and, at the
   shortest context, the kernel's max error against the PyTorch reference, in units of max(1, |out|);
4. launch settings (tokens per tile, warps, pipeline stages, programs per SM) swept at the goal point (64k, batch 8),
   int4 and int8, eager and from CUDA graphs: the defaults are judged, the best is reported beside them;
5. the decode loop's issue and memory floors at the goal point, from the machine code this machine's
   triton compiles (bench/compile_sm90.py), and the measured time over the issue floor;
6. end-to-end decode tokens/s per model, prompt length, batch, precision and backend (bench/gpu_e2e.py): the
   embedded model, and
   `random:<config>` models (assets/model_configs, random weights: tokens/s does not depend on weight
   values). Where the embedded model is not installed (the device machine cannot take its 94 MB
   along) its shapes run with random weights, `random:smollm2-135m`, and the row says so. Per row also the
   decode's peak memory beside the headroom formula's, and the memory floor's tokens/s;
7. a model split across devices (bench/gpu_e2e.py, `split`): the embedded model's shapes with half its layers
   on the GPU and half on the CPU, greedy tokens against one device, each layer's cache on its layer's device;
8. long-context prefill (bench/gpu_long_context.py; last: it has whatever time the sections above leave, at most
   `--long-budget-s`): a Llama-3.1-8B-shaped random model prefilled in chunks to 128k tokens, int4 and
   full, then its first 2 layers (1 when time is short) to 1M tokens, int4. Per row: peak memory
   (torch.cuda.max_memory_allocated) split into weights, cache and workspace, the cache's bytes by the
   formula (kvdemo.layout.region_bytes) beside the measured ones, prefill seconds and the share spent
   over the packed past (`attention.long_past_attention`: the Triton decode kernel over tiles of query
   rows, its calls counted). Rows that do not fit the time are recorded as skipped, with the reason.

Quantize also checks that the kernel's bytes equal the PyTorch reference's on the GPU. Each section
that fails is recorded with its error and the rest still run; the JSON is rewritten after each.

Goals (H200): int4 >= 2.5x SDPA at 64k context, batch 8; int8 >= 1.7x; quantize >= 60% of copy. End to end
(reported side by side, gpu_e2e.e2e_goals): Llama-3.1-8B shapes at 32k, batch 8, int4 >= 1.3x full and >= 50% of
the memory floor (triton+graphs); the 135M shapes >= 150 tok/s.

`--smoke` runs every code path at tiny sizes on CPU under TRITON_INTERPRET=1 (set here when no GPU):
its numbers say nothing about speed. Usage:

    python bench/gpu_attention.py --out reports/gpu_attention.json
    python bench/gpu_attention.py --sections long --long-budget-s 400 --out reports/gpu_long.json
    TRITON_INTERPRET=1 python bench/gpu_attention.py --smoke --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

LLAMA_8B = {"q_heads": 32, "kv_heads": 8, "head_dim": 128}
SMOKE_SHAPE = {"q_heads": 8, "kv_heads": 2, "head_dim": 64}
EMBEDDED_CONFIG = "smollm2-135m"  # assets/model_configs: the embedded model's shapes
PRESET = {"int8": "int8", "int4": "int4", "int2": "int2", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8-e5m2", "k8v4": "k8v4"}
FULL_DEFAULTS = {
    "contexts": "4096,16384,32768,65536,131072",
    "batches": "1,4,8,16",
    "group": 128,
    "residual": 128,
    "e2e_prompt": "4096,32768",
    "e2e_batches": "1,8",
    "e2e_tokens": 64,
    "e2e_split_prompt": 512,
    "e2e_precisions": "full,int8,int4",
    "models": "embedded,random:llama-3.1-8b",
    "long_model": "llama-3.1-8b",
    "long_context": 131072,
    "long_max_context": 1 << 20,
    "long_max_layers": 2,
    "method_formats": "nuq4:o1,nuq3:o1,nuq2:o1:s1,int3,nvfp4,int4:hadamard",
}
SMOKE_DEFAULTS = {
    "contexts": "96,200",
    "batches": "1,2",
    "group": 32,
    "residual": 32,
    "e2e_prompt": 48,
    "e2e_batches": "1,2",
    "e2e_tokens": 2,
    "e2e_split_prompt": 40,
    "e2e_precisions": "full,int4",
    "models": "embedded",
    "long_model": "scale",
    "long_context": 2304,
    "long_max_context": 4096,
    "long_max_layers": 1,
    "method_formats": "nuq3:o1,nvfp4",
}
GOAL_POINT = (8, 65536)  # (batch, context) of the decode goals
SWEEP = {"block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3), "programs_per_sm": (2, 8, 16)}
SECTIONS = ("copy", "quantize", "decode", "sweep", "floors", "e2e", "split", "long")  # in this order
GOALS = {"int4_speedup_64k_b8": 2.5, "int8_speedup_64k_b8": 1.7, "quantize_fraction_of_copy": 0.6}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="reports/gpu_attention.json")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, CPU + TRITON_INTERPRET=1 when no GPU")
    p.add_argument("--contexts", default=None, help="default 4096,16384,32768,65536,131072 (smoke: 96,200)")
    p.add_argument("--batches", default=None, help="default 1,4,8,16 (smoke: 1,2)")
    p.add_argument("--formats", default="int4,int8,k8v4,fp8_e4m3", help="decode formats (PRESET's names)")
    p.add_argument(
        "--method-formats",
        default=None,
        help="the methods' formats (nuq, int3, nvfp4, outliers, rotation, pre-RoPE; precision strings), decoded at the goal point only (smoke: the first point); "
        "default nuq4:o1,nuq3:o1,nuq2:o1:s1,int3,nvfp4,int4:hadamard (smoke: nuq3:o1,nvfp4); '' to skip",
    )
    p.add_argument("--quant-formats", default="int8,int4,int2,fp8_e4m3,fp8_e5m2")
    p.add_argument("--group", type=int, default=None, help="default 128 (smoke: 32)")
    p.add_argument("--residual", type=int, default=None, help="default 128 (smoke: 32)")
    p.add_argument(
        "--models",
        default=None,
        help="end-to-end models: embedded, a hub id or folder, random:<assets/model_configs name> ('' to skip); "
        "default embedded,random:llama-3.1-8b (smoke: embedded)",
    )
    p.add_argument("--e2e-prompt", default=None, help="prompt tokens, a list; default 4096,32768 (smoke: 48)")
    p.add_argument("--e2e-batches", default=None, help="sequences decoded together, a list; default 1,8 (smoke: 1,2)")
    p.add_argument("--e2e-budget-s", type=float, default=None, help="seconds the e2e rows may take; later ones skipped")
    p.add_argument("--e2e-split-prompt", type=int, default=None, help="prompt tokens of the split rows, default 512")
    p.add_argument("--split-precisions", default="full,int4", help="precisions of the split rows")
    p.add_argument("--e2e-tokens", type=int, default=None, help="new tokens per run, default 64 (smoke: 2)")
    p.add_argument("--e2e-precisions", default=None, help="default full,int8,int4 (smoke: full,int4)")
    p.add_argument(
        "--e2e-backends",
        default="torch,triton,triton+graphs,hf-dynamic,hf-static",
        help="kvdemo's cache on the PyTorch path (torch), the Triton kernels with eager steps (triton) or steps "
        "replayed from a CUDA graph (triton+graphs); transformers' own DynamicCache / StaticCache decode with "
        "SDPA (hf-dynamic, hf-static: full precision only)",
    )
    p.add_argument("--sweep", default="auto", help="launch-setting sweep: auto (full runs), on, off")
    p.add_argument("--time-budget-s", type=float, default=420.0, help="decode rows past this are skipped")
    p.add_argument("--sections", default=",".join(SECTIONS), help="which sections run (always in the order above)")
    p.add_argument("--long-model", default=None, help="assets/model_configs name (smoke: 'scale', kvdemo.measured's)")
    p.add_argument("--long-context", type=int, default=None, help="tokens of the context rows, default 131072")
    p.add_argument("--long-precisions", default="int4,full", help="precisions of the context rows")
    p.add_argument("--long-max-context", type=int, default=None, help="tokens of the int4 max row, default 1M")
    p.add_argument("--long-max-layers", type=int, default=None, help="layers of the max row at most, default 2")
    p.add_argument("--long-budget-s", type=float, default=240.0, help="seconds the long section may take")
    p.add_argument(
        "--stop-by-s", type=float, default=None, help="seconds from the start by which the long section ends"
    )
    args = p.parse_args(argv)
    defaults = SMOKE_DEFAULTS if args.smoke else FULL_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# --- timing ---------------------------------------------------------------------------------------


def time_us(fn, device: torch.device, smoke: bool) -> float:
    """Median microseconds per call: triton.testing.do_bench on CUDA (L2 flushed), wall clock on CPU."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3
    fn()
    runs = []
    for _ in range(2 if smoke else 5):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs) * 1e6


GRAPH_CALLS = 20  # calls of the op captured in one CUDA graph: one replay runs them back to back


def graph_us(fn, device: torch.device, calls: int = GRAPH_CALLS, reps: int = 5) -> tuple[float | None, str | None]:
    """(median microseconds per call, None) with `calls` calls of `fn` captured in one `torch.cuda.CUDAGraph` and
    the replays timed with CUDA events: the GPU's time with the host's launch gaps removed (do_bench's eager
    calls include them). (None, why) where capture is not possible (no CUDA device) or fails (a host sync or an
    allocation the capture refuses): the caller keeps the eager time. `fn` has run eagerly before (compiled).
    No L2 flush between the captured calls; the goal point's K/V (0.5-2 GB) is far over any L2."""
    if device.type != "cuda":
        return None, f"no CUDA device ({device.type}): eager timing only"
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph asks
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize(device)
        runs = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) * 1e3 / calls)
        del graph
        return statistics.median(runs), None
    except Exception as err:  # noqa: BLE001 - a capture that fails is a result: the eager time stands
        torch.cuda.synchronize(device)
        return None, f"capture failed: {type(err).__name__}: {err}"[:500]


def graph_fields(prefix: str, fn, eager_us: float, device: torch.device) -> dict:
    """`<prefix>_graph_us` (the eager time where capture failed) and `<prefix>_graph_fallback` (None, or why)."""
    us, why = graph_us(fn, device)
    return {f"{prefix}_graph_us": eager_us if us is None else us, f"{prefix}_graph_fallback": why}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- 1. copy bandwidth ----------------------------------------------------------------------------


def bench_copy(device: torch.device, smoke: bool) -> dict:
    n = (1 << 16) if smoke else (1 << 29)  # fp16 elements: 128 KiB or 1 GiB
    src = torch.randn(n, device=device, dtype=torch.float16)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), device, smoke)
    moved = 2 * src.numel() * src.element_size()
    return {"bytes": src.numel() * src.element_size(), "us": us, "gb_s": moved / us / 1e3}


# --- 2. quantize throughput -----------------------------------------------------------------------


def bench_quantize(device: torch.device, args, copy_gb_s: float) -> list[dict]:
    from kvdemo.quant import reference, triton_quantize

    shape = (1, 2, 256, 64) if args.smoke else (8, 8, 32768, 128)  # 512 MiB of fp16 at full size
    x = torch.randn(shape, device=device, dtype=torch.float16)
    rows = []
    for fmt in _names(args.quant_formats):
        for role, axis in (("keys", "channel"), ("values", "token")):
            group = min(args.group, shape[-1]) if axis == "token" else args.group
            q = triton_quantize.quantize(x, fmt, axis, group)  # outputs (and compilation) outside the timed loop

            def run(fmt=fmt, axis=axis, group=group, q=q):
                triton_quantize.quantize_into(x, fmt, axis, group, q.codes, q.scale, q.zero)

            us = time_us(run, device, args.smoke)
            want = reference.quantize(x[:, :, :1024], fmt, axis, group)  # a slice: the reference's temporaries
            got = triton_quantize.quantize(x[:, :, :1024], fmt, axis, group)
            same = all(
                (a is None and b is None) or torch.equal(a, b)
                for a, b in ((got.codes, want.codes), (got.scale, want.scale), (got.zero, want.zero))
            )
            written = sum(q.nbytes().values())
            moved = x.numel() * x.element_size() + written
            rows.append(
                {
                    "format": fmt,
                    "role": role,
                    "axis": axis,
                    "group": group,
                    "shape": list(shape),
                    "us": us,
                    "gb_s": moved / us / 1e3,
                    "fraction_of_copy": moved / us / 1e3 / copy_gb_s,
                    "bit_identical_to_reference": same,
                }
            )
    return rows


# --- 3. decode attention --------------------------------------------------------------------------


def make_packed(keys: torch.Tensor, values: torch.Tensor, spec):
    """PackedKV of `keys`/`values` [B, H, T, D] in the regions that decoding one token at a time leaves
    (kvdemo.layout: sinks, whole quantized blocks, a full-precision residual below `residual` tokens)."""
    from kvdemo.cache import PackedKV, StoredPart
    from kvdemo.layout import Layout
    from kvdemo.quant import reference, triton_quantize

    d = keys.shape[-1]
    r = Layout(spec).regions([1] * keys.shape[-2])

    def part(x, fmt, axis, group, values=False):
        coded = triton_quantize.quantize(x[:, :, : r.quantized], fmt, axis, group) if r.has_codes else None
        if values and coded is not None:  # as the cache stores values' metadata
            coded = reference.paired(coded)
        return StoredPart(x[:, :, : r.sinks], coded, x[:, :, r.residual_start :])

    k = part(keys, spec.key_format, spec.key_axis, spec.key_group(d))
    return PackedKV(spec, r, k, part(values, spec.value_format, "token", spec.value_group(d), values=True))


def method_packed(keys: torch.Tensor, values: torch.Tensor, spec):
    """PackedKV of `keys`/`values` in a one-layer QuantizedKVCache at `spec` (codebooks: NormalFloat, the same
    speed as fitted ones), so the methods' fields (levels, outliers, rotation, nvfp4 scales) are as the app has them."""
    from kvdemo.cache import QuantizedKVCache

    cache = QuantizedKVCache(spec, num_layers=1)
    cache.layers[0].update(keys, values)
    return cache.layers[0].packed()


def decode_inputs(batch: int, ctx: int, shape: dict, device: torch.device):
    """Random 16-bit keys, values [B, Hkv, T, D] and one decode query [B, Hq, 1, D] (seeded by the size)."""
    hq, hkv, d = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    gen = torch.Generator(device=device).manual_seed(batch * 1_000_003 + ctx)
    keys = torch.randn((batch, hkv, ctx, d), device=device, dtype=torch.float16, generator=gen)
    values = torch.randn((batch, hkv, ctx, d), device=device, dtype=torch.float16, generator=gen)
    query = torch.randn((batch, hq, 1, d), device=device, dtype=torch.float16, generator=gen)
    return keys, values, query


def sdpa_calls(keys, values, query) -> tuple:
    """SDPA over the 16-bit cache as two calls: (enable_gqa=True, the group's heads folded into query rows)."""
    import torch.nn.functional as F

    b, hq, _, d = query.shape
    folded = query.view(b, keys.shape[1], hq // keys.shape[1], d)  # the same math for one decode query
    scale = d**-0.5
    return (
        lambda: F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True),
        lambda: F.scaled_dot_product_attention(folded, keys, values, scale=scale),
    )


def sdpa_us(keys, values, query, device: torch.device, smoke: bool) -> tuple[float, float]:
    """Microseconds of SDPA over the 16-bit cache: (enable_gqa=True, the group's heads folded into rows)."""
    gqa, fold = sdpa_calls(keys, values, query)
    return time_us(gqa, device, smoke), time_us(fold, device, smoke)


def sdpa_graph_fields(keys, values, query, us_gqa: float, us_fold: float, device: torch.device) -> dict:
    """`graph_fields` of the faster SDPA call (by the eager times): `sdpa_graph_us`, `sdpa_graph_fallback`."""
    gqa, fold = sdpa_calls(keys, values, query)
    return graph_fields("sdpa", gqa if us_gqa <= us_fold else fold, min(us_gqa, us_fold), device)


def bench_decode(device: torch.device, args, deadline: float) -> list[dict]:
    from kvdemo.precision import parse_precision
    from kvdemo.quant import launch, reference_attention, triton_decode

    shape = SMOKE_SHAPE if args.smoke else LLAMA_8B
    hq, hkv, d = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    scale = d**-0.5
    contexts, batches = _ints(args.contexts), _ints(args.batches)
    rows = []
    points = [(b, c) for b in batches for c in contexts]
    points.sort(key=lambda p: p != GOAL_POINT)  # the goal point first: the time budget never skips it
    for batch, ctx in points:
        base = {"batch": batch, "context": ctx, "q_heads": hq, "kv_heads": hkv, "head_dim": d}
        if time.perf_counter() > deadline:
            rows.extend(base | {"format": f, "skipped": "time budget"} for f in _names(args.formats))
            continue
        need = 2 * batch * hkv * ctx * d * 2 * 1.7  # 16-bit K and V, packed copies, workspace
        if device.type == "cuda" and need > 0.9 * torch.cuda.mem_get_info(device)[0]:
            rows.extend(base | {"format": f, "skipped": "memory"} for f in _names(args.formats))
            continue
        keys, values, query = decode_inputs(batch, ctx, shape, device)
        us_gqa, us_fold = sdpa_us(keys, values, query, device, args.smoke)
        sdpa = min(us_gqa, us_fold)
        sdpa_graph = sdpa_graph_fields(keys, values, query, us_gqa, us_fold, device)
        bytes16 = 2 * keys.numel() * keys.element_size()
        methods = _names(args.method_formats) if (batch, ctx) == (points[0] if args.smoke else GOAL_POINT) else []
        for fmt in _names(args.formats) + methods:
            if fmt in methods:  # the methods' formats: built as the cache builds them
                spec = parse_precision(f"{fmt}:g{args.group}:r{args.residual}")
                kv = method_packed(keys, values, spec)
            else:
                spec = parse_precision(f"{PRESET[fmt]}:g{args.group}:r{args.residual}")
                kv = make_packed(keys, values, spec)
            # the default form, then the plane-split loop's direct-keys form where it applies (`launch.direct_keys_config`)
            forms = [False] + ([True] if launch.direct_keys_config(spec, d, 16, launch.capability(device)) else [])
            want = reference_attention.past_attention(query, kv, scale)[0] if ctx == contexts[0] else None
            packed_bytes = triton_decode.kv_bytes_read(kv)
            for direct in forms:
                call = lambda q=query, kv=kv, direct=direct: triton_decode.past_attention(  # noqa: E731
                    q, kv, scale, direct_keys=direct
                )
                tri_us = time_us(call, device, args.smoke)
                graphed = graph_fields("triton", call, tri_us, device) | sdpa_graph
                err = None
                if want is not None:  # in the tests' unit: |kernel - reference| / max(1, max |reference|)
                    got = call()[0]
                    err = float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
                rows.append(
                    base
                    | {
                        "format": fmt,
                        "precision": spec.label,
                        "kernel": launch.supports_attention(query, kv),  # False: handed to the reference
                        "triton_us": tri_us,
                        "sdpa_us": sdpa,
                        "sdpa_gqa_us": us_gqa,
                        "sdpa_folded_us": us_fold,
                        "speedup": sdpa / tri_us,
                        "memory_bound_limit": bytes16 / packed_bytes,
                        "triton_gb_s": packed_bytes / tri_us / 1e3,
                        "sdpa_gb_s": bytes16 / sdpa / 1e3,
                        "max_err_vs_reference": err,
                    }
                    | ({"variant": "direct keys"} if direct else {})
                    | graphed
                    | {"speedup_graph": graphed["sdpa_graph_us"] / graphed["triton_graph_us"]}
                )
        keys = values = query = kv = None  # free this size before the next
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# --- 4. launch settings ---------------------------------------------------------------------------


def bench_sweep(device: torch.device, args) -> list[dict]:
    """Decode time per launch setting at the goal point (64k context, batch 8; smoke: the last context and
    batch given), int4 and int8, beside SDPA at the same point. `default` marks `launch_config`'s choice."""
    from kvdemo.precision import parse_precision
    from kvdemo.quant import launch, triton_decode

    shape = SMOKE_SHAPE if args.smoke else LLAMA_8B
    batch, ctx = (_ints(args.batches)[-1], _ints(args.contexts)[-1]) if args.smoke else GOAL_POINT
    keys, values, query = decode_inputs(batch, ctx, shape, device)
    us_gqa, us_fold = sdpa_us(keys, values, query, device, args.smoke)
    sdpa = min(us_gqa, us_fold)
    sdpa_graph = sdpa_graph_fields(keys, values, query, us_gqa, us_fold, device)
    block_n, warps = launch.launch_config(shape["head_dim"], 16, launch.capability(device))
    heads = batch * shape["kv_heads"]
    # tile x warps x stages at the default split, then programs per SM at the default tile
    settings = [
        (n, w, st, None, False) for n in SWEEP["block_n"] for w in SWEEP["num_warps"] for st in SWEEP["num_stages"]
    ]
    settings += [(block_n, warps, launch.NUM_STAGES, per_sm, False) for per_sm in SWEEP["programs_per_sm"]]
    # the direct-keys form: its own tile, warps and stages, then at the default stages where those differ
    settings += [(None, None, None, None, True), (None, None, launch.NUM_STAGES, None, True)]
    rows = []
    for fmt in ("int4", "int8"):
        spec = parse_precision(f"{PRESET[fmt]}:g{args.group}:r{args.residual}")
        kv = make_packed(keys, values, spec)
        for n, w, st, per_sm, direct in settings[:2] + settings[-3:] if args.smoke else settings:
            if direct:  # where it applies (`launch.direct_keys_config`)
                config = launch.direct_keys_config(spec, shape["head_dim"], 16, launch.capability(device))
                if config is None:
                    continue
                n, w, config_stages = config
                if st == config_stages:
                    continue
                st = st or config_stages
            splits = None if per_sm is None else launch.splits_for(heads, device, per_sm)

            def run(kv=kv, n=n, w=w, st=st, splits=splits, direct=direct):
                scale = shape["head_dim"] ** -0.5
                return triton_decode.past_attention(
                    query, kv, scale, num_splits=splits, block_n=n, num_warps=w, num_stages=st, direct_keys=direct
                )

            us = time_us(run, device, args.smoke)
            graphed = graph_fields("triton", run, us, device) | sdpa_graph
            rows.append(
                {"format": fmt, "context": ctx, "batch": batch, "block_n": n, "num_warps": w, "num_stages": st}
                | {"programs_per_sm": per_sm or launch.PROGRAMS_PER_SM, "direct_keys": direct}
                | {"us": us, "speedup": sdpa / us, "sdpa_us": sdpa}
                | {"default": (n, w, st, per_sm, direct) == (block_n, warps, launch.NUM_STAGES, None, False)}
                | graphed
                | {"speedup_graph": graphed["sdpa_graph_us"] / graphed["triton_graph_us"]}
            )
    return rows


# --- 5. the decode loop's floors --------------------------------------------------------------------


def bench_floors() -> list[dict]:
    """Issue and memory floors of the decode loop at the goal point, per format, from the machine code that
    this machine's triton compiles (bench/compile_sm90.py --goal-rows, in a subprocess: it compiles, the
    smoke run interprets): set beside the measured times, they say what bounds the kernel."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "floors.json"
        cmd = [sys.executable, str(Path(__file__).with_name("compile_sm90.py")), "--goal-rows", "--json", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"compile_sm90.py failed: {(proc.stdout + proc.stderr)[-2000:]}")
        rows = json.loads(out.read_text())["rows"]
    return [{"format": r["format"], "issue_per_token": r["issue_per_token"]} | r["goal_floors"] for r in rows]


# --- report ---------------------------------------------------------------------------------------


def goals(report: dict) -> dict:
    """Each goal with what was measured; `met` is None where not measured, or in a smoke run."""

    def at_goal(r: dict, fmt: str, variant: str | None = None) -> bool:
        return r.get("format") == fmt and r.get("variant") == variant and (r["batch"], r["context"]) == GOAL_POINT

    def speedup(fmt: str, variant: str | None = None):
        for r in report.get("decode", []):
            if at_goal(r, fmt, variant) and "speedup" in r:
                return r["speedup"]
        return None

    def best_swept(fmt: str):
        rows = [r for r in report.get("sweep", []) if at_goal(r, fmt)]
        best = max(rows, key=lambda r: r["speedup"], default=None)
        keys = ("speedup", "block_n", "num_warps", "num_stages", "programs_per_sm", "direct_keys")
        return best and {k: best.get(k, False) for k in keys}

    frac = [r["fraction_of_copy"] for r in report.get("quantize", [])]
    measured = {
        "int4_speedup_64k_b8": speedup("int4"),
        "int8_speedup_64k_b8": speedup("int8"),
        "quantize_fraction_of_copy": min(frac) if frac else None,  # the slowest format and role
    }
    out = {
        k: {"goal": GOALS[k], "measured": v, "met": None if v is None or report["smoke"] else bool(v >= GOALS[k])}
        for k, v in measured.items()
    }
    if report.get("e2e"):
        from gpu_e2e import e2e_goals

        out |= e2e_goals(report["e2e"], report["smoke"])
    for fmt in ("int4", "int8"):  # judged at the default launch setting; the sweep's best beside it
        out[f"{fmt}_speedup_64k_b8"]["best_launch_setting"] = best_swept(fmt)
        if (direct := speedup(fmt, "direct keys")) is not None:  # the plane-split loop's other form
            out[f"{fmt}_speedup_64k_b8"]["direct_keys_speedup"] = direct
        graphed = next((r for r in report.get("decode", []) if at_goal(r, fmt) and "speedup_graph" in r), None)
        if graphed:  # both timed from CUDA graphs (no host gaps), or the eager times where capture failed
            out[f"{fmt}_speedup_64k_b8"]["speedup_graph"] = graphed["speedup_graph"]
            out[f"{fmt}_speedup_64k_b8"]["graph_fallback"] = graphed["triton_graph_fallback"]
        floors = next((f for f in report.get("floors", []) if f["format"] == f"k:{fmt} v:{fmt}"), None)
        measured_us = next(
            (r["triton_us"] for r in report.get("decode", []) if at_goal(r, fmt) and "triton_us" in r), None
        )
        if floors:  # the kernel's time over its issue floor: how much its schedulers stall
            out[f"{fmt}_speedup_64k_b8"]["floors_ms"] = {
                k: floors[k] for k in ("issue_ms", "memory_ms", "sdpa_memory_ms")
            }
            if measured_us and not report["smoke"]:
                out[f"{fmt}_speedup_64k_b8"]["measured_over_issue_floor"] = measured_us / 1e3 / floors["issue_ms"]
    return out


def device_info(device: torch.device) -> dict:
    import triton

    info = {
        "type": device.type,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "name": props.name,
            "sm_count": props.multi_processor_count,
            "memory_gb": round(props.total_memory / 1e9, 1),
            "cuda": torch.version.cuda,
        }
    else:
        info |= {"name": platform.processor() or platform.machine(), "interpreter": os.environ.get("TRITON_INTERPRET")}
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported below
        device = torch.device("cpu")
    else:
        print("error: no CUDA device; run with --smoke for a CPU run of the code paths", file=sys.stderr)
        return 2
    report: dict = {"smoke": args.smoke, "device": device_info(device), "args": vars(args)}
    if args.smoke:
        report["note"] = "smoke run: Triton's CPU interpreter at tiny sizes; the times measure nothing"
    out = Path(args.out)
    sweep = args.sweep == "on" or (args.sweep == "auto" and not args.smoke)
    stop_by = started + (args.stop_by_s if args.stop_by_s is not None else float("inf"))

    def long_rows_so_far(rows: list[dict]) -> None:
        report["long"] = rows
        write_report(report, out)

    def bench_long(*a):  # its own program: bench/gpu_long_context.py (it imports this file's helpers)
        from gpu_long_context import bench_long

        return bench_long(*a)

    def bench_e2e():  # bench/gpu_e2e.py (it imports this file's helpers)
        from gpu_e2e import bench_e2e

        budget = float("inf") if args.e2e_budget_s is None else time.perf_counter() + args.e2e_budget_s
        return bench_e2e(device, args, report, budget) if args.models.strip() else []

    def bench_split():
        from gpu_e2e import bench_split

        return bench_split(device, args)

    sections = {
        "copy": lambda: bench_copy(device, args.smoke),
        "quantize": lambda: bench_quantize(device, args, report.get("copy", {}).get("gb_s", float("nan"))),
        "decode": lambda: bench_decode(device, args, started + args.time_budget_s),
        "sweep": lambda: bench_sweep(device, args) if sweep else [],
        "floors": bench_floors,
        "e2e": bench_e2e,
        "split": bench_split,
        "long": lambda: bench_long(device, args, stop_by, long_rows_so_far),
    }
    chosen = set(_names(args.sections))
    if chosen - set(SECTIONS):
        print(
            f"error: unknown sections {sorted(chosen - set(SECTIONS))}; allowed: {', '.join(SECTIONS)}", file=sys.stderr
        )
        return 2
    for name in (n for n in SECTIONS if n in chosen):
        run = sections[name]
        if name == "long" and device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()  # the worker process needs the memory the sections above cached
        t0 = time.perf_counter()
        try:
            report[name] = run()
        except Exception as err:  # noqa: BLE001 - the device run is one shot: keep the other sections' numbers
            report.setdefault("errors", {})[name] = traceback.format_exc()[-4000:]
            print(f"section {name} failed: {type(err).__name__}: {err}", file=sys.stderr)
        report.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 1)
        report["goals"] = goals(report)
        report["wall_s"] = time.perf_counter() - started
        write_report(report, out)
    for r in report.get("decode", []):
        if "speedup" in r:
            print(
                f"{r['format']:>8} ctx {r['context']:>6} batch {r['batch']:>2}: {r['triton_us']:9.1f} us "
                f"vs SDPA {r['sdpa_us']:9.1f} us = {r['speedup']:.2f}x (memory-bound limit {r['memory_bound_limit']:.2f}x); "
                f"graphs {r['triton_graph_us']:9.1f} vs {r['sdpa_graph_us']:9.1f} us = {r['speedup_graph']:.2f}x"
            )
    for r in report.get("e2e", []):
        if "decode_tok_s" in r:
            floor = f" ({r['fraction_of_floor']:.0%} of the memory floor)" if r.get("fraction_of_floor") else ""
            print(
                f"{r['model'][:40]:<40} {r['prompt_tokens']:>6} x{r['batch']:<2} {r['precision']:<14} {r['backend']:>13}: "
                f"{r['decode_tok_s']:8.1f} tok/s{floor}"
            )
    for r in report.get("split", []):
        print(
            f"split {r['precision']}: same tokens as on one device: {r['same_tokens']}, caches on {r['cache_devices']}"
        )
    for r in report.get("long", []):
        what = f"long {r['tokens']:>8} tokens {r['precision']:<14} {r.get('layers', '?'):>3} layers"
        if "prefill_s" in r:
            print(
                f"{what}: peak {r['peak_bytes'] / 1e9:7.2f} GB (weights {r['weights_bytes'] / 1e9:.2f}, cache "
                f"{r['cache_bytes'] / 1e9:.2f} vs formula {r['cache_bytes_formula'] / 1e9:.2f}, workspace "
                f"{r['workspace_bytes'] / 1e9:.2f}), prefill {r['prefill_s']:.1f} s ({r['past_attention_s']:.1f} s over the past)"
            )
        else:
            print(f"{what}: {r.get('skipped') or r.get('error')}")
    print(json.dumps(report["goals"], indent=2))
    print(
        f"wrote {out} in {report['wall_s']:.0f} s"
        + (f"; failed sections: {', '.join(report['errors'])}" if "errors" in report else "")
    )
    return 1 if "errors" in report else 0


def write_report(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(main())
