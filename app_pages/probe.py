"""API probe: the needle grid asked of OpenAI-compatible endpoints (yours, a provider's, two engines side by
side), found rates with intervals, heatmaps and the difference map, CSV/JSON. The work is
`kvdemo.probe.run_probe`, its result a `kvdemo.results.probe.ProbeReport`; the figures are the Needle page's."""

import pandas as pd
import streamlit as st

from app_pages import common
from kvdemo.figures.needle import needle_difference_figure, needle_heatmap_figure
from kvdemo.needle import KINDS, MAX_REPEATS, parse_numbers
from kvdemo.probe import (
    ECHO_TEMPLATES,
    LOGPROB_LABELS,
    LOGPROB_PATHS,
    MAX_CONCURRENCY,
    key_status,
    parse_endpoints,
    resolve_template,
    run_probe,
)
from kvdemo.results.needle import difference_line
from kvdemo.results.probe import (
    ProbeCell,
    ProbeReport,
    endpoint_differences,
    errors,
    failure_line,
    found_rates,
    needle_grid,
    partial_report,
    report_csv,
    report_json,
)

st.title("API probe")
st.caption(
    "The needle grid (passkey, RULER multikey or your own needle) asked of OpenAI-compatible endpoints through "
    "chat completions, the same prompts to each. Lengths are approximate: prompts are sized by an estimate of "
    "the endpoint's tokens, and each cell records the prompt tokens the endpoint counted (`usage`). Keys are "
    "read from environment variables of the server running this app: name the variable, never paste a key."
)

defaults = {
    "probe_endpoints": "",
    "probe_kind": "passkey",
    "probe_lengths": "1024,4096,16384",
    "probe_depths": "0,50,100",
    "probe_repeats": 1,
    "probe_concurrency": 2,
    "probe_timeout": 120,
    "probe_retries": 3,
    "probe_logprobs": "chat",
    "probe_echo_template": "plain",
    "probe_needle": "The secret ingredient of the soup is cardamom.",
    "probe_question": "What is the secret ingredient of the soup?",
    "probe_answer": "cardamom",
}
for key, value in defaults.items():
    common.persist(key, value)

st.text_area(
    "Endpoints, one per line: NAME=BASE_URL,MODEL[,KEY_ENV]",
    key="probe_endpoints",
    placeholder="local=http://127.0.0.1:8080/v1,llama\nprovider=https://api.example.com/v1,some-model,PROVIDER_KEY",
    help="KEY_ENV is the name of the environment variable holding the key (sent as a Bearer token)",
)
try:
    endpoints = parse_endpoints(st.session_state["probe_endpoints"])
    endpoint_error = None if endpoints else "add at least one endpoint"
except ValueError as err:
    endpoints, endpoint_error = [], str(err)
if endpoint_error and st.session_state["probe_endpoints"].strip():
    st.error(endpoint_error)
if endpoints:
    table = [{"name": e.name, "base URL": e.base_url, "model": e.model, "key": key_status(e)} for e in endpoints]
    st.dataframe(pd.DataFrame(table), hide_index=True, key="probe_endpoint_table")

kind = st.radio("Needle", KINDS, key="probe_kind", horizontal=True)
if kind == "custom":
    st.text_input("Needle sentence", key="probe_needle")
    c1, c2 = st.columns(2)
    c1.text_input("Question", key="probe_question")
    c2.text_input("Expected answer (must appear in the needle)", key="probe_answer")
doc = common.document()
use_doc = doc is not None and st.checkbox(f"Hide the needle in your document ({doc['name']})", key="probe_use_doc")
c1, c2, c3 = st.columns([2, 2, 1])
c1.text_input("Prompt lengths (estimated tokens)", key="probe_lengths", help="comma-separated")
c2.text_input("Depths (% of the haystack)", key="probe_depths", help="comma-separated, 0 = start, 100 = end")
c3.number_input("Repeats", 1, MAX_REPEATS, key="probe_repeats", help="runs per cell, a new needle each")
c1, c2, c3 = st.columns(3)
c1.number_input("Requests in flight per endpoint", 1, MAX_CONCURRENCY, key="probe_concurrency")
c2.number_input("Timeout per request (s)", 1, 3600, key="probe_timeout")
c3.number_input("Retries (429, 5xx, timeouts)", 0, 10, key="probe_retries")
logprobs = st.radio(
    "Answer log-prob",
    LOGPROB_PATHS,
    format_func=LOGPROB_LABELS.get,
    key="probe_logprobs",
    horizontal=True,
    help="echo sends each answered prompt again to BASE_URL/completions with the true answer after it and reads "
    "the log-probs of its echoed tokens: the needle page's log p(answer), for misses too",
)
if logprobs == "echo":
    st.text_input(
        "Echo template",
        key="probe_echo_template",
        help=f"{' or '.join(ECHO_TEMPLATES)}, or your model's chat template up to the assistant's turn with {{prompt}} "
        "where the needle's user message goes (\\n for a newline)",
    )

