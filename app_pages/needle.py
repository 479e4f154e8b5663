"""Needle in a haystack: a grid of prompt lengths x needle depths, full precision beside each quantized
precision on the same tokens; heatmaps, the change vs full precision, a table of answers, CSV/JSON.
The work is `kvdemo.needle.run_grid`; figures come from `kvdemo.figures`."""

import csv
import io
import json
import time

import pandas as pd
import streamlit as st

from app_pages import common
from kvdemo import prefill_modes, progress, runner
from kvdemo.figures.needle import FULL_MISSED, needle_difference_figure, needle_heatmap_figure, needle_logprob_figure
from kvdemo.needle import (
    CSV_COLUMNS,
    KINDS,
    MAX_REPEATS,
    NeedleError,
    difference_line,
    differences_from_full,
    parse_numbers,
    run_grid,
    summarize,
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
    "needle_prefill_mode": "exact",
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
prefill_mode = st.radio(
    "Prefill: how each quantized cache stores the haystack",
    PREFILL_MODES,
    key="needle_prefill_mode",
    horizontal=True,
    captions=[prefill_modes.MODE_HELP[m] for m in PREFILL_MODES],
)

c1, c2 = st.columns([1, 5])
run = c1.button("Run grid", key="needle_run", type="primary")
c2.button("Cancel", key="needle_cancel", help="Stops the grid; the cells finished so far are kept")
try:
    planned = (
        sum(parse_numbers(st.session_state["needle_lengths"], "lengths", int))
        * len(parse_numbers(st.session_state["needle_depths"], "depths", float))
        * int(st.session_state["needle_repeats"])
    )
    st.caption(progress.hint(lm, "needle", planned * len(set(["full", *picked])), "this grid"))
except NeedleError:
    pass

partial = st.session_state.get("needle_partial")
if st.session_state.get("needle_cancel") and partial and partial["rows"]:  # a run interrupted by Cancel
    # kept beside the last complete grid, never in its place
    st.session_state["needle_cancelled"] = partial["meta"] | {
        "rows": partial["rows"],
        "summary": summarize(partial["rows"]),
        "stopped": "cancelled",
        "seconds": round(partial["seconds"], 2),
    }
    st.session_state.pop("needle_partial", None)

if run:
    status = st.empty()
    bar_slot = st.empty()  # the progress bar; emptied whatever happens, a rejected setting included
    try:
        lengths = parse_numbers(st.session_state["needle_lengths"], "lengths", int)
        depths = parse_numbers(st.session_state["needle_depths"], "depths", float)
        if not picked:
            raise NeedleError("pick at least one precision")
    except NeedleError as err:
        status.error(str(err))
    else:
        custom = kind == "custom"
        use_doc = hay == "document" and doc is not None
        meta = {
            "model": lm.name,
            "kind": kind,
            "haystack": doc["name"] if use_doc else "built in",
            "seed": int(st.session_state["needle_seed"]),
            "repeats": int(st.session_state["needle_repeats"]),
            "lengths": lengths,
            "depths": depths,
            "precisions": list(dict.fromkeys(["full", *picked])),
            "prefill_mode": prefill_mode,
            "seconds": 0.0,
            "notes": [],
        }
        st.session_state["needle_partial"] = {"meta": meta, "rows": [], "seconds": 0.0}

        def work():
            bar = bar_slot.progress(0.0, text="starting...")
            start = time.perf_counter()

            def show_progress(done: int, total: int, row) -> None:
                partial = st.session_state["needle_partial"]
                partial["rows"].append(row.to_dict())
                partial["seconds"] = time.perf_counter() - start  # what a Cancel keeps
                mark = "found" if row.correct else "missed"
                seed = f", seed {row.seed}" if meta["repeats"] > 1 else ""
                bar.progress(done / total, text=f"{done}/{total}: {row.precision} at {row.length} tokens, "
                             f"depth {row.depth:g}%{seed}: {mark}")  # fmt: skip

            result = run_grid(
                lm,
                lengths,
                depths,
                meta["precisions"],
                kind=kind,
                document=doc["text"] if use_doc else None,
                document_name=doc["name"] if use_doc else "document",
                needle=st.session_state["needle_text"] if custom else "",
                question=st.session_state["needle_question"] if custom else "",
                answer=st.session_state["needle_answer"] if custom else "",
                seed=meta["seed"],
                repeats=meta["repeats"],
                on_progress=show_progress,
                prefill_mode=prefill_mode,
            )
            progress.record(lm, "needle", sum(r.prompt_tokens for r in result.rows), result.seconds)
            return result.to_dict()

        try:
            out = common.run_exclusive(lm, work, status)
        finally:
            bar_slot.empty()
        st.session_state.pop("needle_partial", None)
        if out is not None:
            st.session_state["needle_result"] = out
            st.session_state.pop("needle_cancelled", None)  # the new complete grid supersedes it


def show(out: dict, key: str = "needle") -> None:
    """A grid's summary, heatmaps, answers and downloads (`key` prefixes the widget keys)."""
    for note in out.get("notes", []):
        st.caption(note)
    full_runs = [r for r in out["rows"] if r["precision"] == "full"]
    missed = sum(not r["correct"] for r in full_runs)
    if missed:
        runs = "cells" if out.get("repeats", 1) == 1 else "runs"
        st.warning(
            f'Full precision itself missed {missed} of {len(full_runs)} {runs} (marked "{FULL_MISSED}"): '
            "there the model fails without any quantization, so a quantized miss says nothing; compare "
            "log p(true answer) instead, or load a stronger model (sidebar).",
            icon=":material/info:",
        )
    summary = pd.DataFrame(out["summary"])
    found = {"accuracy": "found", "found_low": "found, 95% low", "found_high": "found, 95% high"}
    percent = {c: st.column_config.NumberColumn(label, format="percent") for c, label in found.items()}
    st.dataframe(summary, hide_index=True, key=f"{key}_summary", column_config=percent)
    if out.get("repeats", 1) > 1:  # found rates against full precision, paired on the same needles
        for d in differences_from_full(out["rows"]):
            st.caption(difference_line(d))
    st.plotly_chart(needle_heatmap_figure(out), key=f"{key}_heatmap")
    precisions = list(dict.fromkeys(r["precision"] for r in out["rows"]))
    if "full" in precisions and len(precisions) > 1:
        st.plotly_chart(needle_difference_figure(out), key=f"{key}_difference")
    st.plotly_chart(needle_logprob_figure(out), key=f"{key}_logprob")
    st.markdown("**Answers**")
    columns = ["length", "depth", "precision", "correct", "answer", "expected", "answer_logprob", "depth_actual"]
    columns += ["prompt_tokens"] + (["seed"] if out.get("repeats", 1) > 1 else [])
    table = pd.DataFrame(out["rows"])[columns]
    st.dataframe(table, hide_index=True, key=f"{key}_answers")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(out["rows"])
    c1, c2 = st.columns(2)
    name = "needle" if key == "needle" else "needle-partial"
    c1.download_button("Download CSV", buf.getvalue(), f"{name}.csv", "text/csv", key=f"{key}_csv")
    c2.download_button(
        "Download JSON", json.dumps(out, indent=2), f"{name}.json", "application/json", key=f"{key}_json"
    )


with st.expander("Compare prefill modes for one cell", expanded="needle_modes_result" in st.session_state):
    st.caption(
        "One cell of this grid (its needle, seed and haystack) with each quantized cache's haystack stored exact "
        "and chunked. The modes differ only when the haystack spans more than one prefill chunk "
        f"({runner.PREFILL_CHUNK:,} tokens)."
    )
    quantized = [p for p in picked if p != "full"] or [common.spec().label]
    try:
        lengths_now = parse_numbers(st.session_state["needle_lengths"], "lengths", int)
        depths_now = parse_numbers(st.session_state["needle_depths"], "depths", float)
    except NeedleError:
        lengths_now, depths_now = [], []
    if not lengths_now or not depths_now:
        st.caption("Set valid prompt lengths and depths above first.")
    else:
        c1, c2, c3, c4 = st.columns([2, 2, 2, 2], vertical_alignment="bottom")
        m_spec = c1.selectbox("Precision", quantized, key="needle_modes_precision")
        m_length = c2.selectbox("Prompt length", lengths_now, index=len(lengths_now) - 1, key="needle_modes_length")
        m_depth = c3.selectbox("Depth (%)", depths_now, key="needle_modes_depth")
        if c4.button("Compare prefill modes", key="needle_compare"):
            use_doc = hay == "document" and doc is not None
            custom = kind == "custom"
            modes_status = st.empty()
            result = common.run_exclusive(
                lm,
                lambda: prefill_modes.needle_modes(
                    lm,
                    [m_spec],
                    int(m_length),
                    float(m_depth),
                    kind,
                    haystack=doc["text"] if use_doc else None,
                    haystack_name=doc["name"] if use_doc else "document",
                    seed=int(st.session_state["needle_seed"]),
                    needle_text=st.session_state["needle_text"] if custom else "",
                    question=st.session_state["needle_question"] if custom else "",
                    answer=st.session_state["needle_answer"] if custom else "",
                ),
                modes_status,
            )
            if result is not None:
                st.session_state["needle_modes_result"] = result
    modes = st.session_state.get("needle_modes_result")
    if modes is not None:
        title = (
            f"{modes['kind']} in {modes['haystack']}, {modes['prompt_tokens']:,} tokens "
            f"({modes['chunks']} prefill chunks), depth {modes['depth']:g}%, seed {modes['seed']}"
        )
        common.prefill_modes_result(title, "needle_modes_table", cell=modes)

out = st.session_state.get("needle_result")
cancelled = st.session_state.get("needle_cancelled")
if out is None and cancelled is None:
    st.info("Set the grid and press **Run grid**.")
    st.stop()

if out is not None:
    st.subheader(f"{out['kind']} needle in {out['haystack']}: {len(out['rows'])} runs, {out['seconds']:.1f} s")
    st.caption(f"Prefill: {prefill_modes.describe(out.get('prefill_mode', 'exact'))}")
    show(out)
if cancelled is not None:
    planned = (
        len(cancelled["lengths"])
        * len(cancelled["depths"])
        * len(cancelled["precisions"])
        * cancelled.get("repeats", 1)
    )
    title = f"Cancelled run (partial): {len(cancelled['rows'])} of {planned} runs in {cancelled['seconds']:.1f} s" + (
        ", shown beside the last complete grid above" if out is not None else ""
    )
    st.info(title, icon=":material/cancel:")
    with st.expander(title, expanded=out is None):
        show(cancelled, key="needle_partial")
