"""Streamlit helpers shared by every page: the sidebar (model, device, dtype, KV precision), the model
status card, the current document (upload or bundled sample) and small display helpers.

Layout only: loading, parsing, quantizing and generating all happen in `kvdemo`. Everything a
session owns (its chat, its document, its precision) lives in `st.session_state`, so sessions never
see each other's data; the loaded model is shared through `st.cache_resource` and guarded by its lock
(`kvdemo.models.model_lock`) for one generation at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import html
from collections.abc import Callable
from typing import TypeVar

import pandas as pd
import streamlit as st
import torch

from kvdemo import formats, rates, runner
from kvdemo.chat.session import quantized_presets
from kvdemo.documents import DocumentError, HeldDocument, document_budget, extract_bytes, hold_document, truncation_note
from kvdemo.models import DTYPES, LoadedModel, ModelLoadError, load_model, model_lock
from kvdemo.precision import (
    DEFAULT_GROUP,
    DEFAULT_RESIDUAL,
    DEFAULT_SINKS,
    GROUP_SIZES,
    KEY_AXES,
    PRESETS,
    PrecisionSpec,
    parse_precision,
    spec_from_options,
)
from kvdemo.progress import Progress, ProgressFn
from kvdemo.results.prefill_modes import DriftModes, NeedleModes, headlines, summary_rows

MODEL_KINDS = {"embedded": "Embedded (SmolLM2-135M)", "hf": "Hugging Face id", "folder": "Local folder"}
DEVICES = ("auto", "cpu", "cuda")
DTYPE_CHOICES = ("auto", *DTYPES)
DEFAULT_PRESET = "int4"
MAX_OUTLIERS = 5.0  # percent of the elements the sidebar lets stay exact
AS_PRESET = "as the preset"  # the key / value format selects' default: the preset's own format
DEFAULT_MODEL_KEY = ("embedded", "auto", "auto")  # (source, device, dtype)
SAMPLE_TOKENS = 1024  # default length of the bundled sample document
PERSISTED = "_persisted_widget_keys"
DOC_TYPES = ["txt", "text", "md", "markdown", "pdf", "docx", "html", "htm"]


# --- the model ------------------------------------------------------------------------------------
@st.cache_resource(show_spinner=False, max_entries=2)
def _load(source: str, device: str, dtype: str) -> LoadedModel:
    """One LoadedModel per (source, device, dtype) for the whole server; failures are not cached."""
    return load_model(source, device=device, dtype=dtype)


def model() -> LoadedModel:
    """The model this session uses (loaded once per server); stops the page with a message if it cannot load."""
    key = st.session_state.setdefault("model_key", DEFAULT_MODEL_KEY)
    try:
        with st.spinner(f"Loading {key[0]} (the first load of the embedded model converts it, ~40 s)..."):
            return _load(*key)
    except ModelLoadError as err:
        st.error(f"Model: {err}")
        if key != DEFAULT_MODEL_KEY:
            st.session_state["model_key"] = DEFAULT_MODEL_KEY
            st.info("Switched back to the embedded model: reload the page.")
        st.stop()


def _model_section() -> None:
    st.subheader("Model")
    kind = st.radio(
        "Source", list(MODEL_KINDS), format_func=MODEL_KINDS.get, key="model_kind", label_visibility="collapsed"
    )
    path = ""
    if kind == "hf":
        path = st.text_input("Model id", placeholder="HuggingFaceTB/SmolLM2-360M-Instruct", key="model_hf_id")
    elif kind == "folder":
        path = st.text_input("Folder with safetensors weights", placeholder="/models/my-llama", key="model_folder")
    c1, c2 = st.columns(2)
    device = c1.selectbox("Device", DEVICES, key="model_device")
    dtype = c2.selectbox("Weights dtype", DTYPE_CHOICES, key="model_dtype")
    if st.button("Load model", key="model_load", width="stretch"):
        source = "embedded" if kind == "embedded" else path.strip()
        if not source:
            st.session_state["model_error"] = f"enter a {MODEL_KINDS[kind].lower()} first"
        else:
            try:
                with st.spinner(f"Loading {source}..."):
                    _load(source, device, dtype)
            except ModelLoadError as err:
                st.session_state["model_error"] = f"{err} (kept the previous model)"
            else:
                st.session_state["model_key"] = (source, device, dtype)
                st.session_state.pop("model_error", None)
    if st.session_state.get("model_error"):
        st.error(st.session_state["model_error"])


# --- the KV precision -----------------------------------------------------------------------------
def _precision_section() -> PrecisionSpec | None:
    """The precision widgets -> the spec they describe, or None (the reason shown) when they describe none."""
    st.subheader("KV precision")
    presets = quantized_presets()
    st.selectbox(
        "Compared with full precision",
        presets,
        index=presets.index(DEFAULT_PRESET),
        key="kv_preset",
        help="k8v4 = 8-bit keys, 4-bit values. fp8 = e4m3 with a scale per group. nuq = non-uniform levels "
        "fitted per layer (KVQuant); nvfp4 = E2M1 codes with an E4M3 scale per 16 channels.",
    )
    with st.expander("Advanced", expanded=False):
        parts = st.columns(2)
        for col, part in zip(parts, ("key", "value"), strict=True):
            col.selectbox(
                f"{part.title()} format", [AS_PRESET, *formats.names()[1:]], key=f"kv_{part}_format",
                help=f"store the {part}s in this format instead of the preset's (e.g. nuq4 keys with nuq2 "
                "values: `knuq4vnuq2`)",
            )  # fmt: skip
        st.selectbox("Group size", GROUP_SIZES, index=GROUP_SIZES.index(DEFAULT_GROUP), key="kv_group")
        st.radio(
            "Key groups", KEY_AXES, key="kv_key_axis", horizontal=True, help="channel: KIVI/KVQuant per-channel keys"
        )
        st.number_input(
            "Residual (full-precision newest tokens)", 0, 8192, DEFAULT_RESIDUAL, step=16, key="kv_residual"
        )
        st.number_input("Sink tokens (full precision)", 0, 255, DEFAULT_SINKS, step=1, key="kv_sinks")
        st.number_input(
            "Outliers kept exact (%)", 0.0, MAX_OUTLIERS, 0.0, step=0.5, key="kv_outliers",
            help="dense-and-sparse (KVQuant): this share of each token's channels stays exact as sparse fp16 "
            "corrections; the codes cover the narrowed range (integer and nuq formats)",
        )  # fmt: skip
        st.checkbox("Pre-RoPE keys", key="kv_prerope", help="keys quantized before the rotary embedding (KVQuant)")
        st.checkbox(
            "Hadamard rotation", key="kv_hadamard",
            help="keys, queries and values turned by a Hadamard matrix before quantization (QuaRot); "
            "needs a power-of-two head_dim",
        )  # fmt: skip
    try:
        return spec_from_options(
            st.session_state["kv_preset"],
            group_size=int(st.session_state["kv_group"]),
            key_axis=st.session_state["kv_key_axis"],
            residual=int(st.session_state["kv_residual"]),
            sinks=int(st.session_state["kv_sinks"]),
            outliers=float(st.session_state["kv_outliers"]),
            pre_rope=bool(st.session_state["kv_prerope"]),
            hadamard=bool(st.session_state["kv_hadamard"]),
            key_format=_format_choice("kv_key_format"),
            value_format=_format_choice("kv_value_format"),
        )
    except ValueError as err:
        _keep_previous_spec(err)
        return None


def _format_choice(key: str) -> str | None:
    chosen = st.session_state[key]
    return None if chosen == AS_PRESET else chosen


def _keep_previous_spec(err: Exception) -> None:
    prev = st.session_state.get("spec", PRESETS[DEFAULT_PRESET])
    st.error(f"{str(err).rstrip('.')}. Still using {prev.label}.")
    st.session_state.setdefault("spec", prev)


def _accept_spec(candidate: PrecisionSpec | None, lm: LoadedModel) -> None:
    """Make `candidate` the session's spec once the loaded model can take it (pre-RoPE keys need the model's
    rotary embedding, Hadamard a power-of-two head_dim: `runner.new_cache` says why not)."""
    if candidate is None:
        return
    if candidate.pre_rope or candidate.hadamard:
        from kvdemo.runner import new_cache

        try:
            new_cache(lm, candidate)
        except ValueError as err:
            _keep_previous_spec(err)
            return
    st.session_state["spec"] = candidate


def _codebook_section(lm: LoadedModel) -> None:
    """For a nuq spec: which codebooks the caches use; buttons to fit this model's own when it has none and to
    forget a fit of the user's (back to the shipped file or NormalFloat). `document_picker` offers a fit on the
    uploaded document."""
    if not any(spec().codebook_levels().values()):
        return
    from kvdemo import codebooks
    from kvdemo.calibration import default_path, forget_calibration

    done = st.session_state.pop("kv_calibrated", None)
    if done is not None:
        st.success(f"Saved {done['tensors']} codebooks to {done['path']} in {done['seconds']:.0f} s.")
    books = codebooks.for_model(lm)
    st.caption(f"nuq codebooks: {codebooks.describe(books)}")
    if not books.fitted and st.button("Calibrate codebooks for this model", key="kv_calibrate"):
        _calibrate(lm)
    if default_path(lm).is_file():
        shipped = (codebooks.ASSET_DIR / codebooks.file_name(lm.source)).is_file()
        label = "Back to the shipped codebooks" if shipped else "Forget this calibration (NormalFloat levels)"
        if st.button(label, key="kv_forget_calibration"):
            forget_calibration(lm)
            st.rerun()


def _calibrate(lm: LoadedModel, document: tuple[str, str] | None = None) -> None:
    """Fit the model's codebooks (on the bundled prose, or on `document`: (name, text)) with a progress bar."""
    from kvdemo.calibration import calibrate_to_file

    bar = st.progress(0.0, text="Calibrating: one forward and one backward pass, then the k-means per layer")

    def progress(p: Progress) -> None:
        bar.progress(p.fraction, text=f"Calibrating: {p.text()}")

    result = run_exclusive(lm, lambda: calibrate_to_file(lm, on_progress=progress, document=document))
    bar.empty()
    if result is not None:
        st.session_state["kv_calibrated"] = result
        st.rerun()


