"""Run a model over a cache at a chosen precision: prefill, stream greedy tokens, score answers, and
compare full precision with quantized precisions on the same tokens, side by side.

Everything here takes a `LoadedModel` and plain token lists; results are dataclasses with `to_dict()`.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch
from transformers import Cache

from .cache import QuantizedKVCache
from .graphs import DecodeSteps
from .models import LoadedModel
from .precision import PrecisionSpec, parse_precision

PREFILL_CHUNK = 2048  # long prompts are prefilled in chunks: bounded activation memory on CPU
# How a prompt is stored in a quantized cache:
#   exact:   its states are computed at full precision (chunks attend over the exact earlier chunks) and
#            then stored quantized, as one append: how KVQuant evaluates, and how the needle grid runs;
#            costs a full-precision copy of the prompt's cache while it runs.
#   chunked: chunk after chunk goes into the quantized cache, each attending over the earlier chunks as
#            stored (quantized): how llama.cpp and chunked-prefill servers behave, errors compound inside
#            the prompt; memory is the packed cache plus a workspace bounded by the chunk.
PREFILL_MODES = ("exact", "chunked")


def chat_ids(lm: LoadedModel, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation with the model's chat template (plain text if it has none)."""
    tok = lm.tokenizer
    if getattr(tok, "chat_template", None):
        out = tok.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)
    text = "\n\n".join(f"{m['role']}: {m['content']}" for m in messages)
    return tok(text + ("\n\nassistant:" if add_generation_prompt else ""), add_special_tokens=True)["input_ids"]


def new_cache(lm: LoadedModel, spec: PrecisionSpec | str, codebooks=None) -> QuantizedKVCache:
    """An empty cache for `lm` at `spec`, with what its methods need from the model: the rotary embedding
    (pre-RoPE keys) and nuq codebooks (`codebooks`, a `codebooks.Codebooks`; default: the model's own,
    kvdemo/codebooks.py, NormalFloat when none is fitted). ValueError (a message for the user) when the model
    cannot take the spec."""
    spec = parse_precision(spec)
    rope = None
    if spec.pre_rope:
        from .quant.rotations import Rope

        rope = Rope.from_model(lm.model)
    if not any(spec.codebook_levels().values()):
        codebooks = None
    elif codebooks is None:
        from . import codebooks as books

        codebooks = books.for_model(lm)
    if spec.hadamard and lm.head_dim & (lm.head_dim - 1):
        raise ValueError(f"hadamard needs a power-of-two head_dim; this model's is {lm.head_dim}")
    return QuantizedKVCache(spec, num_layers=lm.num_layers, rope=rope, codebooks=codebooks)


def fork(cache: QuantizedKVCache) -> QuantizedKVCache:
    """An independent copy (to score an answer and still generate from the same prefill)."""
    return copy.deepcopy(cache)


def stop_token_ids(lm: LoadedModel) -> set[int]:
    ids = set()
    for source in (getattr(lm.model, "generation_config", None), lm.config):
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if lm.tokenizer.eos_token_id is not None:
        ids.add(lm.tokenizer.eos_token_id)
    for special in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        tid = lm.tokenizer.convert_tokens_to_ids(special)
        if isinstance(tid, int) and tid != lm.tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return ids


@torch.no_grad()
def forward(
    lm: LoadedModel, ids: Sequence[int], cache: QuantizedKVCache, chunk: int | None = None, last_only: bool = False
) -> torch.Tensor:
    """Append `ids` to the cache in chunks (of PREFILL_CHUNK tokens by default, read at call time);
    return float32 logits [len(ids), vocab] of those positions' next tokens ([1, vocab], the last
    position only, with `last_only`)."""
    chunk = chunk or PREFILL_CHUNK
    if not len(ids):
        raise ValueError("nothing to run: empty token list")
    x = torch.tensor([list(ids)], device=lm.device)
    outs = []
    for start in range(0, x.shape[1], chunk):
        piece = x[:, start : start + chunk]
        out = lm.model(input_ids=piece, past_key_values=cache, use_cache=True, logits_to_keep=int(last_only))
        logits = out.logits[0].float()
        outs = [logits] if last_only else [*outs, logits]
    return torch.cat(outs)


@contextlib.contextmanager
def attention_impl(lm: LoadedModel, impl: str) -> Iterator[None]:
    """Run the model with attention implementation `impl` ("kvdemo", "sdpa"), restoring the previous one
    afterwards. transformers' caches run with plain SDPA (the kvdemo function would hand their tensors to
    SDPA anyway; switching keeps our code out of their path entirely). Not safe while another thread
    generates with the same model."""
    before = lm.model.config._attn_implementation
    if impl == before:
        yield
        return
    lm.model.set_attn_implementation(impl)
    try:
        yield
    finally:
        lm.model.set_attn_implementation(before)