try:
    lengths = parse_numbers(st.session_state["probe_lengths"], "lengths", int)
    depths = parse_numbers(st.session_state["probe_depths"], "depths", float)
    if logprobs == "echo":
        resolve_template(st.session_state["probe_echo_template"])
    settings_error = endpoint_error
except ValueError as err:  # NeedleError is one
    lengths, depths, settings_error = [], [], str(err)

job = common.LongRun("probe", "Run probe", "Stops sending requests; the cells answered so far are kept")
if job.buttons():
    status = st.empty()
    if settings_error is not None:
        status.error(settings_error)
    else:
        custom = kind == "custom"
        planned = ProbeReport(
            endpoints=[e.to_json() for e in endpoints],
            kind=kind,
            haystack=doc["name"] if use_doc else "built in",
            lengths=sorted(lengths),
            depths=depths,
            seed=0,
            repeats=int(st.session_state["probe_repeats"]),
            cells=[],
            seconds=0.0,
        )
        result = job.run(
            None,
            lambda on_progress: run_probe(
                endpoints,
                lengths,
                depths,
                kind=kind,
                document=doc["text"] if use_doc else None,
                document_name=doc["name"] if use_doc else "document",
                needle=st.session_state["probe_needle"] if custom else "",
                question=st.session_state["probe_question"] if custom else "",
                answer=st.session_state["probe_answer"] if custom else "",
                repeats=planned.repeats,
                concurrency=int(st.session_state["probe_concurrency"]),
                timeout_s=float(st.session_state["probe_timeout"]),
                retries=int(st.session_state["probe_retries"]),
                logprobs=logprobs,
                echo_template=st.session_state["probe_echo_template"],
                on_progress=on_progress,
            ),
            planned.to_json(),
            status,
        )
        if result is not None:
            st.session_state["probe_result"] = result


def show(report: ProbeReport, key: str = "probe") -> None:
    """A probe's failures, found rates, heatmaps, difference map, cells and downloads (`key` prefixes widget keys)."""
    for failure in errors(report.cells):
        st.warning(failure_line(failure), icon=":material/error:")
    for note in report.notes:
        st.caption(note)
    percent = {c: st.column_config.NumberColumn(c, format="percent") for c in ("rate", "low", "high")}
    for by in ("all", "length", "depth"):
        st.dataframe(pd.DataFrame(found_rates(report.cells, by)), hide_index=True, column_config=percent,
                     key=f"{key}_rates_{by}")  # fmt: skip
    for d in endpoint_differences(report):
        st.caption(difference_line(d))
    grid = needle_grid(report)
    if grid.rows:
        st.plotly_chart(needle_heatmap_figure(grid), key=f"{key}_heatmap")
        answered = list(dict.fromkeys(r.precision for r in grid.rows))
        if len(answered) > 1:
            base = st.selectbox("Difference map against", answered, key=f"{key}_baseline")
            st.plotly_chart(needle_difference_figure(grid, base, "correct"), key=f"{key}_difference")
    st.markdown("**Cells**")
    st.dataframe(pd.DataFrame([c.to_json() for c in report.cells]), hide_index=True, key=f"{key}_cells")
    c1, c2 = st.columns(2)
    c1.download_button("Download CSV", report_csv(report), f"{key}.csv", "text/csv", key=f"{key}_csv")
    c2.download_button("Download JSON", report_json(report), f"{key}.json", "application/json", key=f"{key}_json")


report = st.session_state.get("probe_result")
cancelled = job.cancelled()
if report is None and cancelled is None:
    st.info("Add endpoints, set the grid and press **Run probe**.")
    st.stop()
if report is not None:
    st.subheader(f"{report.kind} needle: {len(report.cells)} cells, {report.seconds:.1f} s")
    show(report)
if cancelled is not None:
    cells = [ProbeCell.from_json(c) for c in cancelled["rows"]]
    partial = partial_report(ProbeReport.from_json(cancelled["meta"]), cells, cancelled["seconds"])
    title = (
        f"Cancelled probe (partial): {len(partial.cells)} of {partial.planned_cells} cells in {partial.seconds:.1f} s"
    )
    st.info(title, icon=":material/cancel:")
    with st.expander(title, expanded=report is None):
        show(partial, key="probe_partial")
