"""Plotly figures built from plain result dicts/dataclasses; no Streamlit import."""

import textwrap

import plotly.graph_objects as go

TITLE_CHARS = 48  # a title line longer than this is wrapped: a chart in a half-width column shows ~50 characters


def wrap_title(text: str, width: int = TITLE_CHARS) -> str:
    """`text` broken into lines of at most `width` characters (at spaces) joined by <br>: plotly does not
    wrap titles, and a long one is cut off at the chart's edge."""
    return "<br>".join(textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)) or text


def _title(fig: go.Figure, text: str, width: int = TITLE_CHARS, space: int = 0, **layout) -> None:
    """Set a title wrapped at `width` characters and leave room above the plot for its lines (+ `space` px)."""
    wrapped = wrap_title(text, width)
    lines = wrapped.count("<br>") + 1
    fig.update_layout(title={"text": wrapped}, margin={"t": 40 + 24 * lines + space}, **layout)


# --- memory / concurrency headroom: figures of `kvdemo.memory.headroom` result dicts ---------------

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
    _title(
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
    _title(
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
    _title(
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
    _title(
        fig,
        f"Stacking weight and KV precision: concurrent {out['context']:,}-token sequences",
        yaxis_title="KV precision",
    )
    return fig


# --- attention-score drift: figures of `kvdemo.drift.run_drift` / `run_cli` dicts -------------------


def drift_js_heatmap_figure(result: dict) -> go.Figure:
    """Layer x query-head heatmap of the mean Jensen-Shannon divergence for one precision (an entry of
    `out["results"]`)."""
    rows = result["per_layer"]
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
    _title(
        fig,
        f"{result['precision']}: attention JS divergence vs full precision (mean {result['mean_js']:.2e})",
        xaxis_title="query head",
        yaxis_title="layer",
    )
    return fig


def drift_layer_figure(out: dict) -> go.Figure:
    """Mean JS divergence of the attention distributions by layer, one line per precision (log scale)."""
    fig = go.Figure()
    for r in out["results"]:
        fig.add_trace(
            go.Scatter(
                x=[row["layer"] for row in r["per_layer"]],
                y=[row["js"] for row in r["per_layer"]],
                mode="lines+markers",
                name=r["precision"],
                hovertemplate="layer %{x}: JS %{y:.2e}<extra>" + r["precision"] + "</extra>",
            )
        )
    _title(
        fig,
        "Attention drift by layer",
        xaxis_title="layer",
        yaxis_title="mean JS divergence (nats)",
        yaxis_type="log",
        legend_title="KV precision",
    )
    return fig


def drift_position_figure(out: dict) -> go.Figure:
    """JS divergence per key vs key position (one line per precision, log scale): where the error sits.
    The sink tokens are the first bin; the dotted line marks where the full-precision residual begins."""
    fig = go.Figure()
    for r in out["results"]:
        prof = r["position_profile"]
        fig.add_trace(
            go.Scatter(
                x=[(b["start"] + b["end"] - 1) / 2 for b in prof],
                y=[b["js_per_key"] for b in prof],
                customdata=[[b["start"], b["end"], 100 * b["js_share"], 100 * b["mass_full"]] for b in prof],
                mode="lines+markers",
                name=r["precision"],
                hovertemplate="keys [%{customdata[0]}, %{customdata[1]}): JS/key %{y:.2e}, "
                "%{customdata[2]:.0f}% of JS, %{customdata[3]:.0f}% of attention<extra>" + r["precision"] + "</extra>",
            )
        )
    quantized = [r for r in out["results"] if r["spec"]["key_format"] != "full"]
    if quantized:
        recent = next(b for b in quantized[0]["by_position"] if b["bin"] == "recent")
        fig.add_vline(x=recent["start"], line_dash="dot", line_color="gray", annotation_text="full-precision residual")
    _title(
        fig,
        "Attention drift by key position",
        xaxis_title="key position (tokens)",
        yaxis_title="JS divergence per key (nats)",
        yaxis_type="log",
        legend_title="KV precision",
    )
    return fig


def drift_logit_kl_figure(out: dict) -> go.Figure:
    """Next-token logit KL(full || quantized) for each generated (teacher-forced) token, per precision."""
    fig = go.Figure()
    for r in out["results"]:
        fig.add_trace(
            go.Scatter(
                x=list(range(1, len(r["logit_kl"]) + 1)),
                y=r["logit_kl"],
                mode="lines+markers",
                name=r["precision"],
                hovertemplate="token %{x}: KL %{y:.2e}<extra>" + r["precision"] + "</extra>",
            )
        )
    _title(
        fig,
        "Next-token logit KL along the generation",
        xaxis_title="generated token",
        yaxis_title="KL(full || quantized) (nats)",
        yaxis_type="log",
        legend_title="KV precision",
    )
    return fig


# --- bench: figures of `kvdemo.bench.run_bench` report dicts ---------------------------------------------


def _bench_bars(report: dict, metric: str, keys: list, key_label: str, title: str, yaxis: str) -> go.Figure:
    """Grouped bars: one group per contender, one bar per size (`keys`) of `row[metric]`."""
    names = [r["contender"] for r in report["results"]]
    fig = go.Figure()
    for key in keys:
        ys = [r[metric].get(str(key)) for r in report["results"]]
        fig.add_trace(
            go.Bar(
                x=names,
                y=ys,
                name=f"{key_label} {key}",
                hovertemplate="%{x}: %{y:.4g}<extra>" + f"{key_label} {key}" + "</extra>",
            )
        )
    _title(fig, title, barmode="group", yaxis_title=yaxis, xaxis_title="contender")
    return fig


def ablation_frontier_figure(report: dict) -> go.Figure:
    """An ablation report (`kvdemo.ppl.run_ablation`) as a frontier: logit KL vs full precision (log axis) against
    bits/element, one line per method through its 4-, 3- and 2-bit cells; lower left is better."""
    fig = go.Figure()
    for col in report["columns"]:
        cells = [row["cells"][col] for row in report["rows"] if row["cells"][col] is not None]
        hover = [_delta_hover(r) for r in cells]
        fig.add_trace(
            go.Scatter(
                x=[r["bits_per_element"] for r in cells],
                y=[r["logit_kl"] for r in cells],
                mode="lines+markers",
                name=col,
                text=hover,
                hovertemplate="%{text}<br>%{x:.2f} bits/element, KL %{y:.3g}<extra>" + col + "</extra>",
            )
        )
    _title(
        fig,
        f"KV methods on {report['model']}: logit KL vs full precision against bits per element (lower left is better)",
        72,
        xaxis_title="bits per element (16-bit basis)",
        yaxis_title="logit KL vs full precision (nats)",
        yaxis_type="log",
    )
    return fig


def _delta_hover(row: dict) -> str:
    """A `run_ppl` result row's precision and perplexity delta, with its 95% interval when the row has one."""
    from .ppl import interval_text

    ci = row.get("delta_vs_full_ci95")
    interval = "" if ci is None else f" (95%: {interval_text(ci)})"
    return f"{row['precision']}<br>ppl delta {row['delta_vs_full']:+.3f}{interval}"


def ppl_frontier_figure(report: dict) -> go.Figure:
    """A `kvdemo.ppl.run_ppl` report's quantized precisions: logit KL vs full precision (log axis, 95% interval as
    error bars where the report has it) against bits per element, one labelled point each; lower left is better."""
    from .ppl import HELD_OUT_NAME

    rows = [r for r in report["results"] if r["precision"] != "full"]
    low = [r["logit_kl"] - r["logit_kl_ci95"][0] if r.get("logit_kl_ci95") else 0.0 for r in rows]
    high = [r["logit_kl_ci95"][1] - r["logit_kl"] if r.get("logit_kl_ci95") else 0.0 for r in rows]
    fig = go.Figure(
        go.Scatter(
            x=[r["bits_per_element"] for r in rows],
            y=[r["logit_kl"] for r in rows],
            error_y={"type": "data", "symmetric": False, "array": high, "arrayminus": low},
            mode="markers+text",
            text=[r["precision"] for r in rows],
            textposition="top center",
            customdata=[_delta_hover(r) for r in rows],
            hovertemplate="%{customdata}<br>%{x:.2f} bits/element, KL %{y:.3g}<extra></extra>",
            showlegend=False,
        )
    )
    _title(
        fig,
        f"{report.get('text', HELD_OUT_NAME)} on {report['model']}: logit KL vs full precision against bits per "
        "element (lower left is better)",
        72,
        xaxis_title="bits per element (16-bit basis)",
        yaxis_title="logit KL vs full precision (nats)",
        yaxis_type="log",
    )
    return fig


def bench_memory_figure(report: dict) -> go.Figure:
    """Cache memory ratio vs a 16-bit cache, per contender and context length."""
    fig = _bench_bars(
        report, "ratio_vs_fp16", report["sizes"]["contexts"], "tokens", "KV cache: x smaller than fp16", "ratio"
    )
    fig.add_hline(y=1.0, line_dash="dash", line_color="gray")
    return fig


def bench_ppl_figure(report: dict) -> go.Figure:
    """Perplexity change vs full precision (%), per contender and text length."""
    return _bench_bars(
        report,
        "ppl_delta_pct",
        report["sizes"]["ppl_lengths"],
        "tokens",
        "Held-out perplexity vs full precision",
        "perplexity change (%)",
    )


def bench_speed_figure(report: dict) -> go.Figure:
    """Warm decode tokens/s, per contender and context length."""
    return _bench_bars(
        report, "decode_tok_s", report["sizes"]["contexts"], "context", "Decode speed (warm, median round)", "tokens/s"
    )


def bench_needle_figure(report: dict) -> go.Figure:
    """Teacher-forced log-prob of the pass key: one bar group per contender, one bar per grid cell."""
    fig = go.Figure()
    rows = report["results"]
    names = [r["contender"] for r in rows]
    cells = rows[0]["needle"]["cells"] if rows else []
    for i, cell in enumerate(cells):
        label = f"{cell['length']} tokens, depth {cell['depth']}%"
        fig.add_trace(
            go.Bar(
                x=names,
                y=[r["needle"]["cells"][i]["logprob"] for r in rows],
                name=label,
                hovertemplate="%{x}: %{y:.3f} nats<extra>" + label + "</extra>",
            )
        )
    _title(
        fig,
        "Pass key log-probability (higher is better, 0 = certain)",
        barmode="group",
        yaxis_title="log-prob (nats)",
        xaxis_title="contender",
    )
    return fig


def bench_figures(report: dict) -> list[go.Figure]:
    """Every bench figure, in page order."""
    return [
        bench_memory_figure(report),
        bench_ppl_figure(report),
        bench_speed_figure(report),
        bench_needle_figure(report),
    ]


# --- needle in a haystack: figures of `kvdemo.needle.run_grid` results (`NeedleResult.to_dict()`) ----------

_NEEDLE_SCALE = [[0.0, "#F0496E"], [0.5, "#EBB839"], [1.0, "#0CD79F"]]  # as the well-known needle heatmaps
_NEEDLE_VALUES = {"correct": "answer found", "answer_prob": "p(true answer)", "answer_logprob": "log p(true answer)"}


def _needle_rows(result) -> tuple[list[dict], list[str], list[int], list[float]]:
    """(rows, precisions, lengths, depths) of a needle result dict, a NeedleResult or a list of rows."""
    out = result.to_dict() if hasattr(result, "to_dict") else result
    rows = out["rows"] if isinstance(out, dict) else [r.to_dict() if hasattr(r, "to_dict") else r for r in out]
    precisions = list(out.get("precisions") or []) if isinstance(out, dict) else []
    precisions = [p for p in precisions if any(r["precision"] == p for r in rows)] or list(
        dict.fromkeys(r["precision"] for r in rows)
    )
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    return rows, precisions, lengths, depths


def _needle_value(row: dict, value: str) -> float:
    import math

    if value == "correct":
        return float(row["correct"])
    if value == "answer_prob":
        return math.exp(row["answer_logprob"])
    if value == "answer_logprob":
        return float(row["answer_logprob"])
    raise ValueError(f"unknown needle value {value!r}; allowed: {', '.join(_NEEDLE_VALUES)}")


def _needle_cells(rows: list[dict], precision: str) -> dict[tuple[int, float], list[dict]]:
    """(length, depth) -> the precision's runs of that cell (one per seed)."""
    cells: dict[tuple[int, float], list[dict]] = {}
    for r in rows:
        if r["precision"] == precision:
            cells.setdefault((r["length"], r["depth"]), []).append(r)
    return cells


def _needle_grid(rows: list[dict], precision: str, lengths: list, depths: list, value: str) -> list[list]:
    """z[depth][length] for one precision: the value, its mean over the cell's runs with repeats (the found
    rate for "correct"); None where a cell did not run."""
    cells = _needle_cells(rows, precision)
    return [
        [
            sum(_needle_value(r, value) for r in cells[(n, d)]) / len(cells[(n, d)]) if (n, d) in cells else None
            for n in lengths
        ]
        for d in depths
    ]


FULL_MISSED = "full missed"  # the label of a cell where full precision itself missed the needle


def full_missed_cells(rows: list[dict], baseline: str = "full") -> dict[tuple[int, float], int]:
    """(length, depth) -> how many of its runs `baseline` (full precision) itself missed, for the cells where it
    missed any: there a quantized miss says nothing about quantization."""
    misses: dict[tuple[int, float], int] = {}
    for r in rows:
        if r["precision"] == baseline and not r["correct"]:
            misses[(r["length"], r["depth"])] = misses.get((r["length"], r["depth"]), 0) + 1
    return misses


def _missed_label(runs: int, misses: int) -> str:
    return "" if not misses else f"<br>({FULL_MISSED})" if runs == 1 else f"<br>({FULL_MISSED} {misses})"


def _needle_texts(rows: list[dict], precision: str, lengths: list, depths: list, misses=None) -> list[list[str]]:
    """Cell labels: ok/miss and the answer's log-prob (found/runs and the mean log-prob with repeats), and
    FULL_MISSED where full precision missed (with how many of the runs, with repeats); misses: `full_missed_cells`."""
    cells, misses = _needle_cells(rows, precision), misses or {}

    def label(runs: list[dict], missed: int) -> str:
        logp = sum(r["answer_logprob"] for r in runs) / len(runs)
        found = (
            ("ok" if runs[0]["correct"] else "miss")
            if len(runs) == 1
            else f"{sum(r['correct'] for r in runs)}/{len(runs)}"
        )
        return f"{found}<br>{logp:.2f}" + _missed_label(len(runs), missed)

    return [[label(cells[(n, d)], misses.get((n, d), 0)) if (n, d) in cells else "" for n in lengths] for d in depths]


def _needle_panels(precisions: list[str], title: str) -> go.Figure:
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=max(len(precisions), 1), subplot_titles=precisions, shared_yaxes=True)
    _title(fig, title, width=90, space=20, height=380)
    return fig


def _needle_panel(fig: go.Figure, col: int, z: list, text: list, lengths: list, depths: list, **style) -> None:
    """One depth x length heatmap panel (column `col`), cells labelled with `text`. Every panel's y axis
    gets the same settings (depth 0 at the top, categories in `depths` order): shared axes in plotly only
    share the range, so a setting made on the first panel alone leaves the others upside down."""
    x, y = [str(n) for n in lengths], [f"{d:g}%" for d in depths]
    heat = go.Heatmap(z=z, x=x, y=y, text=text, texttemplate="%{text}", xgap=2, ygap=2, **style)
    fig.add_trace(heat, row=1, col=col)
    fig.update_xaxes(title_text="prompt tokens", type="category", row=1, col=col)
    fig.update_yaxes(
        autorange="reversed",
        type="category",
        categoryorder="array",
        categoryarray=y,
        title_text="needle depth" if col == 1 else None,
        row=1,
        col=col,
    )


def needle_heatmap_figure(result, value: str = "correct") -> go.Figure:
    """Depth (down) x prompt length (across), one panel per precision, coloured by `value`:
    "correct" (exact match), "answer_prob" (teacher-forced p of the true answer) or "answer_logprob", each
    the mean over a cell's runs with repeats. Each cell is labelled with ok/miss (found/runs) and the
    answer's log-probability (its mean)."""
    rows, precisions, lengths, depths = _needle_rows(result)
    fig = _needle_panels(precisions, f"Needle in a haystack: {_NEEDLE_VALUES.get(value, value)} by depth and length")
    bounded = value in ("correct", "answer_prob")
    missed = full_missed_cells(rows)
    for i, label in enumerate(precisions, start=1):
        _needle_panel(
            fig,
            i,
            _needle_grid(rows, label, lengths, depths, value),
            _needle_texts(rows, label, lengths, depths, missed),
            lengths,
            depths,
            colorscale=_NEEDLE_SCALE if bounded else "Viridis",
            zmin=0.0 if bounded else None,
            zmax=1.0 if bounded else None,
            showscale=i == len(precisions),
            hovertemplate=label + ": %{x} tokens, depth %{y}<br>%{text}<extra></extra>",
        )
    return fig


def needle_difference_figure(result, baseline: str = "full", value: str = "answer_logprob") -> go.Figure:
    """Each quantized precision minus `baseline` on the same runs: log-prob change (default), change in
    p(true answer), or correct (-1: lost, +1: gained), each the mean over a cell's runs (same seed against same
    seed) with repeats. Diverging colours centred on 0, one scale for all panels."""
    from .needle import cell_key

    rows, precisions, lengths, depths = _needle_rows(result)
    if baseline not in precisions:
        raise ValueError(f"no {baseline!r} rows to compare with; have: {', '.join(precisions)}")
    others = [p for p in precisions if p != baseline]
    fig = _needle_panels(others, f"Needle: {_NEEDLE_VALUES.get(value, value)}, change vs {baseline}")
    base = {cell_key(r): _needle_value(r, value) for r in rows if r["precision"] == baseline}
    diffs = {}
    for label in others:
        changes: dict[tuple[int, float], list[float]] = {}
        for r in rows:
            if r["precision"] == label and cell_key(r) in base:
                changes.setdefault((r["length"], r["depth"]), []).append(_needle_value(r, value) - base[cell_key(r)])
        diffs[label] = [[sum(c) / len(c) if (c := changes.get((n, d))) else None for n in lengths] for d in depths]
    span = max([abs(v) for d in diffs.values() for r in d for v in r if v is not None] + [1e-3])
    missed = full_missed_cells(rows, baseline)
    for i, (label, diff) in enumerate(diffs.items(), start=1):
        _needle_panel(
            fig,
            i,
            diff,
            [
                [
                    "" if v is None else f"{v:+.2f}" + (f"<br>({FULL_MISSED})" if (n, d) in missed else "")
                    for n, v in zip(lengths, r, strict=True)
                ]
                for d, r in zip(depths, diff, strict=True)
            ],
            lengths,
            depths,
            colorscale="RdBu",
            zmin=-span,
            zmax=span,  # one scale for every panel
            showscale=i == len(others),
            hovertemplate=label + f" - {baseline}: " + "%{x} tokens, depth %{y}: %{text}<extra></extra>",
        )
    return fig


def needle_logprob_figure(result) -> go.Figure:
    """Teacher-forced log p(true answer) vs prompt length, one line per precision: the mean over the runs at
    that length (its depths, and seeds with repeats), with bars from the worst to the best run."""
    rows, precisions, lengths, _ = _needle_rows(result)
    fig = go.Figure()
    for label in precisions:
        means, lo, hi = [], [], []
        for n in lengths:
            vals = [r["answer_logprob"] for r in rows if r["precision"] == label and r["length"] == n]
            m = sum(vals) / len(vals) if vals else None
            means.append(m)
            lo.append(m - min(vals) if vals else None)
            hi.append(max(vals) - m if vals else None)
        fig.add_trace(
            go.Scatter(
                x=lengths,
                y=means,
                mode="lines+markers",
                name=label,
                error_y={"type": "data", "array": hi, "arrayminus": lo, "visible": True, "thickness": 1},
                hovertemplate="%{x} tokens: mean log p %{y:.3f}<extra>" + label + "</extra>",
            )
        )
    _title(
        fig,
        "Needle: log p(true answer) vs length (mean over depths and repeats; bars: worst to best run)",
        width=90,
        xaxis={"title": "prompt tokens", "type": "log", "tickvals": lengths, "ticktext": [str(n) for n in lengths]},
        yaxis_title="log p(true answer), nats",
        height=380,
    )
    return fig


def needle_figures(result) -> list[go.Figure]:
    """The needle page's figures: pass/fail heatmap, log-prob change vs full, log-prob vs length."""
    precisions = _needle_rows(result)[1]
    figs = [needle_heatmap_figure(result)]
    if "full" in precisions and len(precisions) > 1:
        figs.append(needle_difference_figure(result))
    figs.append(needle_logprob_figure(result))
    return figs


# --- findings: figures of `kvdemo.findings` dicts (one per claim; large fonts for a projector) ------------

_FINDINGS_FONT = {"size": 16}


def _findings_layout(fig: go.Figure, title: str, **layout) -> go.Figure:
    _title(fig, title, width=80, font=_FINDINGS_FONT, height=460, legend={"font": {"size": 14}}, **layout)
    return fig


def _claim(found: dict, claim_id: str) -> dict:
    return next((c for c in found.get("claims", []) if c["id"] == claim_id), {"data": {}})


def findings_capacity_figure(found: dict) -> go.Figure:
    """Claim 1: concurrent sequences per precision (bars, labelled with the multiplier vs 16-bit)."""
    cap = _claim(found, "capacity")["data"].get("capacity", {})
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


def findings_position_figure(found: dict) -> go.Figure:
    """Claim 2a: NLL delta vs full precision per position window of the held-out text, one line per precision."""
    from .findings import window_deltas

    fig = go.Figure()
    for label in found.get("precisions", []):
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
    th = found.get("thresholds", {}).get("nll_ok_nats")
    if th is not None:
        fig.add_hline(y=th, line_dash="dash", line_color="gray", annotation_text="pass threshold")
    return _findings_layout(
        fig,
        "Next-token NLL vs full precision by position in the text (every token attends over the stored cache)",
        xaxis={"title": "token position (window centre)", "type": "log"},
        yaxis_title="NLL delta, nats/token",
    )


def findings_needle_figure(found: dict) -> go.Figure:
    """Claim 2b: needle answer log-prob delta vs full precision by prompt length, one line per precision."""
    from .findings import needle_deltas

    fig = go.Figure()
    for label in found.get("precisions", []):
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
    th = found.get("thresholds", {}).get("needle_ok_nats")
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
    from plotly.subplots import make_subplots

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


def findings_keys_figure(found: dict) -> go.Figure:
    """Claim 3: k4v8 vs k8v4 (vs k8v2) on logit KL, NLL delta and needle log-prob loss."""
    losses = _claim(found, "keys")["data"].get("losses", {})
    groups = [(p, losses[p]) for p in ("k4v8", "k8v4", "k8v2") if p in losses]
    measures = [("kl", "logit KL (nats)"), ("nll", "NLL delta (nats/token)"), ("needle", "needle log p loss (nats)")]
    return _pair_bars(
        groups, measures, "4-bit keys (k4v8) vs 4-bit values (k8v4) and 2-bit values (k8v2): loss vs full"
    )


def findings_axis_figure(found: dict) -> go.Figure:
    """Claim 4: per-channel vs per-token keys at 4 and 2 bits, NLL delta (bars)."""
    rows = _claim(found, "axis")["data"].get("rows", [])
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


def findings_sinks_figure(found: dict) -> go.Figure:
    """Claim 5: int2 without / with sinks, residual 32 / 128 (NLL delta bars)."""
    rows = _claim(found, "sinks")["data"].get("rows", [])
    x, y, colors = [], [], []
    for r in rows:
        x += [r["without"], r["with"]]
        y += [r["nll_without"], r["nll_with"]]
        colors += ["#d62728", "#2ca02c"]
    fig = go.Figure(go.Bar(x=x, y=y, marker_color=colors, hovertemplate="%{x}: %{y:+.4f} nats/token<extra></extra>"))
    return _findings_layout(
        fig, "2-bit cache: sink tokens and the residual window (NLL delta vs full)", yaxis_title="NLL delta, nats/token"
    )


def findings_stacking_figure(found: dict) -> go.Figure:
    """Claim 6: weights x KV heatmap of NLL delta, each cell labelled with its sequences per GPU."""
    grid = _claim(found, "stacking")["data"].get("grid", [])
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


def findings_tradeoff_figure(found: dict, budget: float | None = None, config: dict | None = None) -> go.Figure:
    """Claim 7: every precision as (capacity multiplier, NLL delta), the Pareto front and the budget line."""
    from .findings import tradeoff

    t = tradeoff(found, budget, config)
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


def findings_figures(found: dict, claim_id: str) -> list[go.Figure]:
    """The figures of one claim's section."""
    return [fn(found) for fn in FINDINGS_FIGURES.get(claim_id, [])]


# --- measured headroom: figures of `kvdemo.scale.measure_headroom` rows ------------------------------


def headroom_measured_figure(rows: list[dict]) -> go.Figure:
    """Sequences admitted into the budget (real caches) beside the formula's count, per KV precision."""
    labels = [r["precision"] for r in rows]
    fig = go.Figure()
    for name, field in (("measured (real caches)", "measured_max_sequences"), ("formula", "max_sequences")):
        counts = [r[field] for r in rows]
        fig.add_trace(go.Bar(x=labels, y=counts, name=name, text=[f"{n:,}" for n in counts], textposition="outside"))
    first = rows[0] if rows else {"context": 0, "budget_bytes": 0}
    _title(
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
    _title(
        fig, "Decode tokens/s vs batch size (measured)", xaxis_title="batch size (sequences)", yaxis_title="tokens/s"
    )
    fig.update_xaxes(type="log", dtick=0.30103)  # powers of two
    return fig
