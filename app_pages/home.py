"""Home: what KV-cache quantization is, with one live number (KV bytes per token at the chosen precision)."""

import streamlit as st

from app_pages import common

lm = common.model()
spec = common.spec()
fp16 = lm.kv_bytes_per_token()
quant = lm.kv_bytes_per_token(spec)
bits = spec.bits_per_element(lm.head_dim)

st.title("kvdemo: what KV-cache quantization buys and costs")
st.markdown(
    """
A transformer keeps the **keys and values** of every token it has read (the *KV cache*) so that each new
token attends over them without recomputing the past. The cache grows with the context: for long
documents and many users it, not the weights, fills the GPU. Storing it in 8, 4 or 2 bits instead of 16
makes it 2-7x smaller, and the question is what that costs in answers.

Here the cache stores keys **per channel** (groups of tokens, as KIVI and KVQuant do: keys have outlier
channels) and values **per token**, keeps the newest tokens (the *residual* window) and the first
*sink* tokens at full precision, and attends directly over the packed codes.
"""
)
c1, c2, c3 = st.columns(3)
c1.metric("KV bytes/token at 16 bit", f"{fp16:,.0f} B")
c2.metric(
    f"KV bytes/token at {spec.label}",
    f"{quant:,.0f} B",
    delta=f"{fp16 / quant:.2f}x smaller",
    delta_color="off",
    help=f"{bits['key']:.2f} bits per key element, {bits['value']:.2f} per value element (codes + scales/zeros)",
)
c3.metric("A full 16-bit context", f"{fp16 * lm.max_context / 2**20:,.0f} MiB", help=f"{lm.max_context:,} tokens")
st.caption(
    f"{lm.name}: 2 (K and V) x {lm.num_layers} layers x {lm.kv_heads} kv heads x {lm.head_dim} head_dim x bytes "
    "per element. Change the precision in the sidebar and this number follows."
)

st.subheader("Pages")
st.page_link(
    "app_pages/chat.py", label="Chat: a document, answered at full precision and at your precision, side by side"
)
st.page_link(
    "app_pages/needle.py", label="Needle: find a hidden fact in long text, full vs quantized, by length and depth"
)
st.page_link("app_pages/memory.py", label="Memory & headroom: measured bytes and how many users fit on a GPU")
st.page_link("app_pages/drift.py", label="Attention drift: where quantization moves the attention, layer by head")
