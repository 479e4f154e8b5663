"""Perplexity: what each KV precision costs in next-token prediction over a long text (held-out prose or the
current document), every scored token attending over the stored quantized past, beside its bits per element.
The work is `kvdemo.ppl.run_ppl`, as `python -m kvdemo ppl` runs it; its report and tables are
`kvdemo.results.ppl`, the figure `kvdemo.figures.ppl`."""

import json

import pandas as pd
import streamlit as st

from app_pages import common
from kvdemo import ppl
from kvdemo.documents import token_ids
from kvdemo.figures.ppl import ppl_frontier_figure
from kvdemo.results.ppl import HELD_OUT_NAME, PplRow, interval_note, result_rows, size_note

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

doc = common.text_source("ppl_source", HELD_OUT_NAME)
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
job = common.LongRun("ppl", "Run", "Stops the run; the precisions finished so far are kept", task="ppl")
run = job.buttons(disabled=tokens is None)
if tokens is not None:
    prefix = ppl.default_prefix(tokens)
    planned_tokens = ppl.work_tokens(tokens, prefix, len(picked))
    what = f"{tokens:,} tokens at {len(picked) + 1} precisions ({prefix:,} stored exactly, {tokens - prefix:,} decoded)"
    job.hint(lm, planned_tokens, what)

if run:
    if not picked:
        st.error("pick at least one quantized precision")
    else:
        name = doc["name"] if doc else HELD_OUT_NAME
        text = (name, doc_ids) if doc else None
        meta = {"text": name, "tokens": tokens, "planned": len(picked) + 1}
        out = job.run(
            lm, lambda on_progress: ppl.run_ppl(lm, picked, tokens, prefix, text=text, on_progress=on_progress), meta
        )
        if out is not None:
            st.session_state["ppl_result"] = out

cancelled = job.cancelled()
if cancelled is not None:
    meta = cancelled["meta"]
    st.info(
        f"Cancelled run on {meta['text']} ({meta['tokens']:,} tokens): {len(cancelled['rows'])} of "
        f"{meta['planned']} precisions finished. Intervals need the whole run.",
        icon=":material/cancel:",
    )
    rows = [PplRow.from_json(r) for r in cancelled["rows"]]
    st.dataframe(pd.DataFrame(result_rows(rows)), hide_index=True, key="ppl_partial_table")

out = st.session_state.get("ppl_result")
if out is None:
    if cancelled is None:
        st.info("Pick precisions and press **Run**.")
    st.stop()

lo, hi = out.scored_positions
st.subheader(f"{out.text_name}: tokens {lo:,} to {hi:,} scored")
table = pd.DataFrame(result_rows(out.results))
st.dataframe(table, hide_index=True, key="ppl_table")
st.caption(interval_note(out))
st.caption(size_note(out))
if len(out.results) > 1:
    st.plotly_chart(ppl_frontier_figure(out), key="ppl_frontier")
if out.codebooks is not None:
    st.caption(f"nuq levels: {out.codebooks}")
c1, c2 = st.columns(2)
c1.download_button(
    "Download JSON", json.dumps(out.to_json(), indent=2), file_name="ppl.json", mime="application/json", key="ppl_json"
)
c2.download_button(
    "Download CSV",
    table.to_csv(index=False),
    file_name="ppl.csv",
    mime="text/csv",
    key="ppl_csv",
)
