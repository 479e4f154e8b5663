"""Host time of one decode-attention call, the GPU kernels left out: what Python spends around the launches.

A decode step calls `triton_decode.past_attention` once per layer; on a GPU that runs at the memory floor, the
step can only be as fast as the host prepares those calls. Here the two kernels are replaced by functions that
return at once, so what is timed is everything else: the checks of what the kernel takes, the launch settings,
the buffers, the arguments. Runs on the CPU, no GPU needed (the kernels are never entered).

    python bench/host_overhead.py --out assets/reports/host_overhead.json --label after

Each run adds its rows (per precision: microseconds per call, the fastest of `--repeats` rounds of `--calls`
calls, the precisions taking turns) under its label, with the commit, machine and date, so a report holds the code before and after a
change side by side (same machine, separate runs: compare them as separate runs on a shared CPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

from kvdemo.cache import QuantizedKVCache  # noqa: E402
from kvdemo.precision import parse_precision  # noqa: E402
from kvdemo.quant import triton_decode  # noqa: E402

SHAPE = {"batch": 1, "q_heads": 32, "kv_heads": 8, "head_dim": 128}  # Llama-3.1-8B heads, one sequence


class _NoLaunch:
    """A kernel stand-in: `kernel[grid](*args, **kwargs)` returns at once."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def host_us(precisions: list[str], context: int, calls: int, repeats: int) -> list[dict]:
    """Microseconds per `past_attention` call over a layer holding `context` tokens, per precision: the fastest
    of `repeats` rounds of `calls` calls, the precisions taking turns round by round (a busy moment of a shared
    CPU then costs each precision one round, not one precision all of its rounds)."""
    b, hq, hkv, d = SHAPE["batch"], SHAPE["q_heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
    g = torch.Generator().manual_seed(0)
    query = torch.randn(b, hq, 1, d, generator=g)
    packed = {}
    for precision in precisions:
        cache = QuantizedKVCache(parse_precision(precision), num_layers=1)  # nuq: NormalFloat levels
        cache.update(torch.randn(b, hkv, context, d, generator=g), torch.randn(b, hkv, context, d, generator=g), 0)
        packed[precision] = cache.layers[0].packed()
    saved = triton_decode._decode_split_kernel, triton_decode._merge_kernel
    triton_decode._decode_split_kernel = triton_decode._merge_kernel = _NoLaunch()
    best = dict.fromkeys(precisions, float("inf"))
    try:
        for kv in packed.values():
            triton_decode.past_attention(query, kv, d**-0.5)  # first call: whatever is set up once
        for _ in range(repeats):
            for precision, kv in packed.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    triton_decode.past_attention(query, kv, d**-0.5)
                best[precision] = min(best[precision], (time.perf_counter() - t0) / calls * 1e6)
    finally:
        triton_decode._decode_split_kernel, triton_decode._merge_kernel = saved
    return [{"precision": p, "context": context, "us_per_call": round(best[p], 2)} for p in precisions]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precisions", default="int4,int8,k8v4,nuq4:o1,full")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--label", default="run", help="the name this run's rows go under (e.g. before, after)")
    p.add_argument("--out", default="", help="JSON report to add this run to (created when missing)")
    args = p.parse_args(argv)
    rows = host_us([s.strip() for s in args.precisions.split(",") if s.strip()], args.context, args.calls, args.repeats)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    run = {
        "label": args.label,
        "command": "python bench/host_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": commit.stdout.strip(),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}",
        "shape": SHAPE,
        "rows": rows,
    }
    for r in rows:
        print(f"{args.label:>8} {r['precision']:>10} at {r['context']:,} tokens: {r['us_per_call']:8.1f} us per call")
    if args.out:
        out = Path(args.out)
        report = json.loads(out.read_text()) if out.exists() else {"runs": []}
        report["runs"] = [r for r in report["runs"] if r["label"] != args.label] + [run]
        out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
