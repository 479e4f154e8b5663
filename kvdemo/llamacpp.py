"""llama.cpp as a contender: its own quantized KV cache (`-ctk/-ctv`), run in-process on the same GGUF file and
the same token ids as kvdemo's rows.

A contender is written ``llama.cpp:<type>`` or ``llama.cpp:<key type>/<value type>`` (kvdemo/engines.py: the
cache types, their sizes, the grammar). ``llama.cpp:f16`` is llama.cpp's own full row: every quantized llama.cpp
row is read against it, never against kvdemo's full row, since the two engines' kernels differ (llama.cpp runs
the GGUF's Q4_1 weights as they are; transformers dequantizes them).

`Engine` is one llama.cpp context (flash attention on: llama.cpp needs it for a quantized V) that feeds tokens
and returns the logits of the positions a caller asks for (llama.cpp computes only those). How the protocols line up with kvdemo's:

- perplexity (`score_text`): the text's first `prefix` tokens go through llama.cpp's own prefill, the rest are
  fed `chunk` tokens at a time, so every scored token attends over the cache as llama.cpp stored it. Unlike
  kvdemo's rows, the prefix is not read exactly: llama.cpp writes each batch's keys/values into its cache and
  attends over what it wrote, so the prefix's later layers already see quantized states. That is the engine's
  behaviour in production, and the report says so.
- needle (`needle_answer`): the prompt's tokens, then the true answer teacher-forced (its log-probability), and
  the greedy reply, decoded on the same context.
- memory (`kv_bytes`): llama.cpp's cache rows, as it allocates them: ggml's block sizes per type, a row per
  token per layer for keys and for values (checked against llama.cpp's own log line in the tests).

llama-cpp-python is on PyPI as source only; `pip install llama-cpp-python` builds it (cmake, a C++ compiler;
about 20 minutes on 2 cores). Without it every llama.cpp contender is refused with that message.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .engines import CACHE_TYPES, KvTypes, LlamaCppError, kv_bytes

if TYPE_CHECKING:
    import torch

INSTALL = (
    "llama.cpp contenders need llama-cpp-python, which PyPI has as source only: `pip install llama-cpp-python` "
    "builds it (cmake and a C++ compiler; about 20 minutes on 2 cores), and `make test` does that"
)


def available() -> str | None:
    """None when llama-cpp-python imports; else why not (how to install it)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return INSTALL
    return None


def require() -> None:
    """LlamaCppError saying how to install llama-cpp-python, unless it imports."""
    reason = available()
    if reason:
        raise LlamaCppError(reason)


def version() -> str:
    """llama-cpp-python's version (it vendors one llama.cpp commit per release)."""
    import llama_cpp

    return f"llama-cpp-python {llama_cpp.__version__}"


def engine_note(path: Path) -> dict:
    """What a report records of the llama.cpp rows: the binding's version, the file, the protocol."""
    return {
        "engine": version(),
        "gguf": Path(path).name,
        "flags": "flash attention on (-fa on); cache types per row (-ctk/-ctv)",
        "protocol": "the prefix through llama.cpp's own prefill (its attention reads the cache as stored), "
        "then the rest in chunks as kvdemo's rows; each quantized row against llama.cpp's f16 row",
    }