def spec() -> PrecisionSpec:
    """The KV precision this session compares with full precision."""
    return st.session_state.get("spec", PRESETS[DEFAULT_PRESET])


def _status_card(lm: LoadedModel) -> None:
    """The model and its KV bytes per token: live bytes in the model's dtype, and how many times smaller than a
    16-bit cache of the same tokens (`kvdemo.sizes.CacheSize.times_smaller`)."""
    from kvdemo import sizes

    s = spec()
    full, quant = sizes.per_token(lm, "full"), sizes.per_token(lm, s)

    def per_token(b: float) -> str:
        return f"{b:,.0f} B"

    with st.container(border=True, key="model_status"):
        st.markdown(f"**{lm.name}**")
        st.caption(
            f"{lm.num_layers} layers · {lm.kv_heads} kv heads · head_dim {lm.head_dim} · "
            f"context {lm.max_context:,} · {lm.device.type} · {sizes.dtype_name(lm.dtype)} · "
            f"weights {lm.weight_bytes() / 2**20:,.0f} MiB"
        )
        st.markdown(
            f"KV cache per token: full **{full.text(per_token)}**, {s.label} **{quant.text(per_token)}**: "
            f"**{quant.times_smaller(full):.2f}x smaller** than a 16-bit cache (B/token)"
        )
        doc = document()
        if doc and s.is_quantized:
            n = doc["tokens"]
            a, b = sizes.prefilled(lm, "full", n), sizes.prefilled(lm, s, n)
            st.caption(
                f"Your document ({n:,} tokens): full {a.text()}, {s.label} {b.text()}: {b.times_smaller(a):.2f}x "
                f"smaller than at 16 bits (its newest {min(s.residual, n):,} tokens stay full precision)."
            )
        st.caption(sizes.basis_note(lm))


