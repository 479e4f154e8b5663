"""Needle in a haystack: heatmaps and difference maps of a `NeedleGrid` (kvdemo/results/needle.py).

Each row is read against its own engine's full row (`engines.baseline_of`): kvdemo's precisions against
"full", llama.cpp's cache types against "llama.cpp:f16" (the engines' kernels differ, so only each engine's cost
compares): the difference map draws each against its own, a heatmap marks where its own full row missed, and
the log-prob figure draws llama.cpp's lines dashed beside kvdemo's."""

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..engines import baseline_of, is_llamacpp
from ..results.needle import NeedleGrid, NeedleRow, cell_key
from . import set_title

_NEEDLE_SCALE = [[0.0, "#F0496E"], [0.5, "#EBB839"], [1.0, "#0CD79F"]]  # as the well-known needle heatmaps
_NEEDLE_VALUES = {"correct": "answer found", "answer_prob": "p(true answer)", "answer_logprob": "log p(true answer)"}


def _needle_rows(grid: NeedleGrid) -> tuple[list[NeedleRow], list[str], list[int], list[float]]:
    """(rows, precisions with rows, lengths, depths) of a grid, lengths and depths as the rows have them."""
    rows = grid.rows
    precisions = [p for p in grid.precisions if any(r.precision == p for r in rows)]
    precisions += [p for p in dict.fromkeys(r.precision for r in rows) if p not in precisions]
    lengths = sorted({r.length for r in rows})
    depths = sorted({r.depth for r in rows})
    return rows, precisions, lengths, depths


def _needle_value(row: NeedleRow, value: str) -> float:
    if value == "correct":
        return float(row.correct)
    if value == "answer_prob":
        return math.exp(row.answer_logprob)
    if value == "answer_logprob":
        return float(row.answer_logprob)
    raise ValueError(f"unknown needle value {value!r}; allowed: {', '.join(_NEEDLE_VALUES)}")


def _needle_cells(rows: list[NeedleRow], precision: str) -> dict[tuple[int, float], list[NeedleRow]]:
    """(length, depth) -> the precision's runs of that cell (one per seed)."""
    cells: dict[tuple[int, float], list[NeedleRow]] = {}
    for r in rows:
        if r.precision == precision:
            cells.setdefault((r.length, r.depth), []).append(r)
    return cells


def _needle_grid(rows: list[NeedleRow], precision: str, lengths: list, depths: list, value: str) -> list[list]:
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


def full_missed_cells(rows: list[NeedleRow], baseline: str = "full") -> dict[tuple[int, float], int]:
    """(length, depth) -> how many of its runs `baseline` (full precision) itself missed, for the cells where it
    missed any: there a quantized miss says nothing about quantization."""
    misses: dict[tuple[int, float], int] = {}
    for r in rows:
        if r.precision == baseline and not r.correct:
            misses[(r.length, r.depth)] = misses.get((r.length, r.depth), 0) + 1
    return misses


def _missed_label(runs: int, misses: int) -> str:
    return "" if not misses else f"<br>({FULL_MISSED})" if runs == 1 else f"<br>({FULL_MISSED} {misses})"


def _needle_texts(rows: list[NeedleRow], precision: str, lengths: list, depths: list, misses=None) -> list[list[str]]:
    """Cell labels: ok/miss and the answer's log-prob (found/runs and the mean log-prob with repeats), and
    FULL_MISSED where full precision missed (with how many of the runs, with repeats); misses: `full_missed_cells`."""
    cells, misses = _needle_cells(rows, precision), misses or {}

    def label(runs: list[NeedleRow], missed: int) -> str:
        logp = sum(r.answer_logprob for r in runs) / len(runs)
        found = (
            ("ok" if runs[0].correct else "miss") if len(runs) == 1 else f"{sum(r.correct for r in runs)}/{len(runs)}"
        )
        logp_text = "" if math.isnan(logp) else f"<br>{logp:.2f}"  # NaN: no log-prob came back (API probes)
        return found + logp_text + _missed_label(len(runs), missed)

    return [[label(cells[(n, d)], misses.get((n, d), 0)) if (n, d) in cells else "" for n in lengths] for d in depths]


def _needle_panels(precisions: list[str], title: str) -> go.Figure:
    fig = make_subplots(rows=1, cols=max(len(precisions), 1), subplot_titles=precisions, shared_yaxes=True)
    set_title(fig, title, width=90, space=20, height=380)
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


