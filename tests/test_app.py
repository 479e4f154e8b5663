"""The Streamlit app under `streamlit.testing.v1.AppTest` (headless, the embedded model, small sizes):
every page renders, a chat turn gives two answers and reuses its caches, a small needle grid draws its
heatmaps, bad uploads / settings / model folders show a message and keep what the user had, injected
out-of-memory and Stop keep the app serving, and four sessions at once queue on one model."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from streamlit.runtime.scriptrunner_utils.exceptions import StopException
from streamlit.testing.v1 import AppTest

from kvdemo.results import labels

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT = 300  # seconds per script run: model work on 2 busy CPU cores
NOTES = (
    "Meeting notes. The budget review is on Tuesday at 10 in room 4. Anna presents the travel costs, "
    "which rose by 12 percent. Ben asks for a new laptop. The next review is in March."
)
PAGES = [
    "app_pages/chat.py",
    "app_pages/needle.py",
    "app_pages/perplexity.py",
    "app_pages/memory.py",
    "app_pages/drift.py",
    "app_pages/probe.py",
]

pytestmark = pytest.mark.model


def app_model():
    """The model the app's sessions share (st.cache_resource): for its lock."""
    from app_pages.common import DEFAULT_MODEL_KEY, _load

    return _load(*DEFAULT_MODEL_KEY)


def start(page: str | None = None) -> AppTest:
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=RUN_TIMEOUT)
    at.run()
    assert not at.exception, at.exception
    if page:
        at.switch_page(page).run()
        assert not at.exception, at.exception
    return at


def texts(at: AppTest, kind: str) -> list[str]:
    return [e.value for e in at.get(kind)]


def upload(at: AppTest, name: str, data: bytes) -> AppTest:
    if at.radio(key="doc_source").value != "upload":
        at.radio(key="doc_source").set_value("upload").run()
    at.file_uploader(key="doc_upload").set_value((name, data, "application/octet-stream")).run()
    assert not at.exception, at.exception
    return at


def ask(at: AppTest, question: str) -> AppTest:
    at.chat_input(key="chat_input").set_value(question).run()
    assert not at.exception, at.exception
    return at


def chat_app(max_new: int = 4, doc: bytes = NOTES.encode()) -> AppTest:
    at = start("app_pages/chat.py")
    at.number_input(key="chat_max_new").set_value(max_new)
    return upload(at, "notes.txt", doc)


def turn_answers(at: AppTest, turn: int = -1) -> list:
    return at.session_state["chat_session"].turns[turn].answers


def answer_labels(at: AppTest) -> list[str]:
    return [m for m in texts(at, "markdown") if m in ("**full**", "**int4**", "**int8**")]


# --- pages ---------------------------------------------------------------------------------------
def test_every_page_renders_with_sidebar_and_status_card():
    at = start()
    assert "kvdemo" in at.title[0].value
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["KV bytes/token, full (float32)"] == "46,080 B"  # 2 x 30 layers x 3 heads x 64 x 4 bytes (live)
    assert (
        metrics["KV bytes/token at int4"] == "6,300 B"
    )  # int4: keys 4 + 32/128 bits, values 4 + 32/64 (groups of min(128, head_dim))
    for page in PAGES:
        at.switch_page(page).run()
        assert not at.exception, (page, at.exception)
        assert not at.error, (page, [e.value for e in at.error])
        sidebar = " ".join(m.value for m in at.sidebar.markdown)
        assert "SmolLM2-135M-Instruct" in sidebar and "B/token" in sidebar, page


def test_precision_change_updates_live_number_and_bad_settings_are_rejected():
    at = start()
    at.sidebar.selectbox(key="kv_preset").set_value("int2").run()  # keys 2.25 bits, values 2.5: 11,520 x 2.375 / 8
    assert {m.label: m.value for m in at.metric}["KV bytes/token at int2"] == "3,420 B"
    at.sidebar.number_input(key="kv_residual").set_value(100).run()  # not a multiple of the group (128)
    assert not at.exception
    (err,) = [e.value for e in at.sidebar.error]
    assert "multiple of the group size" in err and "Still using int2" in err
    assert {m.label: m.value for m in at.metric}["KV bytes/token at int2"] == "3,420 B"


def test_sidebar_builds_its_spec_by_the_cli_rule():
    """Group 256 with the residual left at its default is `int4:g256` on the CLI (residual raised to 256):
    the sidebar gives the same spec instead of rejecting it; an explicit bad residual is still rejected."""
    from kvdemo.precision import parse_precision

    at = start()
    at.sidebar.selectbox(key="kv_group").set_value(256).run()
    assert not at.exception and not at.sidebar.error, [e.value for e in at.sidebar.error]
    assert at.session_state["spec"] == parse_precision("int4:g256")
    assert at.session_state["spec"].residual == 256
    at.sidebar.number_input(key="kv_residual").set_value(384).run()
    assert "multiple of the group size" in at.sidebar.error[0].value


def test_model_load_failure_keeps_previous_model(tmp_path):
    at = start()
    at.sidebar.radio(key="model_kind").set_value("folder").run()
    at.sidebar.text_input(key="model_folder").set_value(str(tmp_path / "missing")).run()
    at.sidebar.button(key="model_load").click().run()
    assert not at.exception
    assert any("model folder not found" in e.value and "kept the previous model" in e.value for e in at.sidebar.error)
    vit = tmp_path / "vit"
    vit.mkdir()
    (vit / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 32}))
    (vit / "model.safetensors").write_bytes(b"")
    at.sidebar.text_input(key="model_folder").set_value(str(vit)).run()
    at.sidebar.button(key="model_load").click().run()
    assert any("not a causal language model" in e.value for e in at.sidebar.error)
    assert at.session_state["model_key"] == ("embedded", "auto", "auto")
    assert "SmolLM2-135M-Instruct" in " ".join(m.value for m in at.sidebar.markdown)


