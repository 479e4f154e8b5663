"""Needle in a haystack: a grid of prompt lengths x needle depths, full precision beside each quantized
precision on the same tokens; heatmaps, the change vs full precision, a table of answers, CSV/JSON.
The work is `kvdemo.needle.run_grid`, its result a `kvdemo.results.needle.NeedleGrid`; figures come from
`kvdemo.figures`."""

import pandas as pd
import streamlit as st

from app_pages import common
from kvdemo import needle, prefill_modes
from kvdemo.figures.needle import (
    FULL_MISSED,
    compared,
    needle_difference_figure,
    needle_heatmap_figure,
    needle_logprob_figure,
)
from kvdemo.needle import KINDS, LLAMACPP_FAILED, MAX_REPEATS, NeedleError, parse_numbers
from kvdemo.results.labels import label, readable
from kvdemo.results.needle import (
    NeedleGrid,
    NeedleRow,
    difference_line,
    differences_from_full,
    full_missed,
    grid_csv,
    grid_json,
    partial_grid,
)
from kvdemo.runner import PREFILL_MODES

lm = common.model()
st.title("Needle in a haystack")
st.page_link(
    "app_pages/findings.py",
    label="Findings, claim 2: long-range recall breaks before short chat",
    icon=":material/fact_check:",
)
st.caption(
    "A fact is hidden at a chosen depth of a long text; the model is asked for it. Each cell runs once at "
    "full precision and once per quantized precision, on exactly the same tokens. Scored by exact match and "
    "by the teacher-forced log-probability of the true answer (continuous: it moves before a pass turns "
    "into a miss). The embedded model is a weak retriever: always read the full-precision row first."
)


doc = common.document()
haystacks = ["default", "document"] if doc else ["default"]
defaults = {
    "needle_kind": "passkey",
    "needle_haystack": "default",
    "needle_lengths": "512,1024",
    "needle_depths": "0,50,100",
    "needle_seed": 0,
    "needle_repeats": 1,
    "needle_text": "The secret ingredient of the soup is cardamom.",
    "needle_question": "What is the secret ingredient of the soup?",
    "needle_answer": "cardamom",
    "needle_prefill_mode": "chunked",
    "needle_llamacpp": [],
}
for key, value in defaults.items():
    common.persist(key, value)
if st.session_state["needle_haystack"] not in haystacks:
    st.session_state["needle_haystack"] = "default"

c1, c2 = st.columns(2)
kind = c1.radio("Needle", KINDS, key="needle_kind", horizontal=True)
hay = c2.radio(
    "Haystack",
    haystacks,
    key="needle_haystack",
    horizontal=True,
    format_func=lambda h: f"Your document: {doc['name']}" if h == "document" else "Built in (filler / prose)",
)
if not doc:
    c2.caption("Choose or upload a document on the Chat page to hide the needle inside it.")
if kind == "custom":
    st.text_input("Needle sentence", key="needle_text")
    c1, c2 = st.columns(2)
    c1.text_input("Question", key="needle_question")
    c2.text_input("Expected answer (must appear in the needle)", key="needle_answer")
c1, c2, c3, c4 = st.columns([2, 2, 1, 1])
c1.text_input("Prompt lengths (tokens)", key="needle_lengths", help=f"comma-separated, up to ~{lm.max_context - 32}")
c2.text_input("Depths (% of the haystack)", key="needle_depths", help="comma-separated, 0 = start, 100 = end")
c3.number_input("Seed", 0, 1_000_000, key="needle_seed")
c4.number_input(
    "Repeats",
    1,
    MAX_REPEATS,
    key="needle_repeats",
    help="Runs per cell, each with a new needle (seeds seed, seed + 1, ...): one cell is one draw, so found "
    "counts of a small grid move by cells between runs; the summary gives each found rate a 95% interval",
)
picked = common.precision_picker(
    "Precisions (full precision is always included)",
    "needle_precisions",
    ["full", "int8", common.spec().label, "int2"],
)
offered, no_llamacpp = needle.llamacpp_choices(lm)
if offered:
    st.session_state["needle_llamacpp"] = [t for t in st.session_state["needle_llamacpp"] if t in offered]
    picked_llamacpp = st.multiselect(
        "llama.cpp KV caches (llama.cpp:f16 comes with them, their baseline)",
        offered,
        key="needle_llamacpp",
        help="llama.cpp's own quantized cache (-ctk/-ctv) on the same GGUF file and token ids; each row is read "
        "against llama.cpp's f16 row, never against kvdemo's full row (docs/llamacpp.md)",
    )