def sidebar() -> LoadedModel:
    """Draw the sidebar on every page; returns the session's model."""
    _keep_persisted()
    with st.sidebar:
        _model_section()
        candidate = _precision_section()
        lm = model()
        _accept_spec(candidate, lm)
        _codebook_section(lm)
        _status_card(lm)
        with st.expander("A stronger model", expanded=False, key="model_stronger"):
            from kvdemo import sizes

            st.markdown(sizes.stronger_model_text(lm))
    return lm


# --- session state --------------------------------------------------------------------------------
def persist(key: str, default):
    """A page widget's value that survives visits to other pages: create the widget with `key=key` and no
    default of its own. Streamlit drops the state of widgets a run does not draw; `sidebar()` (every run)
    re-assigns the keys registered here, which keeps them."""
    st.session_state.setdefault(PERSISTED, set()).add(key)
    st.session_state[key] = st.session_state[key] if key in st.session_state else default
    return st.session_state[key]


def _keep_persisted() -> None:
    for key in st.session_state.get(PERSISTED, ()):
        if key in st.session_state:
            st.session_state[key] = st.session_state[key]


# --- the current document -------------------------------------------------------------------------
PENDING = "document_pending"  # a new document waiting for the user to confirm it replaces one in use


def document() -> HeldDocument | None:
    """The session's current document (`kvdemo.documents.HeldDocument`), or None."""
    return st.session_state.get("document")


