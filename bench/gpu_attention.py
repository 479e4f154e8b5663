"""GPU benchmark of the Triton quantized-cache kernels (issue 3): one script, one device call, one JSON.

Measured in the same run, on one GPU:

1. copy bandwidth: a device-to-device copy of a large fp16 buffer, (bytes read + written) / time;
2. quantize-and-pack throughput per format, keys per channel (groups of 128 tokens) and values per
   token, as (bytes read + written) / time and as a fraction of (1);
3. decode attention time per step: `triton_kernels.past_attention` over packed K/V against torch
   SDPA over a 16-bit cache of the same tokens, Llama-3.1-8B head shapes (32 query heads, 8 kv heads,
   head_dim 128), contexts 4k-128k, batch 1-16. SDPA runs twice, with `enable_gqa=True` and with
   the 4 query heads of a group folded into 4 query rows (the same math for decode, one K/V read),
   and the faster counts. Also: the memory-bound limit (16-bit bytes / packed bytes read) and, at the
   shortest context, the kernel's max error against the PyTorch reference;
4. end-to-end decode tokens/s with the embedded model (and any `--models`), per precision and backend.

Goals (issue 3, H200): int4 >= 2.5x SDPA at 64k context, batch 8; int8 >= 1.7x; quantize >= 60% of copy.

`--smoke` runs every code path at tiny sizes on CPU under TRITON_INTERPRET=1 (set here when no GPU):
its numbers say nothing about speed. Usage:

    python bench/gpu_attention.py --out reports/gpu_attention.json
    TRITON_INTERPRET=1 python bench/gpu_attention.py --smoke --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

LLAMA_8B = {"q_heads": 32, "kv_heads": 8, "head_dim": 128}
SMOKE_SHAPE = {"q_heads": 8, "kv_heads": 2, "head_dim": 64}
PRESET = {"int8": "int8", "int4": "int4", "int2": "int2", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8-e5m2"}
FULL_DEFAULTS = {
    "contexts": "4096,16384,32768,65536,131072",
    "batches": "1,4,8,16",
    "group": 128,
    "residual": 128,
    "e2e_prompt": 4096,
    "e2e_tokens": 64,
    "e2e_precisions": "full,int8,int4",
}
SMOKE_DEFAULTS = {
    "contexts": "96,200",
    "batches": "1,2",
    "group": 32,
    "residual": 32,
    "e2e_prompt": 48,
    "e2e_tokens": 2,
    "e2e_precisions": "full,int4",
}
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
    p.add_argument("--formats", default="int4,int8,fp8_e4m3", help="decode formats (keys and values alike)")
    p.add_argument("--quant-formats", default="int8,int4,int2,fp8_e4m3,fp8_e5m2")
    p.add_argument("--group", type=int, default=None, help="default 128 (smoke: 32)")
    p.add_argument("--residual", type=int, default=None, help="default 128 (smoke: 32)")
    p.add_argument("--models", default="embedded", help="models for end-to-end tokens/s ('' to skip)")
    p.add_argument("--e2e-prompt", type=int, default=None, help="prompt tokens, default 4096 (smoke: 48)")
    p.add_argument("--e2e-tokens", type=int, default=None, help="new tokens per run, default 64 (smoke: 2)")
    p.add_argument("--e2e-precisions", default=None, help="default full,int8,int4 (smoke: full,int4)")
    p.add_argument("--e2e-backends", default="torch,triton")
    p.add_argument("--time-budget-s", type=float, default=480.0, help="decode rows past this are skipped")
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
    from kvdemo.quant import triton_kernels as tk

    shape = (1, 2, 256, 64) if args.smoke else (8, 8, 32768, 128)  # 512 MiB of fp16 at full size
    x = torch.randn(shape, device=device, dtype=torch.float16)
    rows = []
    for fmt in _names(args.quant_formats):
        for role, axis in (("keys", "channel"), ("values", "token")):
            group = min(args.group, shape[-1]) if axis == "token" else args.group
            q = tk.quantize(x, fmt, axis, group)  # outputs (and compilation) outside the timed loop

            def run(fmt=fmt, axis=axis, group=group, q=q):
                tk.quantize_into(x, fmt, axis, group, q.codes, q.scale, q.zero)

            us = time_us(run, device, args.smoke)
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
                }
            )
    return rows


# --- 3. decode attention --------------------------------------------------------------------------


def make_packed(keys: torch.Tensor, values: torch.Tensor, spec, tk):
    """PackedKV of `keys`/`values` [B, H, T, D] as a steady-state cache holds them: sinks, whole
    quantized blocks, and a full-precision residual of `residual` to `residual + group - 1` tokens."""
    from kvdemo.cache import PackedKV

    t, d = keys.shape[-2], keys.shape[-1]
    g, s = spec.group_size, spec.sinks
    q = max(((t - spec.residual) // g) * g, 0)
    if q <= s:
        q = 0
    qk = tk.quantize(keys[:, :, :q], spec.key_format, spec.key_axis, spec.key_group(d)) if q else None
    qv = tk.quantize(values[:, :, :q], spec.value_format, "token", spec.value_group(d)) if q else None
    start = max(q, s)
    return PackedKV(
        key_format=spec.key_format,
        value_format=spec.value_format,
        key_axis=spec.key_axis,
        key_group=spec.key_group(d),
        value_group=spec.value_group(d),
        sink_keys=keys[:, :, :s],
        sink_values=values[:, :, :s],
        quant_len=q,
        key_codes=qk.codes if qk else None,
        key_scale=qk.scale if qk else None,
        key_zero=qk.zero if qk else None,
        value_codes=qv.codes if qv else None,
        value_scale=qv.scale if qv else None,
        value_zero=qv.zero if qv else None,
        residual_keys=keys[:, :, start:],
        residual_values=values[:, :, start:],
        length=t,
    )


def bench_decode(device: torch.device, args, deadline: float) -> list[dict]:
    import torch.nn.functional as F

    from kvdemo.precision import parse_precision
    from kvdemo.quant import reference
    from kvdemo.quant import triton_kernels as tk

    shape = SMOKE_SHAPE if args.smoke else LLAMA_8B
    hq, hkv, d = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    dtype = torch.float16
    scale = d**-0.5
    contexts, batches = _ints(args.contexts), _ints(args.batches)
    rows = []
    for batch in batches:
        for ctx in contexts:
            base = {"batch": batch, "context": ctx, "q_heads": hq, "kv_heads": hkv, "head_dim": d}
            if time.perf_counter() > deadline:
                rows.extend(base | {"format": f, "skipped": "time budget"} for f in _names(args.formats))
                continue
            need = 2 * batch * hkv * ctx * d * 2 * 1.7  # 16-bit K and V, packed copies, workspace
            if device.type == "cuda" and need > 0.9 * torch.cuda.mem_get_info(device)[0]:
                rows.extend(base | {"format": f, "skipped": "memory"} for f in _names(args.formats))
                continue
            gen = torch.Generator(device=device).manual_seed(batch * 1_000_003 + ctx)
            keys = torch.randn((batch, hkv, ctx, d), device=device, dtype=dtype, generator=gen)
            values = torch.randn((batch, hkv, ctx, d), device=device, dtype=dtype, generator=gen)
            query = torch.randn((batch, hq, 1, d), device=device, dtype=dtype, generator=gen)
            folded = query.view(batch, hkv, hq // hkv, d)  # the group's heads as query rows (decode only)

            def sdpa_gqa(q=query, k=keys, v=values):
                return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

            def sdpa_folded(q=folded, k=keys, v=values):
                return F.scaled_dot_product_attention(q, k, v, scale=scale)

            us_gqa = time_us(sdpa_gqa, device, args.smoke)
            us_fold = time_us(sdpa_folded, device, args.smoke)
            sdpa_us = min(us_gqa, us_fold)
            bytes16 = 2 * keys.numel() * keys.element_size()
            for fmt in _names(args.formats):
                spec = parse_precision(f"{PRESET[fmt]}:g{args.group}:r{args.residual}")
                kv = make_packed(keys, values, spec, tk)
                tri_us = time_us(lambda q=query, kv=kv: tk.past_attention(q, kv, scale), device, args.smoke)
                err = None
                if ctx == contexts[0]:
                    got = tk.past_attention(query, kv, scale)[0]
                    want = reference.past_attention(query, kv, scale)[0]
                    err = float((got - want).abs().max())
                packed_bytes = tk.kv_bytes_read(kv)
                rows.append(
                    base
                    | {
                        "format": fmt,
                        "precision": spec.label,
                        "triton_us": tri_us,
                        "sdpa_us": sdpa_us,
                        "sdpa_gqa_us": us_gqa,
                        "sdpa_folded_us": us_fold,
                        "speedup": sdpa_us / tri_us,
                        "memory_bound_limit": bytes16 / packed_bytes,
                        "triton_gb_s": packed_bytes / tri_us / 1e3,
                        "sdpa_gb_s": bytes16 / sdpa_us / 1e3,
                        "max_abs_err_vs_reference": err,
                    }
                )
            keys = values = query = folded = kv = None  # free this size before the next
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# --- 4. end-to-end tokens/s -----------------------------------------------------------------------


def bench_e2e(device: torch.device, args) -> list[dict]:
    from kvdemo import runner
    from kvdemo.models import load_model
    from kvdemo.precision import parse_precision
    from kvdemo.quant import BACKEND_ENV
    from kvdemo.texts import prose_ids

    rows = []
    suffix = f":g{args.group}:r{args.residual}"
    for source in _names(args.models):
        try:
            lm = load_model(source, device=device.type, dtype="auto")
        except ValueError as err:
            rows.append({"model": source, "error": str(err)})
            continue
        ids = prose_ids(lm, min(args.e2e_prompt, lm.max_context - args.e2e_tokens))
        for name in _names(args.e2e_precisions):
            spec = parse_precision(name if name == "full" else name + suffix)
            tokens_by_backend = {}
            for backend in _names(args.e2e_backends):
                os.environ[BACKEND_ENV] = backend
                runner.run_precision(lm, ids[: 2 * args.group + 8], spec, 2)  # warm-up: compile, allocate
                _sync(device)
                gen = runner.run_precision(lm, ids, spec, args.e2e_tokens)
                _sync(device)
                tokens_by_backend[backend] = gen.tokens
                rows.append(
                    {
                        "model": lm.name,
                        "dtype": str(lm.dtype).removeprefix("torch."),
                        "precision": spec.label,
                        "backend": backend,
                        "prompt_tokens": len(ids),
                        "new_tokens": len(gen.tokens),
                        "prefill_s": gen.prefill_s,
                        "decode_tok_s": gen.decode_tok_s,
                        "cache_bytes": gen.cache_bytes.get("total"),
                    }
                )
            first = next(iter(tokens_by_backend.values()))
            for row in rows[-len(tokens_by_backend) :]:
                row["same_tokens_across_backends"] = all(t == first for t in tokens_by_backend.values())
        del lm
        gc.collect()
    os.environ.pop(BACKEND_ENV, None)
    return rows


# --- report ---------------------------------------------------------------------------------------


def goals(report: dict) -> dict:
    """Each goal with what was measured; `met` is None where not measured, or in a smoke run."""

    def speedup(fmt: str):
        for r in report["decode"]:
            if r.get("format") == fmt and r["context"] == 65536 and r["batch"] == 8 and "speedup" in r:
                return r["speedup"]
        return None

    frac = [r["fraction_of_copy"] for r in report["quantize"]]
    measured = {
        "int4_speedup_64k_b8": speedup("int4"),
        "int8_speedup_64k_b8": speedup("int8"),
        "quantize_fraction_of_copy": min(frac) if frac else None,  # the slowest format and role
    }
    return {
        k: {"goal": GOALS[k], "measured": v, "met": None if v is None or report["smoke"] else bool(v >= GOALS[k])}
        for k, v in measured.items()
    }


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
    report["copy"] = bench_copy(device, args.smoke)
    report["quantize"] = bench_quantize(device, args, report["copy"]["gb_s"])
    report["decode"] = bench_decode(device, args, started + args.time_budget_s)
    report["e2e"] = bench_e2e(device, args) if args.models.strip() else []
    report["goals"] = goals(report)
    report["wall_s"] = time.perf_counter() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    for r in report["decode"]:
        if "speedup" in r:
            print(
                f"{r['format']:>8} ctx {r['context']:>6} batch {r['batch']:>2}: {r['triton_us']:9.1f} us "
                f"vs SDPA {r['sdpa_us']:9.1f} us = {r['speedup']:.2f}x (memory-bound limit {r['memory_bound_limit']:.2f}x)"
            )
    print(json.dumps(report["goals"], indent=2))
    print(f"wrote {out} in {report['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
