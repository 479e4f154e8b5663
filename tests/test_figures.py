"""Figures read back from their data: every needle panel shows each depth on the same row as the rows it
was built from, cells where full precision missed are marked, and long titles wrap."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvdemo import configs, memory
from kvdemo.figures.memory import (
    headroom_concurrency_figure,
    headroom_memory_figure,
    headroom_split_figure,
    headroom_stacking_figure,
)
from kvdemo.figures.needle import FULL_MISSED, full_missed_cells, needle_difference_figure, needle_heatmap_figure
from kvdemo.figures.ppl import ablation_frontier_figure
from kvdemo.results import ablation
from kvdemo.results.headroom import Headroom
from kvdemo.results.needle import NeedleGrid, NeedleRow

LENGTHS = [1000, 2000]
DEPTHS = [10.0, 50.0, 90.0]
PRECISIONS = ["full", "int8", "int4", "int2"]
MAX_TITLE_CHARS = 60  # a half-width chart at the default page width shows about this many


def _rows() -> list[NeedleRow]:
    """A grid whose every (precision, length, depth) cell has its own log-prob; full misses depth 90."""
    rows = []
    for p, label in enumerate(PRECISIONS):
        for n in LENGTHS:
            for d in DEPTHS:
                correct = not (d == 90.0 or (label == "int2" and d == 10.0))
                logprob = -(p + 1) - d / 100 - n / 10_000
                rows.append(
                    NeedleRow(n, d, label, "", correct, logprob, "12345", "passkey", "", n, d, 0, 5, 5, "eos", 0, 0, 0)
                )
    return rows


def _result() -> NeedleGrid:
    return NeedleGrid("m", "passkey", "filler", 0, LENGTHS, DEPTHS, PRECISIONS, _rows(), 1.0)


def displayed_rows(fig, trace) -> list[str]:
    """The y labels of a heatmap trace from the top of its panel down, as plotly draws them: categories in
    the axis's `categoryarray` order (or the trace's), bottom up unless the axis is reversed."""
    axis = fig.layout["yaxis" + trace.yaxis[1:]]
    order = list(axis.categoryarray) if axis.categoryorder == "array" else list(trace.y)
    return order if axis.autorange == "reversed" else order[::-1]


def _row_value(rows, label, n, depth, value):
    (row,) = [r for r in rows if r.precision == label and r.length == n and r.depth == depth]
    return float(row.correct) if value == "correct" else row.answer_logprob


@pytest.mark.parametrize("value", ["correct", "answer_logprob"])
def test_needle_heatmap_panels_put_each_depth_on_the_same_row(value):
    rows = _rows()
    fig = needle_heatmap_figure(_result(), value=value)
    assert len(fig.data) == len(PRECISIONS)
    for label, trace in zip(PRECISIONS, fig.data, strict=True):
        top_down = displayed_rows(fig, trace)
        assert top_down == ["10%", "50%", "90%"], (label, top_down)  # depth 0 at the top in every panel
        for shown in top_down:
            z = trace.z[list(trace.y).index(shown)]
            depth = float(shown.rstrip("%"))
            assert list(z) == [_row_value(rows, label, n, depth, value) for n in LENGTHS], (label, shown)


def test_needle_difference_panels_put_each_depth_on_the_same_row():
    rows = _rows()
    fig = needle_difference_figure(_result())
    assert len(fig.data) == len(PRECISIONS) - 1
    for label, trace in zip(PRECISIONS[1:], fig.data, strict=True):
        top_down = displayed_rows(fig, trace)
        assert top_down == ["10%", "50%", "90%"], (label, top_down)
        for shown in top_down:
            depth = float(shown.rstrip("%"))
            want = [
                _row_value(rows, label, n, depth, "answer_logprob")
                - _row_value(rows, "full", n, depth, "answer_logprob")
                for n in LENGTHS
            ]
            got = trace.z[list(trace.y).index(shown)]
            assert all(math.isclose(a, b) for a, b in zip(got, want, strict=True)), (label, shown)


def test_cells_where_full_precision_missed_are_marked():
    result = _result()
    assert full_missed_cells(result.rows) == {(n, 90.0): 1 for n in LENGTHS}  # one run per cell
    for fig in (needle_heatmap_figure(result), needle_difference_figure(result)):
        for trace in fig.data:
            for depth, texts in zip(trace.y, trace.text, strict=True):
                marked = [FULL_MISSED in t for t in texts]
                assert marked == [depth == "90%"] * len(LENGTHS), (trace.name, depth, texts)


def test_llamacpp_rows_are_read_against_llamacpps_own_f16_row():
    """A grid with kvdemo's rows and llama.cpp's: the difference map draws int4 - full and llama.cpp:q4_0 -
    llama.cpp:f16, each heatmap panel marks where its own engine's full row missed, llama.cpp's lines are dashed."""
    from kvdemo.figures.needle import compared, needle_logprob_figure

    labels = ["full", "int4", "llama.cpp:f16", "llama.cpp:q4_0"]
    rows = []
    for p, label in enumerate(labels):
        for n in LENGTHS:
            correct = not (label == "full" and n == 1000) and not (label == "llama.cpp:f16" and n == 2000)
            rows.append(NeedleRow(n, 50.0, label, "", correct, -(p + 1) - n / 10_000, "12345", "passkey", "", n, 50.0,
                                  0, 5, 5, "eos", 0, 0, 0))  # fmt: skip
    grid = NeedleGrid("m", "passkey", "filler", 0, LENGTHS, [50.0], labels, rows, 1.0)
    assert compared(grid) == {"int4": "full", "llama.cpp:q4_0": "llama.cpp:f16"}
    diff = needle_difference_figure(grid)
    assert [list(t.z[0]) for t in diff.data] == [[pytest.approx(-1.0)] * 2, [pytest.approx(-1.0)] * 2]
    assert "each engine's full row" in diff.layout.title.text
    assert [[FULL_MISSED in t for t in trace.text[0]] for trace in diff.data] == [[True, False], [False, True]]
    heat = needle_heatmap_figure(grid)
    assert [[FULL_MISSED in t for t in trace.text[0]] for trace in heat.data][1::2] == [[True, False], [False, True]]
    assert [t.line.dash for t in needle_logprob_figure(grid).data] == [None, None, "dash", "dash"]


def test_needle_heatmap_of_a_shipped_grid_reads_its_found_rates():
    """The typed grid of assets/reports/needle_passkey_repeats.json: each heatmap cell is that cell's found rate
    over its ten seeds, labelled found/runs."""
    from kvdemo.results.needle import load_grid

    grid = load_grid(Path(__file__).resolve().parent.parent / "assets" / "reports" / "needle_passkey_repeats.json")
    fig = needle_heatmap_figure(grid)
    assert [t.name for t in fig.data] == [None] * len(grid.precisions)  # panels are titled, not traces
    for label, trace in zip(grid.precisions, fig.data, strict=True):
        for i, depth in enumerate(grid.depths):
            for j, n in enumerate(grid.lengths):
                runs = [r for r in grid.rows if (r.precision, r.length, r.depth) == (label, n, depth)]
                assert len(runs) == grid.repeats
                assert trace.z[i][j] == pytest.approx(sum(r.correct for r in runs) / len(runs))
                assert trace.text[i][j].startswith(f"{sum(r.correct for r in runs)}/{len(runs)}<br>")


def _headroom() -> Headroom:
    cfg = configs.get_model_config("llama-3.1-70b")
    gpu = configs.get_gpu("h100-80gb")
    return memory.headroom(cfg, gpu, ["full", "fp8", "int8", "k8v4", "int4", "int2"], context=100_000, gpus=4)


def test_long_chart_titles_wrap():
    out = _headroom()
    figs = [
        headroom_memory_figure(out),
        headroom_concurrency_figure(out),
        headroom_split_figure(out),
        headroom_stacking_figure(out),
    ]
    for fig in figs:
        text = fig.layout.title.text
        lines = text.split("<br>")
        assert all(len(line) <= MAX_TITLE_CHARS for line in lines), text
        assert fig.layout.margin.t >= 40 + 24 * len(lines), text  # room above the plot for every line
    assert any("<br>" in fig.layout.title.text for fig in figs)  # these titles are long: they did wrap


def test_ablation_frontier_reads_back_every_cell_of_the_shipped_report():
    """One line per method through its cells (NVFP4: the 4-bit one only), each point at the cell's bits/element
    and KL, its hover the precision, delta and the delta's 95% interval; the table rows say the same."""
    report = ablation.load_ablation()
    fig = ablation_frontier_figure(report)
    assert [t.name for t in fig.data] == report.columns and fig.layout.yaxis.type == "log"
    cells = {r.precision: r for r in report.ppl.results}
    for trace in fig.data:
        for x, y, text in zip(trace.x, trace.y, trace.text, strict=True):
            r = cells[text.split("<br>")[0]]
            assert (x, y) == (r.bits_per_element, r.logit_kl)
            low, high = r.delta_vs_full_ci95
            assert f"ppl delta {r.delta_vs_full:+.3f} (95%: {low:+.3f} .. {high:+.3f})" in text
    assert len(fig.data[report.columns.index("NVFP4")].x) == 1
    rows = ablation.cell_rows(report)
    assert len(rows) == sum(len(t.x) for t in fig.data) == len(report.ppl.results) - 1  # every cell, not full
    claims = ablation.claim_rows(report)
    assert [c["over resampled text"] for c in claims] == [c.verdict for c in report.checks]
    costs = ablation.cost_rows(report)
    assert [c["precision"] for c in costs] == [
        "int4",
        "nuq4:o1",
        "nuq3:o1",
        "nuq2:o1",
        "nuq2:o1:s1",
        "int3",
        "nvfp4",
        "nuq4",
        "int4:hadamard",
    ]
    assert costs[-1]["bits/element"] is None and costs[-1]["decode vs int4"] == report.decode.results[-2].vs_first