def _offer_document(doc: dict, replacing_ends: str) -> None:
    """Make `doc` the current document, or hold it for confirmation when replacing would end something."""
    if replacing_ends and document() is not None:
        st.session_state[PENDING] = doc
    else:
        st.session_state.pop(PENDING, None)
        st.session_state["document"] = doc


def _replace_document() -> None:
    st.session_state["document"] = st.session_state.pop(PENDING)


def _keep_document(key: str) -> None:
    """Drop the waiting document and put the picker back on the current one."""
    declined = st.session_state.pop(PENDING)
    current = document()
    st.session_state[f"{key}_source"] = current["source"]
    if current["source"] == "sample":
        st.session_state[f"{key}_sample_tokens"] = current["budget"]
    if declined["source"] == "upload":
        st.session_state["doc_declined"] = declined["name"]


def document_picker(lm: LoadedModel, key: str = "doc", replacing_ends: str = "") -> dict | None:
    """Upload a txt/md/pdf/docx/html file or use the bundled sample; keeps the last good document on errors.

    `replacing_ends` says what a new document would end (e.g. "the conversation (2 questions)"): when
    it is set, a new document waits until the user confirms it replaces the current one.
    """
    budget = document_budget(lm.max_context)
    persist(f"{key}_source", "sample")
    if persist(f"{key}_sample_tokens", min(SAMPLE_TOKENS, budget)) > budget:  # a model with a shorter context
        st.session_state[f"{key}_sample_tokens"] = budget
    source = st.radio(
        "Document", ["sample", "upload"], key=f"{key}_source", horizontal=True,
        format_func={"sample": "Bundled sample (Pride and Prejudice)", "upload": "Upload a file"}.get,
    )  # fmt: skip
    current, pending = document(), st.session_state.get(PENDING)
    if pending is not None and (pending["source"] != source or not replacing_ends):
        st.session_state.pop(PENDING)  # the picker moved on, or nothing would be lost any more
        if pending["source"] == source:
            st.session_state["document"] = current = pending
        pending = None
    if source == "sample":
        n = st.number_input("Sample length (tokens)", 32, budget, step=64, key=f"{key}_sample_tokens")
        name = f"Pride and Prejudice (first {int(n):,} tokens)"
        wanted = current is None or current["source"] != "sample" or current["name"] != name
        if (wanted or current["model"] != lm.name) and (pending is None or pending["name"] != name):
            from kvdemo.texts import prose

            _offer_document(hold_document(name, prose(), lm.tokenizer, int(n), "sample", [], lm.name), replacing_ends)
        elif not wanted and pending is not None:
            st.session_state.pop(PENDING)  # back to the current sample's length
    else:
        up = st.file_uploader("txt, md, pdf, docx or html", type=DOC_TYPES, key=f"{key}_upload")
        if up is not None and up.file_id != st.session_state.get("doc_upload_id"):
            st.session_state["doc_upload_id"] = up.file_id
            for stale in ("doc_error", "doc_declined"):
                st.session_state.pop(stale, None)
            try:
                parsed = extract_bytes(up.getvalue(), up.name)
                if not parsed.text.strip():
                    raise DocumentError("no text found in the file")
                doc = hold_document(parsed.name, parsed.text, lm.tokenizer, budget, "upload", parsed.warnings, lm.name)
                _offer_document(doc, replacing_ends)
            except DocumentError as err:
                st.session_state["doc_error"] = f"{up.name}: {err}"
        if up is None:
            for stale in ("doc_upload_id", "doc_error", "doc_declined", PENDING):
                st.session_state.pop(stale, None)
        if st.session_state.get("doc_error"):
            st.error(st.session_state["doc_error"] + (" (kept the previous document)" if document() else ""))
        elif st.session_state.get("doc_declined") and current is not None:
            st.caption(f"Kept {current['name']}: {st.session_state['doc_declined']} was not loaded.")
        elif up is None and current is not None:
            st.caption(f"No file uploaded yet: using {current['name']}.")
    _ask_before_replacing(key, replacing_ends)
    doc = document()
    if doc is not None:
        _document_notes(doc, lm)
        _fit_on_document(doc, lm, key)
    return doc


