"""Memory measured on live caches rather than computed: long prompts, many sequences, live bytes.

- `measure_memory` / `compare_measured`: prefill a prompt at each precision and report the cache's live
  bytes beside a 16-bit cache and beside the layout formula (`layout.region_bytes`, to the byte).

- `prefill_rows`: prefill N tokens at each precision and measure the process's peak memory: what the
  run adds is the packed cache plus a workspace (activations of one chunk, one piece of the past turned
  into floats, one piece of scores) that does not grow with the past. Each row runs in a fresh Python
  process, so no earlier row's freed memory hides an allocation; the peak is the kernel's high-water
  mark of resident memory (VmHWM, reset with /proc/self/clear_refs once the model is loaded), an upper
  bound on what PyTorch held. On CPU the row's process runs with a fixed glibc mmap threshold
  (`MALLOC_ENV`): by default glibc raises that threshold each time a large buffer is freed, so later
  buffers of that size come from the heap and freed ones stay resident; the high-water mark then grows
  with the allocator's leftovers (measured: 58 -> 74 MiB of "workspace" from 8k to 48k int4 tokens)
  instead of with what PyTorch holds (38.3 -> 38.6 MiB with the fixed threshold).
- `measure_headroom`: admit sequences of a given context into a memory budget until the next one would
  not fit, each a real cache allocated by `QuantizedKVCache` at the fullest state a sequence of that
  context reaches while decoding (its residual window full), and compare the count with the formula's;
  then decode batches of them together (kvdemo/batch.py) for tokens/s against batch size.

The default model is a small random-weight Llama-style model (`SCALE_MODEL`): memory and time do not
depend on the weights' values, and its small hidden size lets 64k-token prompts run on 2 CPU cores.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from . import memory
from .batch import decode_batch
from .cache import QuantizedKVCache
from .layout import Layout, region_bytes
from .memory import fp16_cache_bytes, sequence_bytes
from .models import LoadedModel, config_from_model, load_model, random_model
from .precision import PrecisionSpec, parse_precision
from .progress import ProgressFn, StopFn, Tracker
from .results.measured import BatchSpeed, CacheMeasurement, HeadroomRow, MeasuredHeadroom, MemoryReport, PrefillRow
from .runner import PREFILL_CHUNK, new_cache, prefill
from .sizes import from_nbytes

SCALE_MODEL = {
    "name": "small-llama",
    "display_name": "Small Llama-style model (2 layers, 4 heads, 2 kv heads, head_dim 64)",
    "layers": 2,
    "attention_heads": 4,
    "kv_heads": 2,
    "head_dim": 64,
    "hidden_size": 256,
    "intermediate_size": 512,
    "vocab_size": 4096,
    "tie_word_embeddings": True,
    "max_context": 1 << 20,
}
BATCH_SIZES = (1, 2, 4, 8)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # buffers >= 128 KiB get their own mapping, unmapped when freed


def load_scale_model(model: str = "random", device: str = "cpu") -> LoadedModel:
    """ "random": SCALE_MODEL with random weights; "random:<config>": a reference config's shapes; else
    anything `load_model` takes (the embedded model, a hub id, a folder)."""
    if model == "random":
        return random_model(SCALE_MODEL, device)
    if model.startswith("random:"):
        return random_model(model.removeprefix("random:"), device)
    return load_model(model, device=device)


def _status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Start a new high-water mark of resident memory (Linux: VmHWM := VmRSS)."""
    Path("/proc/self/clear_refs").write_text("5")


