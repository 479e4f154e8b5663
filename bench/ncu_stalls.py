"""Why the decode kernel stalls: Nsight Compute's warp-state statistics for one decode-attention call at the goal
point (Llama-3.1-8B heads, batch 8, 64k context; default format int4), parsed into one JSON.

The parent finds `ncu` (PATH, else /usr/local/cuda*/bin), runs this file as the profiled program (`--target`:
builds the packed cache, runs the call once to compile it, then once more between cudaProfilerStart/Stop, so
only that call's kernels, the split kernel and the merge, are profiled), reads ncu's CSV (`--csv --page raw`:
a header row of metric names, a row of units, one row per kernel) and writes per kernel:

- the stall reasons, largest first: `smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio`, the
  warp cycles per issued instruction spent stalled for that reason (the WarpStateStats section's breakdown),
  with each reason's share of their sum;
- achieved and theoretical occupancy (`sm__warps_active.avg.pct_of_peak_sustained_active`,
  `sm__maximum_warps_per_active_cycle_pct`), DRAM throughput (% of peak and GB/s) and the kernel's duration.

ncu locks the clocks to base and flushes caches between its replay passes: its durations are longer than the
benchmark's. Without ncu the JSON says so (`absent`) and nothing else runs. Usage:

    python bench/ncu_stalls.py --out reports/ncu_stalls.json
    python bench/ncu_stalls.py --smoke --out /tmp/ncu.json     # CPU: tiny shapes, the target run without ncu
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the benchmark's input builders

SECTIONS = ("WarpStateStats", "SchedulerStats", "MemoryWorkloadAnalysis", "Occupancy")
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
STALL_REASONS = (
    "barrier", "branch_resolving", "dispatch_stall", "drain", "imc_miss", "lg_throttle", "long_scoreboard",
    "math_pipe_throttle", "membar", "mio_throttle", "misc", "no_instruction", "not_selected", "selected",
    "short_scoreboard", "sleeping", "tex_throttle", "wait",
)  # fmt: skip
METRICS = {  # what the JSON reports -> ncu's metric (asked for by name too, so a section set that lacks one still has it)
    "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "theoretical_occupancy_pct": "sm__maximum_warps_per_active_cycle_pct",
    "dram_throughput_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_bytes_per_s": "dram__bytes.sum.per_second",
    "duration_s": "gpu__time_duration.sum",
    "warp_cycles_per_issue": "smsp__average_warp_latency_per_inst_issued.ratio",
    "registers_per_thread": "launch__registers_per_thread",
}
UNIT_SCALE = {  # ncu's units -> the JSON's (seconds, bytes per second); absent: kept as printed
    "nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0,
    "byte/second": 1.0, "Kbyte/second": 1e3, "Mbyte/second": 1e6, "Gbyte/second": 1e9, "Tbyte/second": 1e12,
}  # fmt: skip
TOP = 6  # stall reasons in the summary
DECODE_KERNEL = "_decode_split_kernel"  # kvdemo/quant/triton_decode.py's split kernel (the merge is the other one)
NCU_ABSENT = "ncu is not on PATH nor under /usr/local/cuda*/bin: no stall reasons measured"


def find_ncu() -> str | None:
    """Path of Nsight Compute's CLI: PATH first, then the newest /usr/local/cuda*/bin/ncu."""
    found = shutil.which("ncu")
    if found:
        return found
    candidates = sorted(glob.glob("/usr/local/cuda*/bin/ncu"))
    return candidates[-1] if candidates else None


def ncu_command(ncu: str, target: list[str]) -> list[str]:
    """ncu over `target` (a command line): the sections and metrics above, raw CSV on stdout, only the
    kernels launched between the target's cudaProfilerStart and Stop."""
    cmd = [ncu, "--csv", "--page", "raw", "--profile-from-start", "off", "--target-processes", "all"]
    for section in SECTIONS:
        cmd += ["--section", section]
    stalls = [f"{STALL_PREFIX}{r}{STALL_SUFFIX}" for r in STALL_REASONS]
    return cmd + ["--metrics", ",".join([*METRICS.values(), *stalls])] + target


def _number(text: str) -> float | str:
    """A CSV cell as a float (ncu writes thousands separators: "1,234.5"), else the text."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def parse_raw_csv(text: str) -> list[dict]:
    """ncu's `--csv --page raw` output (other lines, ==PROF== notes or the program's own, are skipped) as one
    dict per profiled kernel: {"kernel", "values": {metric: float or text}, "units": {metric: unit}}."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError('no ncu CSV in the output (no header row starting with "ID")')
    rows = list(csv.reader(io.StringIO("\n".join(line for line in lines[start:] if line.startswith('"')))))
    header, units, kernels = rows[0], rows[1], rows[2:]
    if units and units[0]:  # a units row has an empty ID cell; without one, every row is a kernel
        units, kernels = [""] * len(header), rows[1:]
    out = []
    for row in kernels:
        cells = dict(zip(header, row, strict=False))
        values = {name: _number(v) for name, v in cells.items()}
        unit_of = dict(zip(header, units, strict=False))
        out.append({"kernel": cells.get("Kernel Name", ""), "values": values, "units": unit_of})
    return out