# --- chat ----------------------------------------------------------------------------------------
def test_chat_turn_gives_two_answers_and_followup_reuses_caches():
    at = chat_app()
    assert any("notes.txt" in c for c in texts(at, "caption"))
    ask(at, "When is the budget review?")
    assert answer_labels(at) == ["**full**", "**int4**"]
    first = [c for c in texts(at, "caption") if "new tokens" in c]
    assert len(first) == 2 and all("cache " in c and "MiB" in c for c in first), first
    # 4 tokens end no sentence: the caption says the cap cut the answer (unless the model ended its turn)
    assert all(
        "cut mid-sentence at the 4-token cap" in c
        for c, a in zip(first, turn_answers(at), strict=True)
        if a.stopped == "length"
    )
    assert any(a.stopped == "length" for a in turn_answers(at))
    ask(at, "Who presents the travel costs?")
    assert answer_labels(at) == ["**full**", "**int4**"] * 2  # the first turn is still shown
    captions = texts(at, "caption")
    reused = [c for c in captions if "from the cache" in c]
    assert len(reused) == 2, captions  # both precisions fed only the follow-up's tokens
    at.run()  # a plain rerun (any widget change) keeps the chat
    assert answer_labels(at) == ["**full**", "**int4**"] * 2
    at.switch_page("app_pages/memory.py").run()
    at.switch_page("app_pages/chat.py").run()  # another page and back: chat, document and settings kept
    assert answer_labels(at) == ["**full**", "**int4**"] * 2
    assert at.session_state["document"]["name"] == "notes.txt"
    assert at.number_input(key="chat_max_new").value == 4 and at.radio(key="doc_source").value == "upload"
    session = at.session_state["chat_session"]
    assert [t.question for t in session.turns] == ["When is the budget review?", "Who presents the travel costs?"]
    assert all(0 < a.fed_tokens < 40 for a in session.turns[1].answers)


def test_out_of_memory_in_chat_shows_hint_and_keeps_chat(monkeypatch):
    import kvdemo.chat.lane as lanes

    at = chat_app()
    ask(at, "When is the budget review?")

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(lanes, "prefill", oom)
    ask(at, "Who asks for a laptop?")
    errors = [e.value for e in at.error]
    assert any("out of memory" in e and "lower KV precision" in e and "chat and document are kept" in e for e in errors)
    assert answer_labels(at) == ["**full**", "**int4**"]  # the earlier turn is still there
    assert not app_model().lock.locked()
    monkeypatch.undo()
    ask(at, "Who asks for a laptop?")
    assert not at.error and answer_labels(at) == ["**full**", "**int4**"] * 2


def test_stop_mid_answer_releases_lock_and_next_turn_works(monkeypatch):
    import kvdemo.chat.lane as lanes

    at = chat_app(max_new=6)
    real = lanes.prefill

    def stopped(lm, ids, cache, *args, **kwargs):
        logits = real(lm, ids, cache, *args, **kwargs)
        if len(ids) == 1:  # the first decode step: Streamlit raises this in the script when the user clicks Stop
            raise StopException()
        return logits

    monkeypatch.setattr(lanes, "prefill", stopped)
    ask(at, "When is the budget review?")
    assert not app_model().lock.locked()
    monkeypatch.undo()
    at.run()
    assert answer_labels(at) == ["**full**", "**int4**"]  # the stopped turn is kept, marked
    assert any("stopped" in c for c in texts(at, "caption"))
    ask(at, "Who presents the travel costs?")
    assert not at.error
    assert answer_labels(at) == ["**full**", "**int4**"] * 2
    turn = at.session_state["chat_session"].turns[-1]
    assert all(a.stopped in ("eos", "length") for a in turn.answers)


# --- uploads -------------------------------------------------------------------------------------
def test_upload_errors_are_shown_and_the_document_is_kept():
    from kvdemo.documents import extract_bytes

    at = chat_app()
    for name, data, words in [
        ("empty.txt", b"", "empty file"),
        ("scan.pdf", b"%PDF-1.4 truncated \x00\x01\x02", "scan.pdf"),
        ("noise.txt", bytes(range(256)) * 8, "noise.txt"),
        ("report.docx", b"PK\x03\x04 not really a docx", "report.docx"),
        ("tool.exe", b"MZ\x90\x00", ".exe"),
    ]:
        upload(at, name, data)
        errors = [e.value for e in at.error]
        assert len(errors) == 1 and words in errors[0] and "kept the previous document" in errors[0], (name, errors)
        assert not at.exception
        assert at.session_state["document"]["name"] == "notes.txt"
    long = (NOTES + "\n\n").encode() * 400  # ~28k tokens: far beyond the 8k context
    upload(at, "long.txt", long)
    assert not at.error
    notice = [w.value for w in at.warning if "longer than fits" in w.value]
    assert notice and "8,192 tokens" in notice[0]
    doc = at.session_state["document"]
    assert doc["name"] == "long.txt" and doc["truncated"] and doc["tokens"] <= 8192 - 1024
    text = extract_bytes(long, "long.txt").text  # the whole document, before the cut
    tokens = len(app_model().tokenizer(text, add_special_tokens=False)["input_ids"])
    kept = f"kept its first {doc['tokens']:,} of {tokens:,} tokens ({len(doc['text']):,} of {len(text):,} characters)"
    assert kept in notice[0], notice[0]


def document_panel(at: AppTest):
    (panel,) = [e for e in at.expander if e.label == "Document"]
    return panel


