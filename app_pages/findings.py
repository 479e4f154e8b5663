"""Findings: each claim about KV-cache quantization with its verdict on the model, a figure and how it was
measured. Opens on the report shipped for the embedded model (assets/reports/findings/); re-runs on the
loaded model with progress and Cancel (KVDEMO_FINDINGS_QUICK_SIZES picks the quick sizes, "tiny" in the
browser test; KVDEMO_FINDINGS_CACHE=0 measures again instead of reading the cache). The work is `kvdemo.findings`; figures `kvdemo.figures`; files
`kvdemo.report`."""

import os
import tempfile
import time
from pathlib import Path

import pandas as pd
import streamlit as st

from app_pages import common
from kvdemo import findings, report
from kvdemo.configs import gpu_presets, model_configs
from kvdemo.figures.findings import findings_figures
from kvdemo.figures.ppl import ablation_frontier_figure
from kvdemo.production import ENGINES
from kvdemo.results import ablation as ablation_results
from kvdemo.results.kv_split import load_kv_split

VERDICT_ICONS = {True: ":material/check_circle:", False: ":material/cancel:", None: ":material/help:"}
VERDICT_COLORS = {True: "green", False: "red", None: "gray"}

st.title("Findings: what KV-cache quantization buys and costs, measured")

shipped = findings.load()
partial = st.session_state.get("findings_partial")
if st.session_state.get("findings_cancel") and partial and partial["found"]["measurements"]:
    # a re-run interrupted by Cancel: its finished measurements are kept and shown
    st.session_state["findings_result"] = partial["found"] | {"stopped": "cancelled"}
    st.session_state["findings_note"] = f"Cancelled: {partial['done']} of {partial['total']} measurements kept."
    st.session_state.pop("findings_partial", None)

found = st.session_state.get("findings_result") or shipped
if found is None:
    st.info("No findings yet: press **Re-run on the loaded model** below (or `python -m kvdemo findings`).")

# --- settings that re-read the numbers (no model work) -----------------------------------------------
configs, gpus = model_configs(), gpu_presets()
default = findings.DEFAULT_CONFIG
c1, c2, c3, c4 = st.columns([2, 2, 1, 2])
cfg_name = c1.selectbox(
    "Model config (capacity)", list(configs), index=list(configs).index(default["model_config"]), key="findings_config"
)
gpu_name = c2.selectbox("GPU", list(gpus), index=list(gpus).index(default["gpu"]), key="findings_gpu")
n_gpus = c3.number_input("GPUs", 1, 16, default["gpus"], key="findings_gpus")
context = c4.select_slider(
    "Context per sequence",
    [2048, 4096, 8192, 16384, 32768, 65536, 131072],
    value=default["context"],
    key="findings_context",
)
budget = st.slider(
    "Quality budget (claim 7): NLL loss vs full precision, nats/token",
    0.0,
    0.2,
    float(findings.THRESHOLDS["budget_nll_nats"]),
    0.005,
    key="findings_budget",
    help="The cheapest precision whose held-out NLL loss is within this, and whose needle loss is within "
    f"{findings.THRESHOLDS['needle_ok_nats']} nats",
)
config = {"model_config": cfg_name, "gpu": gpu_name, "gpus": int(n_gpus), "context": int(context)}

# --- re-run ----------------------------------------------------------------------------------------------
lm = common.model()
c1, c2, c3 = st.columns([2, 1, 3])
run = c1.button("Re-run on the loaded model", key="findings_run", type="primary")
c2.button("Cancel", key="findings_cancel", help="Stops the run; the finished measurements are kept")
quick = c3.toggle("Quick sizes (minutes; the full report takes ~30 min on 2 cores)", value=True, key="findings_quick")

if run:
    status, bar_slot = st.empty(), st.empty()
    st.session_state["findings_partial"] = {"found": {"measurements": {}}, "done": 0, "total": 0}

    def work():
        bar = bar_slot.progress(0.0, text="building the text and the exact states...")
        start = time.perf_counter()

        def progress(done: int, total: int, message: str) -> None:
            st.session_state["findings_partial"].update(done=done, total=total)
            bar.progress(done / max(total, 1), text=f"{done}/{total}: {message} ({time.perf_counter() - start:.0f} s)")

        def keep(partial_found: dict) -> None:
            st.session_state["findings_partial"]["found"] = partial_found

        return findings.run_findings(
            lm,
            sizes=findings.SIZES[os.environ.get("KVDEMO_FINDINGS_QUICK_SIZES", "quick")] if quick else findings.FULL,
            config=config,
            on_progress=progress,
            on_partial=keep,
            use_cache=os.environ.get("KVDEMO_FINDINGS_CACHE", "1") != "0",
        )

    try:
        out = common.run_exclusive(lm, work, status)
    finally:
        bar_slot.empty()
    st.session_state.pop("findings_partial", None)
    if out is not None:
        st.session_state["findings_result"] = out
        st.session_state["findings_note"] = f"Re-run on {out['model']}: {out['seconds']:.0f} s."
        found = out

