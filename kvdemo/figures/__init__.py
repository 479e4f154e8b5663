"""Plotly figures of kvdemo's results, one module per subject; no Streamlit import, no model, no run.

Each figure takes a result (kvdemo/results/) and returns a `plotly.graph_objects.Figure`. This module holds
what every subject's figures share: titles wrapped to the chart's width.
"""

import textwrap

import plotly.graph_objects as go

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
