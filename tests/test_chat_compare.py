"""What quantization changed in a chat turn: the per-token comparison (kvdemo/chat/compare.py, its result in
kvdemo/results/chat.py, its HTML strip in kvdemo/figures/chat.py), the suggested questions, the planted-fact
check."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import caches_equal

from kvdemo.chat.compare import compare_answers, snapshot, teacher_forced_logprobs
from kvdemo.chat.planted import plant_and_ask
from kvdemo.chat.questions import SAMPLE_QUESTIONS, suggested_questions
from kvdemo.chat.session import SYSTEM_PROMPT, ChatError, ChatSession
from kvdemo.documents import hold_document
from kvdemo.figures.chat import legend_html, strip_html
from kvdemo.needle.prompts import answer_matches
from kvdemo.results.chat import (
    CHAT_SPEED_REPORT,
    KL_LEVELS,
    AnswerComparison,
    ChatSpeedReport,
    PlantedCheck,
    SpeedRow,
    TokenScores,
    cpu_speed_caption,
    kl_level,
    legend,
    load_chat_speed,
)
from kvdemo.runner import chat_ids, fork, new_cache, prefill, run_precision
from kvdemo.texts import prose

SAMPLE_TOKENS = 1024  # the Chat page's default sample length

DOC = (
    "The Zorblat company was founded in 1987 in Lisbon by Maria Santos. It makes blue bicycles and red "
    "scooters. Its headquarters moved to Porto in 2003, next to the river. The company has 412 employees."
)


def scores(**kw) -> TokenScores:
    base = dict(
        answer_of="full",
        scored_under="int2",
        tokens=[1, 2, 3],
        pieces=["The", " cat", ""],
        logprob_own=[-0.1, -0.5, -0.2],
        logprob_other=[-0.3, -4.0, -0.2],
        kl=[0.001, 2.5, 0.05],
        divergence=1,
        divergence_piece=" dog",
    )
    return TokenScores(**(base | kw))


# --- without a model -------------------------------------------------------------------------------
def test_scores_totals_levels_and_summary():
    s = scores()
    assert s.total_own == pytest.approx(-0.8) and s.total_other == pytest.approx(-4.5)
    assert s.levels() == [0, 3, 1] and s.max_kl == 2.5
    line = s.summary()
    assert "-0.80 under full" in line and "-4.50 under int2" in line and "token #1" in line and "' dog'" in line
    assert "would have chosen every token" in scores(divergence=None, divergence_piece="").summary()


def test_kl_levels_cut_at_their_bounds():
    assert [kl_level(x) for x in (0.0, KL_LEVELS[0], KL_LEVELS[1] - 1e-9, KL_LEVELS[2], 50.0)] == [0, 1, 1, 3, 3]
    assert [name for name, _ in legend()] == ["agree", "slight", "clear", "strong"]
    assert legend()[0][1] == "< 0.01" and legend()[-1][1] == ">= 1"


def test_comparison_and_planted_check_round_trip_through_json():
    comp = AnswerComparison("full", "int2", [scores(), scores(answer_of="int2", scored_under="full")], 1.25)
    assert AnswerComparison.from_json(comp.to_json()) == comp
    assert comp.of("int2").scored_under == "full" and comp.of("int4") is None
    check = PlantedCheck("notes.txt", 900, "The pass key is 12345.", "What is the pass key?", "12345", 0.5,
                         {"full": "12345", "int2": "1234"}, {"full": True, "int2": False}, comp)  # fmt: skip
    assert PlantedCheck.from_json(check.to_json()) == check


def test_cpu_speed_caption_says_why_and_the_measured_ratio_when_a_report_backs_it(tmp_path):
    assert "Triton kernels read the codes directly" in cpu_speed_caption(None, "int4")
    assert "Measured" not in cpu_speed_caption(None, "int4")
    report = ChatSpeedReport("python bench/chat_cpu_speed.py", "abc", "2026-12-07", "x86_64, 2 CPU cores", "m", 1100, 8,
                             [SpeedRow("full", 100.0, 10.0, 1.0), SpeedRow("int4", 250.0, 4.0, 2.5)])  # fmt: skip
    assert ChatSpeedReport.from_json(report.to_json()) == report
    line = cpu_speed_caption(report, "int4")
    assert "int4 2.5x slower" in line and "1,100-token" in line and "2026-12-07" in line
    assert "Measured" not in cpu_speed_caption(report, "nuq2")  # not measured: no figure
    assert load_chat_speed(tmp_path / "missing.json") is None
    if CHAT_SPEED_REPORT.is_file():  # the shipped report reads back and writes the same JSON
        d = json.loads(CHAT_SPEED_REPORT.read_text())
        assert load_chat_speed().to_json() == d


def test_strip_colours_every_token_and_marks_the_divergence():
    out = strip_html(scores(pieces=["<b>", " cat", ""]))
    assert out.count('class="kv-tok"') == 3 and "&lt;b&gt;" in out and "<b>" not in out.replace('"<b>"', "")
    assert out.count("border-bottom") == 1 and "would have said &#x27; dog&#x27;" in out
    assert "⏎" in out  # the end-of-turn token is shown, not dropped
    assert "agree" in legend_html() and "hover" in legend_html()


def test_suggested_questions_need_their_model_and_their_answer_in_the_sample():
    assert SAMPLE_QUESTIONS, "ship at least one suggested question"
    whole = prose()
    assert suggested_questions("SmolLM2-135M-Instruct (embedded, GGUF Q4_1)", whole) == list(SAMPLE_QUESTIONS)
    assert suggested_questions("Qwen2.5-0.5B", whole) == []
    assert suggested_questions("SmolLM2-135M-Instruct (embedded, GGUF Q4_1)", whole[:40]) == []
    for q in SAMPLE_QUESTIONS:
        assert answer_matches(q.expected, q.quote), q  # the expected answer is the document's own words


# --- with the model ---------------------------------------------------------------------------------
@pytest.mark.model
def test_own_cache_reproduces_the_lane_and_full_answer_is_scored_under_the_quantized_cache(lm):
    s = ChatSession(lm, "int2", DOC)
    turn = s.ask("Who founded the company?", max_new_tokens=16)
    comp = turn.comparison
    assert comp is not None and [a.answer_of for a in comp.answers] == ["full", "int2"]
    full, quant = comp.answers
    for a, ans in zip(comp.answers, turn.answers, strict=True):
        assert a.tokens == ans.tokens and len(a.kl) == len(a.tokens) == len(a.logprob_other)
        # under its own cache, each answer is that cache's greedy choice at every token
        assert all(lp <= 0 for lp in a.logprob_own) and all(k >= 0 for k in a.kl)
    assert full.scored_under == "int2" and quant.scored_under == "full"
    # the greedy answer is the argmax of its own distribution: the other cache cannot give it more probability
    # on the first token it disagrees on
    for a in comp.answers:
        if a.divergence is not None:
            assert a.logprob_other[a.divergence] < a.logprob_own[a.divergence]
            assert a.divergence_piece != a.pieces[a.divergence]
    if full.tokens == quant.tokens:
        assert full.divergence is None
    else:
        assert full.divergence is not None or quant.divergence is not None


@pytest.mark.model
def test_teacher_forcing_under_its_own_cache_matches_greedy_decoding(lm):
    ids = chat_ids(lm, [{"role": "system", "content": DOC}, {"role": "user", "content": "Where is it based?"}])
    for prec in ("full", "int4"):
        cache = new_cache(lm, prec)
        first = prefill(lm, ids, cache)
        state = snapshot(prec, cache, first)
        tokens, logits = [], first
        for _ in range(10):
            tokens.append(int(torch.argmax(logits)))
            logits = prefill(lm, [tokens[-1]], cache)
        lp = teacher_forced_logprobs(lm, state, tokens)  # [10, V]
        assert lp.argmax(-1).tolist() == tokens, prec
        comp = compare_answers(lm, [state, state], [tokens, tokens])
        assert all(k == pytest.approx(0, abs=1e-6) for k in comp.answers[0].kl)  # same cache: no divergence
        assert comp.answers[0].divergence is None


@pytest.mark.model
def test_a_cancelled_turn_or_compare_off_has_no_comparison(lm):
    s = ChatSession(lm, "int4", DOC, compare=False)
    assert s.ask("Who founded the company?", max_new_tokens=4).comparison is None
    s = ChatSession(lm, "int4", DOC)
    calls = iter(range(1000))
    turn = s.ask("Who founded the company?", max_new_tokens=8, should_stop=lambda: next(calls) > 3)
    assert turn.cancelled and turn.comparison is None


@pytest.mark.model
@pytest.mark.parametrize("q", SAMPLE_QUESTIONS, ids=lambda q: q.question)
def test_suggested_questions_are_answered_right_at_full_precision(lm, q):
    doc = hold_document("sample", prose(), lm.tokenizer, SAMPLE_TOKENS, "sample", [], lm.name)["text"]
    assert q in suggested_questions(lm.name, doc)
    ids = chat_ids(
        lm, [{"role": "system", "content": f"{SYSTEM_PROMPT}\n\n{doc}"}, {"role": "user", "content": q.question}]
    )
    gen = run_precision(lm, ids, "full", 64)  # the page's full lane: same prompt, greedy, ends at end of turn
    assert gen.stopped == "eos" and answer_matches(q.expected, gen.text), gen.text


@pytest.mark.model
def test_planted_fact_leaves_the_users_chat_alone(lm):
    doc = hold_document("sample", prose(), lm.tokenizer, 256, "sample", [], lm.name)["text"]
    user = ChatSession(lm, "int4", doc)
    user.ask("Who is Mr. Bennet?", max_new_tokens=4)
    before = [(lane.ids[:], lane.messages[:]) for lane in user._lanes]
    copies = [fork(lane.cache) for lane in user._lanes]
    check = plant_and_ask(lm, "int4", doc, "sample")
    assert [(lane.ids, lane.messages) for lane in user._lanes] == before and len(user.turns) == 1
    assert all(caches_equal(a, lane.cache) for a, lane in zip(copies, user._lanes, strict=True))
    assert check.needle.startswith("The pass key is") and check.expected in check.needle and 0.3 < check.depth < 0.7
    assert set(check.answers) == set(check.found) == {"full", "int4"}
    assert check.found["full"] == answer_matches(check.expected, check.answers["full"])
    assert check.comparison is not None and check.comparison.precision == "int4"
    with pytest.raises(ChatError):
        plant_and_ask(lm, "int4", "   ")


@pytest.mark.model
def test_out_of_memory_while_scoring_keeps_the_answers(lm, monkeypatch):
    import kvdemo.chat.session as sessions

    def boom(*args, **kwargs):
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(sessions, "compare_answers", boom)
    s = ChatSession(lm, "int4", DOC)
    turn = s.ask("Who founded the company?", max_new_tokens=4)
    assert turn.comparison is None and all(a.finished and a.tokens for a in turn.answers)
    assert len(s.turns) == 1 and all(lane.cache is not None for lane in s._lanes)  # the chat goes on
