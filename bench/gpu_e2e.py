"""End-to-end decode tokens/s, and a model split across devices: sections `e2e` and `split` of bench/gpu_attention.py.

`bench_e2e`: per model, prompt length, batch, precision and backend, greedy decode tokens/s (batch x new tokens /
decode seconds). kvdemo's cache on the PyTorch path (torch), the Triton kernels with eager steps (triton) or with
steps replayed from a CUDA graph (triton+graphs); transformers' own decode with its DynamicCache / StaticCache
and SDPA (hf-dynamic, hf-static; full precision). The B sequences of a row have one length and share one cache
(`kvdemo.batch.decode_equal`). The prompt of a (model, length, batch) point is prefilled once, by transformers'
SDPA into a DynamicCache in chunks, and each kvdemo row's cache gets those states as one append per layer (the
runner's "exact" prefill): decode speed does not depend on how the prompt got in, and the rows share one prefill.
Per row beside tokens/s: the peak memory of the decode (`torch.cuda.max_memory_allocated`, less the DynamicCache
the point holds for its other rows) with the headroom formula's weights + cache bytes (`kvdemo.memory`) and their
ratio, and the memory floor: (bytes of the weights read per step + the cache's bytes) / bandwidth, as tokens/s,
and the row's fraction of it. Rows run largest first; rows past `--e2e-budget-s` are recorded as skipped.

`bench_split`: the embedded model's shapes (random weights) with the first half of its layers on cuda:0 and the
rest on the CPU (smoke: the 2-layer small model split cpu/cpu, the same code path): greedy tokens against the
model on one device, and each layer's cache on its layer's device.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the sections' shared helpers

from gpu_attention import EMBEDDED_CONFIG, _ints, _names, _sync, bench_copy  # noqa: E402

NOMINAL_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}  # bytes/s by GPU name, where no copy was measured
SPLIT_TOKENS = 16  # new tokens of the split rows


def e2e_model_and_prompt(source: str, device: torch.device, n_tokens: int, new_tokens: int):
    """(LoadedModel, prompt ids): prose for a real model, seeded random ids for a random-weights one."""
    from kvdemo.models import DEFAULT_MODEL, ModelLoadError, embedded_gguf, load_model, random_model
    from kvdemo.texts import prose_ids

    if source == DEFAULT_MODEL:
        try:
            embedded_gguf()
        except ModelLoadError:  # the device machine: the same shapes, so the same tokens/s
            source = f"random:{EMBEDDED_CONFIG}"
    if source.startswith("random:"):
        lm = random_model(source.removeprefix("random:"), device)
        gen = torch.Generator().manual_seed(0)
        n = min(n_tokens, lm.max_context - new_tokens)
        return lm, torch.randint(1, lm.config.vocab_size, (n,), generator=gen).tolist()
    lm = load_model(source, device=device.type, dtype="auto")
    return lm, prose_ids(lm, min(n_tokens, lm.max_context - new_tokens))


def batch_prompts(lm, first: list[int], batch: int) -> list[list[int]]:
    """`batch` prompts of len(first) tokens: `first`, then seeded random ids (a random-weights model) or `first`
    again (a real one: the prose it has)."""
    prompts = [first]
    for seed in range(1, batch):
        if lm.source.startswith("random:"):
            gen = torch.Generator().manual_seed(seed)
            prompts.append(torch.randint(1, lm.config.vocab_size, (len(first),), generator=gen).tolist())
        else:
            prompts.append(list(first))
    return prompts


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


@torch.no_grad()
def hf_prefill(lm, prompts: list[list[int]]):
    """(DynamicCache, float32 logits [B, vocab] of the next tokens, seconds): transformers' SDPA over the prompts in
    chunks of `runner.PREFILL_CHUNK` tokens."""
    from transformers import DynamicCache

    from kvdemo.runner import PREFILL_CHUNK, attention_impl

    x = torch.tensor(prompts, device=lm.device)  # [B, n]
    cache = DynamicCache(config=lm.config)
    _sync(lm.device)
    t0 = time.perf_counter()
    with attention_impl(lm, "sdpa"):
        for start in range(0, x.shape[1], PREFILL_CHUNK):
            out = lm.model(input_ids=x[:, start : start + PREFILL_CHUNK], past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1].float()
    _sync(lm.device)
    return cache, logits, time.perf_counter() - t0


def filled_cache(lm, states, spec):
    """kvdemo's cache at `spec` holding a DynamicCache's states, one append per layer (`runner.transplant`'s rule)."""
    from kvdemo.runner import new_cache

    cache = new_cache(lm, spec)
    cache.reserve(states.get_seq_length())
    for i, layer in enumerate(states.layers):
        cache.update(layer.keys, layer.values, i)
    if lm.device.type == "cuda":  # the flushes' kernels compiled now, not inside the timed decode
        cache.warm_up()
    return cache


def kvdemo_decode(lm, states, first_logits, spec, backend: str, new_tokens: int) -> dict:
    """Greedy decode of the prefilled batch through kvdemo's cache: backend "torch", "triton" (eager steps) or
    "triton+graphs" (steps between flushes replayed from a CUDA graph)."""
    from kvdemo.batch import decode_equal
    from kvdemo.graphs import GRAPHS_ENV
    from kvdemo.quant.backend import BACKEND_ENV

    os.environ[BACKEND_ENV] = backend.removesuffix("+graphs")
    os.environ[GRAPHS_ENV] = "1" if backend.endswith("+graphs") else "0"
    try:
        cache = filled_cache(lm, states, spec)
        _sync(lm.device)
        _reset_peak(lm.device)
        out = decode_equal(lm, cache, first_logits, new_tokens)
        _sync(lm.device)
        peak = _peak(lm.device)
        cache_bytes = cache.nbytes().get("total")
    finally:
        os.environ.pop(GRAPHS_ENV, None)
        os.environ.pop(BACKEND_ENV, None)
    steps = out["steps"] - 1  # the first token comes from the prefill's logits
    batch = len(out["tokens"])
    return {
        "tokens": out["tokens"],
        "new_tokens": out["steps"],
        "decode_s": out["decode_s"],
        "decode_tok_s": batch * steps / out["decode_s"] if steps and out["decode_s"] > 0 else 0.0,
        "cache_bytes": cache_bytes,
        "peak_bytes": peak,
        "graph_steps": out["graph_steps"],
        "graph_blocker": out["graph_blocker"],
    }


def hf_decode(lm, prompts: list[list[int]], kind: str, new_tokens: int) -> dict:
    """transformers' own greedy `generate` of the batch with its DynamicCache or StaticCache (SDPA attention): the
    baseline the full-precision rows are read against. Each step's time is taken where generate hands the logits
    to its processors (synchronized): prefill = until the first, decode = from the first to the last."""
    from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StaticCache

    from kvdemo.runner import attention_impl

    device = lm.device

    class StepClock(LogitsProcessor):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            _sync(device)
            self.times.append(time.perf_counter())
            return scores

    x = torch.tensor(prompts, device=device)
    if kind == "dynamic":
        cache = DynamicCache(config=lm.config)
    elif kind == "static":
        cache = StaticCache(config=lm.config, max_cache_len=x.shape[1] + new_tokens)
    else:
        raise ValueError(f"unknown transformers cache {kind!r}; allowed: dynamic, static")
    clock = StepClock()
    with attention_impl(lm, "sdpa"):
        _sync(device)
        _reset_peak(device)
        t0 = time.perf_counter()
        out = lm.model.generate(
            x, attention_mask=torch.ones_like(x), past_key_values=cache, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]),
        )  # fmt: skip
        _sync(device)
    tokens = out[:, x.shape[1] :].tolist()
    decode_s = clock.times[-1] - clock.times[0]
    steps = len(clock.times) - 1
    return {
        "tokens": tokens,
        "new_tokens": len(tokens[0]),
        "prefill_s": clock.times[0] - t0,
        "decode_s": decode_s,
        "decode_tok_s": len(tokens) * steps / decode_s if steps and decode_s > 0 else 0.0,
        "cache_bytes": None,
        "peak_bytes": _peak(device),
        "peak_covers": "prefill and decode (generate does both)",
    }


