"""kvdemo.chat (session and lane): prefix reuse across turns, two lanes streaming together, where an answer
ends, cancel, OOM injection, the model lock, concurrency."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from kvdemo.chat import lane as lanes
from kvdemo.chat.lane import Answer, Decoding, Lane, ends_sentence
from kvdemo.chat.session import ChatError, ChatSession, divergence_split
from kvdemo.models import model_lock
from kvdemo.precision import parse_precision
from kvdemo.progress import Cancelled
from kvdemo.runner import chat_ids, first_divergence, run_precision

DOC = (
    "The Zorblat company was founded in 1987 in Lisbon by Maria Santos. It makes blue bicycles and red "
    "scooters. Its headquarters moved to Porto in 2003, next to the river. The company has 412 employees, "
    "and its best-selling model is called the Heron. In 2019 Zorblat opened a second factory in Braga, "
    "where 150 people build electric bicycles. The current chief executive is Tomas Ferreira."
)
NEW = 6  # new tokens per answer: small, the tests are about cache bookkeeping, not answer quality


class Boom(BaseException):
    """Stands in for Streamlit's RerunException/StopException (BaseException subclasses)."""


# --- the lock, without a model ---------------------------------------------------------------------
def test_model_lock_waits_reports_and_releases():
    fake = SimpleNamespace(lock=threading.Lock())
    fake.lock.acquire()
    threading.Timer(0.5, fake.lock.release).start()
    waits = []
    with model_lock(fake, on_wait=waits.append, poll_s=0.05) as waited:
        assert fake.lock.locked()
        assert waited >= 0.4
    assert waits and waits[0] < waits[-1]
    assert not fake.lock.locked()


def test_model_lock_cancel_while_waiting_does_not_take_the_lock():
    fake = SimpleNamespace(lock=threading.Lock())
    fake.lock.acquire()
    calls = []
    with pytest.raises(Cancelled):
        with model_lock(fake, on_wait=calls.append, should_stop=lambda: len(calls) >= 3, poll_s=0.01):
            pytest.fail("must not enter")
    assert len(calls) == 3
    fake.lock.release()  # still ours: the cancelled waiter never took or released it
    with model_lock(fake):
        pass


def test_model_lock_released_on_exception():
    fake = SimpleNamespace(lock=threading.Lock())
    with pytest.raises(Boom):
        with model_lock(fake):
            raise Boom()
    assert not fake.lock.locked()


# --- where an answer ends, without a model ----------------------------------------------------------
VOCAB = ["The", " cat", " sat", ".", " It", " ran", " far", "<eos>", "\n", " Mr", " Darcy", " 3", "14"]


def scripted(monkeypatch, words: list[str], cap: int) -> Answer:
    """Decode `words` (scripted greedy tokens) with the real stop rules; returns the answer."""
    ids = [VOCAB.index(w) for w in words]
    tok = SimpleNamespace(decode=lambda t, **kw: "".join(VOCAB[i] for i in t))
    fake_lm = SimpleNamespace(tokenizer=tok)

    def one_hot(i: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(ids[i]), len(VOCAB)).float()

    fed = []
    monkeypatch.setattr(lanes, "prefill", lambda lm, chunk, cache: (fed.extend(chunk), one_hot(len(fed)))[1])
    run = Decoding(Lane(parse_precision("full"), []), Answer("full", cap=cap), one_hot(0), {VOCAB.index("<eos>")})
    while run.step(fake_lm):
        pass
    assert fed == run.answer.tokens[: run.answer.decode_steps]
    return run.answer


def test_answer_ends_at_a_sentence_near_its_cap(monkeypatch):
    words = ["The", " cat", " sat", ".", " It", " ran", " far", ".", " It", " ran", " far", " far"] * 4
    late = scripted(monkeypatch, words, cap=40)  # sentences end at 4, 8, 16, 20, 28, 32...: the window opens at 30
    assert late.stopped == "sentence" and late.text.endswith("far.") and len(late.tokens) == 32
    a = scripted(monkeypatch, words, cap=10)  # window from token 8 ("The cat sat. It ran far." is 8 tokens)
    assert (a.stopped, a.text, a.decode_steps) == ("sentence", "The cat sat. It ran far.", 8)
    cut = scripted(monkeypatch, ["The", " cat", " sat", " far"] * 4, cap=6)
    assert (cut.stopped, len(cut.tokens), cut.decode_steps) == ("length", 6, 5)  # no sentence end: the cap cuts
    # a line broken mid-sentence is no sentence end: a looping answer runs to the cap, and says so
    broken = scripted(monkeypatch, ["The", " cat", " sat", "\n"] * 4, cap=10)
    assert (broken.stopped, len(broken.tokens)) == ("length", 10)
    para = scripted(monkeypatch, ["The", " cat", " sat", ".", "\n"] * 4, cap=10)
    assert (para.stopped, para.text) == ("sentence", "The cat sat.\nThe cat sat.")
    eos = scripted(monkeypatch, ["The", " cat", "<eos>", " far"], cap=6)
    assert (eos.stopped, eos.text, len(eos.tokens)) == ("eos", "The cat", 3)  # the end-of-turn token is no text