def _fit_on_document(doc: dict, lm: LoadedModel, key: str) -> None:
    """For a nuq spec and an uploaded document: fit the model's codebooks on the document's text (KVQuant's
    calibration on the kind of text the cache will hold; the sidebar says what the levels were fitted on)."""
    if doc["source"] != "upload" or not any(spec().codebook_levels().values()):
        return
    if st.button(f"Fit the nuq codebooks on {doc['name']}", key=f"{key}_calibrate_doc"):
        _calibrate(lm, (doc["name"], doc["text"]))


def _ask_before_replacing(key: str, replacing_ends: str) -> None:
    pending, current = st.session_state.get(PENDING), document()
    if pending is None:
        return
    with st.container(border=True, key=f"{key}_replace_box"):
        st.warning(f"Replace **{current['name']}** with **{pending['name']}**? That ends {replacing_ends}.")
        c1, c2 = st.columns(2)
        c1.button("Replace: start a new conversation", key=f"{key}_replace", on_click=_replace_document)
        c2.button(f"Keep {current['name']}", key=f"{key}_keep", on_click=_keep_document, args=(key,))


def _document_notes(doc: dict, lm: LoadedModel) -> None:
    for w in doc["warnings"]:
        st.warning(w)
    if doc["truncated"] and doc["source"] == "upload":
        st.warning(truncation_note(doc, lm.max_context))
    st.caption(f"**{doc['name']}**: {doc['tokens']:,} tokens, {len(doc['text']):,} characters")


# --- running model work -------------------------------------------------------------------------
T = TypeVar("T")
OOM_HINT = "out of memory: try fewer tokens, a shorter document or a lower KV precision (int4, int2)"


