"""Findings: one figure set per claim, large fonts for a projector. Each figure reads a `Findings` report:
the numbers its claim's verdict read (`Claim.data`), or the deltas of `kvdemo.results.findings`."""

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..results.findings import Findings, needle_deltas, tradeoff, window_deltas
from . import set_title

_FINDINGS_FONT = {"size": 16}


def _findings_layout(fig: go.Figure, title: str, **layout) -> go.Figure:
    set_title(fig, title, width=80, font=_FINDINGS_FONT, height=460, legend={"font": {"size": 14}}, **layout)
    return fig


def _data(found: Findings, claim_id: str) -> dict:
    """The numbers a claim's verdict read ({} when the claim was not judged)."""
    claim = found.claim(claim_id)
    return claim.data if claim is not None else {}


def findings_capacity_figure(found: Findings) -> go.Figure:
    """Claim 1: concurrent sequences per precision (bars, labelled with the multiplier vs 16-bit)."""
    cap = _data(found, "capacity").get("capacity", {})
    labels = list(cap.get("sequences", {}))
    seqs = [cap["sequences"][p] for p in labels]
    mult = [cap["multiplier"].get(p) for p in labels]
    fig = go.Figure(
        go.Bar(
            x=labels,
            y=seqs,
            text=[f"{m:.2f}x" if m is not None else "" for m in mult],
            textposition="outside",
            marker_color=["#888888" if p == "full" else "#1f77b4" for p in labels],
            hovertemplate="%{x}: %{y} sequences<extra></extra>",
        )
    )
    c = cap.get("config", {})
    return _findings_layout(
        fig,
        f"Concurrent sequences: {c.get('model_config', '?')} on {c.get('gpus', 1)} x {c.get('gpu', '?')}, "
        f"{int(c.get('context', 0)):,} tokens each (labels: x vs 16-bit)",
        yaxis_title="sequences that fit",
        xaxis_title="KV precision",
    )


def findings_position_figure(found: Findings) -> go.Figure:
    """Claim 2a: NLL delta vs full precision per position window of the held-out text, one line per precision."""
    fig = go.Figure()
    for label in found.precisions:
        rows = window_deltas(found, label) if label != "full" else []
        if rows:
            fig.add_trace(
                go.Scatter(
                    x=[(r["start"] + r["end"]) / 2 for r in rows],
                    y=[r["delta"] for r in rows],
                    mode="lines+markers",
                    name=label,
                    hovertemplate="tokens %{x:.0f}: %{y:+.4f} nats/token<extra>" + label + "</extra>",
                )
            )
    th = found.thresholds.get("nll_ok_nats")
    if th is not None:
        fig.add_hline(y=th, line_dash="dash", line_color="gray", annotation_text="pass threshold")
    return _findings_layout(
        fig,
        "Next-token NLL vs full precision by position in the text (every token attends over the stored cache)",
        xaxis={"title": "token position (window centre)", "type": "log"},
        yaxis_title="NLL delta, nats/token",
    )


def findings_needle_figure(found: Findings) -> go.Figure:
    """Claim 2b: needle answer log-prob delta vs full precision by prompt length, one line per precision."""
    fig = go.Figure()
    for label in found.precisions:
        rows = needle_deltas(found, label) if label != "full" else []
        if rows:
            fig.add_trace(
                go.Scatter(
                    x=[r["length"] for r in rows],
                    y=[r["delta"] for r in rows],
                    mode="lines+markers",
                    name=label,
                    hovertemplate="%{x} tokens: %{y:+.2f} nats<extra>" + label + "</extra>",
                )
            )
    th = found.thresholds.get("needle_ok_nats")
    if th is not None:
        fig.add_hline(y=-th, line_dash="dash", line_color="gray", annotation_text="pass threshold")
    return _findings_layout(
        fig,
        "Needle: log p(true answer) vs full precision by prompt length (needles near the start)",
        xaxis={"title": "prompt tokens", "type": "log"},
        yaxis_title="answer log-prob delta, nats",
    )


def _pair_bars(groups: list[tuple[str, dict]], measures: list[tuple[str, str]], title: str) -> go.Figure:
    """Bars side by side per measure (one panel each, its own scale): `groups` = [(label, {measure: value})]."""
    fig = make_subplots(rows=1, cols=len(measures), subplot_titles=[m[1] for m in measures])
    for col, (key, _) in enumerate(measures, start=1):
        fig.add_trace(
            go.Bar(
                x=[g[0] for g in groups],
                y=[g[1].get(key) for g in groups],
                marker_color=["#d62728", "#1f77b4", "#2ca02c", "#9467bd"][: len(groups)],
                showlegend=False,
                hovertemplate="%{x}: %{y:.4g}<extra></extra>",
            ),
            row=1,
            col=col,
        )
    return _findings_layout(fig, title)


def findings_keys_figure(found: Findings) -> go.Figure:
    """Claim 3: k4v8 vs k8v4 (vs k8v2) on logit KL, NLL delta and needle log-prob loss."""
    losses = _data(found, "keys").get("losses", {})
    groups = [(p, losses[p]) for p in ("k4v8", "k8v4", "k8v2") if p in losses]
    measures = [("kl", "logit KL (nats)"), ("nll", "NLL delta (nats/token)"), ("needle", "needle log p loss (nats)")]
    return _pair_bars(
        groups, measures, "4-bit keys (k4v8) vs 4-bit values (k8v4) and 2-bit values (k8v2): loss vs full"
    )


