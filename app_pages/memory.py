"""Memory & headroom: live cache bytes of the loaded model next to the formula, and how many sequences
fit on a GPU at each KV precision (`kvdemo.memory.headroom`), with the nearest production settings
(`kvdemo.production`), the count measured with real caches in a budget on this machine
(`kvdemo.measured.measure_headroom`) and, when present, the benchmark report (reports/bench.json, read by
`kvdemo.results.bench`)."""

import json
from pathlib import Path

import pandas as pd
import streamlit as st

from app_pages import common
from kvdemo import sizes
from kvdemo.configs import WEIGHT_BITS, get_gpu, get_model_config, gpu_presets, model_configs
from kvdemo.figures.bench import bench_figures
from kvdemo.figures.memory import (
    headroom_batch_speed_figure,
    headroom_concurrency_figure,
    headroom_measured_figure,
    headroom_memory_figure,
    headroom_split_figure,
    headroom_stacking_figure,
)
from kvdemo.findings.glossary import GLOSSARY
from kvdemo.measured import compare_measured
from kvdemo.memory import headroom
from kvdemo.models import config_from_model
from kvdemo.precision import parse_precision_list
from kvdemo.results import bench

ROOT = Path(__file__).resolve().parent.parent
REPORTS_DIR = ROOT / "reports"  # your `python -m kvdemo bench` runs
SHIPPED_REPORT_DIR = ROOT / "assets" / "reports"  # the report docs/benchmark.md shows
DEFAULT_PRECISIONS = ["full", "fp8", "int8", "k8v4", "int4", "int2"]

lm = common.model()
spec = common.spec()
st.title("Memory & headroom")
st.caption(f"**Headroom**: {GLOSSARY['headroom']}")
st.page_link(
    "app_pages/findings.py",
    label="Findings, claims 1, 6, 7: capacity, stacking, the trade-off",
    icon=":material/fact_check:",
)

# --- headroom: formulas, instant ------------------------------------------------------------------
st.subheader("How many sequences fit on a GPU")
st.caption(
    "A deployment plan: weights and every full-precision part of the cache at 16 bits, as a GPU serves them "
    "(the sizes measured below are live bytes in this model's dtype)."
)
configs = ["loaded", *model_configs()]
gpus = list(gpu_presets())
defaults = {
    "hr_model": "llama-3.1-8b",
    "hr_gpu": "h100-80gb",
    "hr_gpus": 1,
    "hr_wbits": 16,
    "hr_context": 32768,
    "hr_users": 1,
    "hr_reserve": 0.0,
    "hr_custom": False,
    "hr_custom_gb": 48.0,
}
for key, value in defaults.items():
    common.persist(key, value)
c1, c2, c3, c4 = st.columns(4)
cfg_name = c1.selectbox(
    "Model config",
    configs,
    key="hr_model",
    format_func=lambda n: f"loaded: {lm.name}" if n == "loaded" else model_configs()[n].display_name,
)
gpu_name = c2.selectbox("GPU", gpus, key="hr_gpu", format_func=lambda n: gpu_presets()[n].display_name)
n_gpus = int(c3.number_input("GPUs (tensor parallel)", 1, 64, key="hr_gpus"))
weight_bits = c4.selectbox("Weight bits", WEIGHT_BITS, key="hr_wbits")
c1, c2, c3, c4 = st.columns(4)
context = int(c1.number_input("Context per sequence (tokens)", 1, 10_000_000, step=1024, key="hr_context"))
users = int(c2.number_input("Users (for max context each)", 1, 100_000, key="hr_users"))
reserve = c3.number_input(
    "Reserve (GB, 0 = 10% of the GPU)", 0.0, 10_000.0, step=1.0, key="hr_reserve",
    help="memory kept for activations and the runtime",
)  # fmt: skip
custom = c4.checkbox("Custom GPU size", key="hr_custom")
custom_gb = c4.number_input("GB per GPU", 1.0, 10_000.0, key="hr_custom_gb", disabled=not custom)
specs_picked = common.precision_picker("KV precisions", "hr_precisions", [*DEFAULT_PRECISIONS, spec.label])