def run_exclusive(lm: LoadedModel | None, work: Callable[[], T], status=None) -> T | None:
    """Run `work()` holding the model's lock (one generation at a time for all sessions; no lock when `lm` is
    None: work that uses no model, such as the API probe).

    Shows "waiting for another user" in `status` while queued; a `ValueError` (bad settings) or out of
    memory becomes an `st.error` line and returns None, so the page keeps serving.
    """
    status = status if status is not None else st.empty()

    def waiting(seconds: float) -> None:
        status.info(f"Waiting for another user's run to finish... {seconds:.0f} s", icon=":material/hourglass:")

    try:
        with model_lock(lm, on_wait=waiting) if lm is not None else contextlib.nullcontext():
            status.empty()
            return work()
    except (torch.OutOfMemoryError, MemoryError):
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        status.error(OOM_HINT)
    except ValueError as err:  # ModelLoadError, DocumentError, HeadroomError, bad precision strings
        status.error(str(err))
    return None


def time_hint(lm: LoadedModel, task: str | None, tokens: float, what: str, where=st) -> float | None:
    """A caption with the time `tokens` of `task` work should take here (`kvdemo.rates.hint`): from this
    machine's last runs of the task, else a quick probe of the machine (run now when the model is free), else a
    stated first guess. Returns the estimate in seconds (None without a task)."""
    if task is None:
        return None
    if rates.needs_probe(lm, task):
        runner.probe_speed(lm)  # a fraction of a second; skipped while another session holds the model
    where.caption(rates.hint(lm, task, tokens, what))
    return rates.estimate(lm, task, tokens)


def timed_bar(bar, expected_s: float | None, seen: list[Progress]) -> ProgressFn:
    """A `ProgressFn` that moves `bar` with `Progress.text()` (time left from this run's speed, from
    `expected_s` until its first unit is done) and keeps the latest `Progress` in `seen` for `record_speed`."""

    def show(p: Progress) -> None:
        if p.expected_s is None:
            p = dataclasses.replace(p, expected_s=expected_s)
        seen[:] = [p]
        bar.progress(p.fraction, text=p.text())

    return show


def record_speed(lm: LoadedModel, task: str | None, seen: list[Progress]) -> None:
    """Remember the speed of the work a run did (finished or stopped) as this machine's for `task`."""
    if task is not None and seen:
        rates.record(lm, task, seen[-1].done, seen[-1].elapsed_s)


