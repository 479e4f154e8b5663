"""Chat: a document plus a conversation, each turn answered at full precision and at the chosen KV
precision in two columns that stream together (one token per lane in turn), the first diverging token
highlighted. The work is `kvdemo.chat.ChatSession` (kept in this session's state, so its caches are
reused across turns)."""

import contextlib
import html
from collections.abc import Iterator

import streamlit as st

from app_pages import common
from kvdemo import rates
from kvdemo.chat.lane import Answer
from kvdemo.chat.planted import plant_and_ask
from kvdemo.chat.questions import suggested_questions
from kvdemo.chat.session import ChatError, ChatSession, Turn, divergence_split, work_done
from kvdemo.figures.chat import legend_html, strip_html
from kvdemo.prefill_modes import MODE_HELP
from kvdemo.progress import Cancelled, Progress
from kvdemo.results.chat import cpu_speed_caption, load_chat_speed
from kvdemo.runner import PREFILL_MODES
from kvdemo.sizes import cache_caption

STOPPING_WAIT_S = 60  # a stopped answer ends at its next token (a prefill chunk at the most)
DEFAULT_CAP = 256  # tokens per answer at the most; answers usually end earlier, at the model's end of turn

lm = common.model()
spec = common.spec()
st.title("Chat with a document")
st.page_link(
    "app_pages/findings.py",
    label="Findings: what quantization costs, measured per claim",
    icon=":material/fact_check:",
)
st.caption(
    "Every question is answered twice: with a full-precision KV cache and with your KV precision (sidebar). "
    "The document is read once per precision; follow-up questions reuse both caches."
)
if lm.device.type == "cpu" and spec.is_quantized:
    st.caption(cpu_speed_caption(load_chat_speed(), spec.label))

session: ChatSession | None = st.session_state.get("chat_session")
if session is not None and not session.wait_idle(timeout=0.05):
    with st.spinner("Stopping the previous answer..."):
        if not session.wait_idle(timeout=STOPPING_WAIT_S):
            st.warning("The previous answer is still stopping: reload the page in a few seconds.")
            st.stop()
asked = len(session.turns) if session is not None and session.lm is lm else 0
replacing_ends = f"the conversation ({asked} question{'s' if asked > 1 else ''})" if asked else ""
with st.expander("Document", expanded=True):  # constant: a changing value would re-collapse it on a rerun
    doc = common.document_picker(lm, key="doc", replacing_ends=replacing_ends)
doc_text = doc["text"] if doc else ""

common.persist("chat_prefill_mode", "chunked")
if session is None or session.lm is not lm:
    if session is not None and session.turns:
        st.info("A different model is loaded: the conversation starts again (the document is kept).")
    session = ChatSession(lm, spec, doc_text, prefill_mode=st.session_state["chat_prefill_mode"])
    st.session_state["chat_session"] = session
else:
    if session.document != doc_text.strip():
        if session.turns:
            st.info("Document replaced: a new conversation starts.")
        session.set_document(doc_text)
    session.set_precision(spec)

common.persist("chat_max_new", DEFAULT_CAP)
c1, c2, c3 = st.columns([2, 1, 1], vertical_alignment="bottom")
max_new = int(
    c1.number_input(
        "Longest answer (tokens)", 1, 2048, step=32, key="chat_max_new",
        help="An answer ends at the model's end of turn. In the last quarter of this cap it ends at the first "
        "sentence end; the cap cuts it mid-sentence only when no sentence ended there (the caption says so).",
    )
)  # fmt: skip
read_now = c2.button("Read document now", key="chat_prepare", help="Prefill the document into both caches now")
if c3.button("New chat", key="chat_reset"):
    session.reset()
mode = st.radio(
    f"Prefill: how the document enters the {spec.label} cache",
    PREFILL_MODES,
    key="chat_prefill_mode",
    horizontal=True,
    captions=[MODE_HELP[m] for m in PREFILL_MODES],
    help="Changing it keeps the chat; the quantized cache reads the document again at the next question.",
)
session.set_prefill_mode(mode)


def answer_caption(a: Answer) -> str:
    parts = [f"{len(a.tokens)} tokens"]
    if a.decode_tok_s:
        parts.append(f"{a.decode_tok_s:.1f} tok/s")
    if a.stopped in ("cancelled", "skipped"):
        parts.append("stopped")
    elif a.stopped == "length":
        parts.append(f"cut mid-sentence at the {a.cap:,}-token cap")
    elif a.stopped == "sentence":
        parts.append(f"ended at a sentence end near the {a.cap:,}-token cap")
    reused = a.prompt_tokens - a.fed_tokens
    parts.append(f"read {a.fed_tokens:,} new tokens" + (f", {reused:,} from the cache" if reused > 0 else ""))
    if a.cache_tokens:
        parts.append(cache_caption(lm, a.precision, a.cache_bytes, a.cache_tokens))
    return " · ".join(parts)


def show_answer(box, a: Answer, turn: Turn) -> None:
    with box.container():
        with st.chat_message("assistant"):
            st.markdown(f"**{a.precision}**")
            before, token, rest = divergence_split(a, turn.first_divergence, lm.tokenizer)
            body = common.highlighted(before, token, rest) or "<i>(no answer)</i>"
            st.markdown(body, unsafe_allow_html=True)
            st.caption(answer_caption(a))
            scores = turn.comparison.of(a.precision) if turn.comparison is not None else None
            if scores is not None:
                st.markdown(strip_html(scores), unsafe_allow_html=True)
                st.caption(scores.summary())