def test_document_panel_stays_open_and_a_new_document_asks_before_ending_the_chat():
    at = chat_app()
    ask(at, "When is the budget review?")
    at.radio(key="doc_source").set_value("sample").run()  # the user looks at the other choice...
    assert document_panel(at).proto.expanded  # ...in a panel that stays open (it collapsed on every rerun)
    (question,) = [w.value for w in at.warning if w.value.startswith("Replace")]
    assert "**notes.txt**" in question and "the conversation (1 question)" in question
    assert at.session_state["document"]["name"] == "notes.txt" and len(at.session_state["chat_session"].turns) == 1
    at.button(key="doc_keep").click().run()
    assert at.radio(key="doc_source").value == "upload" and not any(w.value.startswith("Replace") for w in at.warning)
    assert at.file_uploader(key="doc_upload") is not None  # the uploader is back in view
    assert answer_labels(at) == ["**full**", "**int4**"]  # the chat is still there
    upload(at, "agenda.txt", b"Agenda: the picnic is on Saturday at noon, by the lake.")
    assert document_panel(at).proto.expanded
    assert any("**agenda.txt**" in w.value for w in at.warning if w.value.startswith("Replace"))
    assert at.session_state["document"]["name"] == "notes.txt" and answer_labels(at) == ["**full**", "**int4**"]
    at.button(key="doc_replace").click().run()
    assert not at.exception
    assert at.session_state["document"]["name"] == "agenda.txt"
    assert at.session_state["chat_session"].turns == [] and "picnic" in at.session_state["chat_session"].document
    assert answer_labels(at) == [] and any("new conversation" in i.value for i in at.info)


# --- needle, drift, memory -----------------------------------------------------------------------
def test_small_needle_grid_draws_heatmaps_and_table():
    at = start("app_pages/needle.py")
    at.text_input(key="needle_lengths").set_value("160")
    at.text_input(key="needle_depths").set_value("50")
    at.multiselect(key="needle_precisions").set_value(["full", "int4"])
    at.button(key="needle_run").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    charts = at.get("plotly_chart")
    assert len(charts) == 3  # pass/fail heatmap, change vs full, log-prob vs length
    heat = json.loads(charts[0].proto.spec)
    assert [t["type"] for t in heat["data"]] == ["heatmap", "heatmap"]
    result = at.session_state["needle_result"]
    assert len(result.rows) == 2 and {r.precision for r in result.rows} == {"full", "int4"}
    assert len(at.get("download_button")) == 2


@pytest.mark.llamacpp
def test_needle_page_runs_llamacpp_cache_types_against_their_own_f16_row(monkeypatch):
    import kvdemo.llamacpp as llamacpp
    from kvdemo.engines import LlamaCppError

    at = start("app_pages/needle.py")
    at.text_input(key="needle_lengths").set_value("160")
    at.text_input(key="needle_depths").set_value("50")
    at.multiselect(key="needle_precisions").set_value(["full"])
    at.multiselect(key="needle_llamacpp").set_value(["llama.cpp:q4_0"])
    at.button(key="needle_run").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    result = at.session_state["needle_result"]
    assert result.precisions == ["full", "llama.cpp:f16", "llama.cpp:q4_0"]
    assert [r.precision for r in result.rows] == result.precisions
    heat, diff, _ = (json.loads(c.proto.spec) for c in at.get("plotly_chart"))
    assert len(heat["data"]) == 3 and len(diff["data"]) == 1  # llama.cpp:q4_0 - llama.cpp:f16 only
    assert "llama.cpp:q4_0 - llama.cpp:f16" in diff["data"][0]["hovertemplate"]

    def broken(*args, **kwargs):
        raise RuntimeError("llama_context: failed to allocate")

    monkeypatch.setattr(llamacpp, "Engine", broken)  # the engine fails: a warning, kvdemo's rows kept
    at.button(key="needle_run").click().run()
    assert not at.exception
    assert [r.precision for r in at.session_state["needle_result"].rows] == ["full"]
    assert any(w.value.startswith("llama.cpp failed at 160 tokens") and "failed to allocate" in w.value
               for w in at.warning)  # fmt: skip

    def hub_model(lm):
        raise LlamaCppError("llama.cpp contenders run a GGUF file; m was loaded from org/m")

    monkeypatch.setattr(llamacpp, "gguf_path", hub_model)  # a Hugging Face folder: said instead of offered
    at.run()
    assert all(m.key != "needle_llamacpp" for m in at.get("multiselect"))
    assert any("llama.cpp rows: llama.cpp contenders run a GGUF file" in c.value for c in at.caption)
    monkeypatch.setattr(llamacpp, "available", lambda: llamacpp.INSTALL)  # no binding: how to install it
    at.run()
    assert any("`make llamacpp` builds it" in c.value for c in at.caption)