def findings_axis_figure(found: Findings) -> go.Figure:
    """Claim 4: per-channel vs per-token keys at 4 and 2 bits, NLL delta (bars)."""
    rows = _data(found, "axis").get("rows", [])
    fig = go.Figure()
    for axis, color in (("channel", "#1f77b4"), ("token", "#ff7f0e")):
        fig.add_trace(
            go.Bar(
                x=[f"{r['bits']}-bit" for r in rows],
                y=[r[f"nll_{axis}"] for r in rows],
                name=f"keys per {axis}",
                marker_color=color,
                hovertemplate="%{x}: %{y:+.4f} nats/token<extra>per " + axis + "</extra>",
            )
        )
    return _findings_layout(
        fig, "Keys per channel vs per token: NLL delta vs full", barmode="group", yaxis_title="NLL delta, nats/token"
    )


def findings_sinks_figure(found: Findings) -> go.Figure:
    """Claim 5: int2 without / with sinks, residual 32 / 128 (NLL delta bars)."""
    rows = _data(found, "sinks").get("rows", [])
    x, y, colors = [], [], []
    for r in rows:
        x += [r["without"], r["with"]]
        y += [r["nll_without"], r["nll_with"]]
        colors += ["#d62728", "#2ca02c"]
    fig = go.Figure(go.Bar(x=x, y=y, marker_color=colors, hovertemplate="%{x}: %{y:+.4f} nats/token<extra></extra>"))
    return _findings_layout(
        fig, "2-bit cache: sink tokens and the residual window (NLL delta vs full)", yaxis_title="NLL delta, nats/token"
    )


def findings_stacking_figure(found: Findings) -> go.Figure:
    """Claim 6: weights x KV heatmap of NLL delta, each cell labelled with its sequences per GPU."""
    grid = _data(found, "stacking").get("grid", [])
    weights = list(dict.fromkeys(r["weights"] for r in grid))
    kvs = list(dict.fromkeys(r["kv"] for r in grid))
    cell = {(r["weights"], r["kv"]): r for r in grid}
    z = [[(cell.get((w, k)) or {}).get("nll_delta") for k in kvs] for w in weights]
    text = [
        [
            ("n/a" if (cell.get((w, k)) or {}).get("nll_delta") is None else f"{cell[(w, k)]['nll_delta']:+.3f}")
            + (f"<br>{cell[(w, k)]['sequences']} seq" if (cell.get((w, k)) or {}).get("sequences") is not None else "")
            for k in kvs
        ]
        for w in weights
    ]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[f"KV {k}" for k in kvs],
            y=[f"weights {w}" for w in weights],
            text=text,
            texttemplate="%{text}",
            textfont={"size": 16},
            colorscale="Reds",
            colorbar={"title": "nats/token"},
            hovertemplate="%{y} x %{x}: %{z:+.4f}<extra></extra>",
        )
    )
    return _findings_layout(fig, "Weights x KV quantization: NLL delta vs (as loaded, full); sequences per GPU")


def findings_tradeoff_figure(found: Findings, budget: float | None = None, config: dict | None = None) -> go.Figure:
    """Claim 7: every precision as (capacity multiplier, NLL delta), the Pareto front and the budget line:
    as the claim was judged (for the config and budget the page chose), unless `budget` / `config` are given."""
    judged = _data(found, "tradeoff").get("tradeoff")
    t = judged if judged is not None and budget is None and config is None else tradeoff(found, budget, config)
    pts = t["points"]
    fig = go.Figure(
        go.Scatter(
            x=[p["multiplier"] for p in pts],
            y=[p["nll_delta"] for p in pts],
            mode="markers+text",
            text=[p["precision"] for p in pts],
            textposition="top center",
            textfont={"size": 14},
            marker={"size": 14, "color": ["#2ca02c" if p["pareto"] else "#7f7f7f" for p in pts]},
            name="precisions",
            hovertemplate="%{text}: %{x:.2f}x sequences, %{y:+.4f} nats/token<extra></extra>",
        )
    )
    front = sorted((p for p in pts if p["pareto"]), key=lambda p: p["multiplier"])
    fig.add_trace(
        go.Scatter(
            x=[p["multiplier"] for p in front],
            y=[p["nll_delta"] for p in front],
            mode="lines",
            line={"dash": "dot", "color": "#2ca02c"},
            name="Pareto front",
        )
    )
    fig.add_hline(y=t["budget"], line_dash="dash", line_color="#d62728", annotation_text="quality budget")
    if t["pick"]:
        fig.add_trace(
            go.Scatter(
                x=[t["pick"]["multiplier"]],
                y=[t["pick"]["nll_delta"]],
                mode="markers",
                marker={"size": 26, "symbol": "circle-open", "color": "#d62728", "line": {"width": 3}},
                name=f"pick: {t['pick']['precision']}",
            )
        )
    return _findings_layout(
        fig,
        "Capacity vs quality: every precision, the Pareto front, the cheapest within the budget",
        xaxis_title="sequences vs 16-bit (x)",
        yaxis_title="NLL delta, nats/token",
    )


FINDINGS_FIGURES = {
    "capacity": [findings_capacity_figure],
    "long_range": [findings_position_figure, findings_needle_figure],
    "keys": [findings_keys_figure],
    "axis": [findings_axis_figure],
    "sinks": [findings_sinks_figure],
    "stacking": [findings_stacking_figure],
    "tradeoff": [findings_tradeoff_figure],
}


def findings_figures(found: Findings, claim_id: str) -> list[go.Figure]:
    """The figures of one claim's section."""
    return [fn(found) for fn in FINDINGS_FIGURES.get(claim_id, [])]