else:
    picked_llamacpp = []
    st.caption(f"llama.cpp rows: {no_llamacpp}")
prefill_mode = st.radio(
    "Prefill: how each quantized cache stores the haystack",
    PREFILL_MODES,
    key="needle_prefill_mode",
    horizontal=True,
    captions=[prefill_modes.MODE_HELP[m] for m in PREFILL_MODES],
)


def grid_numbers() -> tuple[list[int], list[float]]:
    """The lengths and depths typed above (a NeedleError says what is wrong with them)."""
    lengths = parse_numbers(st.session_state["needle_lengths"], "lengths", int)
    return lengths, parse_numbers(st.session_state["needle_depths"], "depths", float)


custom = kind == "custom"
use_doc = hay == "document" and doc is not None
repeats = int(st.session_state["needle_repeats"])
try:
    lengths, depths = grid_numbers()
    needle.check_grid(
        lm,
        lengths,
        depths,
        repeats,
        kind,
        needle=st.session_state["needle_text"] if custom else "",
        question=st.session_state["needle_question"] if custom else "",
        answer=st.session_state["needle_answer"] if custom else "",
    )
    settings_error = None if picked or picked_llamacpp else "pick at least one precision"
except NeedleError as err:
    lengths, depths, settings_error = [], [], str(err)

job = common.LongRun("needle", "Run grid", "Stops the grid; the cells finished so far are kept", task="needle")
run = job.buttons()
if settings_error is not None:  # checked before any estimate: a grid that cannot run has no time
    st.error(settings_error)
else:
    job.hint(lm, needle.work_tokens(lengths, depths, ["full", *picked, *picked_llamacpp], repeats), "this grid")

if run and settings_error is None:
    status = st.empty()
    settings = NeedleGrid(
        model=lm.name,
        kind=kind,
        haystack=doc["name"] if use_doc else "built in",
        seed=int(st.session_state["needle_seed"]),
        lengths=lengths,
        depths=depths,
        precisions=needle.contender_labels(["full", *picked, *picked_llamacpp]),
        rows=[],
        seconds=0.0,
        prefill_mode=prefill_mode,
        repeats=repeats,
    )

    def work(on_progress) -> NeedleGrid:
        return needle.run_grid(
            lm,
            lengths,
            depths,
            settings.precisions,
            kind=kind,
            document=doc["text"] if use_doc else None,
            document_name=doc["name"] if use_doc else "document",
            needle=st.session_state["needle_text"] if custom else "",
            question=st.session_state["needle_question"] if custom else "",
            answer=st.session_state["needle_answer"] if custom else "",
            seed=settings.seed,
            repeats=repeats,
            on_progress=on_progress,
            prefill_mode=prefill_mode,
        )

    result = job.run(lm, work, settings.to_json(), status)
    if result is not None:
        st.session_state["needle_result"] = result