def gguf_path(lm) -> Path:
    """The GGUF file a loaded model came from: the embedded model's, or the .gguf path it was loaded by."""
    from .models import DEFAULT_MODEL, embedded_gguf

    source = (lm.source or DEFAULT_MODEL).strip()
    if source in (DEFAULT_MODEL, "default", "smollm2"):
        return embedded_gguf()
    if source.lower().endswith(".gguf"):
        return Path(source).expanduser()
    raise LlamaCppError(
        f"llama.cpp contenders run a GGUF file; {lm.name} was loaded from {source} (use the embedded model or a "
        ".gguf path)"
    )


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """llama.cpp prints its load log on fd 2 whatever `verbose` says in places; keep it off the user's console."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class Engine:
    """One llama.cpp context over `path` with the cache types of `kv`, holding up to `n_ctx` tokens.

    `feed(ids, last=k)` appends tokens and returns the logits of the last k of them; `keep(n)` drops every token
    after the first n (the next feed starts there). Threads: `threads` (default: torch's, as kvdemo's rows use).

    `feed` drives llama.cpp's batch itself, flagging only the tokens whose logits the caller asked for: llama.cpp
    then runs its last layer's feed-forward and the output matmul on those rows alone and copies out only those
    (a needle prompt of 4,096 tokens needs one row, not 4,096 x 49,152 floats). The binding's own `Llama.eval` (the
    chat path, `chat_reply`) still computes every row, as llama.cpp's server does (`logits_all`)."""

    def __init__(self, path: Path | str, kv: KvTypes, n_ctx: int, threads: int | None = None, batch: int = 512):
        import torch

        require()
        from llama_cpp import Llama

        threads = threads or torch.get_num_threads()

        self.kv = kv
        with _quiet_stderr():
            self.llm = Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_batch=min(batch, n_ctx),
                n_ubatch=min(batch, n_ctx),
                type_k=CACHE_TYPES[kv.key].ggml_type,
                type_v=CACHE_TYPES[kv.value].ggml_type,
                flash_attn=True,
                logits_all=True,  # the server's setting, for `chat_reply`; `feed` flags its own rows
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
            )
        self.n_ctx = self.llm.n_ctx()
        self.batch = self.llm.n_batch
        self.n_vocab = self.llm.n_vocab()
        meta = self.llm.metadata
        arch = meta.get("general.architecture", "llama")
        self.n_layers = int(meta[f"{arch}.block_count"])
        heads = int(meta[f"{arch}.attention.head_count"])
        kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
        head_dim = int(meta.get(f"{arch}.attention.key_length", int(meta[f"{arch}.embedding_length"]) // heads))
        self.kv_width = kv_heads * head_dim

    @property
    def n_tokens(self) -> int:
        return self.llm.n_tokens

    def keep(self, n: int) -> None:
        """Forget every token after the first `n` (llama.cpp drops their cache cells at the next feed)."""
        self.llm.n_tokens = n

    def feed(self, ids: Sequence[int], chunk: int | None = None, last: int | None = None) -> torch.Tensor:
        """Append `ids` in calls of `chunk` tokens (None: one call), each split at the batch size as the binding's
        `Llama.eval` splits it, so the batches (and llama.cpp's numerics, which move with them) are the same
        whatever `last` is. Logits [k, V] float32 of the last k = min(`last`, len(ids)) tokens (None: all), row i
        predicting the token after ids[len(ids) - k + i]; only those rows are computed."""
        import numpy as np
        import torch

        ids = [int(t) for t in ids]
        if self.n_tokens + len(ids) > self.n_ctx:
            raise LlamaCppError(f"{self.n_tokens + len(ids)} tokens do not fit llama.cpp's context of {self.n_ctx}")
        first_out = 0 if last is None else len(ids) - min(max(last, 0), len(ids))  # first index with logits
        out = np.empty((len(ids) - first_out, self.n_vocab), dtype=np.float32)  # [k, V]
        self.llm._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1)  # cells past n_tokens (after a `keep`)
        step = chunk or len(ids) or 1
        for s in range(0, len(ids), step):
            end = min(s + step, len(ids))
            for b in range(s, end, self.batch):
                self._decode(ids[b : min(b + self.batch, end)], b - first_out, out)
        return torch.from_numpy(out)

    def _decode(self, tokens: list[int], row: int, out) -> None:
        """One llama_decode of `tokens` after the tokens fed so far; tokens[i] has its logits copied into
        out[row + i] when row + i >= 0."""
        import llama_cpp
        import numpy as np

        llm, n_past = self.llm, self.llm.n_tokens
        batch = llm._batch.batch  # the binding's llama_batch, sized n_batch
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, n_past + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = row + i >= 0
        llm._ctx.decode(llm._batch)
        for i in range(max(-row, 0), len(tokens)):
            logits = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, i)  # float* [V]
            out[row + i] = np.ctypeslib.as_array(logits, shape=(self.n_vocab,))
        llm.input_ids[n_past : n_past + len(tokens)] = tokens
        llm.n_tokens += len(tokens)
        llm._requires_eval = row + len(tokens) <= 0  # the binding samples from the last token's logits if any

    def kv_bytes(self, tokens: int | None = None) -> int:
        """Bytes its cache holds for `tokens` tokens (default: the tokens fed so far)."""
        return kv_bytes(self.n_layers, self.kv_width, self.n_tokens if tokens is None else tokens, self.kv)

    def close(self) -> None:
        self.llm.close()