def weights_read_bytes(lm) -> int:
    """Bytes of the weights a decode step reads: every parameter but the input embedding (a step reads B of its
    rows), which counts where the output head shares it."""
    model = lm.model
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embed
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total if tied else total - embed.numel() * embed.element_size()


def bandwidth(report: dict, device: torch.device, smoke: bool) -> tuple[float, str]:
    """(bytes/s, how it was had): the copy section's GB/s, else a copy measured here, else the nominal figure."""
    if report.get("copy", {}).get("gb_s"):
        return report["copy"]["gb_s"] * 1e9, "copy section"
    try:
        return bench_copy(device, smoke)["gb_s"] * 1e9, "copy measured in the e2e section"
    except RuntimeError as err:  # out of memory for the copy's 2 GiB: the GPU's nominal figure
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        nominal = next((bw for key, bw in NOMINAL_BANDWIDTH.items() if key in name), None)
        if nominal is None:
            raise RuntimeError(f"no bandwidth for the memory floor: {err}") from err
        return nominal, f"nominal for {name}"


def row_memory(lm, source: str, spec, batch: int, prompt: int, new: int, bw: float, tok_s: float) -> dict:
    """The headroom formula's weights + cache bytes for the row (kvdemo.memory: the model config of `source`), and
    the memory floor: batch x bandwidth / (weights read + cache bytes at the prompt's length) tokens/s."""
    from kvdemo import memory
    from kvdemo.configs import get_model_config

    name = EMBEDDED_CONFIG if source == "embedded" else source.removeprefix("random:")
    try:
        cfg = get_model_config(name)
    except (KeyError, ValueError):
        return {"predicted_bytes": None}
    bits = 8 * lm.dtype.itemsize
    predicted = cfg.weight_bytes(16) + batch * memory.sequence_bytes(cfg, spec, prompt + new, full_bits=16)
    per_step = weights_read_bytes(lm) + batch * memory.sequence_bytes(cfg, spec, prompt, full_bits=bits)
    floor = batch * bw / per_step
    return {
        "predicted_bytes": round(predicted),
        "floor_bytes_per_step": round(per_step),
        "floor_tok_s": floor,
        "fraction_of_floor": tok_s / floor if floor else None,
    }


