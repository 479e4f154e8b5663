"""llama.cpp's own server as endpoints, and the probe's answers checked against llama.cpp in-process.

`python -m kvdemo probe --llamacpp f16,q4_0` starts one ``llama_cpp.server`` per cache type on loopback
(kvdemo.llamacpp.server: the model's GGUF file, flash attention on, the types as ``--type_k/--type_v``), probes
them beside any other endpoint, and then asks every question again in-process (`in_process_checks`): the same
messages through the same chat template and sampler settings on a `kvdemo.llamacpp.Engine` with the same cache
types. A served answer that differs from its in-process one is a finding about the server path (batching,
threads, a template), not about the cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

from .. import llamacpp
from ..engines import PREFIX, KvTypes
from ..results.probe import ProbeCell, ProbeReport
from .client import Endpoint
from .prompts import Question

ALIAS = "kvdemo-gguf"  # the model name the local servers serve


def endpoint_name(kv: KvTypes) -> str:
    """``llama.cpp-q4_0`` (``llama.cpp-q8_0-q4_0`` for mixed types): an endpoint name without ':' or '/'."""
    return "llama.cpp-" + kv.label[len(PREFIX) :].replace("/", "-")


def start_servers(stack: contextlib.ExitStack, path: Path, kvs: Sequence[KvTypes], n_ctx: int) -> list[Endpoint]:
    """One llama.cpp server per cache type, each closed with `stack`; their endpoints (no key)."""
    out = []
    for kv in kvs:
        url = stack.enter_context(llamacpp.server(path, kv, n_ctx=n_ctx, alias=ALIAS))
        out.append(Endpoint(endpoint_name(kv), url, ALIAS))
    return out


def in_process_checks(
    report: ProbeReport,
    asked: Sequence[Question],
    path: Path,
    kvs: Sequence[KvTypes],
    n_ctx: int,
    max_tokens: int,
) -> list[dict]:
    """Per local endpoint and answered cell: its served answer beside the in-process reply to the same messages
    (`kvdemo.llamacpp.chat_reply`), and whether they agree. The questions are replayed in the order the server
    answered them on one context, as the server reuses the prompt prefix it has cached: llama.cpp's logits move
    with where a batch starts, so a prompt read after a reused prefix can be answered differently from the same
    prompt read whole. With more than one request in flight the server's order is not the report's, and an
    answer may differ for that reason alone."""
    by_cell = {(q.length, q.depth, q.seed): q for q in asked}
    checks = []
    for kv in kvs:
        name = endpoint_name(kv)
        cells: list[ProbeCell] = [c for c in report.cells if c.endpoint == name and c.found is not None]
        if not cells:
            continue
        engine = llamacpp.Engine(path, kv, n_ctx=n_ctx)
        try:
            for c in cells:
                q = by_cell[(c.length, c.depth, c.seed)]
                local = llamacpp.chat_reply(engine, q.messages(), max_tokens)
                checks.append(
                    {
                        "endpoint": name,
                        "cache": kv.label,
                        "length": c.length,
                        "depth": c.depth,
                        "seed": c.seed,
                        "served": c.answer,
                        "in_process": local,
                        "same": local.strip() == c.answer.strip(),
                    }
                )
        finally:
            engine.close()
    return checks