def _scaled(kernel: dict, metric: str) -> float | None:
    value = kernel["values"].get(metric)
    if not isinstance(value, float):
        return None
    return value * UNIT_SCALE.get(kernel["units"].get(metric, ""), 1.0)


def summarize(kernel: dict) -> dict:
    """One kernel's row: its stall reasons largest first (warp cycles per issued instruction, and share of their
    sum), the top TOP of them, occupancy, DRAM throughput, duration."""
    stalls = {}
    for name, value in kernel["values"].items():
        if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX) and isinstance(value, float):
            stalls[name[len(STALL_PREFIX) : -len(STALL_SUFFIX)]] = value
    total = sum(stalls.values())
    ranked = sorted(stalls.items(), key=lambda kv: -kv[1])
    row = {"kernel": kernel["kernel"]}
    row |= {key: _scaled(kernel, metric) for key, metric in METRICS.items()}
    if row["dram_bytes_per_s"] is not None:
        row["dram_gb_s"] = row["dram_bytes_per_s"] / 1e9
    row["stalls"] = [{"reason": r, "cycles_per_issue": v, "share": v / total if total else None} for r, v in ranked]
    row["top_stalls"] = [s["reason"] for s in row["stalls"][:TOP] if s["cycles_per_issue"] > 0]
    return row


def report_from_csv(text: str) -> dict:
    """The JSON's kernels (the decode split kernel first) from ncu's raw CSV."""
    kernels = [summarize(k) for k in parse_raw_csv(text)]
    kernels.sort(key=lambda k: DECODE_KERNEL not in k["kernel"])
    return {"kernels": kernels, "decode": next((k for k in kernels if DECODE_KERNEL in k["kernel"]), None)}


# --- the profiled program ---------------------------------------------------------------------------------


def run_target(args) -> None:
    """Build the goal point's packed cache at `--format`, run the decode call once (compiles), then once between
    cudaProfilerStart/Stop: the only kernels ncu profiles."""
    from gpu_attention import GOAL_POINT, LLAMA_8B, PRESET, SMOKE_SHAPE, decode_inputs, make_packed

    from kvdemo.precision import parse_precision
    from kvdemo.quant import triton_decode

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch, ctx = (2, 96) if args.smoke else GOAL_POINT
    shape = SMOKE_SHAPE if args.smoke else LLAMA_8B
    group = 32 if args.smoke else 128
    keys, values, query = decode_inputs(batch, ctx, shape, device)
    kv = make_packed(keys, values, parse_precision(f"{PRESET[args.format]}:g{group}:r{group}"))
    keys = values = None
    scale = shape["head_dim"] ** -0.5
    triton_decode.past_attention(query, kv, scale)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    triton_decode.past_attention(query, kv, scale)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="reports/ncu_stalls.json")
    p.add_argument("--format", default="int4", help="decode format (bench/gpu_attention.py's PRESET names)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1); ncu as found")
    p.add_argument("--target", action="store_true", help="be the profiled program (ncu runs this)")
    p.add_argument("--ncu", default=None, help="ncu's path (default: found on PATH or under /usr/local/cuda*)")
    p.add_argument("--timeout-s", type=float, default=240.0, help="seconds ncu may take")
    args = p.parse_args(argv)
    if args.smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.target:
        run_target(args)
        return 0
    started = time.perf_counter()
    ncu = args.ncu or find_ncu()
    report: dict = {"smoke": args.smoke, "format": args.format, "ncu": ncu}
    target = [sys.executable, str(Path(__file__).resolve()), "--target", "--format", args.format]
    target += ["--smoke"] if args.smoke else []
    if ncu is None:
        report["absent"] = NCU_ABSENT
        if args.smoke:  # the profiled program's path still runs, as it would under ncu
            proc = subprocess.run(target, capture_output=True, text=True, timeout=args.timeout_s)
            report["target_exit_status"] = proc.returncode
    else:
        cmd = ncu_command(ncu, target)
        report["command"] = " ".join(cmd)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
        except subprocess.TimeoutExpired as err:
            proc = None
            report["error"] = f"ncu ran past {args.timeout_s:.0f} s; it said: {str(err.stdout or '')[-2000:]}"
        if proc is not None:
            report["ncu_exit_status"] = proc.returncode
            try:
                report |= report_from_csv(proc.stdout)
            except ValueError as err:
                report["error"] = f"{err}; ncu said: {(proc.stdout + proc.stderr)[-3000:]}"
    report["wall_s"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    decode = report.get("decode")
    if decode:
        top = ", ".join(f"{s['reason']} {s['cycles_per_issue']:.1f}" for s in decode["stalls"][:TOP])
        print(
            f"{decode['kernel']}: occupancy {decode['achieved_occupancy_pct']}%, DRAM {decode['dram_throughput_pct']}%"
        )
        print(f"stalls (warp cycles per issued instruction): {top}")
    print(f"wrote {out}: {report.get('absent') or report.get('error', 'ok')[:200]}")
    return 1 if "error" in report or report.get("target_exit_status") else 0


if __name__ == "__main__":
    sys.exit(main())