def bench_e2e(device: torch.device, args, report: dict, deadline: float = float("inf")) -> list[dict]:
    """Rows of every model x prompt length x batch (largest first) x precision x backend; see the module docstring."""
    from kvdemo.precision import parse_precision

    bw, bw_source = bandwidth(report, device, args.smoke)
    rows: list[dict] = []
    suffix = f":g{args.group}:r{args.residual}"
    for source in _names(args.models):
        prompts_n = sorted(_ints(str(args.e2e_prompt)), reverse=True)
        batches = sorted(_ints(str(args.e2e_batches)), reverse=True)
        try:
            lm, longest = e2e_model_and_prompt(source, device, max(prompts_n), args.e2e_tokens)
        except ValueError as err:  # a model that is not there (the embedded one on the device machine)
            rows.append({"model": source, "error": str(err)})
            continue
        base = {"model": lm.name, "source": source, "dtype": str(lm.dtype).removeprefix("torch.")}
        warmed: set = set()
        for n_prompt, batch in ((n, b) for n in prompts_n for b in batches):
            point = base | {"prompt_tokens": min(n_prompt, len(longest)), "batch": batch}
            specs = [parse_precision(p if p == "full" else p + suffix) for p in _names(args.e2e_precisions)]
            wanted = [
                (s, b) for s in specs for b in _names(args.e2e_backends) if not (b.startswith("hf-") and s.is_quantized)
            ]
            if time.perf_counter() > deadline:
                rows.extend(point | {"precision": s.label, "backend": b, "skipped": "time budget"} for s, b in wanted)
                continue
            prompts = batch_prompts(lm, longest[:n_prompt], batch)
            if (lm.source, batch) not in warmed:  # compiles the kernels for this batch outside the timed rows
                warm = [p[: 2 * args.group + 8] for p in prompts]
                states, first, _ = hf_prefill(lm, warm)
                for spec, backend in wanted:
                    if backend.startswith("hf-"):
                        hf_decode(lm, warm, backend.removeprefix("hf-"), 2)
                    else:
                        kvdemo_decode(lm, states, first, spec, backend, 4)
                warmed.add((lm.source, batch))
                del states
            try:
                states, first, prefill_s = hf_prefill(lm, prompts)
            except torch.OutOfMemoryError as err:
                rows.extend(
                    point | {"precision": s.label, "backend": b, "skipped": f"memory: {err}"[:300]} for s, b in wanted
                )
                continue
            held = sum(t.numel() * t.element_size() for layer in states.layers for t in (layer.keys, layer.values))
            tokens_by_backend: dict[str, list] = {}
            for spec, backend in sorted(wanted, key=lambda sb: sb[1].startswith("hf-")):  # hf rows after the states go
                row = point | {"precision": spec.label, "backend": backend}
                if time.perf_counter() > deadline:
                    rows.append(row | {"skipped": "time budget"})
                    continue
                if backend.startswith("hf-"):
                    states = None  # transformers' generate prefills on its own: the shared states go first
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                try:
                    if backend.startswith("hf-"):
                        got = hf_decode(lm, prompts, backend.removeprefix("hf-"), args.e2e_tokens)
                    else:
                        got = kvdemo_decode(lm, states, first, spec, backend, args.e2e_tokens)
                        got |= {"prefill_s": prefill_s, "prefill": "transformers SDPA, stored as one append per layer"}
                        if got["peak_bytes"] is not None:
                            got |= {"held_states_bytes": held, "decode_peak_bytes": got["peak_bytes"] - held}
                except torch.OutOfMemoryError as err:
                    rows.append(row | {"error": f"out of memory: {err}"[:300]})
                    continue
                tokens_by_backend[f"{spec.label}/{backend}"] = got.pop("tokens")
                got |= row_memory(lm, source, spec, batch, n_prompt, args.e2e_tokens, bw, got["decode_tok_s"])
                measured = got.get("decode_peak_bytes") or got.get("peak_bytes")
                if measured and got["predicted_bytes"]:
                    got["measured_vs_predicted"] = measured / got["predicted_bytes"]
                rows.append(row | got | {"bandwidth_bytes_s": bw, "bandwidth_from": bw_source})
            by_spec: dict[str, list] = {}
            for key, tokens in tokens_by_backend.items():
                by_spec.setdefault(key.split("/")[0], []).append(tokens)
            for row in rows[-len(wanted) :]:
                same = by_spec.get(row["precision"])
                if same and "skipped" not in row and "error" not in row:
                    row["same_tokens_across_backends"] = all(t == same[0] for t in same)
            states = first = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del lm
        gc.collect()
    return rows