def prefill(
    lm: LoadedModel, ids: Sequence[int], cache: Cache, chunk: int | None = None, mode: str = "chunked"
) -> torch.Tensor:
    """Append `ids`; return the float32 logits [vocab] for the token after them (only the last row).

    `cache`: kvdemo's QuantizedKVCache (its buffers are sized for the whole prompt first, so no chunk
    regrows them) or any transformers Cache (the bench's contenders; appended chunk by chunk).
    mode (PREFILL_MODES): "exact" computes an empty quantized cache's prompt at full precision and stores
    it quantized (`transplant`); into a cache that already holds tokens, or a full-precision one, both
    modes append chunk by chunk.
    """
    if mode not in PREFILL_MODES:
        raise ValueError(f"unknown prefill mode {mode!r}; allowed: {', '.join(PREFILL_MODES)}")
    ours = isinstance(cache, QuantizedKVCache)
    if ours:
        cache.reserve(cache.get_seq_length() + len(ids))
    if mode == "exact" and ours and cache.spec.is_quantized and cache.get_seq_length() == 0:
        full = new_cache(lm, "full")
        full.reserve(len(ids))
        logits = forward(lm, ids, full, chunk, last_only=True)[-1]
        transplant(full, cache)
    else:
        logits = forward(lm, ids, cache, chunk, last_only=True)[-1]
    if ours and lm.device.type == "cuda":  # compile the flushes' kernels now, not inside the timed decode
        cache.warm_up()
    return logits


def transplant(source: QuantizedKVCache, target: QuantizedKVCache) -> QuantizedKVCache:
    """Store `source`'s keys/values (a full-precision cache) into the empty `target`, one append per layer:
    bit for bit what prefilling the same tokens into `target` in one call would store."""
    if source.spec.is_quantized:
        raise ValueError("transplant needs a full-precision source cache")
    if target.get_seq_length():
        raise ValueError("transplant needs an empty target cache")
    for i, layer in enumerate(source.layers):
        keys, values = layer.packed().dequantized()  # [B, H, T, D] each: exact for a full cache
        target.update(keys, values, i)
    return target


@dataclass
class Generation:
    precision: str
    tokens: list[int]
    text: str
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    stopped: str  # "eos" | "length" | "cancelled"
    cache_bytes: dict = field(default_factory=dict)
    logits: list = field(default_factory=list, repr=False)  # per generated token, float32 [vocab] (if kept)

    @property
    def decode_tok_s(self) -> float:
        steps = max(len(self.tokens) - 1, 0)  # the first token comes from the prefill's logits
        return steps / self.decode_s if self.decode_s > 0 and steps else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("logits")
        d["decode_tok_s"] = round(self.decode_tok_s, 3)
        return d