# --- one palette, plain log ticks, readable column names ----------------------------------------------
def _drift_report():
    import json

    from kvdemo.results.drift import DriftReport

    path = Path(__file__).resolve().parent.parent / "assets" / "reports" / "drift.json"
    return DriftReport.from_json(json.loads(path.read_text()))


def test_drift_figures_give_each_format_its_own_colour_from_the_one_palette():
    from kvdemo.figures import PALETTE, format_colors
    from kvdemo.figures.drift import drift_layer_figure, drift_logit_kl_figure, drift_position_figure

    report = _drift_report()
    labels = [r.precision for r in report.results]
    assert {"int2", "int8"} <= set(labels)
    for make in (drift_layer_figure, drift_logit_kl_figure, drift_position_figure):
        colors = {t.name: t.line.color for t in make(report).data}
        assert len(set(colors.values())) == len(colors) == len(labels), colors  # int2 and int8 apart
        assert set(colors.values()) <= set(PALETTE) and colors["int2"] != colors["int8"]
    # a preset keeps its colour across charts; variants take free colours, never a preset's of the same chart
    a, b = format_colors(["int8", "int2"]), format_colors(["int2", "int4:s4", "int4", "int8"])
    assert a["int2"] == b["int2"] and a["int8"] == b["int8"]
    assert len(set(b.values())) == 4


def test_log_axes_use_powers_of_ten_never_si_prefixes():
    from kvdemo.figures.drift import drift_layer_figure, drift_logit_kl_figure, drift_position_figure

    report = _drift_report()
    figures = [drift_layer_figure(report), drift_logit_kl_figure(report), drift_position_figure(report)]
    shipped = ablation.load_ablation()
    if shipped is not None:
        figures.append(ablation_frontier_figure(shipped))
    for fig in figures:
        logs = [ax for ax in (fig.layout.xaxis, fig.layout.yaxis) if ax.type == "log"]
        assert logs and all(ax.exponentformat == "power" for ax in logs), fig.layout.title.text


def test_page_tables_show_readable_column_names():
    from kvdemo.results.labels import label, readable
    from kvdemo.results.needle import summarize

    rows = readable(summarize(_rows()))
    assert "mean log p(answer)" in rows[0] and "found, 95% low" in rows[0]
    assert not [k for r in rows for k in r if "_" in k]
    assert label("precision") == "precision" and label("answer_logprob") == "log p(answer)"
