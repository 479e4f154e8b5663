"""kvdemo: the Streamlit app. `streamlit run app.py` (or `make run`).

Layout only: `st.navigation` over the pages in app_pages/, and the shared sidebar (model, device,
dtype, KV precision) drawn on every page by `app_pages.common.sidebar`. All work is done by `kvdemo`.
"""

import streamlit as st

from app_pages import common

st.set_page_config(page_title="kvdemo: KV-cache quantization", page_icon=":material/memory:", layout="wide")

PAGES = [
    st.Page("app_pages/home.py", title="Home", icon=":material/home:", default=True),
    st.Page("app_pages/findings.py", title="Findings", icon=":material/fact_check:", url_path="findings"),
    st.Page("app_pages/chat.py", title="Chat", icon=":material/chat:", url_path="chat"),
    st.Page("app_pages/needle.py", title="Needle", icon=":material/search:", url_path="needle"),
    st.Page("app_pages/perplexity.py", title="Perplexity", icon=":material/show_chart:", url_path="perplexity"),
    st.Page("app_pages/memory.py", title="Memory & headroom", icon=":material/bar_chart:", url_path="memory"),
    st.Page("app_pages/drift.py", title="Attention drift", icon=":material/grid_on:", url_path="drift"),
    st.Page("app_pages/probe.py", title="API probe", icon=":material/cloud:", url_path="probe"),
]

page = st.navigation(PAGES)
common.sidebar()
page.run()
