"""Attention drift: the current document (or bundled prose) at full precision vs quantized caches; layer x
head heatmap of the attention JS divergence, drift by key position and the next-token logit KL per
token. The work is `kvdemo.drift.run_drift`, its result a `kvdemo.results.drift.DriftReport`; figures come
from `kvdemo.figures`."""

import json

import pandas as pd
import streamlit as st

from app_pages import common
from kvdemo import drift, prefill_modes
from kvdemo.figures.drift import (
    drift_js_heatmap_figure,
    drift_layer_figure,
    drift_logit_kl_figure,
    drift_position_figure,
)
from kvdemo.precision import parse_precision_list
from kvdemo.results.drift import DriftReport, table_rows, unquantized
from kvdemo.runner import PREFILL_MODES

lm = common.model()
st.title("Attention drift")
st.page_link(
    "app_pages/findings.py",
    label="Findings, claims 3-5: keys vs values, per-channel keys, sinks",
    icon=":material/fact_check:",
)
st.caption(
    "The same prompt runs with a full-precision cache and with quantized caches; the same tokens are then "
    "teacher-forced into both. Per layer and head: how far the attention distribution over the keys moves "
    "(Jensen-Shannon divergence), and how far the next-token distribution moves (logit KL)."
)

doc = common.text_source("drift_source", "Bundled prose (Pride and Prejudice)", document_first=True)
budget = max(lm.max_context - 64, 64)
common.persist("drift_tokens", min(1024, budget))
common.persist("drift_new_tokens", 16)
common.persist("drift_prefill_mode", "chunked")
c1, c2, c3 = st.columns([1, 3, 1])
tokens = int(c1.number_input("Document tokens", 32, budget, step=64, key="drift_tokens"))
picked = common.precision_picker(
    "Quantized precisions", "drift_precisions", [common.spec().label, "int8", "int2"], c2, leave_out=("full",)
)
new_tokens = int(c3.number_input("Generated tokens", 1, 256, key="drift_new_tokens"))
prefill_mode = st.radio(
    "Prefill: how each quantized cache stores the document",
    PREFILL_MODES,
    key="drift_prefill_mode",
    horizontal=True,
    captions=[prefill_modes.MODE_HELP[m] for m in PREFILL_MODES],
)
run = st.button("Run drift", key="drift_run", type="primary")
planned = drift.planned_work_tokens(tokens, new_tokens, len(picked))
expected_s = common.time_hint(lm, "drift", planned, f"{tokens:,} tokens at {len(picked) + 1} precisions")


def prompt_now() -> tuple[list[int], int]:
    """The chat-templated prompt of the chosen text cut to `tokens` tokens, and the text's token count."""
    from kvdemo.documents import fit_to_context
    from kvdemo.texts import prose

    text = doc["text"] if doc else prose()
    text, n, _ = fit_to_context(text, lm.tokenizer, tokens)
    return drift.document_prompt(lm, text), n


if run:
    if not picked:
        st.error("pick at least one quantized precision")
    else:
        status, bar_slot = st.empty(), st.empty()
        seen = []

        def work() -> DriftReport:
            prompt, n = prompt_now()
            bar = bar_slot.progress(0.0, text="starting...")
            report = drift.run_drift(
                lm,
                prompt,
                parse_precision_list(",".join(picked)),
                new_tokens,
                on_progress=common.timed_bar(bar, expected_s, seen),
                prefill_mode=prefill_mode,
            )
            report.document, report.tokens = doc["name"] if doc else "Pride and Prejudice", n
            return report

        try:
            result = common.run_exclusive(lm, work, status)
        finally:
            bar_slot.empty()
            common.record_speed(lm, "drift", seen)
        if result is not None:
            st.session_state["drift_result"] = result


def precision_comparison(columns):
    """The prefill-mode comparison of one precision on this text, picked in `columns`."""
    spec = columns[0].selectbox("Precision", picked or [common.spec().label], key="drift_modes_precision")

    def compare(on_progress):
        prompt, n = prompt_now()
        modes = prefill_modes.drift_modes(lm, prompt, [spec], new_tokens, on_progress)
        modes.document_tokens = n
        return modes

    return compare


common.prefill_modes_expander(
    lm,
    "drift",
    "Compare prefill modes for one precision",
    "This text, these tokens and generated tokens, one precision, with the document stored exact and chunked "
    "against one full-precision reference.",
    "prompt",
    [3, 1],
    precision_comparison,
)

report = st.session_state.get("drift_result")
if report is None:
    st.info("Pick precisions and press **Run drift**.")
    st.stop()

st.subheader(f"{report.document}: {report.prompt_tokens:,}-token prompt, {report.new_tokens} generated tokens")
st.caption(f"Full precision continued with: {report.generated!r}")
st.caption(f"Prefill: {prefill_modes.describe(report.prefill_mode)}")
keys = report.prompt_tokens + report.new_tokens
exact = unquantized(report)
if exact:
    st.info(
        f"{', '.join(exact)}: all {keys} tokens were still held in full precision (sinks and residual window), so "
        "nothing was read from quantized codes and there is no drift to see. Use more tokens or a smaller "
        "residual (sidebar, Advanced)."
    )
st.dataframe(pd.DataFrame(table_rows(report)), hide_index=True, key="drift_table")
labels = [r.precision for r in report.results]
chosen = st.selectbox("Heatmap for", labels, key="drift_heatmap_precision")
st.plotly_chart(drift_js_heatmap_figure(report.result(chosen)), key="drift_heatmap")
c1, c2 = st.columns(2)
c1.plotly_chart(drift_position_figure(report), key="drift_position")
c2.plotly_chart(drift_logit_kl_figure(report), key="drift_logit_kl")
st.plotly_chart(drift_layer_figure(report), key="drift_layers")
st.download_button(
    "Download JSON",
    json.dumps(report.to_json(), indent=2),
    file_name="drift.json",
    mime="application/json",
    key="drift_json",
)
