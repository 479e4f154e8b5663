"""Perplexity: figures of a perplexity report (`kvdemo.results.ppl.PplReport`) and of the methods ablation
(`kvdemo.results.ablation.AblationReport`)."""

import plotly.graph_objects as go

from ..results.ablation import AblationReport
from ..results.ppl import PplReport, PplRow, interval_text
from . import set_title


def ablation_frontier_figure(report: AblationReport) -> go.Figure:
    """The ablation as a frontier: logit KL vs full precision (log axis) against bits/element, one line per
    method through its 4-, 3- and 2-bit cells; lower left is better."""
    fig = go.Figure()
    for col in report.columns:
        cells = [row.cells[col] for row in report.rows if row.cells[col] is not None]
        fig.add_trace(
            go.Scatter(
                x=[r.bits_per_element for r in cells],
                y=[r.logit_kl for r in cells],
                mode="lines+markers",
                name=col,
                text=[_delta_hover(r) for r in cells],
                hovertemplate="%{text}<br>%{x:.2f} bits/element, KL %{y:.3g}<extra>" + col + "</extra>",
            )
        )
    set_title(
        fig,
        f"KV methods on {report.ppl.model}: logit KL vs full precision against bits per element (lower left is better)",
        72,
        xaxis_title="bits per element (16-bit basis)",
        yaxis_title="logit KL vs full precision (nats)",
        yaxis_type="log",
    )
    return fig


def _delta_hover(row: PplRow) -> str:
    """A row's precision and perplexity delta, with its 95% interval when the row has one."""
    ci = row.delta_vs_full_ci95
    interval = "" if ci is None else f" (95%: {interval_text(ci)})"
    return f"{row.precision}<br>ppl delta {row.delta_vs_full:+.3f}{interval}"


def ppl_frontier_figure(report: PplReport) -> go.Figure:
    """The report's quantized precisions: logit KL vs full precision (log axis, 95% interval as error bars where
    the report has it) against bits per element, one labelled point each; lower left is better."""
    rows = [r for r in report.results if r.precision != "full"]
    low = [r.logit_kl - r.logit_kl_ci95[0] if r.logit_kl_ci95 else 0.0 for r in rows]
    high = [r.logit_kl_ci95[1] - r.logit_kl if r.logit_kl_ci95 else 0.0 for r in rows]
    fig = go.Figure(
        go.Scatter(
            x=[r.bits_per_element for r in rows],
            y=[r.logit_kl for r in rows],
            error_y={"type": "data", "symmetric": False, "array": high, "arrayminus": low},
            mode="markers+text",
            text=[r.precision for r in rows],
            textposition="top center",
            customdata=[_delta_hover(r) for r in rows],
            hovertemplate="%{customdata}<br>%{x:.2f} bits/element, KL %{y:.3g}<extra></extra>",
            showlegend=False,
        )
    )
    set_title(
        fig,
        f"{report.text_name} on {report.model}: logit KL vs full precision against bits per element (lower left "
        "is better)",
        72,
        xaxis_title="bits per element (16-bit basis)",
        yaxis_title="logit KL vs full precision (nats)",
        yaxis_type="log",
    )
    return fig