def test_sentence_ends_skip_abbreviations_and_decimals():
    assert ends_sentence("It ran.", " The") and ends_sentence("Really?", " Yes") and ends_sentence("A list:", "\n")
    assert ends_sentence("Items:\n- a pear", "\n") and ends_sentence("It ran.\n2. It sat", "\n")
    assert not ends_sentence("We met Mrs.", "\n") and not ends_sentence('She said "Mrs.', " Long")
    assert not ends_sentence("It ran.", "14")  # "3." + "14"
    assert not ends_sentence("We met Mr.", " Darcy") and not ends_sentence("see e.g.", " this")
    assert not ends_sentence("by J.", " Austen") and not ends_sentence("It ran", " far")
    assert ends_sentence('He said "go."', " Then") and ends_sentence("It was founded in 1987.", " It")
    assert not ends_sentence("Two items:\n2.", " The")  # a numbered list item, not a sentence end


# --- sessions on the embedded model ----------------------------------------------------------------
@pytest.fixture
def session(lm):
    return ChatSession(lm, "int4:g32:r32", document=DOC)


@pytest.mark.model
def test_prepare_then_followups_feed_only_new_tokens(lm, session):
    doc_ids = chat_ids(lm, session.history()["full"], add_generation_prompt=False)
    read = []
    assert session.prepare(on_progress=read.append) == {"full": len(doc_ids), "int4:g32:r32": len(doc_ids)}
    assert read[-1].unit == "tokens" and read[-1].done == read[-1].total == 2 * len(doc_ids)  # both lanes, counted
    assert read[0].what.startswith("full: reading") and read[-1].what.startswith("int4:g32:r32: reading")
    assert session.prepare() == {"full": 0, "int4:g32:r32": 0}  # already prefilled: nothing fed
    asked = []
    first = session.ask("Who founded Zorblat?", max_new_tokens=NEW, on_progress=asked.append)
    assert asked[-1].done == asked[-1].total == sum(a.fed_tokens for a in first.answers)  # only the new tokens
    second = session.ask("How many employees does it have?", max_new_tokens=NEW)
    for turn in (first, second):
        assert [a.precision for a in turn.answers] == ["full", "int4:g32:r32"]
        for a in turn.answers:
            assert 0 < a.fed_tokens < 40, a  # the ~110-token document is never read again
            assert not a.reprefilled
            assert a.prompt_tokens > len(doc_ids)
            assert a.finished and (len(a.tokens) == NEW or a.stopped in ("eos", "sentence")), a
            assert a.decode_steps == len(a.tokens) - (a.stopped != "sentence")  # an ending token is never fed
    # The full-precision answer of the follow-up equals a from-scratch run on the same conversation.
    hist = session.history()["full"]
    ids = chat_ids(lm, hist[:-1])
    assert second.answers[0].prompt_tokens == len(ids)
    alone = run_precision(lm, ids, "full", NEW).tokens
    assert alone[: len(second.answers[0].tokens)] == second.answers[0].tokens
    # Each lane's cache holds its conversation so far (the token that ends an answer is never fed).
    for a in second.answers:
        held = a.prompt_tokens + a.decode_steps
        assert a.cache_tokens == held == session.cached_tokens()[a.precision]
        assert a.cache_bytes == session.cache_bytes()[a.precision] > 0
    full_bytes, int4_bytes = (a.cache_bytes for a in second.answers)
    assert int4_bytes < full_bytes  # codes + a 32-token residual vs the model's dtype