class LongRun:
    """A page's long run with Run and Cancel: a progress bar fed by `kvdemo.progress.Progress`, and the rows
    finished before a Cancel kept beside the last complete result, never in its place.

    Streamlit stops a running script when any button is clicked; the rows the run reported so far are already
    in the session state, so the rerun that follows a Cancel click turns them into `cancelled()`:
    ``{"meta": ..., "rows": [...], "seconds": s, "stopped": "cancelled"}``. One protocol for every page:

        job = LongRun("needle", "Run grid", "Stops the grid; the cells finished so far are kept")
        if job.buttons():
            out = job.run(lm, lambda on_progress: run_grid(..., on_progress=on_progress), meta)
    """

    def __init__(self, key: str, run_label: str, cancel_help: str, task: str | None = None):
        self.key, self.run_label, self.cancel_help = key, run_label, cancel_help
        self.task = task  # the `kvdemo.rates` task whose speed this run measures and its hint uses
        self.expected_s: float | None = None
        self._hint: tuple | None = None  # (lm, tokens, what, slot) of the caption `hint` drew
        self._keep_cancelled_rows()

    def hint(self, lm: LoadedModel, tokens: float, what: str, where=st) -> None:
        """The caption of `time_hint` for this run's task; the run's progress bar starts from its estimate, and
        once the run ends the caption is redrawn from the speed it measured."""
        self._hint = (lm, tokens, what, where.empty())
        self.expected_s = time_hint(lm, self.task, tokens, what, self._hint[-1])

    def _keep_cancelled_rows(self) -> None:
        partial = st.session_state.get(f"{self.key}_partial")
        if st.session_state.get(f"{self.key}_cancel") and partial and partial["rows"]:
            st.session_state[f"{self.key}_cancelled"] = partial | {"stopped": "cancelled"}
        if st.session_state.get(f"{self.key}_cancel"):
            st.session_state.pop(f"{self.key}_partial", None)

    def buttons(self, where=st, disabled: bool = False) -> bool:
        """Run and Cancel side by side (Run `disabled` when the settings cannot run); True when Run was clicked."""
        c1, c2 = where.columns([1, 5])
        run = c1.button(self.run_label, key=f"{self.key}_run", type="primary", disabled=disabled)
        c2.button("Cancel", key=f"{self.key}_cancel", help=self.cancel_help)
        return run

    def cancelled(self) -> dict | None:
        """The rows a cancelled run kept, with its meta and seconds (None when the last run was not cancelled)."""
        return st.session_state.get(f"{self.key}_cancelled")

    def run(
        self, lm: LoadedModel | None, work: Callable[[ProgressFn], T], meta: dict | None = None, status=None
    ) -> T | None:
        """`work(on_progress)` under the model's lock (`run_exclusive`), with a progress bar showing
        `Progress.text()` (done, total, what runs, time so far and left). Each `Progress.row` is kept for a
        Cancel (rows with a `to_json` are kept as their JSON). A finished run drops the cancelled rows of the
        one before: the complete result supersedes them."""
        status = status if status is not None else st.empty()
        bar_slot = st.empty()
        partial = {"meta": dict(meta or {}), "rows": [], "seconds": 0.0}
        st.session_state[f"{self.key}_partial"] = partial
        bar = bar_slot.progress(0.0, text="starting...")
        seen: list[Progress] = []
        show = timed_bar(bar, self.expected_s, seen)

        def on_progress(p: Progress) -> None:
            if p.row is not None:
                partial["rows"].append(p.row.to_json() if hasattr(p.row, "to_json") else p.row)
            partial["seconds"] = round(p.elapsed_s, 2)
            show(p)

        try:
            out = run_exclusive(lm, lambda: work(on_progress), status)
        finally:
            bar_slot.empty()
            record_speed(lm, self.task, seen)
        if self._hint is not None and seen:
            hint_lm, tokens, what, slot = self._hint
            slot.caption(rates.hint(hint_lm, self.task, tokens, what))
        # the run ended here (finished, or refused with a message): no rows to keep. A Cancel click stops the
        # script inside `work` instead, and the rerun it starts keeps the partial rows (`_keep_cancelled_rows`)
        st.session_state.pop(f"{self.key}_partial", None)
        if out is not None:
            st.session_state.pop(f"{self.key}_cancelled", None)
        return out


def text_source(key: str, builtin: str, document_first: bool = False) -> dict | None:
    """A "Text" radio between a bundled text (labelled `builtin`) and the session's current document, kept across
    pages under `key`: the document when it is picked, else None. Without a document only the bundled text is
    offered, and a caption says where to get one."""
    doc = document()
    sources = (["document", "builtin"] if document_first else ["builtin", "document"]) if doc else ["builtin"]
    persist(key, sources[0])
    if st.session_state[key] not in sources:
        st.session_state[key] = sources[0]
    picked = st.radio(
        "Text",
        sources,
        key=key,
        horizontal=True,
        format_func=lambda s: (
            f"Current document: {doc['name']} ({doc['tokens']:,} tokens)" if s == "document" else builtin
        ),
    )
    if not doc:
        st.caption("Choose or upload a document on the Chat page to use it here.")
    return doc if picked == "document" else None


