"""Attention drift: the current document (or bundled prose) at full precision vs quantized caches; layer x
head heatmap of the attention JS divergence, drift by key position and the next-token logit KL per
token. The work is `kvdemo.drift.run_drift`; figures come from `kvdemo.figures`."""

import json
import time

import pandas as pd
import streamlit as st

from app_pages import common
from kvdemo import prefill_modes, progress, runner
from kvdemo.drift import document_prompt, run_drift, unquantized
from kvdemo.figures.drift import (
    drift_js_heatmap_figure,
    drift_layer_figure,
    drift_logit_kl_figure,
    drift_position_figure,
)
from kvdemo.precision import parse_precision_list
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
QUESTION_TOKENS = 32  # the question and chat template around the document (a rough count, for the hint)
work_tokens = (tokens + QUESTION_TOKENS + new_tokens) * (len(picked) + 1)  # full precision + each picked
st.caption(progress.hint(lm, "drift", work_tokens, f"{tokens:,} tokens at {len(picked) + 1} precisions"))


def prompt_now() -> tuple[list[int], int]:
    """The chat-templated prompt of the chosen text cut to `tokens` tokens, and the text's token count."""
    from kvdemo.documents import fit_to_context
    from kvdemo.texts import prose

    text = doc["text"] if doc else prose()
    text, n, _ = fit_to_context(text, lm.tokenizer, tokens)
    return document_prompt(lm, text), n


if run:
    if not picked:
        st.error("pick at least one quantized precision")
    else:
        status = st.empty()

        def work() -> dict:
            prompt, n = prompt_now()
            specs = parse_precision_list(",".join(picked))
            bar = st.progress(0.0, text="full precision")
            done = [0]

            def show_progress(label: str) -> None:
                bar.progress(done[0] / (len(specs) + 1), text=f"running {label}")
                done[0] += 1

            start = time.perf_counter()
            out = run_drift(lm, prompt, specs, new_tokens, on_progress=show_progress, prefill_mode=prefill_mode)
            done_tokens = (out["prompt_tokens"] + out["new_tokens"]) * (len(specs) + 1)
            progress.record(lm, "drift", done_tokens, time.perf_counter() - start)
            bar.empty()
            out["document"] = doc["name"] if doc else "Pride and Prejudice"
            out["document_tokens"] = n
            return out

        result = common.run_exclusive(lm, work, status)
        if result is not None:
            st.session_state["drift_result"] = result

with st.expander("Compare prefill modes for one precision", expanded="drift_modes_result" in st.session_state):
    st.caption(
        "This text, these tokens and generated tokens, one precision, with the document stored exact and chunked "
        "against one full-precision reference. The modes differ only when the prompt spans more than one "
        f"prefill chunk ({runner.PREFILL_CHUNK:,} tokens)."
    )
    c1, c2 = st.columns([3, 1], vertical_alignment="bottom")
    m_spec = c1.selectbox("Precision", picked or [common.spec().label], key="drift_modes_precision")
    if c2.button("Compare prefill modes", key="drift_compare"):
        modes_status = st.empty()

        def compare() -> dict:
            prompt, n = prompt_now()
            return prefill_modes.drift_modes(lm, prompt, [m_spec], new_tokens) | {"document_tokens": n}

        result = common.run_exclusive(lm, compare, modes_status)
        if result is not None:
            st.session_state["drift_modes_result"] = result
    modes = st.session_state.get("drift_modes_result")
    if modes is not None:
        title = (
            f"{modes['prompt_tokens']:,}-token prompt ({modes['chunks']} prefill chunks), {modes['new_tokens']} queries"
        )
        common.prefill_modes_result(title, "drift_modes_table", drift=modes)

out = st.session_state.get("drift_result")
if out is None:
    st.info("Pick precisions and press **Run drift**.")
    st.stop()

st.subheader(f"{out['document']}: {out['prompt_tokens']:,}-token prompt, {out['new_tokens']} generated tokens")
st.caption(f"Full precision continued with: {out['generated']!r}")
st.caption(f"Prefill: {prefill_modes.describe(out.get('prefill_mode', 'chunked'))}")
keys = out["prompt_tokens"] + out["new_tokens"]
exact = unquantized(out)
if exact:
    st.info(
        f"{', '.join(exact)}: all {keys} tokens were still held in full precision (sinks and residual window), so "
        "nothing was read from quantized codes and there is no drift to see. Use more tokens or a smaller "
        "residual (sidebar, Advanced)."
    )
table = pd.DataFrame(
    [
        {
            "precision": r["precision"],
            "bits/element": r["bits_per_element"],
            "mean JS": r["mean_js"],
            "mean KL": r["mean_kl"],
            "top-10 overlap": r["topk_overlap"],
            "output cosine": r["output_cosine"],
            "top-1 agreement": r["top1_agreement"],
        }
        for r in out["results"]
    ]
)
st.dataframe(table, hide_index=True, key="drift_table")
labels = [r["precision"] for r in out["results"]]
chosen = st.selectbox("Heatmap for", labels, key="drift_heatmap_precision")
result = out["results"][labels.index(chosen)]
st.plotly_chart(drift_js_heatmap_figure(result), key="drift_heatmap")
c1, c2 = st.columns(2)
c1.plotly_chart(drift_position_figure(out), key="drift_position")
c2.plotly_chart(drift_logit_kl_figure(out), key="drift_logit_kl")
st.plotly_chart(drift_layer_figure(out), key="drift_layers")
st.download_button(
    "Download JSON", json.dumps(out, indent=2), file_name="drift.json", mime="application/json", key="drift_json"
)