out = None
try:
    if not specs_picked:
        raise ValueError("pick at least one KV precision")
    cfg = config_from_model(lm) if cfg_name == "loaded" else get_model_config(cfg_name)
    gpu = get_gpu(gpu_name, custom_gb if custom else None)
    out = headroom(
        cfg,
        gpu,
        parse_precision_list(",".join(specs_picked)),
        context=context,
        gpus=n_gpus,
        users=users,
        weight_bits=int(weight_bits),
        reserve_gb=reserve or None,
    )
except ValueError as err:
    st.error(str(err))

if out is not None:
    for w in out.warnings:
        st.warning(w)
    if not out.fits:
        st.error("The weights and the reserve alone do not fit on this GPU budget.")
    st.dataframe(pd.DataFrame(out.table_rows()), hide_index=True, key="hr_table")
    c1, c2 = st.columns(2)
    c1.plotly_chart(headroom_concurrency_figure(out), key="hr_concurrency")
    c2.plotly_chart(headroom_memory_figure(out), key="hr_curve")
    c1, c2 = st.columns(2)
    c1.plotly_chart(headroom_split_figure(out), key="hr_split")
    c2.plotly_chart(headroom_stacking_figure(out), key="hr_stacking")
    st.download_button(
        "Download JSON", json.dumps(out.to_json(), indent=2), "headroom.json", "application/json", key="hr_json"
    )

    st.subheader(f"Take {spec.label} to production")
    from kvdemo.production import ENGINES, production_settings
    from kvdemo.results.ppl import measured_setting

    prod = production_settings(spec, out.model["head_dim"])
    for engine in ENGINES:
        e = prod[engine]
        with st.container(border=True):
            st.markdown(f"**{engine}** ({e['match']} match, {e['bits_per_element']['key']:.3g} / "
                        f"{e['bits_per_element']['value']:.3g} bits K / V)")  # fmt: skip
            st.code(e["setting"], language="bash")
            measured = measured_setting(engine, e["setting"])
            if measured:
                st.caption(measured)
            for gap in e["cannot_express"]:
                st.caption(f"cannot express: {gap}")
            for note in e["notes"]:
                st.caption(note)
            for alt in e.get("alternatives", []):
                st.caption(f"also: `{alt['setting']}` ({alt['when']})")

# --- measured on the loaded model -----------------------------------------------------------------
st.subheader(f"Measured: the live cache of {lm.name}")
common.persist("mem_tokens", min(1024, lm.max_context))
c1, c2 = st.columns([1, 3])
tokens = int(c1.number_input("Tokens of prose", 16, lm.max_context, step=64, key="mem_tokens"))
measure_specs = common.precision_picker("Precisions to measure", "mem_precisions", ["full", "int8", spec.label], c2)
if st.button("Measure", key="mem_run", type="primary"):
    if not measure_specs:
        st.error("pick at least one precision")
    else:
        from kvdemo.texts import prose_ids

        status = st.empty()
        result = common.run_exclusive(
            lm,
            lambda: compare_measured(lm, prose_ids(lm, tokens), parse_precision_list(",".join(measure_specs))),
            status,
        )
        if result is not None:
            st.session_state["mem_result"] = result
measured = st.session_state.get("mem_result")
if measured is not None:
    caption, rows = sizes.live_table(lm, measured)
    st.caption(caption)
    frame = pd.DataFrame(rows)
    st.dataframe(frame, hide_index=True, key="mem_table")
    st.bar_chart(frame, x="precision", y=f"live MiB ({measured.dtype})")