def show_turn(turn: Turn, boxes: list | None = None) -> None:
    if boxes is None:
        with st.chat_message("user"):
            st.markdown(turn.question)
        boxes = [col.empty() for col in st.columns(len(turn.answers))]
    for box, a in zip(boxes, turn.answers, strict=True):
        show_answer(box, a, turn)
    if turn.first_divergence is None:
        same = all(a.tokens == turn.answers[0].tokens for a in turn.answers)
        st.caption("Identical answers." if same else "No diverging token within the shorter answer.")
    else:
        st.caption(f"First diverging token: #{turn.first_divergence} (highlighted).")
    if turn.comparison is not None:
        st.markdown(legend_html(), unsafe_allow_html=True)
        st.caption(
            "Under each answer: its tokens teacher-forced through both caches (the same prompt and document), "
            "coloured by KL(full || quantized) of the next-token distributions."
        )


for past in session.turns:
    show_turn(past)

to_read = session.tokens_to_read()
expected_s = None
if to_read > 50:  # the document still to read: the long part of a first turn
    expected_s = common.time_hint(lm, "chat-read", to_read, f"reading {to_read:,} tokens (both precisions)")
status = st.empty()
progress = st.empty()
seen: list[Progress] = []
on_progress = common.timed_bar(progress, expected_s, seen)  # tokens read so far, time left


@contextlib.contextmanager
def keeping_the_chat() -> Iterator[None]:
    """What stopped a run, on one line in the status slot (the user's error, a wait cancelled, or a bug: never a
    traceback); the chat and the document are kept either way."""
    try:
        yield
    except ChatError as err:
        status.error(f"{err}. Your chat and document are kept.")
    except Cancelled:
        status.info("Stopped while waiting for another user.")
    except Exception as err:  # a bug, not the user's fault
        status.error(f"Something went wrong: {str(err).splitlines()[0] if str(err) else type(err).__name__}")


def on_wait(seconds: float) -> None:
    status.info(f"Waiting for another user's generation to finish... {seconds:.0f} s", icon=":material/hourglass:")


if read_now:
    try:
        fed = session.prepare(on_progress=on_progress, on_wait=on_wait)
    except ChatError as err:
        st.error(str(err))
    except Cancelled:
        st.info("Stopped.")
    else:
        status.success("Document read: " + ", ".join(f"{k} {v:,} tokens" for k, v in fed.items()))
    finally:
        common.record_speed(lm, "chat-read", seen)
    progress.empty()

suggested = suggested_questions(lm.name, doc_text) if doc and doc["source"] == "sample" else []
picked = None
if suggested:
    st.caption(
        "Suggested questions: the embedded model answers these right at full precision (checked by a test); "
        "low-bit formats often do not."
    )
    for col, (i, q) in zip(st.columns(len(suggested)), enumerate(suggested), strict=True):
        if col.button(q.question, key=f"chat_suggest_{i}", help=f"Expected answer: {q.expected}. {q.note}"):
            picked = q.question
if doc_text and st.button(
    "Plant a fact in this document and ask it",
    key="chat_plant",
    help="Hides a pass key (5 digits) in the middle of this document and asks for it at full precision and at "
    f"{spec.label}, in a chat of its own: your conversation and document are kept.",
):
    with st.spinner("Planting a fact and asking for it at both precisions..."), keeping_the_chat():
        st.session_state["chat_planted"] = plant_and_ask(
            lm, spec, doc_text, doc["name"], prefill_mode=mode, on_progress=on_progress, on_wait=on_wait
        )
    progress.empty()
planted = st.session_state.get("chat_planted")
if planted is not None and planted.document == (doc["name"] if doc else None):
    with st.container(border=True, key="chat_planted_box"):
        st.markdown(f"**Planted fact** ({planted.depth:.0%} into {planted.document}): {planted.needle}")
        st.markdown(f"Asked: *{planted.question}* · expected **{planted.expected}**")
        cols = st.columns(len(planted.answers))
        for col, (prec, text) in zip(cols, planted.answers.items(), strict=True):
            verdict = "found it" if planted.found[prec] else "did not find it"
            col.markdown(f"**{prec}** ({verdict}): {html.escape(text) or '<i>(no answer)</i>'}", unsafe_allow_html=True)
            scores = planted.comparison.of(prec) if planted.comparison is not None else None
            if scores is not None:
                col.markdown(strip_html(scores), unsafe_allow_html=True)
                col.caption(scores.summary())

question = st.chat_input("Ask about the document", key="chat_input", submit_mode="stop") or picked
if question:
    with st.chat_message("user"):
        st.markdown(question)
    boxes = [col.empty() for col in st.columns(len(session.labels))]
    slots = dict(zip(session.labels, boxes, strict=True))

    def on_token(a: Answer, piece: str) -> None:
        status.empty()
        progress.empty()
        speed = f" · {a.decode_tok_s:.1f} tok/s" if a.decode_tok_s else ""
        cursor = "" if a.finished else " ▌"  # a finished column waits for the other without a cursor
        head = f"**{a.precision}** · {len(a.tokens)} tokens{speed}"
        slots[a.precision].markdown(f"{head}\n\n{html.escape(a.text)}{cursor}", unsafe_allow_html=True)

    turn = None
    try:
        with keeping_the_chat():
            turn = session.ask(question, max_new, on_token=on_token, on_progress=on_progress, on_wait=on_wait)
            rates.record(lm, "chat-answer", *work_done(turn.answers)["chat-answer"])
    finally:
        common.record_speed(lm, "chat-read", seen)
    if turn is not None:
        status.empty()
        progress.empty()
        show_turn(turn, boxes)
elif not session.turns:
    st.info("Ask a question about the document below.")
