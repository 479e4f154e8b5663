"""Decode speed of the Chat page's two columns on the CPU: full precision and quantized lanes on the same prompt,
side by side, and where a quantized step spends its time.

The prompt is the Chat page's first question over the bundled sample (its default 1,024 tokens, the page's
system prompt). Every precision prefills it into its own cache, then they decode greedily one step each in
turn (`--steps` rounds), so a busy moment of the shared CPU costs every precision the same round. Reported per
precision: the median step time and tokens/s, and the ratio to full precision; with `--profile`, the
functions that take most of a quantized step (cProfile, cumulative time) for the first quantized precision.

    .venv/bin/python bench/chat_cpu_speed.py --out assets/reports/chat_cpu_speed.json

The PyTorch reference path (every CPU run) turns the packed codes into floats at every decode step, for
every stored position of every layer; on a GPU the Triton kernel reads the codes in registers instead.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

from kvdemo.chat.session import SYSTEM_PROMPT  # noqa: E402
from kvdemo.documents import hold_document  # noqa: E402
from kvdemo.models import load_model  # noqa: E402
from kvdemo.results.chat import ChatSpeedReport, SpeedRow  # noqa: E402
from kvdemo.runner import chat_ids, new_cache, prefill  # noqa: E402
from kvdemo.texts import prose  # noqa: E402

QUESTION = "Who has taken Netherfield Park?"


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _profile(lm, cache, first: torch.Tensor, steps: int, top: int = 12) -> list[dict]:
    """The `top` functions by cumulative time over `steps` decode steps into `cache`."""
    prof, nxt = cProfile.Profile(), int(torch.argmax(first))
    prof.enable()
    for _ in range(steps):
        nxt = int(torch.argmax(prefill(lm, [nxt], cache)))
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in stats.stats.items():
        if "kvdemo" in file or name in ("matmul", "copy_", "float", "mul_", "__matmul__"):
            rows.append({"function": f"{Path(file).name}:{line}:{name}", "calls": calls, "own_ms": own, "cum_ms": cum})
    rows.sort(key=lambda r: -r["cum_ms"])
    return [
        r | {"own_ms": round(r["own_ms"] / steps * 1e3, 3), "cum_ms": round(r["cum_ms"] / steps * 1e3, 3)}
        for r in rows[:top]
    ]


def run(precisions: list[str], tokens: int, steps: int, profile_steps: int) -> ChatSpeedReport:
    torch.manual_seed(0)
    lm = load_model("embedded", device="cpu", dtype="float32")
    doc = hold_document("sample", prose(), lm.tokenizer, tokens, "sample", [], lm.name)["text"]
    ids = chat_ids(
        lm, [{"role": "system", "content": f"{SYSTEM_PROMPT}\n\n{doc}"}, {"role": "user", "content": QUESTION}]
    )
    caches = {p: new_cache(lm, p) for p in precisions}
    logits = {p: prefill(lm, ids, caches[p]) for p in precisions}
    times: dict[str, list[float]] = {p: [] for p in precisions}
    for _ in range(steps):  # round by round: every precision one step
        for p in precisions:
            nxt = int(torch.argmax(logits[p]))
            t0 = time.perf_counter()
            logits[p] = prefill(lm, [nxt], caches[p])
            times[p].append(time.perf_counter() - t0)
    base = statistics.median(times[precisions[0]])
    rows = []
    for p in precisions:
        med = statistics.median(times[p])
        rows.append(SpeedRow(p, round(med * 1e3, 2), round(1 / med, 2), round(med / base, 2)))
    quantized = [p for p in precisions if p != "full"]
    profile = None
    if profile_steps and quantized:
        q = quantized[0]
        profile = {
            "precision": q,
            "steps": profile_steps,
            "per_step_ms": _profile(lm, caches[q], logits[q], profile_steps),
        }
    return ChatSpeedReport(
        command="python bench/chat_cpu_speed.py " + " ".join(sys.argv[1:]),
        commit=_commit(),
        date=datetime.date.today().isoformat(),
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores (shared), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads",
        model=lm.name,
        prompt_tokens=len(ids),
        steps=steps,
        rows=rows,
        profile=profile,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precisions", default="full,int4,int2", help="comma-separated; the first is the basis")
    ap.add_argument("--tokens", type=int, default=1024, help="sample length (the Chat page's default)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--profile", type=int, default=4, help="decode steps to profile (0: none)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    report = run(args.precisions.split(","), args.tokens, args.steps, args.profile)
    text = json.dumps(report.to_json(), indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