# --- measured headroom: real caches admitted into a budget ---------------------------------------
st.subheader("Measured on this machine: sequences in a memory budget")
st.caption(
    "Real caches, not the formula: sequences of the chosen context are admitted while the weights plus every "
    "admitted cache's allocated bytes fit the budget, each at its fullest point (residual window full); then "
    "batches of them decode together for tokens/s (`kvdemo.measured.measure_headroom`). The small random-weight "
    "model has a Llama layout (memory and speed do not depend on the weights' values)."
)
SCALE_MODELS = {"random": "Small random Llama-style model (2 layers)", "loaded": f"Loaded model ({lm.name})"}
for key, value in {"hm_model": "random", "hm_budget_gb": 0.25, "hm_context": 4096}.items():
    common.persist(key, value)
c1, c2, c3, c4 = st.columns([2, 1, 1, 3])
hm_model = c1.radio("Model", list(SCALE_MODELS), key="hm_model", format_func=SCALE_MODELS.get)
hm_budget = c2.number_input("Budget (GB)", 0.001, 1000.0, step=0.05, format="%.3f", key="hm_budget_gb")
hm_context = int(c3.number_input("Context (tokens)", 16, 1 << 20, step=1024, key="hm_context"))
hm_specs = common.precision_picker("KV precisions", "hm_precisions", ["full", "int8", "int4"], c4)


@st.cache_resource(show_spinner=False)
def _scale_model():
    from kvdemo.measured import load_scale_model

    return load_scale_model("random")


if st.button("Measure headroom", key="hm_run", type="primary"):
    from kvdemo.measured import measure_headroom

    target = lm if hm_model == "loaded" else _scale_model()
    budget_bytes = round(hm_budget * 1e9)

    def measure():
        if not hm_specs:
            raise ValueError("pick at least one KV precision")
        if hm_context > target.max_context:
            raise ValueError(f"context {hm_context:,} exceeds the model's context ({target.max_context:,} tokens)")
        if target.weight_bytes() >= budget_bytes:
            raise ValueError(
                f"the model's weights ({target.weight_bytes() / 1e9:.3f} GB) do not fit a {hm_budget:g} GB budget"
            )
        return measure_headroom(target, parse_precision_list(",".join(hm_specs)), hm_context, budget_bytes)

    hm_status = st.empty()
    with st.spinner("Admitting caches and timing batched decode..."):
        result = common.run_exclusive(target, measure, hm_status)
    if result is not None:
        st.session_state["hm_result"] = result
hm = st.session_state.get("hm_result")
if hm is not None:
    st.caption(f"{hm.model}: {hm.context:,}-token sequences in {hm.budget_bytes / 1e9:g} GB.")
    st.dataframe(pd.DataFrame(hm.table_rows()), hide_index=True, key="hm_table")
    c1, c2 = st.columns(2)
    c1.plotly_chart(headroom_measured_figure(hm), key="hm_measured")
    c2.plotly_chart(headroom_batch_speed_figure(hm), key="hm_speed")

# --- the benchmark report ------------------------------------------------------------------------
st.subheader("Benchmark: kvdemo vs transformers' QuantizedCache")
raw, source = bench.read_json(REPORTS_DIR), "your latest run (reports/bench.json)"
if raw is None:
    raw, source = bench.read_json(SHIPPED_REPORT_DIR), "shipped with kvdemo (assets/reports/bench.json)"
if raw is None:
    st.info("No benchmark report yet: run `python -m kvdemo bench` to write reports/bench.json.")
else:
    try:
        report = bench.BenchReport.from_json(raw)
        machine = report.machine
        st.caption(
            f"Report {source}: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, "
            f"{machine.get('device', '?')} {machine.get('dtype', '')}, {machine.get('date', '?')}. "
            "Run `python -m kvdemo bench` to measure this machine."
        )
        st.markdown(bench.markdown_table(report))
        for i, fig in enumerate(bench_figures(report)):
            st.plotly_chart(fig, key=f"bench_fig_{i}")
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:  # another kvdemo version
        st.warning(f"The report ({source}) has an unexpected layout ({type(err).__name__}: {err}); raw content below.")
        st.json(raw, expanded=False)