def test_needle_bad_settings_and_oom_show_messages(monkeypatch):
    import kvdemo.needle as needle

    at = start("app_pages/needle.py")
    at.text_input(key="needle_lengths").set_value("160, lots")
    at.button(key="needle_run").click().run()
    assert any("comma-separated numbers" in e.value for e in at.error)
    at.text_input(key="needle_lengths").set_value("99999")
    at.button(key="needle_run").click().run()
    assert any("must fit the model's context" in e.value for e in at.error)

    def oom(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(needle, "run_grid", oom)
    at.text_input(key="needle_lengths").set_value("160")
    at.button(key="needle_run").click().run()
    assert not at.exception
    assert any("out of memory" in e.value and "lower KV precision" in e.value for e in at.error)
    assert not app_model().lock.locked()


def test_drift_page_runs_on_the_current_document():
    at = chat_app()
    at.sidebar.selectbox(key="kv_group").set_value(16)
    at.sidebar.number_input(key="kv_residual").set_value(16).run()  # quantize all but the newest 16 tokens
    assert at.session_state["spec"].label == "int4:g16:r16"
    at.switch_page("app_pages/drift.py").run()
    assert at.radio(key="drift_source").value == "document"
    at.number_input(key="drift_tokens").set_value(64)
    at.number_input(key="drift_new_tokens").set_value(2)
    at.multiselect(key="drift_precisions").set_value(["int4:g16:r16", "int8"])
    at.button(key="drift_run").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    out = at.session_state["drift_result"]
    assert out.document == "notes.txt" and [r.precision for r in out.results] == ["int4:g16:r16", "int8"]
    low, int8 = out.results
    assert low.mean_js > 0  # the document's tokens were quantized in 16-token blocks
    assert int8.mean_js == 0  # ~90 tokens < int8's 128-token residual: exact, and the page says so
    assert any("nothing was read from quantized codes" in i.value and "int8" in i.value for i in at.info)
    assert "int4:g16:r16" not in " ".join(i.value for i in at.info)
    assert len(at.get("plotly_chart")) == 4


def test_memory_page_headroom_and_measured_cache():
    from kvdemo.findings.glossary import GLOSSARY

    at = start("app_pages/memory.py")
    assert any(GLOSSARY["headroom"] in c.value and "Headroom" in c.value for c in at.caption)  # defined where shown
    (plan,) = [d.value for d in at.dataframe if "max sequences" in d.value.columns]
    assert "x smaller than 16-bit" in plan.columns and "-" not in list(plan["x smaller than 16-bit"])
    assert len(at.get("plotly_chart")) >= 4  # headroom figures are formulas: drawn at once (+ bench figures)
    assert any(c.value.startswith("Report ") for c in at.caption)  # the bench report: a local run or the shipped one
    assert not at.warning  # the shipped report has the layout this version reads
    at.number_input(key="mem_tokens").set_value(320)  # int4 quantizes 256 of them (128 stay in the residual)
    at.multiselect(key="mem_precisions").set_value(["full", "int4"])
    at.button(key="mem_run").click().run()
    assert not at.exception and not at.error
    rows = at.session_state["mem_result"].results
    assert [r.precision for r in rows] == ["full", "int4"] and rows[1].bytes < rows[0].bytes


def test_precision_boxes_take_typed_strings_and_say_why_one_is_left_out():
    at = start("app_pages/memory.py")
    at.multiselect(key="mem_precisions").set_value(["full", "knuq4vnuq2:o1", "INT5:g16"])
    at.number_input(key="mem_tokens").set_value(300).run()
    assert not at.exception
    (err,) = [e.value for e in at.error]
    assert err.startswith("'INT5:g16' left out: unknown precision") and "k<key>v<value>" in err
    at.button(key="mem_run").click().run()
    rows = at.session_state["mem_result"].results
    assert [r.precision for r in rows] == ["full", "knuq4vnuq2:o1"]  # the typed string measured, the bad one not
    assert rows[1].bytes == rows[1].formula_bytes
    at.switch_page("app_pages/needle.py").run()
    at.switch_page("app_pages/memory.py").run()  # the picks, typed ones too, survive another page
    assert at.multiselect(key="mem_precisions").value == ["full", "knuq4vnuq2:o1", "INT5:g16"]
    at.sidebar.selectbox(key="kv_preset").set_value("int8").run()  # the drift page's default names int8 twice
    at.switch_page("app_pages/drift.py").run()
    assert not at.exception and at.multiselect(key="drift_precisions").value == ["int8", "int2"]


# --- concurrency ---------------------------------------------------------------------------------
def test_four_sessions_at_once_queue_and_never_see_each_other():
    """Four AppTest sessions on one shared model, each with its own document, asking at the same time."""
    codes = ["ALPHA-11", "BRAVO-22", "CHARLIE-33", "DELTA-44"]
    apps = [chat_app(max_new=3, doc=f"The access code is {c}. Keep it safe.".encode()) for c in codes]
    errors: list[str] = []

    def work(at: AppTest) -> None:
        try:
            ask(at, "What is the access code?")
        except Exception as err:  # reported below
            errors.append(repr(err))

    threads = [threading.Thread(target=work, args=(at,)) for at in apps]
    start_s = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=RUN_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a queued session did not finish in time"
    assert time.perf_counter() - start_s < RUN_TIMEOUT
    assert errors == []
    for code, at in zip(codes, apps, strict=True):
        assert not at.exception and not at.error
        assert answer_labels(at) == ["**full**", "**int4**"]
        session = at.session_state["chat_session"]
        assert code in session.document and all(other not in session.document for other in codes if other != code)
        assert len(session.turns) == 1
    assert len({id(at.session_state["chat_session"].lm) for at in apps}) == 1  # one model for all
    assert not app_model().lock.locked()


# --- one basis for sizes, stronger models, partial needle grids, measured time hints ------------------
def test_every_size_is_live_bytes_with_its_16_bit_equivalent_and_ratios_agree():
    """Home, the sidebar and the chat captions all state live bytes in the model's dtype (float32 on CPU)
    with the 16-bit equivalent, and every ratio they show is against a 16-bit cache of the same tokens:
    bytes_16bit / bytes_format from kvdemo.sizes."""
    from kvdemo import sizes

    at = start()
    lm = app_model()
    full16 = sizes.per_token(lm, "full").at16

    def want(precision: str) -> float:
        return full16 / sizes.per_token(lm, precision).at16

    metric = next(m for m in at.metric if m.label == "KV bytes/token at int4")
    assert metric.value == "6,300 B" and f"{want('int4'):.2f}x smaller than 16-bit" in metric.delta
    assert "3.66x" in metric.delta  # 23,040 / 6,300, both at 16 bits (not 46,080 float32 / 6,300 = 7.31x)
    home = " ".join(m.value for m in at.markdown)
    shown = dict((p, float(x)) for x, p in re.findall(r"(\d+\.\d+)x \((int\d)\)", home))
    assert shown.keys() == {"int8", "int4", "int2"}, home
    assert all(x == round(want(p), 1) for p, x in shown.items()), shown
    assert "2-7x" not in home
    card = " ".join(m.value for m in at.sidebar.markdown)
    assert "46,080 B live (float32) = 23,040 B at 16 bits" in card
    assert re.findall(r"(\d+\.\d+)x smaller", card) == [f"{want('int4'):.2f}"], card
    at.sidebar.selectbox(key="kv_preset").set_value("int2").run()
    card = " ".join(m.value for m in at.sidebar.markdown)
    assert re.findall(r"(\d+\.\d+)x smaller", card) == [f"{want('int2'):.2f}"], card
    at = chat_app()
    ask(at, "When is the budget review?")
    full, int4 = [c.value for c in at.caption if "cache " in c.value and " live (float32)" in c.value]
    assert "at 16 bits" in full and "at 16 bits" in int4
    session = at.session_state["chat_session"]
    a_full, a_int4 = session.turns[-1].answers
    assert (
        f"{a_full.cache_bytes / 2**20:,.1f} MiB live (float32) = {a_full.cache_bytes / 2**21:,.1f} MiB at 16 bits"
        in full
    )
    doc_line = " ".join(c.value for c in at.sidebar.caption)
    assert "Your document" in doc_line and "live (float32)" in doc_line


def test_home_and_sidebar_say_how_to_load_a_stronger_model_and_what_fits():
    at = start()
    assert any(h.value == "A stronger model" for h in at.subheader)
    text = " ".join(m.value for m in at.markdown)
    assert "Hugging Face id" in text and "Local folder" in text and "int4:" in text and "GB of free RAM" in text
    (fits,) = [d.value for d in at.dataframe]
    assert {"model", "load as", "full", "int8", "int4", "int2"} <= set(fits.columns)
    sidebar = " ".join(m.value for m in at.sidebar.markdown)
    assert "Hugging Face id" in sidebar and "int2:" in sidebar


def test_needle_page_marks_cells_where_full_precision_missed():
    from kvdemo.results.needle import NeedleGrid, NeedleRow

    at = start("app_pages/needle.py")
    rows = [
        NeedleRow(160, d, p, "x", ok, -1.0, "y", "custom", "", 160, d, 10, 1, 1, "eos", 0.1, 0.1, 0)
        for p, d, ok in [("full", 0.0, False), ("int4", 0.0, False), ("full", 50.0, True), ("int4", 50.0, True)]
    ]
    at.session_state["needle_result"] = NeedleGrid(
        "m", "custom", "manual", 0, [160], [0.0, 50.0], ["full", "int4"], rows, 3.0
    )
    at.run()
    assert not at.exception
    assert any("Full precision itself missed 1 of 2 cells" in w.value for w in at.warning)
    assert labels.label("full_missed") in at.dataframe[0].value.columns  # the summary, with readable column names
    heat = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert any("full missed" in t for trace in heat["data"] for row in trace["text"] for t in row)


def test_cancel_keeps_the_complete_grid_and_shows_the_partial_one_beside_it(monkeypatch):
    """LongRun on the needle page: a Cancel click keeps the rows the run reported (as `Progress.row`) beside the
    last complete grid, which stays."""
    import kvdemo.needle as needle
    from kvdemo.progress import Progress

    at = start("app_pages/needle.py")
    at.text_input(key="needle_lengths").set_value("160")
    at.text_input(key="needle_depths").set_value("50")
    at.multiselect(key="needle_precisions").set_value(["full", "int4"])
    at.button(key="needle_run").click().run()
    complete = at.session_state["needle_result"]
    assert len(complete.rows) == 2 and complete.seconds > 0

    def one_cell_then_cancel(lm, lengths, depths, precisions, on_progress=None, **kw):
        time.sleep(0.05)
        on_progress(Progress(160, 1280, "tokens", "int4 at 160 tokens", 0.05, complete.rows[0]))
        raise StopException()  # what Streamlit raises in the script when the user's Cancel click reruns it

    monkeypatch.setattr(needle, "run_grid", one_cell_then_cancel)
    at.text_input(key="needle_depths").set_value("25,50,75,100")
    at.button(key="needle_run").click().run()
    at.button(key="needle_cancel").click().run()
    assert not at.exception
    assert at.session_state["needle_result"] == complete  # the finished grid is kept
    partial = at.session_state["needle_cancelled"]
    assert partial["stopped"] == "cancelled" and partial["rows"] == [complete.rows[0].to_json()]
    assert partial["seconds"] >= 0.05 and partial["meta"]["depths"] == [25.0, 50.0, 75.0, 100.0]
    assert any("Cancelled run (partial): 1 of 8 runs" in i.value for i in at.info)
    assert len(at.get("download_button")) == 4  # the complete grid's CSV/JSON and the partial one's


def test_findings_cancel_shows_the_finished_measurements_then_a_finished_run_replaces_them(monkeypatch):
    """Findings under `LongRun`: Cancel keeps what finished ("Cancelled: N of M measurements kept") and shows
    its sections; the next finished run is shown instead."""
    from kvdemo.findings import run
    from kvdemo.progress import Progress
    from kvdemo.results import findings as results

    shipped = results.load()
    planned = []

    def full_then_cancel(lm, the_plan, on_progress=None, **kw):
        planned.append(len(the_plan.units))
        on_progress(
            Progress(768, 9000, "tokens", "full measured in 1 s, 1 of 17 measurements", 0.05, shipped.run_of("full"))
        )
        raise StopException()  # what Streamlit raises in the script when the user's Cancel click reruns it

    monkeypatch.setattr(run, "run_plan", full_then_cancel)
    at = start("app_pages/findings.py")
    at.button(key="findings_run").click().run()
    at.button(key="findings_cancel").click().run()
    assert not at.exception, at.exception
    assert [i.value for i in at.info] == [f"Cancelled: 1 of {planned[0]} measurements kept."]
    assert planned[0] > 10  # every claim's precisions and the weight x KV grid
    assert [h.value for h in at.header][:7] == [c.title for c in shipped.claims]  # the sections of what finished
    (table,) = [d.value for d in at.dataframe if {"verdict", "numbers"} <= set(d.value.columns)]
    assert table["verdict"].iloc[2] == "not measured"  # keys vs values: only full precision finished
    assert any("1 precisions measured" in c.value for c in at.caption)

    monkeypatch.setattr(run, "run_plan", lambda lm, the_plan, on_progress=None, **kw: shipped)
    at.button(key="findings_run").click().run()
    assert not at.exception, at.exception
    assert [i.value for i in at.info] == [f"Re-run on {shipped.model}: {shipped.seconds:.0f} s."]
    assert at.session_state["findings_result"] == shipped and "findings_cancelled" not in at.session_state


def test_perplexity_page_scores_held_out_prose_then_the_users_document():
    """The Perplexity page runs kvdemo.ppl.run_ppl on what it names: the held-out prose, then the uploaded
    document (a document too short to score says so and leaves the page serving)."""
    from kvdemo.results.ppl import HELD_OUT_NAME
    from kvdemo.texts import prose

    at = start("app_pages/perplexity.py")
    at.number_input(key="ppl_tokens").set_value(256)
    at.multiselect(key="ppl_precisions").set_value(["int4"])
    at.button(key="ppl_run").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    out = at.session_state["ppl_result"]
    assert out.text == HELD_OUT_NAME and [r.precision for r in out.results] == ["full", "int4"]
    assert at.subheader[0].value == f"{HELD_OUT_NAME}: tokens 128 to 256 scored"
    assert list(at.dataframe[0].value["precision"]) == ["full", "int4"]
    assert len(at.get("plotly_chart")) == 1 and len(at.get("download_button")) == 2

    at.switch_page("app_pages/chat.py").run()
    upload(at, "notes.txt", NOTES.encode())
    at.switch_page("app_pages/perplexity.py").run()
    at.radio(key="ppl_source").set_value("document").run()
    assert not at.exception
    assert any("notes.txt has" in e.value and "at least 256" in e.value for e in at.error)
    assert at.button(key="ppl_run").disabled
    assert at.session_state["ppl_result"] is out and at.subheader[0].value.startswith(HELD_OUT_NAME)  # still shown

    at.switch_page("app_pages/chat.py").run()
    upload(at, "chapter.txt", prose()[:4000].encode())
    at.switch_page("app_pages/perplexity.py").run()
    at.radio(key="ppl_source").set_value("document").run()
    at.button(key="ppl_run").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    mine = at.session_state["ppl_result"]
    assert mine.text == "chapter.txt" and mine.tokens == at.number_input(key="ppl_tokens").value
    assert mine.results[0].ppl != out.results[0].ppl


def test_perplexity_cancel_keeps_the_last_run_and_shows_the_finished_precisions(monkeypatch):
    from kvdemo import ppl
    from kvdemo.progress import Progress

    at = start("app_pages/perplexity.py")
    at.number_input(key="ppl_tokens").set_value(256)
    at.multiselect(key="ppl_precisions").set_value(["int4"])
    at.button(key="ppl_run").click().run()
    complete = at.session_state["ppl_result"]

    def full_then_cancel(lm, precisions, tokens, prefix, on_progress=None, **kw):
        on_progress(Progress(192, 576, "tokens", "full scored", 0.5, row=complete.results[0]))
        raise StopException()  # what Streamlit raises in the script when the user's Cancel click reruns it

    monkeypatch.setattr(ppl, "run_ppl", full_then_cancel)
    at.multiselect(key="ppl_precisions").set_value(["int4", "int2"])
    at.button(key="ppl_run").click().run()
    at.button(key="ppl_cancel").click().run()
    assert not at.exception
    assert at.session_state["ppl_result"] == complete
    assert any("1 of 3 precisions finished" in i.value for i in at.info)
    partial, last = (d.value for d in at.dataframe)
    assert list(partial["precision"]) == ["full"] and list(last["precision"]) == ["full", "int4"]


def test_needle_repeats_run_each_cell_with_new_needles_and_show_found_rates():
    from kvdemo import needle

    at = start("app_pages/needle.py")
    at.text_input(key="needle_lengths").set_value("160")
    at.text_input(key="needle_depths").set_value("50")
    at.multiselect(key="needle_precisions").set_value(["full", "int4"])
    at.number_input(key="needle_repeats").set_value(2)
    at.button(key="needle_run").click().run()
    assert not at.exception and not at.error
    out = at.session_state["needle_result"]
    assert out.repeats == 2 and [(r.seed, r.precision) for r in out.rows] == [
        (0, "full"), (0, "int4"), (1, "full"), (1, "int4")
    ]  # fmt: skip
    summary, answers = (d.value for d in at.dataframe)
    assert {"found, 95% low", "found, 95% high"} <= set(summary.columns) and list(summary["cells"]) == [2, 2]
    assert not [c for t in (summary, answers) for c in t.columns if "_" in c]  # readable names, no machine keys
    assert "seed" in answers.columns and sorted(answers["seed"]) == [0, 0, 1, 1]
    assert any(c.value.startswith("int4 against full: found rate ") for c in at.caption)
    heat = json.loads(at.get("plotly_chart")[0].proto.spec)
    labels = [t for trace in heat["data"] for row in trace["text"] for t in row]
    assert all(re.match(r"[0-2]/2<br>", t) for t in labels), labels  # found of the cell's 2 runs
    assert at.number_input(key="needle_repeats").max == needle.MAX_REPEATS


def test_rejected_needle_setting_leaves_no_progress_bar():
    at = start("app_pages/needle.py")
    at.text_input(key="needle_lengths").set_value("99999")
    at.button(key="needle_run").click().run()
    assert any("must fit the model's context" in e.value for e in at.error)
    assert not at.get("progress")


def test_pages_without_model_work_render_while_another_session_holds_the_model():
    """Home, Memory on a reference config and Findings with the shipped report never take the model's lock:
    they render in full while another session generates (here: holds the lock), which they outlast."""
    lm = app_model()
    assert lm.lock.acquire(timeout=60)
    try:
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)  # a timeout fails, never hangs
        at.run()
        assert not at.exception, at.exception
        assert any(m.label == "KV bytes/token at int4" for m in at.metric)  # Home, all of it
        at.switch_page("app_pages/memory.py").run()
        assert not at.exception and at.selectbox(key="hr_model").value == "llama-3.1-8b"
        assert at.get("plotly_chart") or at.dataframe  # the headroom plan drawn
        at.switch_page("app_pages/findings.py").run()
        assert not at.exception
        assert any("Showing the shipped report" in c.value for c in at.caption)
        assert len(at.dataframe) >= 1  # the verdicts table
        assert lm.lock.locked()  # still held by the other session: nothing waited for it
    finally:
        lm.lock.release()


