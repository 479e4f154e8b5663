"""Memory and concurrency headroom: figures of a headroom plan (`kvdemo.results.headroom.Headroom`) and of the
headroom measured with real caches (`kvdemo.results.measured.MeasuredHeadroom`)."""

import plotly.graph_objects as go

from ..results.headroom import Headroom
from ..results.measured import MeasuredHeadroom
from . import set_title

_HEADROOM_GB = 1e9
_HEADROOM_SPLIT = (("weights", "weights"), ("kv", "KV cache"), ("reserve", "reserve"), ("free", "unused"))


def headroom_memory_figure(out: Headroom) -> go.Figure:
    """Memory of weights + reserve + `users` sequences (GB, all GPUs) vs context, one line per KV precision,
    with the GPU budget and the weights + reserve floor as dashed lines and the chosen context marked."""
    curve = out.curve
    xs = curve.context
    fig = go.Figure()
    for label, ys in curve.gb.items():
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="lines",
                name=label,
                hovertemplate="%{x:,} tokens: %{y:.1f} GB<extra>" + label + "</extra>",
            )
        )
    budget = curve.budget_gb
    floor = curve.weights_gb + curve.reserve_gb
    fig.add_trace(
        go.Scatter(
            x=[xs[0], xs[-1]],
            y=[budget, budget],
            mode="lines",
            name="GPU budget",
            line={"dash": "dash", "color": "black"},
        )
    )
    fig.add_trace(
        go.Scatter(
            x=[xs[0], xs[-1]],
            y=[floor, floor],
            mode="lines",
            name="weights + reserve",
            line={"dash": "dot", "color": "gray"},
        )
    )
    fig.add_vline(x=out.context, line_dash="dot", line_color="gray", annotation_text=f"{out.context:,} tokens")
    if curve.max_context < xs[-1]:
        fig.add_vline(x=curve.max_context, line_color="red", annotation_text="model max context")
    users = curve.users
    set_title(
        fig,
        f"{out.model['display_name']} on {out.gpus} x {out.gpu_info['display_name']}: "
        f"memory for {users} sequence{'s' if users > 1 else ''} vs context",
        xaxis_title="context (tokens)",
        yaxis_title="GPU memory (GB, all GPUs)",
        legend_title="KV precision",
    )
    return fig


def headroom_concurrency_figure(out: Headroom) -> go.Figure:
    """Max concurrent sequences at the chosen context, one bar per KV precision (zero bars carry the reason)."""
    labels = [p.label for p in out.precisions]
    counts = [p.max_sequences for p in out.precisions]
    ratios = [p.sequences_vs_16bit for p in out.precisions]  # None where 16-bit fits none
    text = [f"{n:,}" + ("" if r is None else f" ({r:.2f}x)") for n, r in zip(counts, ratios, strict=True)]
    hover = [p.reason or f"{p.concurrency:.2f} sequences of {out.context:,} tokens" for p in out.precisions]
    fig = go.Figure(
        go.Bar(x=labels, y=counts, text=text, textposition="outside", hovertext=hover, name="max sequences")
    )
    set_title(
        fig,
        f"Concurrent {out.context:,}-token sequences: {out.model['display_name']}, "
        f"{out.gpus} x {out.gpu_info['display_name']}, {out.weight_bits}-bit weights",
        xaxis_title="KV precision",
        yaxis_title="max concurrent sequences",
    )
    return fig


def headroom_split_figure(out: Headroom) -> go.Figure:
    """Memory split at the max sequence count (GB, all GPUs): weights / KV / reserve / unused, stacked per precision."""
    labels = [p.label for p in out.precisions]
    fig = go.Figure()
    for key, name in _HEADROOM_SPLIT:
        values = [getattr(p.split, key) / _HEADROOM_GB for p in out.precisions]
        fig.add_trace(go.Bar(y=labels, x=values, name=name, orientation="h", hovertemplate="%{x:.1f} GB"))
    over = [p.split.over / _HEADROOM_GB for p in out.precisions]
    if any(over):
        fig.add_trace(go.Bar(y=labels, x=over, name="over budget", orientation="h", marker_color="red"))
    set_title(
        fig,
        f"Memory split: {out.gpus} x {out.gpu_info['display_name']} ({out.budget_bytes / _HEADROOM_GB:.0f} GB)",
        barmode="stack",
        xaxis_title="GB (all GPUs)",
        yaxis_title="KV precision",
    )
    return fig


def headroom_stacking_figure(out: Headroom) -> go.Figure:
    """Max concurrent sequences for every weight bits x KV precision pair (the "stacking" table) as a heatmap."""
    labels = [p.label for p in out.precisions]
    bits = list(out.precisions[0].stacking)
    z = [[p.stacking[b] for b in bits] for p in out.precisions]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[f"{b}-bit weights" for b in bits],
            y=labels,
            text=z,
            texttemplate="%{text:,}",
            colorscale="Blues",
            name="max sequences",
        )
    )
    set_title(
        fig,
        f"Stacking weight and KV precision: concurrent {out.context:,}-token sequences",
        yaxis_title="KV precision",
    )
    return fig


def headroom_measured_figure(report: MeasuredHeadroom) -> go.Figure:
    """Sequences admitted into the budget (real caches) beside the formula's count, per KV precision."""
    labels = [r.precision for r in report.results]
    fig = go.Figure()
    for name, field in (("measured (real caches)", "measured_max_sequences"), ("formula", "max_sequences")):
        counts = [getattr(r, field) for r in report.results]
        fig.add_trace(go.Bar(x=labels, y=counts, name=name, text=[f"{n:,}" for n in counts], textposition="outside"))
    set_title(
        fig,
        f"Sequences of {report.context:,} tokens in {report.budget_bytes / _HEADROOM_GB:,.3g} GB: measured vs formula",
        barmode="group",
        xaxis_title="KV precision",
        yaxis_title="sequences that fit",
    )
    return fig


def headroom_batch_speed_figure(report: MeasuredHeadroom) -> go.Figure:
    """Decode tokens/s (all sequences of the batch together) against batch size, one line per precision."""
    fig = go.Figure()
    for r in report.results:
        fig.add_trace(
            go.Scatter(
                x=[s.batch for s in r.tokens_per_s],
                y=[s.tokens_per_s for s in r.tokens_per_s],
                mode="lines+markers",
                name=r.precision,
            )
        )
    set_title(
        fig, "Decode tokens/s vs batch size (measured)", xaxis_title="batch size (sequences)", yaxis_title="tokens/s"
    )
    fig.update_xaxes(type="log", dtick=0.30103)  # powers of two
    return fig
