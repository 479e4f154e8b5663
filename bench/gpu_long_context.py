"""Long-context prefill on a GPU, the last section of bench/gpu_attention.py, and the worker program its rows run in.

`bench_long` prefills a Llama-3.1-8B-shaped random model in chunks to 128k tokens, int4 and full, then its
first layers to 1M tokens, int4: per row the peak memory (weights, cache, workspace), the cache's bytes by the
formula beside the measured ones, prefill seconds and the share spent over the packed past. The rows run in one
worker process, this file run as a program (`worker_main`: one JSON job per line on stdin, one row per line on
stdout; one import and one CUDA context for the section, a model kept for the next row of the same shape), so
the parent can stop a row that runs past the time left.
"""

from __future__ import annotations

import gc
import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the sections' shared helpers

from gpu_attention import PRESET, _names, _sync  # noqa: E402


def long_shape(args, layers: int | None = None) -> dict:
    """The long rows' model shapes (a dict for `random_model`): `--long-model` (smoke: kvdemo.measured's small
    model), with only its first `layers` layers when given (the max-context row)."""
    from kvdemo.configs import MODEL_CONFIG_DIR, get_model_config
    from kvdemo.measured import SCALE_MODEL

    if args.long_model == "scale":
        shape = dict(SCALE_MODEL)
    else:
        shape = json.loads((MODEL_CONFIG_DIR / f"{get_model_config(args.long_model).name}.json").read_text())
    if layers is not None and layers != shape["layers"]:
        display = shape.get("display_name", shape["name"])
        shape |= {
            "name": f"{shape['name']}-layers-{layers}-of-{shape['layers']}",
            "display_name": f"{display} (its first {layers} of {shape['layers']} layers)",
            "layers": layers,
        }
    shape["max_context"] = max(shape["max_context"], args.long_max_context)  # RoPE positions past the card's
    return shape


def long_spec(name: str, args) -> str:
    return name if name == "full" else f"{PRESET.get(name, name)}:g{args.group}:r{args.residual}"


def chunk_updates(tokens: int, chunk: int) -> list[int]:
    """The appends a chunked prefill of `tokens` makes (kvdemo.runner.forward): whole chunks, then the rest."""
    return [chunk] * (tokens // chunk) + ([tokens % chunk] if tokens % chunk else [])


def long_row(job: dict, lm) -> dict:
    """One long row in the worker: `measure_prefill` of `job["tokens"]` at `job["precision"]`, with the calls
    to `attention.long_past_attention` counted and timed (synchronized on CUDA) and what they ran (Triton
    query tiles or the streamed reference), and the formula's cache bytes beside the measured ones."""
    from kvdemo import attention, runner
    from kvdemo.layout import Layout, bytes_per_token, region_bytes
    from kvdemo.measured import measure_prefill
    from kvdemo.precision import parse_precision
    from kvdemo.quant import reference_attention

    spec = parse_precision(job["precision"])
    counts = ("long_past_calls", "triton_calls", "reference_streamed_calls", "reference_calls")
    zero = dict.fromkeys(counts, 0) | {"past_attention_s": 0.0}
    stats = dict(zero)
    long_past, streamed = attention.long_past_attention, reference_attention.past_attention_streamed

    def counted(fn, key):
        def wrapper(*a, **k):
            stats[key] += 1
            return fn(*a, **k)

        return wrapper

    def timed(*a, **k):
        _sync(lm.device)
        t0 = time.perf_counter()
        out = long_past(*a, **k)
        _sync(lm.device)
        stats["past_attention_s"] += time.perf_counter() - t0
        return out

    patched = [(attention, "long_past_attention", counted(timed, "long_past_calls"))]
    patched.append((reference_attention, "past_attention_streamed", counted(streamed, "reference_streamed_calls")))
    patched.append(
        (reference_attention, "past_attention", counted(reference_attention.past_attention, "reference_calls"))
    )
    if attention.backend_for(lm.device) == "triton":
        from kvdemo.quant import triton_decode

        patched.append((triton_decode, "past_attention", counted(triton_decode.past_attention, "triton_calls")))
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patched]
    try:
        for mod, name, fn in patched:
            setattr(mod, name, fn)
        warmup_s = 0.0
        if job.get("warmup"):  # compiles the kernels outside the timed prefill: one chunk over one chunk
            t0 = time.perf_counter()
            gen = torch.Generator().manual_seed(1)
            ids = torch.randint(1, lm.config.vocab_size, (2 * runner.PREFILL_CHUNK,), generator=gen).tolist()
            runner.prefill(lm, ids, runner.new_cache(lm, spec))
            _sync(lm.device)
            warmup_s = time.perf_counter() - t0
            stats |= zero
        gc.collect()
        row = measure_prefill(lm, job["tokens"], spec, "chunked").to_json()
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
    bits = 8 * lm.dtype.itemsize
    regions = Layout(spec).regions(chunk_updates(job["tokens"], runner.PREFILL_CHUNK))
    formula = region_bytes(regions, lm.num_layers, lm.kv_heads, lm.head_dim, spec, bits)["total"]
    row |= {
        "model": lm.name,
        "layers": lm.num_layers,
        "kv_heads": lm.kv_heads,
        "head_dim": lm.head_dim,
        "dtype": str(lm.dtype).removeprefix("torch."),
        "backend": attention.backend_for(lm.device),
        "cache_bytes_formula": formula,
        "cache_vs_formula": round(row["cache_bytes"] / formula, 4),
        "bytes_per_token_formula": bytes_per_token(lm.num_layers, lm.kv_heads, lm.head_dim, spec, bits),
        "regions": regions.to_dict(),
        "warmup_s": round(warmup_s, 3),
        "past_attention_s": round(stats.pop("past_attention_s"), 3),
    } | stats
    if lm.device.type == "cuda":
        row["reserved_peak_bytes"] = torch.cuda.max_memory_reserved(lm.device)
    return row