def precision_picker(label: str, key: str, default: list[str], where=st, leave_out: tuple[str, ...] = ()) -> list[str]:
    """A multiselect of KV precisions that keeps its picks across pages (`persist`): the presets, the sidebar's
    precision, and any precision string typed into it (`knuq4vnuq2:o1`, `int4:g64:s4`), the CLI's grammar.
    Returns the picks' labels; a string that does not parse shows its reason and is left out (it stays in the
    box until removed, so the user sees what to fix)."""
    wanted = list(dict.fromkeys(persist(key, default)))  # a default may name the sidebar's precision twice
    choices = [c for c in precision_choices(wanted) if c not in leave_out]
    st.session_state[key] = [p for p in wanted if p in choices]
    picked = where.multiselect(
        label, choices, key=key, accept_new_options=True,
        help="pick presets or type any precision string, e.g. knuq4vnuq2:o1 or int4:g64:s4 (docs/precision.md)",
    )  # fmt: skip
    labels = []
    for text in picked:
        try:
            labels.append(parse_precision(text).label)
        except ValueError as err:
            where.error(f"{text!r} left out: {err}")
    return list(dict.fromkeys(labels))


def precision_choices(extra: list[str] | None = None) -> list[str]:
    """Preset names plus the sidebar's precision (if it is not a preset), for multiselects."""
    names = ["full", *quantized_presets()]
    current = spec().label
    for label in [current, *(extra or [])]:
        if label not in names:
            names.append(label)
    return names


# --- display --------------------------------------------------------------------------------------
def highlighted(before: str, diverged: str, rest: str) -> str:
    """HTML (escaped) of an answer with its first diverging token marked."""
    out = html.escape(before)
    if diverged:
        out += f'<mark style="background:#ffb3b3" title="first token that differs from full precision">{html.escape(diverged)}</mark>'
    return (out + html.escape(rest)).replace("\n", "<br>")


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def prefill_modes_result(comparison: NeedleModes | DriftModes, key: str) -> None:
    """A prefill-mode comparison (`kvdemo.prefill_modes`: a needle cell's or a drift run's): its title,
    headlines and summary table."""
    st.markdown(f"**{comparison.title()}**")
    for line in headlines(comparison, runner.PREFILL_CHUNK):
        st.markdown(line)
    part = {"cell": comparison} if isinstance(comparison, NeedleModes) else {"drift": comparison}
    st.dataframe(pd.DataFrame(summary_rows(**part)), hide_index=True, key=key)


def prefill_modes_expander(
    lm: LoadedModel,
    key: str,
    label: str,
    caption: str,
    stored: str,
    widths: list[int],
    choose: Callable[[list], Callable[[ProgressFn], NeedleModes | DriftModes] | None],
) -> None:
    """The "Compare prefill modes" expander of the needle and drift pages. `caption` says what is compared and
    `stored` what each mode stores ("haystack", "prompt"); `choose(columns)` draws the page's pickers in the
    columns (`widths`, less the last, which holds the button) and returns the comparison to run, a function of
    `on_progress`, or None when the page's settings allow none. The result is kept as `{key}_modes_result`."""
    result_key = f"{key}_modes_result"
    with st.expander(label, expanded=result_key in st.session_state):
        st.caption(
            f"{caption} The modes differ only when the {stored} spans more than one prefill chunk "
            f"({runner.PREFILL_CHUNK:,} tokens)."
        )
        columns = st.columns(widths, vertical_alignment="bottom")
        work = choose(columns[:-1])
        if work is not None and columns[-1].button("Compare prefill modes", key=f"{key}_compare"):
            status, bar_slot = st.empty(), st.empty()
            bar = bar_slot.progress(0.0, text="starting...")

            def on_progress(p: Progress) -> None:
                bar.progress(p.fraction, text=p.text())

            try:
                result = run_exclusive(lm, lambda: work(on_progress), status)
            finally:
                bar_slot.empty()
            if result is not None:
                st.session_state[result_key] = result
        comparison = st.session_state.get(result_key)
        if comparison is not None:
            prefill_modes_result(comparison, f"{key}_modes_table")