@torch.no_grad()
def generate(
    lm: LoadedModel,
    cache: QuantizedKVCache,
    first_logits: torch.Tensor,
    max_new_tokens: int,
    on_token: Callable[[int, str], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    keep_logits: bool = False,
) -> tuple[list[int], list[torch.Tensor], str, float]:
    """Greedy decoding from `first_logits` (the prefill's last row).

    Returns (tokens, logits kept per token, stop reason, seconds spent). The stop token, if any, is
    included in `tokens`. `should_stop()` is polled before each token (raise nothing: returns).
    On CUDA with the Triton backend, steps between flushes replay a captured CUDA graph (`kvdemo.graphs`;
    KVDEMO_CUDA_GRAPHS=0 turns it off); elsewhere each step is a one-token `prefill`.
    """
    stops = stop_token_ids(lm)
    steps = DecodeSteps(lm, cache, new_tokens=max_new_tokens)
    next_logits = steps.step if steps.capture is not None else lambda token: prefill(lm, [token], cache)
    tokens, kept, logits, reason = [], [], first_logits, "length"
    start = time.perf_counter()
    for step in range(max_new_tokens):
        if should_stop is not None and should_stop():
            reason = "cancelled"
            break
        if keep_logits:
            kept.append(logits.detach().cpu())
        nxt = int(torch.argmax(logits))
        tokens.append(nxt)
        if on_token is not None:
            on_token(nxt, lm.tokenizer.decode([nxt]))
        if nxt in stops:
            reason = "eos"
            break
        if step + 1 < max_new_tokens:
            logits = next_logits(nxt)
    return tokens, kept, reason, time.perf_counter() - start


def run_precision(
    lm: LoadedModel,
    prompt_ids: Sequence[int],
    spec: PrecisionSpec | str,
    max_new_tokens: int,
    on_token: Callable[[int, str], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    keep_logits: bool = False,
    prefill_mode: str = "chunked",
) -> Generation:
    """Prefill `prompt_ids` into a fresh cache at `spec` (PREFILL_MODES) and decode greedily."""
    spec = parse_precision(spec)
    cache = new_cache(lm, spec)
    t0 = time.perf_counter()
    first = prefill(lm, prompt_ids, cache, mode=prefill_mode)
    prefill_s = time.perf_counter() - t0
    tokens, kept, reason, decode_s = generate(lm, cache, first, max_new_tokens, on_token, should_stop, keep_logits)
    text = lm.tokenizer.decode(tokens, skip_special_tokens=True)
    return Generation(spec.label, tokens, text, len(prompt_ids), prefill_s, decode_s, reason, cache.nbytes(), kept)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, None when one is a prefix of the other (no divergence seen)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


def compare(
    lm: LoadedModel,
    prompt_ids: Sequence[int],
    specs: Sequence[PrecisionSpec | str],
    max_new_tokens: int,
    baseline: str = "full",
    prefill_mode: str = "chunked",
) -> dict:
    """Full precision and each spec on the same prompt: outputs, tokens/s, first diverging token.
    prefill_mode: how each quantized cache stores the prompt (PREFILL_MODES)."""
    specs = [parse_precision(s) for s in specs]
    base = run_precision(lm, prompt_ids, baseline, max_new_tokens)
    rows = [base.to_dict() | {"first_divergence": None, "decode_speed_vs_full": 1.0}]
    for spec in specs:
        if spec.label == base.precision:
            continue
        gen = run_precision(lm, prompt_ids, spec, max_new_tokens, prefill_mode=prefill_mode)
        speed = gen.decode_tok_s / base.decode_tok_s if base.decode_tok_s else None
        rows.append(
            gen.to_dict()
            | {
                "first_divergence": first_divergence(base.tokens, gen.tokens),
                "decode_speed_vs_full": None if speed is None else round(speed, 3),
            }
        )
    return {"model": lm.name, "prompt_tokens": len(prompt_ids), "prefill_mode": prefill_mode, "results": rows}


@torch.no_grad()
def answer_logprob(
    lm: LoadedModel, cache: QuantizedKVCache, first_logits: torch.Tensor, answer_ids: Sequence[int]
) -> float:
    """Teacher-forced log-probability (natural log, summed) of `answer_ids` after the cached prompt.

    Mutates `cache` (appends the answer): pass a `fork()` to keep the prompt's cache.
    """
    answer_ids = list(answer_ids)
    total = float(torch.log_softmax(first_logits, -1)[answer_ids[0]])
    if len(answer_ids) > 1:
        logits = forward(lm, answer_ids[:-1], cache)  # [k-1, V]: predictions for answer_ids[1:]
        lp = torch.log_softmax(logits, -1)
        total += float(lp[torch.arange(len(answer_ids) - 1), torch.tensor(answer_ids[1:])].sum())
    return total


# --- speed: a quick probe, and progress inside a forward pass -------------------------------------------
PROBE_PROMPT = 256  # tokens the probe reads
PROBE_STEPS = 8  # decode steps it times


@torch.no_grad()
def probe_speed(lm: LoadedModel) -> bool:
    """Time a short read (`PROBE_PROMPT` tokens) and a few decode steps of `lm` with a full-precision cache, and
    remember both rates on this machine (`kvdemo.rates`, tasks "probe:prefill" and "probe:decode"): the first
    guess of a time hint before any run of its kind was measured here. A fraction of a second on the embedded
    model; skipped (False) while another session holds the model, so a page never waits for it."""
    from . import rates

    if not lm.lock.acquire(blocking=False):
        return False
    try:
        ids = [int(i) % lm.config.vocab_size for i in range(1000, 1000 + PROBE_PROMPT)]
        prefill(lm, ids[:16], new_cache(lm, "full"))  # warm-up: the first forward pays one-time setup
        cache = new_cache(lm, "full")
        t0 = time.perf_counter()
        logits = prefill(lm, ids, cache)
        t1 = time.perf_counter()
        for _ in range(PROBE_STEPS):
            logits = prefill(lm, [int(torch.argmax(logits))], cache)
        t2 = time.perf_counter()
    finally:
        lm.lock.release()
    rates.record(lm, "probe:prefill", PROBE_PROMPT, t1 - t0)
    rates.record(lm, "probe:decode", PROBE_STEPS, t2 - t1)
    return True


def decoder_layers(lm: LoadedModel) -> list[torch.nn.Module]:
    """The model's decoder layers (`model.model.layers` in Llama-family models; empty when not found)."""
    inner = getattr(lm.model, "model", None)
    return list(getattr(inner, "layers", None) or [])


@contextlib.contextmanager
def layer_progress(lm: LoadedModel, on_layer: Callable[[int, int], None] | None) -> Iterator[None]:
    """Call `on_layer(done, layers)` after each decoder layer of every forward pass inside: progress within a
    long prefill chunk, which runs minutes on a busy CPU (a chunk's tokens are done when its last layer is)."""
    layers = decoder_layers(lm)
    if on_layer is None or not layers:
        yield
        return

    def hook(index: int):
        def after(*_) -> None:  # returns None: the layer's output stays as it is
            on_layer(index + 1, len(layers))

        return after

    hooks = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
