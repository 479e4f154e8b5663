"""Findings: each claim about KV-cache quantization with its verdict on the model, a figure and how it was
measured. Opens on the report shipped for the embedded model (assets/reports/findings/); re-runs on the
loaded model with progress and Cancel (KVDEMO_FINDINGS_QUICK_SIZES picks the quick sizes, "tiny" in the
browser test; KVDEMO_FINDINGS_CACHE=0 measures again instead of reading the cache). The work is
`kvdemo.findings` (run, verdicts, render: the HTML and PDF files); the report `kvdemo.results.findings`;
figures `kvdemo.figures.findings`."""

import os

import pandas as pd
import streamlit as st

from app_pages import common
from kvdemo.configs import gpu_presets, model_configs
from kvdemo.figures.findings import findings_figures
from kvdemo.figures.ppl import ablation_frontier_figure
from kvdemo.findings import decision, render, run, verdicts
from kvdemo.findings.glossary import glossary_rows
from kvdemo.findings.text import FindingsError
from kvdemo.results import ablation as ablation_results
from kvdemo.results import findings as results
from kvdemo.results.kv_split import load_kv_split
from kvdemo.results.ppl import load_llamacpp_report, side_by_side

VERDICT_COLORS = {True: "green", False: "red", None: "gray"}

st.title("Findings: what KV-cache quantization buys and costs, measured")

job = common.LongRun(
    "findings", "Re-run on the loaded model", "Stops the run; the finished measurements are kept", task="findings"
)
shipped = results.load()
cancelled = job.cancelled()
if cancelled is not None:  # the last re-run was cancelled: what it finished is shown
    found = results.kept_after_cancel(cancelled["meta"]["findings"], cancelled["rows"], cancelled["seconds"])
    note = f"Cancelled: {len(cancelled['rows'])} of {cancelled['meta']['measurements']} measurements kept."
else:
    found = st.session_state.get("findings_result") or shipped
    note = None if found is shipped else f"Re-run on {found.model}: {found.seconds:.0f} s."
if found is None:
    st.info("No findings yet: press **Re-run on the loaded model** below (or `python -m kvdemo findings`).")

# --- settings that re-read the numbers (no model work) -----------------------------------------------
configs, gpus = model_configs(), gpu_presets()
default = results.DEFAULT_CONFIG
c1, c2, c3, c4 = st.columns([2, 2, 1, 2])
cfg_name = c1.selectbox(
    "Model config (capacity)", list(configs), index=list(configs).index(default["model_config"]), key="findings_config"
)
gpu_name = c2.selectbox("GPU", list(gpus), index=list(gpus).index(default["gpu"]), key="findings_gpu")
n_gpus = c3.number_input("GPUs", 1, 16, default["gpus"], key="findings_gpus")
context = c4.select_slider(
    "Context per sequence", list(results.CONTEXTS), value=default["context"], key="findings_context"
)
budget = st.slider(
    "Quality budget (claim 7): NLL loss vs full precision, nats/token",
    0.0,
    0.2,
    float(results.THRESHOLDS["budget_nll_nats"]),
    0.005,
    key="findings_budget",
    help="The cheapest precision whose held-out NLL loss is within this, and whose needle loss is within "
    f"{results.THRESHOLDS['needle_ok_nats']} nats",
)
config = results.capacity_config(cfg_name, gpu_name, int(n_gpus), int(context))

# --- re-run ----------------------------------------------------------------------------------------------
lm = common.model()
c1, c2 = st.columns([3, 3])
clicked = job.buttons(c1)
quick = c2.toggle("Quick sizes", value=True, key="findings_quick")
sizes = run.SIZES[os.environ.get("KVDEMO_FINDINGS_QUICK_SIZES", "quick")] if quick else run.FULL
job.hint(lm, run.planned_tokens(lm, sizes), "the measurements not cached yet, at most")

if clicked:
    try:
        the_plan = run.plan(lm, sizes=sizes, config=config)  # the texts and the empty report: tokenizer work only
    except FindingsError as err:
        st.error(str(err))
        the_plan = None
    out = None
    if the_plan is not None:
        meta = {"findings": the_plan.findings.to_json(), "measurements": len(the_plan.units)}
        use_cache = os.environ.get("KVDEMO_FINDINGS_CACHE", "1") != "0"
        out = job.run(lm, lambda on_progress: run.run_plan(lm, the_plan, on_progress, use_cache=use_cache), meta)
    if out is not None:
        st.session_state["findings_result"] = found = out
        note = f"Re-run on {out.model}: {out.seconds:.0f} s."

if note:
    st.info(note, icon=":material/info:")
if found is None:
    st.stop()

view = verdicts.judged(found, config, budget)
source = "the shipped report" if found is shipped else "this session's run"
st.caption(f"{verdicts.caption(view)} Showing {source} ({found.created}).")
if found.weights_note:
    st.caption(found.weights_note)

