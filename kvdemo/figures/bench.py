"""The benchmark against transformers' QuantizedCache: figures of its report (`kvdemo.results.bench.BenchReport`).
llama.cpp's rows are hatched, and their hover names the row they are read against (llama.cpp's f16 row)."""

import plotly.graph_objects as go

from ..results.bench import BenchReport
from . import set_title


def _engine_marks(report: BenchReport) -> dict:
    """Bar styling that sets llama.cpp's rows apart: a hatch on them, each row's baseline for the hover."""
    return {
        "marker_pattern_shape": ["/" if r.engine == "llama.cpp" else "" for r in report.results],
        "customdata": [r.baseline for r in report.results],
    }


def _titled(report: BenchReport, title: str) -> str:
    if any(r.engine == "llama.cpp" for r in report.results):
        return f"{title} (hatched: llama.cpp's rows, read against llama.cpp:f16)"
    return title


def _bench_bars(report: BenchReport, metric: str, keys: list, key_label: str, title: str, yaxis: str) -> go.Figure:
    """Grouped bars: one group per contender, one bar per size (`keys`) of the contender's `metric` map."""
    names = [r.contender for r in report.results]
    fig = go.Figure()
    for key in keys:
        ys = [getattr(r, metric).get(str(key)) for r in report.results]
        fig.add_trace(
            go.Bar(
                x=names,
                y=ys,
                name=f"{key_label} {key}",
                hovertemplate="%{x}: %{y:.4g} (against %{customdata})<extra>" + f"{key_label} {key}" + "</extra>",
                **_engine_marks(report),
            )
        )
    set_title(fig, _titled(report, title), barmode="group", yaxis_title=yaxis, xaxis_title="contender")
    return fig


def bench_memory_figure(report: BenchReport) -> go.Figure:
    """Cache memory ratio vs a 16-bit cache, per contender and context length."""
    fig = _bench_bars(
        report, "ratio_vs_fp16", list(report.sizes.contexts), "tokens", "KV cache: x smaller than fp16", "ratio"
    )
    fig.add_hline(y=1.0, line_dash="dash", line_color="gray")
    return fig


def bench_ppl_figure(report: BenchReport) -> go.Figure:
    """Perplexity change vs full precision (%), per contender and text length."""
    return _bench_bars(
        report,
        "ppl_delta_pct",
        list(report.sizes.ppl_lengths),
        "tokens",
        "Held-out perplexity vs full precision",
        "perplexity change (%)",
    )


def bench_speed_figure(report: BenchReport) -> go.Figure:
    """Warm decode tokens/s, per contender and context length."""
    return _bench_bars(
        report, "decode_tok_s", list(report.sizes.contexts), "context", "Decode speed (warm, median round)", "tokens/s"
    )


def bench_needle_figure(report: BenchReport) -> go.Figure:
    """Teacher-forced log-prob of the pass key: one bar group per contender, one bar per grid cell."""
    fig = go.Figure()
    rows = report.results
    names = [r.contender for r in rows]
    cells = rows[0].needle.cells if rows else []
    for i, cell in enumerate(cells):
        label = f"{cell.length} tokens, depth {cell.depth}%"
        fig.add_trace(
            go.Bar(
                x=names,
                y=[r.needle.cells[i].logprob for r in rows],
                name=label,
                hovertemplate="%{x}: %{y:.3f} nats (against %{customdata})<extra>" + label + "</extra>",
                **_engine_marks(report),
            )
        )
    set_title(
        fig,
        _titled(report, "Pass key log-probability (higher is better, 0 = certain)"),
        barmode="group",
        yaxis_title="log-prob (nats)",
        xaxis_title="contender",
    )
    return fig


def bench_figures(report: BenchReport) -> list[go.Figure]:
    """Every bench figure, in page order."""
    return [
        bench_memory_figure(report),
        bench_ppl_figure(report),
        bench_speed_figure(report),
        bench_needle_figure(report),
    ]
