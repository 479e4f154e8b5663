"""Perplexity: what each KV precision costs in next-token prediction over a long text (held-out prose or the
current document), every scored token attending over the stored quantized past, beside its bits per element.
The work is `kvdemo.ppl.run_ppl`, as `python -m kvdemo ppl` runs it; the figure is `kvdemo.figures`."""

import json
import time

import pandas as pd
import streamlit as st

from app_pages import common
from kvdemo import ppl, progress
from kvdemo.documents import token_ids
from kvdemo.figures.ppl import ppl_frontier_figure

lm = common.model()
st.title("Perplexity")
st.page_link(
    "app_pages/findings.py",
    label="Findings: KVQuant's methods at 4, 3 and 2 bits, measured",
    icon=":material/fact_check:",
)
st.caption(
    "The first quarter of the text is stored into each cache as the model's prefill stores it; the rest is fed 16 "
    "tokens at a time, as decoding feeds it, so every scored token attends over what the cache stored, quantized "
    "past included. Scored: the text's second half. Logit KL: how far each next-token distribution moves from full "
    "precision's. The 95% intervals resample blocks of the text, so they say how far the figures carry to text like it."
)

doc = common.text_source("ppl_source", ppl.HELD_OUT_NAME)
doc_ids = token_ids(doc["text"], lm.tokenizer) if doc else None
available = ppl.longest_text(lm, None if doc_ids is None else len(doc_ids))
c1, c2 = st.columns([1, 4])
tokens = None  # None: this text is too short to score
if available < ppl.MIN_TOKENS:
    c1.error(f"{doc['name']} has {len(doc_ids):,} tokens; scoring needs at least {ppl.MIN_TOKENS}.")
else:
    common.persist("ppl_tokens", min(2048, available))
    st.session_state["ppl_tokens"] = min(max(st.session_state["ppl_tokens"], ppl.MIN_TOKENS), available)
    tokens = int(c1.number_input("Text tokens", ppl.MIN_TOKENS, available, step=256, key="ppl_tokens"))
picked = common.precision_picker(
    "Quantized precisions (full precision always runs first, as the reference)",
    "ppl_precisions",
    [common.spec().label, "int4", "nuq3:o1", "int2"],
    c2,
    leave_out=("full",),
)
c1, c2 = st.columns([1, 5])
run = c1.button("Run", key="ppl_run", type="primary", disabled=tokens is None)
c2.button("Cancel", key="ppl_cancel", help="Stops the run; the precisions finished so far are kept")
if tokens is not None:
    prefix = ppl.default_prefix(tokens)
    planned_tokens = ppl.work_tokens(tokens, prefix, len(picked))
    what = f"{tokens:,} tokens at {len(picked) + 1} precisions ({prefix:,} stored exactly, {tokens - prefix:,} decoded)"
    st.caption(progress.hint(lm, "ppl", planned_tokens, what))

partial = st.session_state.get("ppl_partial")
if st.session_state.get("ppl_cancel") and partial and partial["rows"]:  # a run interrupted by Cancel
    st.session_state["ppl_cancelled"] = partial
    st.session_state.pop("ppl_partial", None)

if run:
    status = st.empty()
    bar_slot = st.empty()
    if not picked:
        status.error("pick at least one quantized precision")
    else:
        name = doc["name"] if doc else ppl.HELD_OUT_NAME
        planned = len(picked) + 1
        st.session_state["ppl_partial"] = {"text": name, "tokens": tokens, "planned": planned, "rows": []}

        def work() -> dict:
            bar = bar_slot.progress(0.0, text="full precision: the exact prefix")
            start = time.perf_counter()
            rows = st.session_state["ppl_partial"]["rows"]

            now = {"what": "full precision", "shown": -1}

            def show_progress(message: str) -> None:
                now["what"], now["shown"] = message, -1
                step(0.0)

            def step(fraction: float) -> None:  # the bar moves by whole percents, not on every 16-token chunk
                done = (len(rows) + fraction) / planned
                if int(done * 100) != now["shown"]:
                    now["shown"] = int(done * 100)
                    bar.progress(done, text=f"{len(rows)}/{planned} done; now {now['what']} ({fraction:.0%})")

            text = (name, doc_ids) if doc else None
            out = ppl.run_ppl(
                lm, picked, tokens, prefix, on_progress=show_progress, on_row=rows.append, on_step=step, text=text
            )
            progress.record(lm, "ppl", planned_tokens, time.perf_counter() - start)
            return out

        try:
            out = common.run_exclusive(lm, work, status)
        finally:
            bar_slot.empty()
        st.session_state.pop("ppl_partial", None)
        if out is not None:
            st.session_state["ppl_result"] = out
            st.session_state.pop("ppl_cancelled", None)  # the new complete run supersedes it

cancelled = st.session_state.get("ppl_cancelled")
if cancelled is not None:
    st.info(
        f"Cancelled run on {cancelled['text']} ({cancelled['tokens']:,} tokens): {len(cancelled['rows'])} of "
        f"{cancelled['planned']} precisions finished. Intervals need the whole run.",
        icon=":material/cancel:",
    )
    st.dataframe(pd.DataFrame(ppl.result_rows(cancelled["rows"])), hide_index=True, key="ppl_partial_table")

out = st.session_state.get("ppl_result")
if out is None:
    if cancelled is None:
        st.info("Pick precisions and press **Run**.")
    st.stop()

lo, hi = out["scored_positions"]
st.subheader(f"{out.get('text', ppl.HELD_OUT_NAME)}: tokens {lo:,} to {hi:,} scored")
table = pd.DataFrame(ppl.result_rows(out["results"]))
st.dataframe(table, hide_index=True, key="ppl_table")
st.caption(ppl.interval_note(out))
if len(out["results"]) > 1:
    st.plotly_chart(ppl_frontier_figure(out), key="ppl_frontier")
if "codebooks" in out:
    st.caption(f"nuq levels: {out['codebooks']}")
c1, c2 = st.columns(2)
c1.download_button(
    "Download JSON", json.dumps(out, indent=2), file_name="ppl.json", mime="application/json", key="ppl_json"
)
c2.download_button(
    "Download CSV",
    table.to_csv(index=False),
    file_name="ppl.csv",
    mime="text/csv",
    key="ppl_csv",
)