# --- perplexity: one contender over a text -------------------------------------------------------------


def score_text(
    engine: Engine,
    ids: Sequence[int],
    prefix: int,
    chunk: int,
    keep_every: int,
    on_tokens: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(NLL [len(ids) - prefix] of ids[prefix:], log-softmax rows [ceil((len(ids) - prefix) / keep_every), V] of
    every `keep_every`-th scored prediction): the text's first `prefix` tokens through llama.cpp's prefill, then
    the rest `chunk` tokens at a time, as `kvdemo.ppl.token_nll` feeds kvdemo's caches. `on_tokens(n)` after
    every call, n the tokens it fed; it may raise to stop the run."""
    import torch
    import torch.nn.functional as F

    ids = [int(t) for t in ids]
    engine.keep(0)
    first = engine.feed(ids[:prefix], last=1)  # [1, V]: predicts ids[prefix]; the prefix's other rows unused
    if on_tokens is not None:
        on_tokens(prefix)
    nll = [F.cross_entropy(first, torch.tensor([ids[prefix]]))[None]]
    kept = [torch.log_softmax(first, -1)]
    for s in range(prefix, len(ids) - 1, chunk):
        piece = ids[s : min(s + chunk, len(ids) - 1)]
        logits = engine.feed(piece)  # [n, V]: row i predicts ids[s + 1 + i]
        nll.append(F.cross_entropy(logits, torch.tensor(ids[s + 1 : s + 1 + len(piece)]), reduction="none"))
        if keep_every:
            rows = [i for i in range(len(piece)) if (s + 1 - prefix + i) % keep_every == 0]
            kept.append(torch.log_softmax(logits[rows], -1))
        if on_tokens is not None:
            on_tokens(len(piece))
    return torch.cat(nll), torch.cat(kept)


# --- needle: one contender on one prompt ---------------------------------------------------------------


def needle_answer(
    engine: Engine,
    context: Sequence[int],
    suffix: Sequence[int],
    answer_ids: Sequence[int],
    max_new_tokens: int,
    eos: set[int],
    on_token: Callable[[int], None],
    should_stop: Callable[[], bool],
) -> tuple[float, list[int], str]:
    """(teacher-forced log p(answer), greedy reply, why it stopped) after `context` + `suffix`, as
    `kvdemo.needle.run.score_and_answer` does for kvdemo's caches: the answer teacher-forced (its log-prob; when
    every argmax along it is the answer, the greedy reply starts with it and decoding goes on), else the reply
    decoded greedily from the prompt. `on_token(t)` sees each reply token; `should_stop()` ends the reply
    ("cancelled"); a stop token in `eos` ends it, kept in the reply ("eos"), as `kvdemo.runner.generate` does;
    `max_new_tokens` or a full context ends it ("length")."""
    import torch

    engine.keep(0)
    engine.feed(list(context), last=0)
    first = engine.feed(list(suffix), last=1)[-1]  # [V]
    at_prompt = engine.n_tokens
    answer_ids = list(answer_ids)
    k = len(answer_ids)
    logits = torch.cat([first[None], engine.feed(answer_ids)]) if k else first[None]  # [k + 1, V]
    lp = torch.log_softmax(logits[:k], -1)
    logprob = float(lp[torch.arange(k), torch.tensor(answer_ids, dtype=torch.long)].sum()) if k else 0.0
    if k and logits[:k].argmax(-1).tolist() == answer_ids:
        reply, nxt = list(answer_ids), logits[k]
        for t in answer_ids:
            on_token(t)
    else:
        engine.keep(at_prompt)
        reply, nxt = [], first
    while True:
        if should_stop():
            return logprob, reply, "cancelled"
        if len(reply) >= max_new_tokens or engine.n_tokens >= engine.n_ctx:
            return logprob, reply, "length"
        t = int(nxt.argmax())
        reply.append(t)
        on_token(t)
        if t in eos:
            return logprob, reply, "eos"
        nxt = engine.feed([t])[-1]


def answer_score(
    engine: Engine, context: Sequence[int], question: Sequence[int], answer: Sequence[int]
) -> tuple[float, bool]:
    """(log-probability of `answer` after `context` + `question`, nats summed, rounded to 4 digits; whether greedy
    decoding would say it), as the benchmark scores kvdemo's caches (`kvdemo.contest.run.answer_score`): the context
    through llama.cpp's prefill with no logits, then question + answer[:-1] in one call, the logits of its last
    len(answer) tokens alone."""
    import torch

    q, a = [int(t) for t in question], [int(t) for t in answer]
    if not q or not a:
        raise LlamaCppError("a needle cell needs a non-empty question suffix and answer")
    engine.keep(0)
    engine.feed(list(context), last=0)
    logits = engine.feed(q + a[:-1], last=len(a))  # [len(a), V]: row i predicts a[i]
    lp = torch.log_softmax(logits, -1)
    target = torch.tensor(a)
    return round(float(lp[torch.arange(len(a)), target].sum()), 4), bool((logits.argmax(-1) == target).all())


# --- llama.cpp's own OpenAI-compatible server: what `kvdemo probe` measures from outside ---------------


def free_port() -> int:
    """A TCP port free on loopback now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(
    path: Path | str,
    kv: KvTypes,
    n_ctx: int = 4096,
    alias: str = "smollm2",
    port: int | None = None,
    threads: int | None = None,
    log: Path | None = None,
    start_timeout_s: float = 180.0,
) -> Iterator[str]:
    """Run ``python -m llama_cpp.server`` on loopback with the cache types of `kv` (flash attention on) for the
    length of the block; yields its base URL (``http://127.0.0.1:PORT/v1``), serving `path` as model `alias`.
    Its log goes to `log` (default: discarded). A server that exits or does not answer within
    `start_timeout_s` raises LlamaCppError with the log's last lines."""
    import subprocess
    import sys
    import tempfile
    import time
    import urllib.request

    import torch

    require()
    port = port or free_port()
    threads = threads or torch.get_num_threads()
    log = Path(log) if log else Path(tempfile.mkstemp(prefix="llamacpp-server-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--model_alias", alias]
    cmd += ["--n_ctx", str(n_ctx), "--flash_attn", "true", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--type_k", str(CACHE_TYPES[kv.key].ggml_type), "--type_v", str(CACHE_TYPES[kv.value].ggml_type)]
    cmd += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
    url = f"http://127.0.0.1:{port}/v1"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise LlamaCppError(f"llama.cpp's server exited ({proc.returncode}): {_tail(log)}")
            try:
                with urllib.request.urlopen(url + "/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise LlamaCppError(f"llama.cpp's server did not answer within {start_timeout_s:g} s: {_tail(log)}")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(log: Path, lines: int = 5) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return " | ".join(text[-lines:]) or "(no output)"


def server_sampling() -> dict:
    """The sampling settings llama.cpp's server applies to a request that names only temperature 0: its
    request defaults (a repeat penalty among them), read from the server's own request type."""
    from llama_cpp.server.types import CreateChatCompletionRequest

    fields = CreateChatCompletionRequest.model_fields
    names = ("repeat_penalty", "presence_penalty", "frequency_penalty", "top_k", "top_p", "min_p")
    return {n: fields[n].default for n in names if n in fields}


def chat_reply(engine: Engine, messages: list[dict], max_tokens: int) -> str:
    """The reply llama.cpp's server would send for `messages` at temperature 0, computed in-process on `engine`:
    the same chat template and the same sampler settings (`server_sampling`). Like the server, the binding reuses
    the cached tokens the new prompt starts with and reads only the rest, so a series of calls replays a series of
    requests when it comes in the same order."""
    out = engine.llm.create_chat_completion(
        messages=messages, max_tokens=max_tokens, temperature=0.0, **server_sampling()
    )
    return out["choices"][0]["message"]["content"] or ""