def test_a_bad_needle_grid_shows_its_error_and_no_time_estimate():
    """Settings are checked before the time is estimated: a grid that cannot run shows why, and no time."""
    at = start("app_pages/needle.py")
    assert any(c.value.startswith("About ") for c in at.caption)  # the default grid runs: it has a time
    assert at.radio(key="needle_prefill_mode").value == "chunked"  # as Chat stores a document
    for lengths, depths, error in [
        ("99999", "50", "must fit the model's context"),
        ("160", "50, 120", "outside 0..100"),
        ("160, lots", "50", "comma-separated numbers"),
    ]:
        at.text_input(key="needle_lengths").set_value(lengths)
        at.text_input(key="needle_depths").set_value(depths).run()
        assert any(error in e.value for e in at.error), [e.value for e in at.error]
        assert not any(c.value.startswith("About ") for c in at.caption)


def test_drift_time_hint_comes_from_measured_rates(tmp_path, monkeypatch):
    from kvdemo import rates

    monkeypatch.setattr(rates, "_path", lambda: tmp_path / "rates.json")  # this machine, nothing measured yet
    monkeypatch.setattr("kvdemo.runner.probe_speed", lambda lm: False)  # as when another session holds the model
    at = start("app_pages/drift.py")
    assert any("a first guess, not yet measured here" in c.value for c in at.caption)
    at.number_input(key="drift_tokens").set_value(64)
    at.number_input(key="drift_new_tokens").set_value(1)
    at.multiselect(key="drift_precisions").set_value(["int8"])
    at.button(key="drift_run").click().run()
    assert not at.exception and not at.error
    at.run()
    hint = next(c.value for c in at.caption if c.value.startswith("About "))
    lm = app_model()
    assert rates.rate(lm, "drift").runs == 1 and "from this machine's last run" in hint
    assert hint.startswith(f"About {rates.duration(rates.estimate(lm, 'drift', (64 + 32 + 1) * 2))} ")