@torch.no_grad()
def measure_prefill(lm: LoadedModel, tokens: int, spec: PrecisionSpec | str, mode: str = "chunked") -> PrefillRow:
    """Prefill `tokens` random token ids at `spec` in this process; its peak memory, split into parts."""
    spec = parse_precision(spec)
    ids = torch.randint(1, lm.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()
    cache = new_cache(lm, spec)
    gpu = lm.device.type == "cuda"
    if gpu:
        torch.cuda.synchronize(lm.device)
        torch.cuda.reset_peak_memory_stats(lm.device)
        base = torch.cuda.memory_allocated(lm.device)
    else:
        base = _status_bytes("VmRSS")
        _reset_peak()
    t0 = time.perf_counter()
    prefill(lm, ids, cache, mode=mode)
    if gpu:
        torch.cuda.synchronize(lm.device)
    seconds = time.perf_counter() - t0
    added = (torch.cuda.max_memory_allocated(lm.device) if gpu else _status_bytes("VmHWM")) - base
    weights = lm.weight_bytes()
    cache_bytes = cache.nbytes()["allocated"]
    return PrefillRow(
        tokens=tokens,
        precision=spec.label,
        mode=mode,
        chunk=PREFILL_CHUNK,
        peak_bytes=weights + added,
        cache_bytes=cache_bytes,
        weights_bytes=weights,
        workspace_bytes=added - cache_bytes,
        prefill_s=round(seconds, 3),
        peak_measured_by="torch.cuda.max_memory_allocated"
        if gpu
        else "VmHWM (peak resident memory), MALLOC_MMAP_THRESHOLD_="
        + os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default"),
    )


def prefill_rows(
    tokens: Sequence[int],
    precisions: Sequence[PrecisionSpec | str],
    model: str = "random",
    mode: str = "chunked",
    device: str = "cpu",
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
) -> list[PrefillRow]:
    """`measure_prefill` for every (tokens, precision), each in a fresh process (`python -m kvdemo.measured`).
    Progress in tokens prefilled, each finished row in `Progress.row`."""
    labels = [parse_precision(spec).label for spec in precisions]
    track = Tracker(sum(tokens) * len(labels), "tokens", on_progress, should_stop)
    for n in tokens:
        for label in labels:
            track.check("the prefills")
            job = json.dumps({"model": model, "tokens": int(n), "precision": label, "mode": mode, "device": device})
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
            env.update(MALLOC_ENV if device == "cpu" else {})
            done = subprocess.run(
                [sys.executable, "-m", "kvdemo.measured", job], capture_output=True, text=True, env=env, check=False
            )
            if done.returncode:
                lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
                raise RuntimeError(f"the {n}-token {label} prefill failed: {lines[-1]}")
            row = PrefillRow.from_json(json.loads(done.stdout.strip().splitlines()[-1]))
            track.advance(f"{n:,} tokens at {label}: peak {row.peak_bytes / 2**20:,.0f} MiB", n, row=row)
    return track.rows


_ROOT = Path(__file__).resolve().parent.parent


# --- headroom, measured ----------------------------------------------------------------------------


def fullest_length(
    spec: PrecisionSpec | str, context: int, layers: int, kv_heads: int, head_dim: int, bits: int
) -> int:
    """The length T <= context at which a sequence decoding one token at a time up to `context` holds the
    most bytes (its residual window fullest): what admitting a sequence of that context must budget for."""
    layout = Layout(spec)
    start = max(context - parse_precision(spec).residual - 1, 0)
    r = layout.regions([start] if start else [])
    best, best_bytes = context, -1
    for t in range(start + 1, context + 1):
        r = layout.after_append(r, 1)
        size = region_bytes(r, layers, kv_heads, head_dim, spec, bits)["total"]
        if size > best_bytes:
            best, best_bytes = t, size
    return best


def sequence_cache(lm: LoadedModel, spec: PrecisionSpec, context: int) -> QuantizedKVCache:
    """A real cache of one sequence at the fullest point on its way to `context` tokens (random states:
    bytes do not depend on values): `context - residual - 1` tokens prefilled, then one at a time."""
    bits = 8 * lm.dtype.itemsize
    t = fullest_length(spec, context, lm.num_layers, lm.kv_heads, lm.head_dim, bits)
    start = max(context - spec.residual - 1, 0)
    cache = new_cache(lm, spec)
    g = torch.Generator(device="cpu").manual_seed(context)
    for n in ([start] if start else []) + [1] * (t - start):
        for i in range(lm.num_layers):
            shape = (1, lm.kv_heads, n, lm.head_dim)
            k = torch.randn(shape, generator=g).to(lm.device, lm.dtype)
            cache.update(k, torch.randn(shape, generator=g).to(lm.device, lm.dtype), i)
    return cache


@torch.no_grad()
def measure_headroom(
    lm: LoadedModel,
    specs: Sequence[PrecisionSpec | str],
    context: int,
    budget_bytes: int,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    decode_steps: int = 8,
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
) -> MeasuredHeadroom:
    """Per precision: sequences of `context` tokens admitted into `budget_bytes` (weights + every admitted
    cache's allocated bytes), beside the formula's count at the model's dtype; decode tokens/s by batch size.
    Progress in precisions, each finished row in `Progress.row`."""
    cfg = config_from_model(lm)
    bits = 8 * lm.dtype.itemsize
    weights = lm.weight_bytes()
    specs = [parse_precision(s) for s in specs]
    track = Tracker(len(specs), "precisions", on_progress, should_stop)
    for spec in specs:
        track.check("measuring headroom")
        seq = sequence_cache(lm, spec, context)
        admitted, used = [], weights
        while True:
            nxt = seq if not admitted else copy.deepcopy(seq)
            size = nxt.nbytes()["allocated"]
            if used + size > budget_bytes:
                break
            admitted.append(nxt)
            used += size
        per_seq = sequence_bytes(cfg, spec, context, full_bits=bits)
        formula = max(int((budget_bytes - weights) // per_seq), 0)
        speed = _decode_speeds(lm, admitted, batch_sizes, decode_steps)
        row = HeadroomRow(
            precision=spec.label,
            context=context,
            budget_bytes=budget_bytes,
            weights_bytes=weights,
            sequence_bytes_measured=admitted[0].nbytes()["allocated"] if admitted else seq.nbytes()["allocated"],
            sequence_bytes_formula=round(per_seq),
            measured_max_sequences=len(admitted),
            max_sequences=formula,
            measured_vs_formula=round(len(admitted) / formula, 4) if formula else None,
            held_bytes=used,
            tokens_per_s=speed,
        )
        del admitted, seq
        track.advance(f"{spec.label}: {row.measured_max_sequences} sequences admitted", row=row)
    return MeasuredHeadroom(lm.name, str(lm.dtype).replace("torch.", ""), budget_bytes, context, track.rows)


def _decode_speeds(lm: LoadedModel, admitted: list, batch_sizes: Sequence[int], steps: int) -> list[BatchSpeed]:
    """Decode tokens/s for batches of the admitted sequences (copies: decoding appends to them)."""
    out = []
    for b in batch_sizes:
        if b > len(admitted):
            break
        caches = [copy.deepcopy(c) for c in admitted[:b]]
        vocab = lm.config.vocab_size
        first = [torch.zeros(vocab, device=lm.device).index_fill_(0, torch.tensor([1 + i]), 1.0) for i in range(b)]
        run = decode_batch(lm, caches, first, steps + 1)  # the first token is given: `steps` timed forwards
        out.append(BatchSpeed(b, round(b * steps / run["decode_s"], 2), round(run["decode_s"], 3)))
        del caches
    return out


# --- live bytes of a prefilled cache beside the formulas ----------------------------------------------


def measure_memory(lm: LoadedModel, ids: Sequence[int], specs: Sequence[PrecisionSpec | str]) -> MemoryReport:
    """Prefill `ids` into a cache at each precision; report its live bytes next to a 16-bit cache."""
    tokens = len(ids)
    fp16 = fp16_cache_bytes(lm.num_layers, lm.kv_heads, lm.head_dim, tokens)
    results = []
    for spec in specs:
        spec = parse_precision(spec)
        cache = new_cache(lm, spec)
        prefill(lm, ids, cache)
        nb = cache.nbytes()
        bits = spec.bits_per_element(lm.head_dim, full_bits=8 * lm.dtype.itemsize)
        results.append(
            CacheMeasurement(
                precision=spec.label,
                bytes=nb["total"],
                bytes_fp16=fp16,
                ratio_vs_fp16=round(fp16 / from_nbytes(nb, lm.dtype).at16, 4),  # 16-bit basis on any dtype
                bits_per_element=round(bits["mean"], 4),
                bytes_per_token=round(nb["total"] / tokens, 1),
                breakdown={
                    k: nb[k] for k in ("codes", "scales", "outliers", "codebooks", "residual", "sinks", "allocated")
                },
                spec=spec.to_dict(),
            )
        )
        del cache
    return MemoryReport(lm.name, tokens, results)


def prefill_updates(tokens: int, chunk: int | None = None) -> list[int]:
    """Tokens per cache update when `runner.prefill` appends `tokens` tokens (chunks of `chunk`)."""
    chunk = PREFILL_CHUNK if chunk is None else chunk
    return [min(chunk, tokens - start) for start in range(0, tokens, chunk)]


def compare_measured(lm: LoadedModel, ids: Sequence[int], specs: Sequence[PrecisionSpec | str]) -> MemoryReport:
    """`measure_memory` beside the formulas: exact regions (`layout.region_bytes`) and plain bytes/token x tokens.

    The plain formula ignores the full-precision sinks and residual, so it matches the live cache only
    when those are empty (sinks 0, tokens a multiple of the group size); the region formula always does.
    """
    specs = [parse_precision(s) for s in specs]
    out = measure_memory(lm, ids, specs)
    cfg = config_from_model(lm)
    full_bits = 8 * lm.dtype.itemsize
    updates = prefill_updates(len(ids))
    rows = []
    for row, spec in zip(out.results, specs, strict=True):
        regions = Layout(spec).regions(updates)
        exact = region_bytes(regions, cfg.layers, cfg.kv_heads, cfg.head_dim, spec, full_bits)
        plain = memory.bytes_per_token(cfg, spec, full_bits=full_bits) * len(ids)
        rows.append(
            replace(
                row,
                layout=regions.to_dict(),
                formula_bytes=exact["total"],
                formula_plain_bytes=round(plain),
                error_vs_formula=round(row.bytes / exact["total"] - 1, 6),
                error_vs_plain=round(row.bytes / plain - 1, 6),
            )
        )
    return replace(out, results=rows, dtype=str(lm.dtype).replace("torch.", ""))


def main(argv: list[str] | None = None) -> int:
    """`python -m kvdemo.measured JOB`: one `measure_prefill` in this fresh process; prints its row as JSON."""
    job = json.loads((argv or sys.argv[1:])[0])
    lm = load_scale_model(job["model"], job.get("device", "cpu"))
    print(json.dumps(measure_prefill(lm, job["tokens"], job["precision"], job["mode"]).to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