st.markdown(f"**{render.config_line(view, budget)}**")
decisions = decision.decide(view, config)
with st.container(border=True, key="findings_decision"):
    st.subheader("Should I turn it on? For long-context serving of this model")
    st.markdown(decision.summary(decisions))
    st.dataframe(pd.DataFrame(decision.rows(decisions)), hide_index=True, key="findings_decision_table")
    st.caption(f"The rule: {decision.RULE}")

st.dataframe(pd.DataFrame(render.verdict_rows(view)), hide_index=True, key="findings_table", width="stretch")

c1, c2 = st.columns(2)
c1.download_button("Download HTML report", render.render_html(view), "findings.html", "text/html", key="findings_html")
pdf_file = results.REPORT_DIR / "findings.pdf"
if render.shipped_pdf_fits(view, shipped) and pdf_file.is_file():
    c2.download_button(
        "Download PDF report", pdf_file.read_bytes(), "findings.pdf", "application/pdf", key="findings_pdf"
    )
elif c2.button("Make the PDF for this config (headless Chromium)", key="findings_make_pdf"):
    pdf = render.pdf_bytes(view)
    if pdf is not None:
        c2.download_button("Download PDF report", pdf, "findings.pdf", "application/pdf", key="findings_pdf")
    else:
        c2.error("Chromium is not installed (make browser): the PDF cannot be printed for this config here.")
        if shipped is not None and pdf_file.is_file():
            c2.download_button(
                f"Download the shipped PDF instead ({render.config_line(shipped)})",
                pdf_file.read_bytes(),
                "findings-shipped.pdf",
                "application/pdf",
                key="findings_pdf_shipped",
            )
            c2.caption(f"The shipped report of {shipped.model} ({shipped.created}), not the config chosen above.")

for c in view.claims:
    st.header(c.title, divider="gray")
    st.markdown(f"*{c.claim}*")
    st.markdown(f"### :{VERDICT_COLORS[c.verdict.holds]}[{c.verdict.word.capitalize()}]")
    st.markdown(c.verdict.text)
    for i, fig in enumerate(findings_figures(view, c.id)):
        st.plotly_chart(fig, key=f"findings_fig_{c.id}_{i}", config=render.FIGURE_CONFIG)
    production = c.data.get("tradeoff", {}).get("production") if c.id == "tradeoff" else None
    if production:
        st.markdown("**Production settings of the pick**")
        st.dataframe(pd.DataFrame(results.production_rows(production)), hide_index=True, key="findings_production")
    st.caption(f"How it was measured: {c.method}")
    st.page_link(c.page, label="Explore this on its page", icon=":material/arrow_forward:")

engines = load_llamacpp_report()
if engines is not None:
    st.header("kvdemo's formats beside llama.cpp's cache types", divider="gray")
    st.markdown(
        f"The same GGUF file and the same tokens through llama.cpp's own quantized cache ({engines.engine['engine']}, "
        "`-ctk/-ctv`, flash attention on) and through kvdemo's, at equal code widths. Each row is read against its "
        "own engine's full-precision row: the two engines' kernels differ, so only their costs compare."
    )
    st.dataframe(pd.DataFrame(side_by_side(engines)), hide_index=True, key="findings_llamacpp")
    st.caption(f"{engines.command} ({engines.date}); the protocol: {engines.engine['protocol']}.")

ablation = ablation_results.load_ablation()
if ablation is not None:
    st.header("KVQuant's methods at 4, 3 and 2 bits", divider="gray")
    st.markdown(
        "Uniform codes, pre-RoPE keys, the fp16 first token (attention sink), fitted non-uniform codebooks (nuq) "
        "with 1% outliers, a Hadamard rotation and NVFP4, each scored on the same held-out text. Each claim "
        "is judged twice: on this text's figures, and over 2,000 resamples of the text in blocks of 64 tokens. "
        "'Not settled by this text' means the difference could go either way on text like it."
    )
    st.plotly_chart(ablation_frontier_figure(ablation), key="findings_ablation_fig", config=render.FIGURE_CONFIG)
    st.dataframe(pd.DataFrame(ablation_results.claim_rows(ablation)), hide_index=True, key="findings_ablation_claims")
    st.markdown("What the formats cost: the live cache at 4,096 tokens (to the byte) and decode speed, one run.")
    st.dataframe(pd.DataFrame(ablation_results.cost_rows(ablation)), hide_index=True, key="findings_ablation_costs")
    with st.expander("Every cell of the grid"):
        st.dataframe(pd.DataFrame(ablation_results.cell_rows(ablation)), hide_index=True, key="findings_ablation_cells")
    st.caption(
        f"Measured with `{ablation.ppl.command}` on {ablation.ppl.date} (assets/reports/ablation.json), CPU, fp32; "
        "docs/methods.md's 'The ablation, measured' has the reading."
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
        "docs/methods.md's 'Keys or values: where the loss sits' has the reading."
    )

st.header("Glossary", divider="gray")
st.dataframe(pd.DataFrame(glossary_rows()), hide_index=True, key="findings_glossary", width="stretch")