# --- KV methods in the sidebar ------------------------------------------------------------------
def test_method_options_build_the_spec_and_a_bad_combination_keeps_the_previous_one():
    at = start()
    at.sidebar.selectbox(key="kv_preset").set_value("nuq3").run()
    at.sidebar.number_input(key="kv_outliers").set_value(1.0).run()
    assert not at.exception and not at.sidebar.error, [e.value for e in at.sidebar.error]
    assert at.session_state["spec"].label == "nuq3:o1"
    assert any(c.value.startswith("nuq codebooks: fitted on") for c in at.sidebar.caption)  # the shipped file
    assert not at.sidebar.get("button") or all(b.key != "kv_calibrate" for b in at.sidebar.button)
    at.sidebar.checkbox(key="kv_prerope").check().run()
    assert at.session_state["spec"].label == "nuq3:o1:prerope"
    at.sidebar.checkbox(key="kv_hadamard").check().run()
    assert not at.exception
    (err,) = [e.value for e in at.sidebar.error]
    assert "do not combine" in err and "Still using nuq3:o1:prerope" in err
    assert at.session_state["spec"].label == "nuq3:o1:prerope"
    at.sidebar.checkbox(key="kv_prerope").uncheck().run()
    assert at.session_state["spec"].label == "nuq3:o1:hadamard" and not at.sidebar.error  # head_dim 64
    at.sidebar.selectbox(key="kv_preset").set_value("nvfp4").run()  # outliers narrow integer/nuq ranges only
    assert "no range to narrow" in at.sidebar.error[0].value
    assert at.session_state["spec"].label == "nuq3:o1:hadamard"