def needle_heatmap_figure(grid: NeedleGrid, value: str = "correct") -> go.Figure:
    """Depth (down) x prompt length (across), one panel per precision, coloured by `value`:
    "correct" (exact match), "answer_prob" (teacher-forced p of the true answer) or "answer_logprob", each
    the mean over a cell's runs with repeats. Each cell is labelled with ok/miss (found/runs) and the
    answer's log-probability (its mean)."""
    rows, precisions, lengths, depths = _needle_rows(grid)
    fig = _needle_panels(precisions, f"Needle in a haystack: {_NEEDLE_VALUES.get(value, value)} by depth and length")
    bounded = value in ("correct", "answer_prob")
    for i, label in enumerate(precisions, start=1):
        _needle_panel(
            fig,
            i,
            _needle_grid(rows, label, lengths, depths, value),
            _needle_texts(rows, label, lengths, depths, full_missed_cells(rows, baseline_of(label))),
            lengths,
            depths,
            colorscale=_NEEDLE_SCALE if bounded else "Viridis",
            zmin=0.0 if bounded else None,
            zmax=1.0 if bounded else None,
            showscale=i == len(precisions),
            hovertemplate=label + ": %{x} tokens, depth %{y}<br>%{text}<extra></extra>",
        )
    return fig


def compared(grid: NeedleGrid, baseline: str = "full") -> dict[str, str]:
    """The difference map's panels: each row's label -> the label it is read against. `baseline` "full": each
    against its own engine's full row (llama.cpp's against llama.cpp:f16), where the grid has it; any other name
    (an API probe's endpoint): every other row against that one."""
    precisions = _needle_rows(grid)[1]
    own = {p: baseline_of(p) if baseline == "full" else baseline for p in precisions}
    return {p: b for p, b in own.items() if p != b and b in precisions}


def needle_difference_figure(grid: NeedleGrid, baseline: str = "full", value: str = "answer_logprob") -> go.Figure:
    """Each quantized precision minus its baseline (`compared`) on the same runs: log-prob change (default), change
    in p(true answer), or correct (-1: lost, +1: gained), each the mean over a cell's runs (same seed against same
    seed) with repeats. Diverging colours centred on 0, one scale for all panels."""
    rows, precisions, lengths, depths = _needle_rows(grid)
    if baseline not in precisions:
        raise ValueError(f"no {baseline!r} rows to compare with; have: {', '.join(precisions)}")
    pairs = compared(grid, baseline)
    both = any(is_llamacpp(p) for p in pairs) and any(not is_llamacpp(p) for p in pairs)
    against = "each engine's full row (llama.cpp's: llama.cpp:f16)" if both else next(iter(pairs.values()), baseline)
    fig = _needle_panels(list(pairs), f"Needle: {_NEEDLE_VALUES.get(value, value)}, change vs {against}")
    values = {(r.precision, cell_key(r)): _needle_value(r, value) for r in rows}
    diffs = {}
    for label, base in pairs.items():
        changes: dict[tuple[int, float], list[float]] = {}
        for r in rows:
            if r.precision == label and (base, cell_key(r)) in values:
                changes.setdefault((r.length, r.depth), []).append(_needle_value(r, value) - values[base, cell_key(r)])
        diffs[label] = [[sum(c) / len(c) if (c := changes.get((n, d))) else None for n in lengths] for d in depths]
    span = max([abs(v) for d in diffs.values() for r in d for v in r if v is not None] + [1e-3])
    for i, (label, diff) in enumerate(diffs.items(), start=1):
        missed = full_missed_cells(rows, pairs[label])
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
            showscale=i == len(pairs),
            hovertemplate=label + f" - {pairs[label]}: " + "%{x} tokens, depth %{y}: %{text}<extra></extra>",
        )
    return fig


def needle_logprob_figure(grid: NeedleGrid) -> go.Figure:
    """Teacher-forced log p(true answer) vs prompt length, one line per precision: the mean over the runs at
    that length (its depths, and seeds with repeats), with bars from the worst to the best run."""
    rows, precisions, lengths, _ = _needle_rows(grid)
    fig = go.Figure()
    for label in precisions:
        means, lo, hi = [], [], []
        for n in lengths:
            vals = [r.answer_logprob for r in rows if r.precision == label and r.length == n]
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
                line={"dash": "dash"} if is_llamacpp(label) else None,  # another engine: read against its own f16
                error_y={"type": "data", "array": hi, "arrayminus": lo, "visible": True, "thickness": 1},
                hovertemplate="%{x} tokens: mean log p %{y:.3f}<extra>" + label + "</extra>",
            )
        )
    set_title(
        fig,
        "Needle: log p(true answer) vs length (mean over depths and repeats; bars: worst to best run)",
        width=90,
        xaxis={"title": "prompt tokens", "type": "log", "tickvals": lengths, "ticktext": [str(n) for n in lengths]},
        yaxis_title="log p(true answer), nats",
        height=380,
    )
    return fig


def needle_figures(grid: NeedleGrid) -> list[go.Figure]:
    """The needle page's figures: pass/fail heatmap, log-prob change vs full, log-prob vs length."""
    precisions = _needle_rows(grid)[1]
    figs = [needle_heatmap_figure(grid)]
    if "full" in precisions and compared(grid):
        figs.append(needle_difference_figure(grid))
    figs.append(needle_logprob_figure(grid))
    return figs
