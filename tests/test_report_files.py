"""The shipped reports of perplexity, the benchmark and memory (assets/reports/) read back into their dataclasses
and write the same JSON: `X.from_json(d).to_json() == d`, key order included, so what the CLI writes today is what
it wrote when they were measured."""

import json
from pathlib import Path

import pytest

from kvdemo.configs import get_gpu, get_model_config
from kvdemo.memory import headroom
from kvdemo.results.ablation import AblationReport, load_ablation
from kvdemo.results.bench import BenchReport, BenchSizes
from kvdemo.results.headroom import Headroom
from kvdemo.results.kv_split import KvSplitReport, load_kv_split
from kvdemo.results.measured import MeasuredHeadroom, MemoryReport, ScaleReport
from kvdemo.results.ppl import PplReport

REPORTS = Path(__file__).resolve().parent.parent / "assets" / "reports"


@pytest.mark.parametrize(
    "name, kind",
    [
        ("ppl.json", PplReport),
        ("ppl_oracle_codebooks.json", PplReport),
        ("ablation.json", AblationReport),
        ("ppl_kv_split.json", KvSplitReport),
        ("bench.json", BenchReport),
        ("bench_llamacpp.json", BenchReport),
        ("memory.json", MemoryReport),
        ("headroom_measured.json", MeasuredHeadroom),
        ("scale.json", ScaleReport),
    ],
)
def test_shipped_report_round_trips(name, kind):
    d = json.loads((REPORTS / name).read_text())
    back = kind.from_json(d).to_json()
    assert back == d
    assert list(back) == list(d)  # the same keys in the same order: the file writes back as it was


def test_the_typed_reports_hold_typed_rows():
    ablation, split = load_ablation(), load_kv_split()
    assert ablation.ppl.results[0].precision == "full" and ablation.ppl.blocks.size == 64
    assert ablation.rows[2].cells["NVFP4"] is None and ablation.rows[0].cells["NVFP4"].precision == "nvfp4"
    assert ablation.memory.results[0].formula_bytes == ablation.memory.results[0].bytes
    assert split.splits[0].comparisons[0].role == "keys alone"
    bench = BenchReport.from_json(json.loads((REPORTS / "bench.json").read_text()))
    assert bench.sizes == BenchSizes() and bench.rows()["kvdemo-int4"].needle.cells[0].length == 1024
    assert load_ablation(REPORTS / "missing.json") is None and load_kv_split(REPORTS / "missing.json") is None


def test_a_headroom_plan_round_trips():
    plan = headroom(get_model_config("llama-3.1-70b"), get_gpu("h100-80gb"), ["full", "int8", "int4"], 100_000, gpus=4)
    d = plan.to_json()
    assert Headroom.from_json(d) == plan and Headroom.from_json(d).to_json() == d
    assert d["max_sequences"] == {p.label: p.max_sequences for p in plan.precisions}  # one map per figure, as ever
    assert list(d)[-3:] == ["production", "warnings", "curve"]