@pytest.mark.model
def test_both_answers_stream_together_each_timed_on_its_own(lm, session):
    streamed = []
    turn = session.ask(
        "Describe the company in detail.", max_new_tokens=12, on_token=lambda a, piece: streamed.append(a.precision)
    )
    base, chosen = turn.answers
    both = 2 * min(len(base.tokens), len(chosen.tokens))
    assert streamed[:both] == ["full", "int4:g32:r32"] * (both // 2)  # one token per lane in turn
    assert both >= 4
    for a in turn.answers:
        assert a.decode_steps >= 1 and a.decode_tok_s == a.decode_steps / a.decode_s > 0
        assert a.decode_s < sum(x.decode_s for x in turn.answers)  # its own steps, not the pair's


@pytest.mark.model
def test_divergence_is_reported_against_the_baseline(lm):
    s = ChatSession(lm, "int2:g32:r32", document=DOC)
    turn = s.ask("Describe the company in one sentence.", max_new_tokens=12)
    base, low = turn.answers
    assert turn.first_divergence == first_divergence(base.tokens, low.tokens)
    before, token, after = divergence_split(low, turn.first_divergence, lm.tokenizer)
    assert before + token + after == low.text
    if turn.first_divergence is None:
        assert token == after == ""
    else:
        assert token == lm.tokenizer.decode([low.tokens[turn.first_divergence]], skip_special_tokens=True)
    assert turn.to_dict()["answers"][1]["precision"] == "int2:g32:r32"


@pytest.mark.model
def test_should_stop_keeps_partial_turn_and_next_turn_reuses_cache(lm, session):
    session.prepare()  # both lanes hold the document
    streamed = []

    def on_token(answer, piece):
        streamed.append((answer.precision, answer.tokens[-1]))

    turn = session.ask(
        "Who founded Zorblat?", max_new_tokens=NEW, on_token=on_token, should_stop=lambda: len(streamed) >= 3
    )
    base, chosen = turn.answers
    assert base.stopped == "cancelled" and len(base.tokens) == 2  # the lanes take turns: full, int4, full
    assert chosen.stopped == "cancelled" and len(chosen.tokens) == 1
    assert turn.cancelled and session.turns == [turn]
    assert not lm.lock.locked()
    nxt = session.ask("Where is the headquarters?", max_new_tokens=NEW)
    assert not nxt.cancelled
    assert all(not a.reprefilled and a.fed_tokens < 40 for a in nxt.answers)  # both caches reused


@pytest.mark.model
def test_exception_from_a_callback_releases_lock_and_keeps_chat(lm, session):
    def on_token(answer, piece):
        if answer.precision != "full":
            raise Boom()  # e.g. Streamlit stops the script when the user clicks Stop or changes page

    with pytest.raises(Boom):
        session.ask("Who founded Zorblat?", max_new_tokens=NEW, on_token=on_token)
    assert not lm.lock.locked()
    (turn,) = session.turns
    assert turn.cancelled and [len(a.tokens) for a in turn.answers] == [1, 1]  # the raising token is kept
    assert [a.stopped for a in turn.answers] == ["cancelled", "cancelled"]
    again = session.ask("And the headquarters?", max_new_tokens=NEW)
    assert all(not a.reprefilled for a in again.answers)
    assert len(session.turns) == 2


@pytest.mark.model
def test_wait_idle_until_a_stopped_turn_in_another_thread_has_unwound(lm, session):
    """Streamlit may start the next page run while a stopped one still unwinds in its old thread: the page
    waits with wait_idle() and then sees the stopped turn recorded."""
    streaming, stop = threading.Event(), threading.Event()

    def on_token(answer, piece):
        streaming.set()
        stop.wait(30)
        raise Boom()  # the old run reaches its next yield point and stops

    def old_run():
        with pytest.raises(Boom):
            session.ask("Who founded Zorblat?", max_new_tokens=NEW, on_token=on_token)

    worker = threading.Thread(target=old_run)
    worker.start()
    assert streaming.wait(60)
    assert not session.wait_idle(timeout=0.2) and session.turns == []
    stop.set()
    assert session.wait_idle(timeout=60)
    worker.join(60)
    (turn,) = session.turns
    assert turn.cancelled and len(turn.answers[0].tokens) == 1
    assert not lm.lock.locked() and session.wait_idle(timeout=0)


@pytest.mark.model
def test_exception_inside_a_forward_pass_drops_only_that_cache(lm, session):
    session.prepare()
    layer = lm.model.model.layers[7]
    calls = {"n": 0}

    def fail_on_decode(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] == 1:  # a decode step: layers 0-6 have appended, layers 7+ have not
            calls["n"] += 1
            raise RuntimeError("injected failure")

    handle = layer.register_forward_pre_hook(fail_on_decode, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            session.ask("Who founded Zorblat?", max_new_tokens=NEW)
    finally:
        handle.remove()
    assert calls["n"] == 1 and not lm.lock.locked()
    assert session.cached_tokens()["full"] == 0  # half-updated cache dropped, not reused
    assert session.cached_tokens()["int4:g32:r32"] > 0  # the other lane's prefilled document is kept
    turn = session.ask("Who founded Zorblat?", max_new_tokens=NEW)
    assert turn.answers[0].fed_tokens == turn.answers[0].prompt_tokens  # rebuilt from scratch
    assert turn.answers[1].fed_tokens < 40


@pytest.mark.model
@pytest.mark.parametrize("where, error", [("prefill", torch.OutOfMemoryError), ("decode", MemoryError)])
def test_out_of_memory_frees_caches_and_keeps_chat(lm, session, monkeypatch, where, error):
    session.ask("Who founded Zorblat?", max_new_tokens=NEW)
    real = lanes.prefill

    def oom(lm, ids, cache, *args, **kwargs):
        if where == "decode" and len(ids) > 1:  # the question's tokens go through; the first decode step fails
            return real(lm, ids, cache, *args, **kwargs)
        raise error("injected: CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(lanes, "prefill", oom)
    with pytest.raises(ChatError, match="out of memory.*lower KV precision"):
        session.ask("How many employees?", max_new_tokens=NEW)
    assert session.cache_bytes() == {"full": 0, "int4:g32:r32": 0}
    assert len(session.turns) == 1 and not lm.lock.locked()
    monkeypatch.setattr(lanes, "prefill", real)
    turn = session.ask("How many employees?", max_new_tokens=NEW)
    assert all(a.fed_tokens == a.prompt_tokens for a in turn.answers)  # re-read after the caches were freed
    assert len(session.turns) == 2


@pytest.mark.model
def test_bad_input_is_a_chat_error(lm, session, monkeypatch):
    with pytest.raises(ChatError, match="type a question"):
        session.ask("   ")
    with pytest.raises(ChatError, match="positive"):
        session.ask("hi", max_new_tokens=0)
    monkeypatch.setattr(type(lm), "max_context", property(lambda self: 120))
    with pytest.raises(ChatError, match=r"exceeds the model's context \(120 tokens\)"):
        session.ask("Who founded Zorblat?", max_new_tokens=NEW)
    assert session.turns == [] and not lm.lock.locked()
    with pytest.raises(ValueError, match="unknown precision"):
        session.set_precision("int5")


@pytest.mark.model
def test_set_precision_keeps_the_chat(lm, session):
    session.ask("Who founded Zorblat?", max_new_tokens=NEW)
    session.set_precision("int8")
    assert session.labels == ["full", "int8"]
    hist = session.history()
    assert hist["int8"] == hist["full"]  # the new lane continues the baseline's conversation
    assert len(session.turns) == 1
    turn = session.ask("Where is the headquarters?", max_new_tokens=NEW)
    assert turn.answers[1].precision == "int8"
    assert turn.answers[1].fed_tokens == turn.answers[1].prompt_tokens  # new precision: new cache
    assert turn.answers[0].fed_tokens < 40
    session.set_document("A short note: the meeting is on Tuesday.")
    assert session.turns == [] and session.cache_bytes() == {"full": 0, "int8": 0}


@pytest.mark.model
def test_four_concurrent_sessions_queue_and_never_cross_talk(lm):
    """Four threads, four sessions, one model: every run completes, one generation at a time, no cross-talk."""
    codes = ["ALPHA-11", "BRAVO-22", "CHARLIE-33", "DELTA-44"]
    sessions = [ChatSession(lm, "k8v4:g32:r32", document=f"The access code is {c}. Keep it safe.") for c in codes]
    active, peak, waits, errors = [0], [0], [0] * 4, []
    guard = threading.Lock()
    real_prefill = lanes.prefill

    def counting_prefill(*args, **kwargs):
        with guard:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            return real_prefill(*args, **kwargs)
        finally:
            with guard:
                active[0] -= 1

    def work(i: int) -> None:
        try:
            sessions[i].ask("What is the access code?", max_new_tokens=4, on_wait=lambda s: waits.__setitem__(i, 1))
        except Exception as err:  # reported below
            errors.append(err)

    lanes.prefill = counting_prefill
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
    finally:
        lanes.prefill = real_prefill
    assert not any(t.is_alive() for t in threads), "a queued run did not finish in time"
    assert errors == []
    assert peak[0] == 1  # the lock serialized the generations
    assert sum(waits) >= 1  # at least one session saw "waiting for another user"
    assert time.perf_counter() - start < 240
    for code, s in zip(codes, sessions, strict=True):
        assert len(s.turns) == 1
        for hist in s.history().values():
            text = " ".join(m["content"] for m in hist)
            assert code in text
            assert not any(other in text for other in codes if other != code)
    assert not lm.lock.locked()
