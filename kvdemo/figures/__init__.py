"""Plotly figures of kvdemo's results, one module per subject; no Streamlit import, no model, no run.

Each figure takes a result (kvdemo/results/) and returns a `plotly.graph_objects.Figure`. This module holds
what every subject's figures share: titles wrapped to the chart's width, plain tick labels on log axes
(10^-4, not plotly's SI "100μ"), and one colour per KV format (`format_colors`).
"""

import textwrap

import plotly.graph_objects as go

# one palette for every figure: the presets keep their colour from chart to chart, other labels (variants such as
# int4:s4) take the next colour no label of the same chart has (plotly's Dark24, distinct at a glance)
PALETTE = (
    "#2E91E5", "#E15F99", "#1CA71C", "#FB0D0D", "#DA16FF", "#222A2A", "#B68100", "#750D86", "#EB663B", "#511CFB",
    "#00A08B", "#FB00D1", "#FC0080", "#B2828D", "#6C7C32", "#778AAE", "#862A16", "#A777F1", "#620042", "#1616A7",
    "#DA60CA", "#6C4516", "#0D2A63", "#AF0038",
)  # fmt: skip
FORMAT_ORDER = (
    "full", "int8", "int4", "int2", "fp8", "fp8-e5m2", "k8v4", "k4v8", "k8v2", "k4v2", "int3", "nuq4", "nuq3",
    "nuq2", "nvfp4",
)  # fmt: skip
TITLE_CHARS = 48  # a title line longer than this is wrapped: a chart in a half-width column shows ~50 characters


def wrap_title(text: str, width: int = TITLE_CHARS) -> str:
    """`text` broken into lines of at most `width` characters (at spaces) joined by <br>: plotly does not
    wrap titles, and a long one is cut off at the chart's edge."""
    return "<br>".join(textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)) or text


def set_title(fig: go.Figure, text: str, width: int = TITLE_CHARS, space: int = 0, **layout) -> None:
    """Set a title wrapped at `width` characters and leave room above the plot for its lines (+ `space` px)."""
    wrapped = wrap_title(text, width)
    lines = wrapped.count("<br>") + 1
    fig.update_layout(title={"text": wrapped}, margin={"t": 40 + 24 * lines + space}, **layout)
    plain_log_ticks(fig)


def format_colors(labels) -> dict[str, str]:
    """A distinct colour per label of one chart: a preset's own (`FORMAT_ORDER` into `PALETTE`), others the
    first colour not taken yet (distinct up to len(PALETTE) labels)."""
    out = {lbl: PALETTE[FORMAT_ORDER.index(lbl)] for lbl in labels if lbl in FORMAT_ORDER}
    free = [c for c in PALETTE if c not in out.values()]
    for lbl in labels:
        if lbl not in out:
            out[lbl] = free.pop(0) if free else PALETTE[len(out) % len(PALETTE)]
    return out


def plain_log_ticks(fig: go.Figure) -> go.Figure:
    """Every log axis of `fig` labelled in powers of ten (10^-4), never with SI prefixes (plotly's default
    writes 1e-4 as "100μ")."""
    fig.update_xaxes(exponentformat="power", selector={"type": "log"})
    fig.update_yaxes(exponentformat="power", selector={"type": "log"})
    return fig
