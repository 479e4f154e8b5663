"""The device check's new parts on CPU (bench/device_check.sh runs them on a GPU): Nsight Compute's CSV parsed
into stall reasons (bench/ncu_stalls.py), and, in --smoke mode, each section's JSON fields."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A hand-made sample of `ncu --csv --page raw` output, written from the format Nsight Compute documents (a header row
# of metric names, a row of their units with empty identity cells, one row per profiled kernel), with the ==PROF==
# lines ncu prints around it: not captured from a GPU. Its numbers are invented for the parser, not measurements.
NCU_RAW_SAMPLE = """==PROF== Connected to process 4242 (/usr/bin/python3)
==PROF== Profiling "_decode_split_kernel": 0%....50%....100% - 40 passes
==PROF== Profiling "_merge_kernel": 0%....50%....100% - 40 passes
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","dram__bytes.sum.per_second","dram__throughput.avg.pct_of_peak_sustained_elapsed","gpu__time_duration.sum","launch__registers_per_thread","sm__maximum_warps_per_active_cycle_pct","sm__warps_active.avg.pct_of_peak_sustained_active","smsp__average_warp_latency_per_inst_issued.ratio","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio","smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio","smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"
"","","","","","","","","","","","Tbyte/second","%","usecond","register/thread","%","%","cycle","inst","inst","inst","inst","inst","inst"
"0","4242","python3","127.0.0.1","_decode_split_kernel","1","7","(128, 1, 1)","(17, 64, 1)","0","9.0","1.21","25.34","1,412.86","168","18.75","17.02","31.40","1.10","12.50","0.00","2.20","4.70","3.30"
"1","4242","python3","127.0.0.1","_merge_kernel","1","7","(64, 1, 1)","(64, 1, 1)","0","9.0","0.05","1.10","6.14","40","100","11.20","9.80","0.00","3.10","0.00","0.00","0.40","2.20"
"""


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return module


def test_ncu_raw_csv_parsed_into_stall_reasons():
    ncu = _bench("ncu_stalls")
    kernels = ncu.parse_raw_csv(NCU_RAW_SAMPLE)
    assert [k["kernel"] for k in kernels] == ["_decode_split_kernel", "_merge_kernel"]
    assert kernels[0]["values"]["gpu__time_duration.sum"] == 1412.86  # the thousands separator read
    assert kernels[0]["units"]["gpu__time_duration.sum"] == "usecond"
    report = ncu.report_from_csv(NCU_RAW_SAMPLE)
    decode = report["decode"]
    assert decode is report["kernels"][0] and decode["kernel"] == "_decode_split_kernel"
    assert decode["top_stalls"] == ["long_scoreboard", "short_scoreboard", "wait", "not_selected", "barrier"]
    assert decode["stalls"][0] == {"reason": "long_scoreboard", "cycles_per_issue": 12.5, "share": 12.5 / 23.8}
    assert decode["achieved_occupancy_pct"] == 17.02 and decode["theoretical_occupancy_pct"] == 18.75
    assert decode["dram_throughput_pct"] == 25.34 and decode["dram_gb_s"] == pytest.approx(1210.0)
    assert decode["duration_s"] == pytest.approx(1412.86e-6) and decode["registers_per_thread"] == 168.0
    assert report["kernels"][1]["top_stalls"] == ["long_scoreboard", "wait", "short_scoreboard"]  # zeros left out


def test_ncu_output_without_csv_is_an_error():
    ncu = _bench("ncu_stalls")
    with pytest.raises(ValueError, match="no ncu CSV"):
        ncu.parse_raw_csv("==ERROR== the application returned an error code (1)\n")


def test_ncu_command_asks_for_the_sections_and_every_stall_reason():
    ncu = _bench("ncu_stalls")
    cmd = ncu.ncu_command("/usr/local/cuda/bin/ncu", ["python3", "target.py"])
    assert cmd[:5] == ["/usr/local/cuda/bin/ncu", "--csv", "--page", "raw", "--profile-from-start"]
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--section"] == list(ncu.SECTIONS)
    metrics = cmd[cmd.index("--metrics") + 1].split(",")
    assert "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio" in metrics
    assert set(ncu.METRICS.values()) <= set(metrics) and cmd[-2:] == ["python3", "target.py"]


@pytest.mark.triton
def test_ncu_stalls_smoke_without_ncu(tmp_path):
    """On a machine without ncu the JSON says so, and the profiled program still runs (interpreted, tiny)."""
    out = tmp_path / "ncu.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PATH="/usr/bin:/bin")
    cmd = [sys.executable, str(ROOT / "bench" / "ncu_stalls.py"), "--smoke", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    report = json.loads(out.read_text())
    if report["ncu"] is not None:
        pytest.skip(f"ncu is installed here ({report['ncu']})")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["absent"].startswith("ncu is not on PATH") and report["target_exit_status"] == 0


def test_each_layers_cache_is_made_on_the_device_of_its_keys():
    """A model split across devices hands each layer's keys on that layer's device: the layer's buffers (and the
    lengths a kernel reads) are made there ('meta' stands in for a second device)."""
    import torch

    from kvdemo.cache import QuantizedKVCache

    cache = QuantizedKVCache("int4:g32:r32", num_layers=2)
    for i, device in enumerate(("cpu", "meta")):
        keys = torch.randn(1, 2, 8, 64, device=device)
        cache.update(keys, keys.clone(), i)
    devices = [
        (layer.device.type, layer.keys.sinks.device.type, layer.values.residual.data.device.type)
        for layer in cache.layers
    ]
    assert devices == [("cpu", "cpu", "cpu"), ("meta", "meta", "meta")]


@pytest.mark.triton
def test_e2e_and_split_sections_smoke(tmp_path):
    """--smoke: the end-to-end rows at batch 2 (one cache for both sequences) with the headroom formula's bytes and
    the memory floor beside tokens/s, and the split rows (2 layers, cpu/cpu: the split's code path) with the same
    tokens as on one device and each layer's cache on its layer's device. Graph steps fall back to eager here."""
    out = tmp_path / "e2e.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    env.pop("KVDEMO_BACKEND", None)
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_attention.py"), "--smoke", "--sections", "e2e,split"]
    cmd += ["--models", "random:smollm2-135m", "--e2e-batches", "2", "--e2e-precisions", "full,int4"]
    cmd += ["--e2e-backends", "torch,hf-static", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "errors" not in report and list(report["section_s"]) == ["e2e", "split"]
    rows = report["e2e"]
    assert [(r["precision"], r["backend"]) for r in rows] == [
        ("full", "torch"),
        ("int4:g32:r32", "torch"),
        ("full", "hf-static"),
    ]
    for r in rows:
        assert r["batch"] == 2 and r["prompt_tokens"] == 48 and r["new_tokens"] == 2 and r["decode_tok_s"] > 0
        assert r["predicted_bytes"] > 0 and r["floor_tok_s"] > 0 and r["fraction_of_floor"] > 0
        assert r["same_tokens_across_backends"] is True
    full, int4, _ = rows
    assert int4["predicted_bytes"] < full["predicted_bytes"] and int4["cache_bytes"] < full["cache_bytes"]
    assert full["graph_steps"]["replayed"] == 0 and full["graph_blocker"]  # no CUDA: eager steps, and why
    assert set(report["goals"]) >= {"int4_over_full_8b_32k_b8", "tok_s_135m_best"}
    assert all(g["met"] is None for g in report["goals"].values())  # never judged from a smoke run
    split = report["split"]
    assert [r["precision"] for r in split] == ["full", "int4:g32:r32"]
    for r in split:
        assert r["layer_devices"] == r["cache_devices"] == ["cpu", "cpu"]
        assert r["same_tokens"] is True and len(r["tokens_split"]) == 16