def worker_main() -> int:
    """`python bench/gpu_long_context.py`: reads one JSON job per line on stdin, answers one `ROW_TAG` line each
    on stdout. One process for the section's rows (one import, one CUDA context); a row's model stays
    loaded for the next row of the same shape."""
    from kvdemo.models import random_model
    from kvdemo.quant.backend import BACKEND_ENV

    parent = os.getppid()

    def orphaned() -> None:  # the parent was killed (device_check.sh's timeout): stop, free the GPU
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=orphaned, daemon=True).start()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loaded, lm = None, None
    for line in sys.stdin:
        job = json.loads(line)
        t0 = time.perf_counter()
        try:
            key = json.dumps(job["shape"], sort_keys=True)  # load_s is 0 for a model kept from the row before
            if key != loaded:
                lm = loaded = None  # the previous model goes before the next one is built
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                lm, loaded = random_model(job["shape"], device), key
            os.environ.pop(BACKEND_ENV, None)
            if job.get("backend"):
                os.environ[BACKEND_ENV] = job["backend"]
            load_s = time.perf_counter() - t0
            row = long_row(job, lm) | {"load_s": round(load_s, 3)}
        except Exception as err:  # noqa: BLE001 - an out-of-memory row is a result: the next row still runs
            row = {"error": f"{type(err).__name__}: {err}"[:2000], "traceback": traceback.format_exc()[-3000:]}
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row["row_s"] = round(time.perf_counter() - t0, 3)
        print(ROW_TAG + json.dumps(row), flush=True)
    return 0


ROW_TAG = "LONG_ROW "