def test_keys_and_values_can_take_their_own_formats():
    at = start()
    at.sidebar.selectbox(key="kv_preset").set_value("nuq4").run()
    at.sidebar.selectbox(key="kv_value_format").set_value("nuq2").run()
    at.sidebar.number_input(key="kv_outliers").set_value(1.0).run()
    assert not at.exception and not at.sidebar.error, [e.value for e in at.sidebar.error]
    spec = at.session_state["spec"]
    assert (spec.label, spec.key_format, spec.value_format) == ("knuq4vnuq2:o1", "nuq4", "nuq2")
    assert any("knuq4vnuq2:o1" in m.value for m in at.sidebar.markdown)  # the status card names it
    at.sidebar.selectbox(key="kv_key_format").set_value("fp8_e4m3").run()  # fp8 has no range for o1 to narrow
    assert (
        "key format fp8_e4m3" in at.sidebar.error[0].value and "Still using knuq4vnuq2:o1" in at.sidebar.error[0].value
    )
    at.sidebar.number_input(key="kv_outliers").set_value(0.0).run()
    assert at.session_state["spec"].label == "kfp8vnuq2" and not at.sidebar.error
    at.sidebar.selectbox(key="kv_value_format").set_value("as the preset").run()
    at.sidebar.selectbox(key="kv_key_format").set_value("as the preset").run()
    assert at.session_state["spec"].label == "nuq4"


def test_a_spec_the_model_cannot_take_is_rejected_with_the_reason(monkeypatch):
    import kvdemo.runner

    def refuse(lm, spec):
        raise ValueError(f"hadamard needs a power-of-two head_dim; this model's is 96 ({spec.label})")

    at = start()
    monkeypatch.setattr(kvdemo.runner, "new_cache", refuse)
    at.sidebar.checkbox(key="kv_hadamard").check().run()
    assert not at.exception
    (err,) = [e.value for e in at.sidebar.error]
    assert "power-of-two head_dim" in err and "Still using int4" in err
    assert at.session_state["spec"].label == "int4"