def show(grid: NeedleGrid, key: str = "needle") -> None:
    """A grid's summary, heatmaps, answers and downloads (`key` prefixes the widget keys)."""
    for note in grid.notes:
        (st.warning if note.startswith(LLAMACPP_FAILED) else st.caption)(note)
    missed, runs = full_missed(grid.rows)
    if missed:
        what = "cells" if grid.runs_per_cell == 1 else "runs"
        st.warning(
            f'Full precision itself missed {missed} of {runs} {what} (marked "{FULL_MISSED}"): '
            "there the model fails without any quantization, so a quantized miss says nothing; compare "
            "log p(true answer) instead, or load a stronger model (sidebar).",
            icon=":material/info:",
        )
    found = [label(c) for c in ("accuracy", "found_low", "found_high")]
    percent = {c: st.column_config.NumberColumn(c, format="percent") for c in found}
    st.dataframe(pd.DataFrame(readable(grid.summary)), hide_index=True, key=f"{key}_summary", column_config=percent)
    if grid.runs_per_cell > 1:  # found rates against full precision, paired on the same needles
        for d in differences_from_full(grid.rows):
            st.caption(difference_line(d))
    st.plotly_chart(needle_heatmap_figure(grid), key=f"{key}_heatmap")
    if any(r.precision == "full" for r in grid.rows) and compared(grid):
        st.plotly_chart(needle_difference_figure(grid), key=f"{key}_difference")
    st.plotly_chart(needle_logprob_figure(grid), key=f"{key}_logprob")
    st.markdown("**Answers**")
    columns = ["length", "depth", "precision", "correct", "answer", "expected", "answer_logprob", "depth_actual"]
    columns += ["prompt_tokens"] + (["seed"] if grid.runs_per_cell > 1 else [])
    answers = pd.DataFrame([r.to_json() for r in grid.rows])[columns].rename(columns=label)
    st.dataframe(answers, hide_index=True, key=f"{key}_answers")
    c1, c2 = st.columns(2)
    name = "needle" if key == "needle" else "needle-partial"
    c1.download_button("Download CSV", grid_csv(grid), f"{name}.csv", "text/csv", key=f"{key}_csv")
    c2.download_button("Download JSON", grid_json(grid), f"{name}.json", "application/json", key=f"{key}_json")


def cell_comparison(columns):
    """The prefill-mode comparison of one cell of this grid, picked in `columns` (None without valid settings)."""
    if not lengths or not depths:
        columns[0].caption("Set valid prompt lengths and depths above first.")
        return None
    quantized = [p for p in picked if p != "full"] or [common.spec().label]
    spec = columns[0].selectbox("Precision", quantized, key="needle_modes_precision")
    length = columns[1].selectbox("Prompt length", lengths, index=len(lengths) - 1, key="needle_modes_length")
    depth = columns[2].selectbox("Depth (%)", depths, key="needle_modes_depth")
    return lambda on_progress: prefill_modes.needle_modes(
        lm,
        [spec],
        int(length),
        float(depth),
        kind,
        haystack=doc["text"] if use_doc else None,
        haystack_name=doc["name"] if use_doc else "document",
        seed=int(st.session_state["needle_seed"]),
        needle_text=st.session_state["needle_text"] if custom else "",
        question=st.session_state["needle_question"] if custom else "",
        answer=st.session_state["needle_answer"] if custom else "",
        on_progress=on_progress,
    )


common.prefill_modes_expander(
    lm,
    "needle",
    "Compare prefill modes for one cell",
    "One cell of this grid (its needle, seed and haystack) with each quantized cache's haystack stored exact and "
    "chunked.",
    "haystack",
    [2, 2, 2, 2],
    cell_comparison,
)

grid = st.session_state.get("needle_result")
cancelled = job.cancelled()
if grid is None and cancelled is None:
    st.info("Set the grid and press **Run grid**.")
    st.stop()

if grid is not None:
    st.subheader(f"{grid.kind} needle in {grid.haystack}: {len(grid.rows)} runs, {grid.seconds:.1f} s")
    st.caption(f"Prefill: {prefill_modes.describe(grid.prefill_mode)}")
    show(grid)
if cancelled is not None:
    rows = [NeedleRow.from_json(r) for r in cancelled["rows"]]
    partial = partial_grid(NeedleGrid.from_json(cancelled["meta"]), rows, cancelled["seconds"])
    title = f"Cancelled run (partial): {len(partial.rows)} of {partial.planned_runs} runs in {partial.seconds:.1f} s"
    title += ", shown beside the last complete grid above" if grid is not None else ""
    st.info(title, icon=":material/cancel:")
    with st.expander(title, expanded=grid is None):
        show(partial, key="needle_partial")