def e2e_goals(rows: list[dict], smoke: bool) -> dict:
    """The end-to-end goals, measured side by side (never asserted): Llama-3.1-8B shapes at 32k, batch 8, int4
    over full (triton+graphs each) >= 1.3x and >= 50% of the memory floor; the 135M shapes >= 150 tok/s."""

    def best(pred) -> dict | None:
        done = [r for r in rows if pred(r) and r.get("decode_tok_s")]
        return max(done, key=lambda r: r["decode_tok_s"], default=None)

    def at_8b(r, precision_prefix):
        return (
            "llama-3.1-8b" in r.get("source", "")
            and (r.get("prompt_tokens"), r.get("batch")) == (32768, 8)
            and r["precision"].startswith(precision_prefix)
            and r["backend"] == "triton+graphs"
        )

    int4, full = best(lambda r: at_8b(r, "int4")), best(lambda r: at_8b(r, "full"))
    small = best(lambda r: EMBEDDED_CONFIG in r.get("source", "") or r.get("source") == "embedded")
    ratio = int4 and full and int4["decode_tok_s"] / full["decode_tok_s"]
    measured = {
        "int4_over_full_8b_32k_b8": (ratio, 1.3),
        "int4_fraction_of_floor_8b_32k_b8": (int4 and int4.get("fraction_of_floor"), 0.5),
        "tok_s_135m_best": (small and small["decode_tok_s"], 150.0),
    }
    return {
        k: {"goal": g, "measured": v, "met": None if v is None or smoke else bool(v >= g)}
        for k, (v, g) in measured.items()
    }


