"""Attention-score drift: figures of a `DriftReport` (kvdemo/results/drift.py)."""

import plotly.graph_objects as go

from ..results.drift import DriftReport, PrecisionDrift
from . import format_colors, set_title


def drift_js_heatmap_figure(result: PrecisionDrift) -> go.Figure:
    """Layer x query-head heatmap of the mean Jensen-Shannon divergence for one precision of a report."""
    rows = result.per_layer
    z = [row["js_per_head"] for row in rows]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(range(len(z[0]) if z else 0)),
            y=[row["layer"] for row in rows],
            colorscale="Viridis",
            colorbar={"title": "JS (nats)"},
            hovertemplate="layer %{y}, head %{x}: JS %{z:.2e}<extra></extra>",
        )
    )
    set_title(
        fig,
        f"{result.precision}: attention JS divergence vs full precision (mean {result.mean_js:.2e})",
        xaxis_title="query head",
        yaxis_title="layer",
    )
    return fig


def drift_layer_figure(report: DriftReport) -> go.Figure:
    """Mean JS divergence of the attention distributions by layer, one line per precision (log scale)."""
    fig = go.Figure()
    colors = format_colors([r.precision for r in report.results])
    for r in report.results:
        fig.add_trace(
            go.Scatter(
                x=[row["layer"] for row in r.per_layer],
                y=[row["js"] for row in r.per_layer],
                mode="lines+markers",
                name=r.precision,
                line={"color": colors[r.precision]},
                hovertemplate="layer %{x}: JS %{y:.2e}<extra>" + r.precision + "</extra>",
            )
        )
    set_title(
        fig,
        "Attention drift by layer",
        xaxis_title="layer",
        yaxis_title="mean JS divergence (nats)",
        yaxis_type="log",
        legend_title="KV precision",
    )
    return fig


def drift_position_figure(report: DriftReport) -> go.Figure:
    """JS divergence per key vs key position (one line per precision, log scale): where the error sits.
    The sink tokens are the first bin; the dotted line marks where the full-precision residual begins."""
    fig = go.Figure()
    colors = format_colors([r.precision for r in report.results])
    for r in report.results:
        prof = r.position_profile
        fig.add_trace(
            go.Scatter(
                x=[(b["start"] + b["end"] - 1) / 2 for b in prof],
                y=[b["js_per_key"] for b in prof],
                customdata=[[b["start"], b["end"], 100 * b["js_share"], 100 * b["mass_full"]] for b in prof],
                mode="lines+markers",
                name=r.precision,
                line={"color": colors[r.precision]},
                hovertemplate="keys [%{customdata[0]}, %{customdata[1]}): JS/key %{y:.2e}, "
                "%{customdata[2]:.0f}% of JS, %{customdata[3]:.0f}% of attention<extra>" + r.precision + "</extra>",
            )
        )
    quantized = [r for r in report.results if r.spec["key_format"] != "full"]
    if quantized:
        recent = next(b for b in quantized[0].by_position if b["bin"] == "recent")
        fig.add_vline(x=recent["start"], line_dash="dot", line_color="gray", annotation_text="full-precision residual")
    set_title(
        fig,
        "Attention drift by key position",
        xaxis_title="key position (tokens)",
        yaxis_title="JS divergence per key (nats)",
        yaxis_type="log",
        legend_title="KV precision",
    )
    return fig


def drift_logit_kl_figure(report: DriftReport) -> go.Figure:
    """Next-token logit KL(full || quantized) for each generated (teacher-forced) token, per precision."""
    fig = go.Figure()
    colors = format_colors([r.precision for r in report.results])
    for r in report.results:
        fig.add_trace(
            go.Scatter(
                x=list(range(1, len(r.logit_kl) + 1)),
                y=r.logit_kl,
                mode="lines+markers",
                name=r.precision,
                line={"color": colors[r.precision]},
                hovertemplate="token %{x}: KL %{y:.2e}<extra>" + r.precision + "</extra>",
            )
        )
    set_title(
        fig,
        "Next-token logit KL along the generation",
        xaxis_title="generated token",
        yaxis_title="KL(full || quantized) (nats)",
        yaxis_type="log",
        legend_title="KV precision",
    )
    return fig