if st.session_state.get("findings_note") and found is not shipped:
    st.info(st.session_state["findings_note"], icon=":material/info:")
if found is None:
    st.stop()

claims = findings.evaluate(found, config, budget)
view = dict(found) | {"claims": claims}
source = "the shipped report" if found is shipped else "this session's run"
st.caption(f"{findings.caption(view)} Showing {source} ({found.get('created', '')}).")
if found.get("weights_note"):
    st.caption(found["weights_note"])

st.dataframe(pd.DataFrame(report.verdict_rows(view)), hide_index=True, key="findings_table", width="stretch")

c1, c2 = st.columns(2)
c1.download_button("Download HTML report", report.render_html(view), "findings.html", "text/html", key="findings_html")
pdf_file = findings.REPORT_DIR / "findings.pdf"
if found is shipped and pdf_file.is_file():
    c2.download_button(
        "Download PDF report", pdf_file.read_bytes(), "findings.pdf", "application/pdf", key="findings_pdf"
    )
elif c2.button("Make the PDF (headless Chromium)", key="findings_make_pdf"):
    with tempfile.TemporaryDirectory() as d:
        html_path = Path(d) / "findings.html"
        html_path.write_text(report.render_html(view), encoding="utf-8")
        pdf = report.print_pdf(html_path, Path(d) / "findings.pdf")
        if pdf is None:
            c2.error("Chromium is not installed (make browser).")
        else:
            c2.download_button(
                "Download PDF report", pdf.read_bytes(), "findings.pdf", "application/pdf", key="findings_pdf"
            )

for c in claims:
    st.header(c["title"], divider="gray")
    st.markdown(f"*{c['claim']}*")
    v = c["verdict"]
    st.markdown(f"### :{VERDICT_COLORS[v['holds']]}[{v['word'].capitalize()}]")
    st.markdown(v["text"])
    for i, fig in enumerate(findings_figures(view, c["id"])):
        st.plotly_chart(fig, key=f"findings_fig_{c['id']}_{i}")
    if c["id"] == "tradeoff" and c["data"]["tradeoff"].get("production"):
        prod = c["data"]["tradeoff"]["production"]
        st.markdown("**Production settings of the pick**")
        st.dataframe(
            pd.DataFrame(
                [
                    {"engine": e, "setting": prod[e]["setting"], "match": prod[e]["match"]}
                    for e in ENGINES
                    if e in prod  # reports written before SGLang / TensorRT-LLM were mapped lack them
                ]
            ),
            hide_index=True,
            key="findings_production",
        )
    st.caption(f"How it was measured: {c['method']}")
    st.page_link(c["page"], label="Explore this on its page", icon=":material/arrow_forward:")

ablation = ablation_results.load_ablation()
if ablation is not None:
    st.header("KVQuant's methods at 4, 3 and 2 bits", divider="gray")
    st.markdown(
        "Uniform codes, pre-RoPE keys, the fp16 first token (attention sink), fitted non-uniform codebooks (nuq) "
        "with 1% outliers, a Hadamard rotation and NVFP4, each scored on the same held-out text. Each claim "
        "is judged twice: on this text's figures, and over 2,000 resamples of the text in blocks of 64 tokens. "
        "'Not settled by this text' means the difference could go either way on text like it."
    )
    st.plotly_chart(ablation_frontier_figure(ablation), key="findings_ablation_fig")
    st.dataframe(pd.DataFrame(ablation_results.claim_rows(ablation)), hide_index=True, key="findings_ablation_claims")
    st.markdown("What the formats cost: the live cache at 4,096 tokens (to the byte) and decode speed, one run.")
    st.dataframe(pd.DataFrame(ablation_results.cost_rows(ablation)), hide_index=True, key="findings_ablation_costs")
    with st.expander("Every cell of the grid"):
        st.dataframe(pd.DataFrame(ablation_results.cell_rows(ablation)), hide_index=True, key="findings_ablation_cells")
    st.caption(
        f"Measured with `{ablation.ppl.command}` on {ablation.ppl.date} (assets/reports/ablation.json), CPU, fp32; "
        "README's 'The ablation, measured' has the reading."
    )
    st.page_link(
        "app_pages/perplexity.py",
        label="Score any of these on the loaded model, on held-out prose or your document",
        icon=":material/arrow_forward:",
    )

split = load_kv_split()
if split is not None:
    st.header("Keys or values: where the loss sits", divider="gray")
    st.markdown(
        "Each precision beside its keys alone and its values alone (the other part at int8, near exact), and, "
        "where the format has the widths, the same mean bits with one bit moved between keys and values. "
        "Each role's logit KL is compared with the precision's own over 2,000 resamples of the text."
    )
    for line in split.lines():
        st.markdown(line)
    st.dataframe(pd.DataFrame(split.rows()), hide_index=True, key="findings_kv_split")
    st.caption(
        f"Measured with `{split.ppl.command}` on {split.ppl.date} (assets/reports/ppl_kv_split.json), CPU, fp32; "
        "README's 'Keys or values: where the loss sits' has the reading."
    )
