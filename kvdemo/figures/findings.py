"""Findings: one figure set per claim, large fonts for a projector. Each figure reads a `Findings` report:
the numbers its claim's verdict read (`Claim.data`), or the deltas of `kvdemo.results.findings`."""

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..results.findings import Findings, needle_deltas, tradeoff, window_deltas
from . import set_title

_FINDINGS_FONT = {"size": 16}
LABEL_FONT = 14  # px: the point labels of claim 7
LABEL_BOX = (8, 18)  # px per character and per line of a label at LABEL_FONT (a generous estimate)
PLOT_PX = (560, 260)  # the narrowest plot area the labels are laid out for (page column or PDF): wider spreads
LABEL_OFFSETS = [(dx, dy) for dy in (-24, -48, 24, -72, 48, -96, 72, 96) for dx in (0, 60, -60)]


def padded_range(values: list[float], pad: float = 0.08) -> list[float]:
    """[low, high] around `values` with `pad` of their span on each side (an axis range set, not guessed)."""
    lo, hi = min(values), max(values)
    span = (hi - lo) or abs(hi) or 1.0
    return [lo - pad * span, hi + pad * span]


def label_boxes(xs, ys, labels, offsets, x_range, y_range, plot_px=PLOT_PX) -> list[tuple[float, float, float, float]]:
    """Each label's box (left, top, right, bottom) in px of a `plot_px` plot area: its point mapped from the
    axis ranges, moved by its (ax, ay) offset (plotly's arrow tail, where the text sits)."""
    w, h = plot_px
    boxes = []
    for x, y, text, (ax, ay) in zip(xs, ys, labels, offsets, strict=True):
        cx = (x - x_range[0]) / (x_range[1] - x_range[0]) * w + ax
        cy = (1 - (y - y_range[0]) / (y_range[1] - y_range[0])) * h + ay
        half_w, half_h = LABEL_BOX[0] * len(text) / 2, LABEL_BOX[1] / 2
        boxes.append((cx - half_w, cy - half_h, cx + half_w, cy + half_h))
    return boxes


def _overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def place_labels(xs, ys, labels, x_range, y_range, plot_px=PLOT_PX) -> list[tuple[int, int]]:
    """An (ax, ay) px offset per label so that no two label boxes overlap and each stays inside the plot (greedy,
    from the top of the chart: the first of `LABEL_OFFSETS` clear of the labels placed so far); near-coincident points (fp8 beside int8,
    k8v4 beside k4v8) get their labels stacked with arrows instead of printed over each other."""
    order = sorted(range(len(xs)), key=lambda i: (-ys[i], xs[i]))
    markers = label_boxes(xs, ys, [""] * len(xs), [(0, 0)] * len(xs), x_range, y_range, plot_px)
    placed: dict[object, tuple] = {("marker", i): (b[0] - 8, b[1], b[2] + 8, b[3]) for i, b in enumerate(markers)}
    offsets: dict[int, tuple[int, int]] = {}
    for i in order:
        for off in LABEL_OFFSETS:
            (box,) = label_boxes([xs[i]], [ys[i]], [labels[i]], [off], x_range, y_range, plot_px)
            inside = box[0] >= 0 and box[1] >= 0 and box[2] <= plot_px[0] and box[3] <= plot_px[1]
            if inside and not any(_overlap(box, other) for other in placed.values()):
                break
        placed[i], offsets[i] = box, off
    return [offsets[i] for i in range(len(xs))]


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
            mode="markers",
            text=[p["precision"] for p in pts],
            marker={"size": 14, "color": ["#2ca02c" if p["pareto"] else "#7f7f7f" for p in pts]},
            name="precisions",
            hovertemplate="%{text}: %{x:.2f}x sequences, %{y:+.4f} nats/token<extra></extra>",
        )
    )
    xs, ys = [p["multiplier"] or 0.0 for p in pts], [p["nll_delta"] for p in pts]
    x_range, y_range = padded_range(xs), padded_range([*ys, t["budget"]])
    offsets = place_labels(xs, ys, [p["precision"] for p in pts], x_range, y_range)
    for p, x, y, (ax, ay) in zip(pts, xs, ys, offsets, strict=True):
        fig.add_annotation(
            x=x, y=y, text=p["precision"], ax=ax, ay=ay, showarrow=True, arrowwidth=1, arrowcolor="#999",
            font={"size": LABEL_FONT}, name="label",
        )  # fmt: skip
    fig.update_xaxes(range=x_range)
    fig.update_yaxes(range=y_range)
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