# --- a model split across devices -------------------------------------------------------------------------------


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple | list):
        return type(x)(_to(v, device) for v in x)
    return x


def split_model(lm, devices: list[torch.device]) -> list:
    """Move decoder layer i to devices[i] (the embedding, final norm and head stay where they are) and hook every
    moved module so its inputs follow it there; returns the hooks' handles. What transformers' `device_map`
    does with accelerate's hooks, by hand: random-weight models have no checkpoint to load with a map."""
    from kvdemo.runner import decoder_layers

    home = lm.device
    handles = []

    def follow(device):
        def pre_hook(module, args, kwargs):
            return _to(args, device), {k: _to(v, device) for k, v in kwargs.items()}

        return pre_hook

    for layer, device in zip(decoder_layers(lm), devices, strict=True):
        layer.to(device)
        handles.append(layer.register_forward_pre_hook(follow(device), with_kwargs=True))
    for module in (lm.model.model.norm, lm.model.lm_head):  # back on the home device after the last layer
        handles.append(module.register_forward_pre_hook(follow(home), with_kwargs=True))
    return handles


def bench_split(device: torch.device, args) -> list[dict]:
    """Greedy tokens of the embedded model's shapes (smoke: the 2-layer small model) with its first half of layers
    on `device` and the rest on the CPU, against the same model on one device; each layer's cache device."""
    from kvdemo import runner
    from kvdemo.graphs import GRAPHS_ENV
    from kvdemo.measured import SCALE_MODEL
    from kvdemo.models import random_model

    shape = SCALE_MODEL if args.smoke else EMBEDDED_CONFIG
    lm = random_model(shape, device, dtype="float32")  # one dtype on both devices
    n_layers = lm.num_layers
    devices = [device] * (n_layers // 2) + [torch.device("cpu")] * (n_layers - n_layers // 2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, lm.config.vocab_size, (args.e2e_split_prompt,), generator=gen).tolist()
    rows = []
    os.environ[GRAPHS_ENV] = "0"  # one graph cannot hold the CPU layers' work (graphs.graphs_blocker refuses too)
    try:
        suffix = f":g{args.group}:r{args.residual}"  # blocks coded within the prompt and the decode
        precisions = [p if p == "full" else p + suffix for p in _names(args.split_precisions)]
        one = {p: runner.run_precision(lm, ids, p, SPLIT_TOKENS) for p in precisions}
        handles = split_model(lm, devices)
        try:
            for precision, want in one.items():
                cache = runner.new_cache(lm, precision)
                t0 = time.perf_counter()
                first = runner.prefill(lm, ids, cache)
                tokens, _, _, decode_s = runner.generate(lm, cache, first, SPLIT_TOKENS)
                rows.append(
                    {
                        "model": lm.name,
                        "precision": want.precision,
                        "prompt_tokens": len(ids),
                        "layer_devices": [str(d) for d in devices],
                        "cache_devices": [str(layer.keys.sinks.device) for layer in cache.layers],
                        "tokens_one_device": want.tokens,
                        "tokens_split": tokens,
                        "same_tokens": tokens == want.tokens,
                        "first_divergence": runner.first_divergence(want.tokens, tokens),
                        "seconds": round(time.perf_counter() - t0, 3),
                        "decode_tok_s_split": (len(tokens) - 1) / decode_s if decode_s > 0 else 0.0,
                        "decode_tok_s_one_device": want.decode_tok_s,
                    }
                )
        finally:
            for h in handles:
                h.remove()
    finally:
        os.environ.pop(GRAPHS_ENV, None)
    return rows