class LongWorker:
    """The parent's handle on the worker process, started by the first `run(job, timeout_s)`: the row, or
    None when the row ran past `timeout_s` (the worker is then stopped: a row cannot be interrupted)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.lines: queue.Queue = queue.Queue()

    def ended(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def _start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "KVDEMO_BACKEND"}
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        if not torch.cuda.is_available():  # peak = VmHWM: freed buffers must leave the heap (see kvdemo.measured)
            from kvdemo.measured import MALLOC_ENV

            env |= MALLOC_ENV
        cmd = [sys.executable, str(Path(__file__).resolve())]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(ROW_TAG):
                self.lines.put(json.loads(line[len(ROW_TAG) :]))
            else:
                print(line, end="", file=sys.stderr)
        self.lines.put(None)  # the worker ended

    def run(self, job: dict, timeout_s: float) -> dict | None:
        if self.proc is None:
            self._start()
        if self.ended():
            return {"error": f"the worker process ended (exit status {self.proc.returncode})"}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        try:
            row = self.lines.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            self.proc.kill()
            self.proc.wait()
            return None
        return row if row is not None else {"error": f"the worker process ended (exit status {self.proc.wait()})"}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc is None or self.ended():
            return
        self.proc.stdin.close()  # the worker's loop ends at the end of its input
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def max_row_layers(ref: dict, tokens: int, max_layers: int, left_s: float, fixed_s: float) -> tuple[int, float]:
    """(layers, estimated seconds) of the max-context row, from a measured context row `ref` of the same
    model: per layer, its time over the past (`past_attention_s`) times the square of the token ratio and
    the rest (projections, MLPs, attention within each chunk) times the ratio, plus `fixed_s` (model load
    and warm-up). An upper estimate for the past: its per-launch costs grow only with the ratio. layers is
    at most `max_layers`, and 0 when not even one layer fits in `left_s`."""
    ratio = tokens / ref["tokens"]
    attn = ref["past_attention_s"]
    per_layer = (attn * ratio**2 + (ref["prefill_s"] - attn) * ratio) / ref["layers"]
    layers = max_layers if per_layer <= 0 else max(0, min(max_layers, int((left_s - fixed_s) // per_layer)))
    return layers, round(fixed_s + max(layers, 1) * per_layer, 1)


def bench_long(device: torch.device, args, deadline: float, on_row=None) -> list[dict]:
    """Prefill peak memory and time at long contexts: `--long-model` (Llama-3.1-8B shapes, random
    weights) at `--long-context` tokens at each of `--long-precisions`, then its first `--long-max-layers`
    layers (fewer when the time left says so) at `--long-max-context` tokens, int4. Chunked prefill
    (kvdemo.runner, PREFILL_CHUNK tokens a chunk): each chunk attends over the packed past through
    `attention.long_past_attention`, on CUDA the Triton decode kernel over tiles of query rows.

    The rows run in one worker process (this file run as a program), stopped when the section's time is up (the
    earlier of `deadline` and `--long-budget-s` from now); a row that would not fit, or did not finish,
    is recorded with the reason. `on_row(rows)` is called after each row. Smoke: kvdemo.measured's small
    model at a few thousand tokens, plus one row through the Triton query tiles under the interpreter
    (one layer with Llama-8B head shapes; one chunk of 17 queries over one chunk of past: 2 tiles)."""
    from kvdemo.runner import PREFILL_CHUNK

    deadline = min(deadline, time.perf_counter() + args.long_budget_s)
    rows: list[dict] = []
    measured: dict[str, dict] = {}  # precision name -> its context row

    def left() -> float:
        return deadline - time.perf_counter()

    def add(row: dict) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(rows)

    warmup = device.type == "cuda"  # Triton compiles outside the timed prefill
    with LongWorker() as worker:
        for name in _names(args.long_precisions):
            job = {"shape": long_shape(args), "tokens": args.long_context, "precision": long_spec(name, args)}
            base = {"tokens": job["tokens"], "precision": job["precision"], "layers": job["shape"]["layers"]}
            prev = next(iter(measured.values()), None)
            estimate = prev and prev["prefill_s"] + prev["warmup_s"]  # the same model, already loaded
            if estimate and estimate > left():
                add(
                    base | {"skipped": f"time budget: estimated {estimate:.0f} s as the row above, {left():.0f} s left"}
                )
                continue
            row = run_long_job(worker, job | {"warmup": warmup}, base, left())
            if "prefill_s" in row:
                measured[name] = row
            add(row)
        job = {"tokens": args.long_max_context, "precision": long_spec("int4", args)}
        base = {"tokens": job["tokens"], "precision": job["precision"]}
        ref = measured.get("int4") or next(iter(measured.values()), None)
        if ref is None:
            add(base | {"skipped": "no context row was measured to size it from"})
        else:
            fixed = max(r["load_s"] for r in measured.values()) + ref["warmup_s"]
            layers, estimate = max_row_layers(ref, job["tokens"], args.long_max_layers, left(), fixed)
            base |= {"layers": max(layers, 1), "estimated_s": estimate}
            if layers == 0:
                add(base | {"skipped": f"time budget: one layer estimated at {estimate:.0f} s, {left():.0f} s left"})
            else:
                job |= {"shape": long_shape(args, layers), "warmup": warmup}
                add(run_long_job(worker, job, base, left()))
        if args.smoke:
            from kvdemo.measured import SCALE_MODEL

            shape = SCALE_MODEL | {"name": "llama-8b-heads", "display_name": "1 layer of Llama-8B heads (4/1, 128)"}
            shape |= {"layers": 1, "attention_heads": 4, "kv_heads": 1, "head_dim": 128, "hidden_size": 64}
            job = {"shape": shape | {"intermediate_size": 128}, "tokens": PREFILL_CHUNK + 17, "backend": "triton"}
            job["precision"] = long_spec("int4", args)
            base = {"tokens": job["tokens"], "precision": job["precision"], "layers": 1, "check": "triton query tiles"}
            add(run_long_job(worker, job, base, left()))
    return rows


def run_long_job(worker: LongWorker, job: dict, base: dict, left_s: float) -> dict:
    """`base` with the worker's row for `job`, or with why there is none."""
    if left_s <= 0 or worker.ended():
        return base | {"skipped": "time budget: none left"}
    t0 = time.perf_counter()
    row = worker.run(job, left_s)
    if row is None:
        return base | {"skipped": f"time budget: stopped after {time.perf_counter() - t0:.0f} s, unfinished"}
    return base | row


if __name__ == "__main__":
    sys.exit(worker_main())