def test_calibrate_button_fits_saves_and_keeps_the_document(tmp_path, monkeypatch):
    """A model without a codebook file gets NormalFloat levels and a button; calibrating saves the file
    where the caches look (the fit itself is faked: tests/test_calibrate.py runs the real one)."""
    import torch

    from kvdemo import calibration, codebooks
    from kvdemo.progress import Progress

    monkeypatch.setenv("KVDEMO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(codebooks, "ASSET_DIR", tmp_path / "no-shipped-files")
    calls = []

    def fake_calibrate(lm, ids=None, bits=calibration.BITS, on_progress=None):
        calls.append(len(ids))
        for done in (0, 1, 2):
            on_progress(Progress(done, 2, "steps", "layer", 1.0))
        levels = torch.linspace(-1, 1, 8).half()
        meta = {"layers": str(lm.num_layers), "calibration_tokens": str(len(ids)), "date": "today", "seconds": "1"}
        return codebooks.Codebooks({codebooks.tensor_name(0, "key", 3, False, False): levels}, meta)

    at = start("app_pages/chat.py")
    doc = at.session_state["document"]["name"]
    at.sidebar.selectbox(key="kv_preset").set_value("nuq3").run()
    assert any("NormalFloat levels" in c.value for c in at.sidebar.caption)
    monkeypatch.setattr(calibration, "calibrate", fake_calibrate)
    at.sidebar.button(key="kv_calibrate").click().run()
    assert not at.exception and not at.sidebar.error, [e.value for e in at.sidebar.error]
    assert calls == [2048]
    path = tmp_path / "codebooks" / "embedded.safetensors"
    assert path.is_file() and any(str(path) in s.value for s in at.sidebar.success)
    assert any(c.value.startswith("nuq codebooks: fitted on 2048 tokens") for c in at.sidebar.caption)
    assert all(b.key != "kv_calibrate" for b in at.sidebar.button)
    assert at.session_state["document"]["name"] == doc

    def broken(lm, ids=None, bits=calibration.BITS, on_progress=None):
        raise RuntimeError("no attention hook on this architecture")

    path.unlink()
    monkeypatch.setattr(calibration, "calibrate", broken)
    at.run()
    at.sidebar.button(key="kv_calibrate").click().run()
    assert not at.exception
    assert any("calibration failed" in e.value and "no attention hook" in e.value for e in at.sidebar.error)
    assert at.session_state["document"]["name"] == doc and not path.exists()


def test_fit_codebooks_on_the_uploaded_document_and_go_back(lm, tmp_path, monkeypatch):
    """With a document uploaded and a nuq spec, a button under it fits the codebooks on its text (the fit faked as above; the CLI test
    runs a real document fit), says so under the codebooks, and a button forgets that fit: the shipped file again."""
    from kvdemo import calibration, codebooks

    monkeypatch.setenv("KVDEMO_CACHE_DIR", str(tmp_path))
    seen = []

    def fake_calibrate(lm, ids=None, bits=calibration.BITS, on_progress=None):
        seen.append(list(ids))
        meta = {"layers": str(lm.num_layers), "calibration_tokens": str(len(ids)), "date": "today", "seconds": "1"}
        return codebooks.Codebooks(
            {codebooks.tensor_name(0, "key", 3, False, False): torch.linspace(-1, 1, 8).half()}, meta
        )

    monkeypatch.setattr(calibration, "calibrate", fake_calibrate)
    at = start("app_pages/chat.py")
    at.sidebar.selectbox(key="kv_preset").set_value("nuq3").run()
    shipped = next(c.value for c in at.sidebar.caption if c.value.startswith("nuq codebooks:"))
    assert all(b.key != "doc_calibrate_doc" for b in at.button)  # the bundled sample: nothing to fit on
    text = " ".join(f"Minutes of meeting {i}: the board approved budget line {i * 3}." for i in range(40))
    upload(at, "minutes.txt", text.encode())
    assert at.session_state["document"]["name"] == "minutes.txt"
    at.button(key="doc_calibrate_doc").click().run()
    assert not at.exception and not at.sidebar.error, [e.value for e in at.sidebar.error]
    assert seen == [lm.tokenizer(at.session_state["document"]["text"], add_special_tokens=False)["input_ids"]]
    path = tmp_path / "codebooks" / "embedded.safetensors"
    caption = next(c.value for c in at.sidebar.caption if c.value.startswith("nuq codebooks:"))
    assert path.is_file() and f"of minutes.txt (a document, its first {len(seen[0]):,} tokens)" in caption
    at.sidebar.button(key="kv_forget_calibration").click().run()
    assert not at.exception and not path.exists()
    assert next(c.value for c in at.sidebar.caption if c.value.startswith("nuq codebooks:")) == shipped
    assert all(b.key != "kv_forget_calibration" for b in at.sidebar.button)
    assert at.session_state["document"]["name"] == "minutes.txt"  # the document stays
    upload(at, "memo.txt", b"Lunch is at noon.")  # under one key block of tokens: refused with the reason
    at.button(key="doc_calibrate_doc").click().run()
    assert not at.exception and len(seen) == 1 and not path.exists()
    assert any("at least 128 tokens" in e.value for e in at.error), texts(at, "error")
    assert at.session_state["document"]["name"] == "memo.txt"


# --- chat: suggested questions, the per-token comparison, a planted fact ------------------------------
def test_chat_suggested_question_shows_the_comparison_and_a_planted_fact_keeps_the_chat():
    from kvdemo.chat.questions import SAMPLE_QUESTIONS

    at = start("app_pages/chat.py")
    at.number_input(key="chat_max_new").set_value(8).run()
    assert any("Triton kernels read the codes directly" in c.value for c in at.caption)  # why CPU decodes slower
    at.button(key="chat_suggest_0").click().run()
    assert not at.exception, at.exception
    session = at.session_state["chat_session"]
    assert [t.question for t in session.turns] == [SAMPLE_QUESTIONS[0].question]
    assert session.turns[0].comparison is not None
    assert sum("kv-strip" in m.value for m in at.markdown) == 2  # a strip under each answer
    assert any(c.value.startswith("log p(answer):") for c in at.caption)
    at.button(key="chat_plant").click().run()
    assert not at.exception, at.exception
    planted = at.session_state["chat_planted"]
    assert set(planted.found) == {"full", "int4"} and planted.expected in planted.needle
    assert any(m.value.startswith("**Planted fact**") for m in at.markdown)
    assert at.session_state["chat_session"] is session and len(session.turns) == 1  # the chat is kept
    assert planted.needle not in session.document
