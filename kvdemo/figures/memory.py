"""Memory and concurrency headroom: figures of `kvdemo.memory.headroom` results and of the measured headroom rows (`kvdemo.measured.measure_headroom`)."""

import plotly.graph_objects as go

from . import set_title

_HEADROOM_GB = 1e9
_HEADROOM_SPLIT = (("weights", "weights"), ("kv", "KV cache"), ("reserve", "reserve"), ("free", "unused"))


def headroom_memory_figure(out: dict) -> go.Figure:
    """Memory of weights + reserve + `users` sequences (GB, all GPUs) vs context, one line per KV precision,
    with the GPU budget and the weights + reserve floor as dashed lines and the chosen context marked."""
    curve = out["curve"]
    xs = curve["context"]
    fig = go.Figure()
    for label, ys in curve["gb"].items():
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="lines",
                name=label,
                hovertemplate="%{x:,} tokens: %{y:.1f} GB<extra>" + label + "</extra>",
            )
        )
    budget = curve["budget_gb"]
    floor = curve["weights_gb"] + curve["reserve_gb"]
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
    fig.add_vline(x=out["context"], line_dash="dot", line_color="gray", annotation_text=f"{out['context']:,} tokens")
    if curve["max_context"] < xs[-1]:
        fig.add_vline(x=curve["max_context"], line_color="red", annotation_text="model max context")
    users = curve["users"]
    set_title(
        fig,
        f"{out['model']['display_name']} on {out['gpus']} x {out['gpu_info']['display_name']}: "
        f"memory for {users} sequence{'s' if users > 1 else ''} vs context",
        xaxis_title="context (tokens)",
        yaxis_title="GPU memory (GB, all GPUs)",
        legend_title="KV precision",
    )
    return fig


def headroom_concurrency_figure(out: dict) -> go.Figure:
    """Max concurrent sequences at the chosen context, one bar per KV precision (zero bars carry the reason)."""
    labels = list(out["max_sequences"])
    counts = [out["max_sequences"][k] for k in labels]
    ratios = [out["sequences_vs_16bit"][k] for k in labels]
    text = [f"{n:,}" + (f" ({r:.2f}x)" if r is not None else "") for n, r in zip(counts, ratios, strict=True)]
    hover = [out["reason"][k] or f"{out['concurrency'][k]:.2f} sequences of {out['context']:,} tokens" for k in labels]
    fig = go.Figure(
        go.Bar(x=labels, y=counts, text=text, textposition="outside", hovertext=hover, name="max sequences")
    )
    set_title(
        fig,
        f"Concurrent {out['context']:,}-token sequences: {out['model']['display_name']}, "
        f"{out['gpus']} x {out['gpu_info']['display_name']}, {out['weight_bits']}-bit weights",
        xaxis_title="KV precision",
        yaxis_title="max concurrent sequences",
    )
    return fig


def headroom_split_figure(out: dict) -> go.Figure:
    """Memory split at the max sequence count (GB, all GPUs): weights / KV / reserve / unused, stacked per precision."""
    labels = list(out["split"])
    fig = go.Figure()
    for key, name in _HEADROOM_SPLIT:
        values = [out["split"][k][key] / _HEADROOM_GB for k in labels]
        fig.add_trace(go.Bar(y=labels, x=values, name=name, orientation="h", hovertemplate="%{x:.1f} GB"))
    over = [out["split"][k]["over"] / _HEADROOM_GB for k in labels]
    if any(over):
        fig.add_trace(go.Bar(y=labels, x=over, name="over budget", orientation="h", marker_color="red"))
    set_title(
        fig,
        f"Memory split: {out['gpus']} x {out['gpu_info']['display_name']} ({out['budget_bytes'] / _HEADROOM_GB:.0f} GB)",
        barmode="stack",
        xaxis_title="GB (all GPUs)",
        yaxis_title="KV precision",
    )
    return fig


def headroom_stacking_figure(out: dict) -> go.Figure:
    """Max concurrent sequences for every weight bits x KV precision pair (the "stacking" table) as a heatmap."""
    labels = list(out["stacking"])
    bits = list(next(iter(out["stacking"].values())))
    z = [[out["stacking"][k][b] for b in bits] for k in labels]
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
        f"Stacking weight and KV precision: concurrent {out['context']:,}-token sequences",
        yaxis_title="KV precision",
    )
    return fig


def headroom_measured_figure(rows: list[dict]) -> go.Figure:
    """Sequences admitted into the budget (real caches) beside the formula's count, per KV precision."""
    labels = [r["precision"] for r in rows]
    fig = go.Figure()
    for name, field in (("measured (real caches)", "measured_max_sequences"), ("formula", "max_sequences")):
        counts = [r[field] for r in rows]
        fig.add_trace(go.Bar(x=labels, y=counts, name=name, text=[f"{n:,}" for n in counts], textposition="outside"))
    first = rows[0] if rows else {"context": 0, "budget_bytes": 0}
    set_title(
        fig,
        f"Sequences of {first['context']:,} tokens in {first['budget_bytes'] / _HEADROOM_GB:,.3g} GB: measured vs "
        "formula",
        barmode="group",
        xaxis_title="KV precision",
        yaxis_title="sequences that fit",
    )
    return fig


def headroom_batch_speed_figure(rows: list[dict]) -> go.Figure:
    """Decode tokens/s (all sequences of the batch together) against batch size, one line per precision."""
    fig = go.Figure()
    for r in rows:
        speeds = r["tokens_per_s"]
        fig.add_trace(
            go.Scatter(
                x=[s["batch"] for s in speeds],
                y=[s["tokens_per_s"] for s in speeds],
                mode="lines+markers",
                name=r["precision"],
            )
        )
    set_title(
        fig, "Decode tokens/s vs batch size (measured)", xaxis_title="batch size (sequences)", yaxis_title="tokens/s"
    )
    fig.update_xaxes(type="log", dtick=0.30103)  # powers of two
    return fig
