"""How fast this machine does each kind of model work, remembered across runs: what time hints come from.

A long run (a needle grid, a perplexity run, a drift run, a chat turn's reading) counts its work in tokens
(`kvdemo.progress`); when it ends, `record` stores its seconds per token in a small JSON file under the cache
folder (`configs.cache_dir() / "rates.json"`, or `KVDEMO_RATES_FILE`), keyed by this machine (`machine_key`: CPU model, core count,
GPU), the model, device, dtype and the task. Before a run, `hint` multiplies the planned tokens by the median
of that key's last `KEEP` runs and says so ("from this machine's last 3 runs"). With no run of the task
measured here yet, the rate comes from a quick probe of this machine (`probe_rates`: a short read and a few
decode steps of the loaded model, stored under the task names "probe:prefill" / "probe:decode" by
`kvdemo.runner.probe_speed`) scaled by `PROBE_MARGIN`, or, before any probe, from `FIRST_GUESS` (a stated
first guess). Each task's tokens are mostly of one kind (`TASK_KIND`): a needle grid reads prompts, a
perplexity or drift run decodes, so a probe of that kind is what its first guess scales.

Nothing here runs a model; several processes (two checkouts, two servers) may share the file: writes go to a
temporary file that replaces it, and a file that does not parse counts as empty.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import threading
from dataclasses import dataclass
from pathlib import Path

from .configs import cache_dir
from .progress import duration

KEEP = 5  # runs remembered per key
RATES_FILE = "rates.json"
# tokens of each task are mostly this kind of work: what a probe of the machine is scaled from
TASK_KIND = {
    "needle": "prefill",
    "chat-read": "prefill",
    "prefill-modes": "prefill",
    "ppl": "decode",
    "drift": "decode",
    "findings": "decode",
    "bench": "decode",
    "chat-answer": "decode",
}
PROBE_MARGIN = 3.0  # a probe runs one full-precision cache; a task runs quantized ones too, on a busier machine
# seconds per token before anything was measured here: cautious, from the embedded model on 2 busy CPU cores
FIRST_GUESS = {("cpu", "prefill"): 0.004, ("cpu", "decode"): 0.1, ("cuda", "prefill"): 0.0002, ("cuda", "decode"): 0.03}
_lock = threading.Lock()


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_key(lm) -> str:
    """``Intel Xeon ... x2 | cpu | SmolLM2-... | float32``: what a measured speed holds for."""
    where = f"{_cpu_name()} x{os.cpu_count()}"
    if lm.device.type == "cuda":
        import torch

        where += f" + {torch.cuda.get_device_name(lm.device)}"
    dtype = str(lm.dtype).removeprefix("torch.")
    return f"{where} | {lm.device.type} | {lm.name} | {dtype}"


def _path() -> Path:
    """The rates file: `KVDEMO_RATES_FILE` when set (a test server's own), else in the cache folder."""
    return Path(os.environ.get("KVDEMO_RATES_FILE") or cache_dir() / RATES_FILE)


def _load() -> dict[str, dict[str, list[float]]]:
    try:
        data = json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record(lm, task: str, tokens: float, seconds: float) -> None:
    """Remember one finished run of `task` on this machine: `tokens` of work in `seconds`."""
    if not (tokens > 0 and seconds > 0):
        return
    key = machine_key(lm)
    with _lock:
        data = _load()
        runs = data.setdefault(key, {}).setdefault(task, [])
        runs[:] = [*runs, seconds / tokens][-KEEP:]
        path = _path()
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(path)


def measured(lm, task: str) -> list[float]:
    """Seconds per token of the last runs of `task` on this machine (oldest first; empty before any)."""
    runs = _load().get(machine_key(lm), {}).get(task, [])
    return [float(r) for r in runs if isinstance(r, int | float) and r > 0]


@dataclass(frozen=True)
class Rate:
    """Seconds per token of a task here, and where that number comes from."""

    s_per_token: float
    runs: int  # runs of the task it comes from (0: a probe or the first guess)
    source: str  # "measured", "probe" or "guess"

    def says(self) -> str:
        if self.source == "measured":
            return "from this machine's last run" if self.runs == 1 else f"from this machine's last {self.runs} runs"
        if self.source == "probe":
            return "a first guess from a quick probe of this machine, no run of this kind measured here yet"
        return "a first guess, not yet measured here"


def rate(lm, task: str) -> Rate:
    """The task's measured rate here (median of the last runs), else a probe's, else the first guess."""
    runs = measured(lm, task)
    if runs:
        return Rate(statistics.median(runs), len(runs), "measured")
    kind = TASK_KIND.get(task, "decode")
    probe = measured(lm, f"probe:{kind}")
    if probe:
        return Rate(statistics.median(probe) * PROBE_MARGIN, 0, "probe")
    return Rate(FIRST_GUESS.get((lm.device.type, kind), FIRST_GUESS[("cpu", kind)]), 0, "guess")


def estimate(lm, task: str, tokens: float) -> float:
    """Seconds `tokens` of work of `task` should take here."""
    return rate(lm, task).s_per_token * max(tokens, 0)


def hint(lm, task: str, tokens: float, what: str) -> str:
    """ "About 12 s for this grid (from this machine's last 2 runs: 340 tokens/s)." or, before any run here,
    "About 40 s for this grid (a first guess, not yet measured here)."."""
    r = rate(lm, task)
    speed = f": {1 / r.s_per_token:,.0f} tokens/s" if r.source == "measured" else ""
    return f"About {duration(r.s_per_token * max(tokens, 0))} for {what} ({r.says()}{speed})."


def needs_probe(lm, task: str) -> bool:
    """No run of `task` and no probe of its kind measured here yet."""
    return not measured(lm, task) and not measured(lm, f"probe:{TASK_KIND.get(task, 'decode')}")
