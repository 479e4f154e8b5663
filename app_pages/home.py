"""Home: what KV-cache quantization is, with live numbers (KV bytes per token at the chosen precision and how
many times smaller than a 16-bit cache, on the basis `kvdemo.sizes` states), and how to load a stronger model
and which sizes fit this machine."""

import pandas as pd
import streamlit as st

from app_pages import common
from kvdemo import sizes

lm = common.model()
spec = common.spec()
full = sizes.per_token(lm, "full")
quant = sizes.per_token(lm, spec)
context = sizes.prefilled(lm, "full", lm.max_context)
bits = spec.bits_per_element(lm.head_dim)
dtype = sizes.dtype_name(lm.dtype)

st.title("kvdemo: what KV-cache quantization buys and costs")
st.markdown(
    f"""
A transformer keeps the **keys and values** of every token it has read (the *KV cache*) so that each new
token attends over them without recomputing the past. The cache grows with the context: for long
documents and many users it, not the weights, fills the GPU. Storing it in 8, 4 or 2 bits instead of 16
makes it {sizes.range_text(lm)} than a 16-bit cache on this model (bytes per token: codes plus their
16-bit scales), and the question is what that costs in answers.

Here the cache stores keys **per channel** (groups of tokens, as KIVI and KVQuant do: keys have outlier
channels) and values **per token**, keeps the newest tokens (the *residual* window) and the first
*sink* tokens at full precision, and attends directly over the packed codes.
"""
)
c1, c2, c3 = st.columns(3)
c1.metric(f"KV bytes/token, full ({dtype})", f"{full.live:,.0f} B", help=f"{full.at16:,.0f} B at 16 bits")
c2.metric(
    f"KV bytes/token at {spec.label}",
    f"{quant.live:,.0f} B",
    delta=f"{quant.times_smaller(full):.2f}x smaller than 16-bit",
    delta_color="off",
    help=f"{bits['key']:.2f} bits per key element, {bits['value']:.2f} per value element (codes + 16-bit "
    f"scales/zeros), in the quantized region; the residual window and sinks stay full precision. Against a "
    f"16-bit cache ({full.at16:,.0f} B/token)",
)
c3.metric(
    f"A full context, full precision ({dtype})",
    sizes.mib(context.live),
    help=f"{lm.max_context:,} tokens: {context.text()}",
)
st.caption(
    f"{lm.name}: 2 (K and V) x {lm.num_layers} layers x {lm.kv_heads} kv heads x {lm.head_dim} head_dim x bytes "
    f"per element. {sizes.basis_note(lm)} Change the precision in the sidebar and these numbers follow."
)

st.subheader("Pages")
st.page_link(
    "app_pages/findings.py",
    label="Findings: each claim about KV quantization, measured on this model, with its verdict",
)
st.page_link(
    "app_pages/chat.py", label="Chat: a document, answered at full precision and at your precision, side by side"
)
st.page_link(
    "app_pages/needle.py", label="Needle: find a hidden fact in long text, full vs quantized, by length and depth"
)
st.page_link(
    "app_pages/perplexity.py",
    label="Perplexity: what each precision costs in next-token prediction over held-out prose or your document",
)
st.page_link("app_pages/memory.py", label="Memory & headroom: measured bytes and how many users fit on a GPU")
st.page_link("app_pages/drift.py", label="Attention drift: where quantization moves the attention, layer by head")

st.subheader("A stronger model")
memory = sizes.machine_memory(lm.device)
st.markdown(sizes.stronger_model_text(lm, memory))
fits = pd.DataFrame(sizes.models_that_fit(memory["available"]))
st.caption(
    f"Longest context (tokens, up to each model's own) one sequence can hold in {memory['available'] / 1e9:,.1f} GB "
    f"of free {memory['name']}, beside 16-bit weights and a 10% reserve, per KV precision (16-bit full precision); "
    f"0: not even {sizes.FIT_CONTEXT:,} tokens fit. Reference configs: the Memory page plans larger GPUs."
)
st.dataframe(fits, hide_index=True, key="home_fits")
