"""Where a measurement ran: the machine, its load and the installed versions, as reports record them.

`machine_info` is what the benchmark, the needle grid, perplexity and the prefill-mode comparison write into
their reports; `load_note` says when other processes had the CPU busy as a run began; `machine_line` is the
one-line version the memory measurements print.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import os
import platform
from pathlib import Path

import torch


def quanto_extension_built() -> bool:
    """Whether optimum-quanto's CPU extension is already compiled for this torch (no build on first call)."""
    try:
        from optimum.quanto.library.extensions import get_extension
    except ImportError:
        return False
    folder = Path(get_extension("quanto_cpp").build_directory)
    version = folder / "pytorch_version.txt"
    built = any(folder.glob("*.so")) or any(folder.glob("*.pyd"))
    return built and version.is_file() and version.read_text().strip() == torch.__version__


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(lm) -> dict:
    """The CPU (and GPU), cores, load average, Python, torch, transformers, optimum-quanto and hqq versions,
    and the model, device and dtype of `lm` (a `kvdemo.models.LoadedModel`), with the date (UTC)."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    if lm.device.type == "cuda":
        cpu += f"; GPU {torch.cuda.get_device_name(lm.device)}"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "optimum-quanto": _version("optimum-quanto"),
        "hqq": _version("hqq"),
        "quanto_extension_built_before_run": quanto_extension_built(),
        "device": str(lm.device),
        "dtype": str(lm.dtype).replace("torch.", ""),
        "model": lm.name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def load_note(machine: dict) -> str | None:
    """A note when other processes had the CPU busy as the run began (1-minute load average over half the cores).
    The load average at the end is not a sign of other load: the run itself keeps every core busy to the end."""
    busy = machine["load_avg_start"][0]
    if busy <= 0.5 * (machine["cores"] or 1):
        return None
    return (
        f"Other processes had the CPU busy as this run began (load average {busy} on {machine['cores']} cores): "
        "absolute tok/s and seconds may be lower and noisier than on an idle machine; speed ratios come from "
        "rounds measured side by side."
    )


def machine_line(device: str = "cpu") -> str:
    """E.g. "x86_64, 2 cores, cpu": what a memory measurement says about where it ran."""
    return f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, {device}"
