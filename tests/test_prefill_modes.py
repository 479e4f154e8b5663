"""Prefill modes end to end: `exact` is today's needle path bit for bit, `chunked` differs once
the prompt spans more than one chunk (a 64-token chunk here, so ~300-token prompts span several), the chat
lanes store a document the way `runner.prefill` does in each mode, the CLI and pages expose both, and the
Memory page measures headroom with real caches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import caches_equal
from streamlit.testing.v1 import AppTest

from kvdemo import needle, prefill_modes, runner
from kvdemo.chat.session import ChatSession
from kvdemo.cli import build_parser, main
from kvdemo.drift import document_prompt, run_drift
from kvdemo.needle.run import _AnswerStop
from kvdemo.results.prefill_modes import PrefillModesReport, headlines, load_report, summary_rows
from kvdemo.texts import prose

ROOT = Path(__file__).resolve().parent.parent
SPEC = "int4:g32:r32"
CHUNK = 64


@pytest.fixture
def small_chunk(monkeypatch):
    monkeypatch.setattr(runner, "PREFILL_CHUNK", CHUNK)


# --- needle and drift ---------------------------------------------------------------------------------


@pytest.mark.model
def test_exact_is_todays_needle_path_bit_for_bit_and_chunked_differs(lm, small_chunk):
    cell = prefill_modes.needle_modes(lm, [SPEC], 300, 50, "passkey", seed=3)
    assert cell.chunks > 1 and cell.context_tokens > 4 * CHUNK
    # today's path from its parts: one full-precision prefill, transplanted, then suffix + answer
    rng = needle.cell_rng(3, 300, 50.0)
    task = needle.make_task("passkey", rng)
    prompt = needle.build_prompt(lm, task, needle.FILLER, 300, 50, rng, " ")
    ctx, suffix = prompt.ids[: prompt.context_len], prompt.ids[prompt.context_len :]
    full = runner.new_cache(lm, "full")
    runner.prefill(lm, ctx, full, chunk=len(ctx))
    expected = {}
    for label, cache in ((SPEC, needle.transplant(lm, full, SPEC)), ("full", full)):
        stop = _AnswerStop(True, None)
        logprob, tokens, _ = needle.score_and_answer(lm, cache, suffix, prompt.answer_ids, task.max_new_tokens, stop)
        expected[label] = (round(logprob, 4), lm.tokenizer.decode(tokens, skip_special_tokens=True).strip())
    exact = {r.precision: (r.answer_logprob, r.answer) for r in cell.rows["exact"]}
    assert exact == expected
    # and the grid in exact mode gives the same rows for this cell
    grid = needle.run_grid(lm, [300], [50], SPEC, kind="passkey", seed=3, prefill_mode="exact")
    assert {r.precision: (r.answer_logprob, r.answer) for r in grid.rows} == expected
    assert grid.to_json()["prefill_mode"] == "exact"
    (r,) = cell.results
    assert r["exact"]["answer_logprob"] == expected[SPEC][0]
    assert r["chunked"]["answer_logprob"] != r["exact"]["answer_logprob"]  # errors compound across chunks
    assert r["chunked_vs_exact"] == pytest.approx(r["chunked"]["answer_logprob"] - r["exact"]["answer_logprob"])
    rows = summary_rows(cell=cell)
    assert rows[0]["log p chunked - exact"] == r["chunked_vs_exact"]
    assert any("chunked minus exact" in line for line in headlines(cell, CHUNK))


@pytest.mark.model
def test_one_chunk_prompts_are_the_same_in_both_modes(lm):
    seen = []
    cell = prefill_modes.needle_modes(lm, [SPEC], 200, 50, "passkey", on_progress=seen.append)  # one 2,048 chunk
    (r,) = cell.results
    assert cell.chunks == 1 and r["chunked"] == r["exact"] and r["chunked_vs_exact"] == 0
    assert any("one prefill chunk" in line for line in headlines(cell, runner.PREFILL_CHUNK))
    rows = [p for p in seen if p.row is not None]  # tokens of work: the cell at full, then SPEC in each mode
    assert [(p.done, p.total, p.unit) for p in rows] == [(n, 600, "tokens") for n in (200, 400, 600)]
    assert [p.row.precision for p in rows] == [SPEC, "full", SPEC] and prefill_modes.needle_work_tokens(200, 1) == 600
    with pytest.raises(ValueError, match="quantized precision"):
        prefill_modes.needle_modes(lm, ["full"], 200)
    with pytest.raises(needle.NeedleError, match="must fit the model's context"):
        prefill_modes.needle_modes(lm, [SPEC], lm.max_context)


@pytest.mark.model
def test_drift_modes_share_one_reference_and_chunked_is_todays_drift(lm, small_chunk):
    prompt = document_prompt(lm, prose()[:1000])  # ~250 tokens: 4 chunks of 64
    seen = []
    out = prefill_modes.drift_modes(lm, prompt, [SPEC], new_tokens=2, on_progress=seen.append)
    work = (len(prompt) + 2) * 3  # tokens of work: the reference, then SPEC in each mode
    assert {(p.total, p.unit) for p in seen} == {(work, "tokens")} and (seen[-1].done, seen[-1].what) == (
        work,
        "chunked: " + SPEC,
    )
    assert [p.done for p in seen] == sorted(p.done for p in seen)  # the count only grows
    (r,) = out.results
    assert out.chunks > 1 and r["exact"]["coded_keys"] > 0
    today = run_drift(lm, prompt, [SPEC], 2).results[0]  # the drift default: chunked
    assert r["chunked"]["mean_js"] == today.mean_js and r["chunked"]["logit_kl_mean"] == pytest.approx(
        sum(today.logit_kl) / len(today.logit_kl), rel=0, abs=0
    )
    exact = run_drift(lm, prompt, [SPEC], 2, prefill_mode="exact").results[0]
    assert r["exact"]["mean_js"] == exact.mean_js
    assert r["chunked"]["mean_js"] != r["exact"]["mean_js"]
    assert r["chunked_over_exact"]["mean_js"] == pytest.approx(r["chunked"]["mean_js"] / r["exact"]["mean_js"])


def test_shipped_report_round_trips():
    """assets/reports/prefill_modes.json reads as a PrefillModesReport and writes back the same file, byte for
    byte (its summary recomputed from the two parts)."""
    path = ROOT / "assets" / "reports" / "prefill_modes.json"
    report = load_report(path)
    assert json.dumps(report.to_json(), indent=2) + "\n" == path.read_text()
    assert isinstance(report, PrefillModesReport) and report.needle.rows["chunked"][0].seed is None  # before seeds
    assert report.needle.title() == "passkey in filler, 7,997 tokens (4 prefill chunks), depth 50%, seed 0"
    lines = headlines(report.drift, report.chunk)
    assert lines == [
        "int4: mean attention JS exact 0.00205, chunked 0.00237; mean logit KL exact 0.00977, chunked 0.015 (1.54x)"
    ]


# --- chat ---------------------------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("mode", ["exact", "chunked"])
def test_chat_lane_stores_the_document_as_runner_prefill_does(lm, mode):
    doc = prose()[:1200]
    session = ChatSession(lm, SPEC, doc, prefill_chunk=CHUNK, prefill_mode=mode)
    session.prepare()
    lane = session._lanes[1]
    direct = runner.new_cache(lm, SPEC)
    runner.prefill(lm, lane.ids, direct, chunk=CHUNK, mode=mode)
    assert len(lane.ids) > 3 * CHUNK and caches_equal(lane.cache, direct)
    other = runner.new_cache(lm, SPEC)
    runner.prefill(lm, lane.ids, other, chunk=CHUNK, mode="chunked" if mode == "exact" else "exact")
    assert not caches_equal(lane.cache, other)
    base = session._lanes[0].cache
    session.set_prefill_mode("chunked" if mode == "exact" else "exact")
    assert lane.cache is None and session._lanes[0].cache is base  # only the quantized cache is rebuilt
    with pytest.raises(ValueError, match="prefill mode"):
        session.set_prefill_mode("fast")


# --- CLI ----------------------------------------------------------------------------------------------


def test_cli_flags_parse():
    parser = build_parser()
    assert parser.parse_args(["needle"]).prefill_mode == "chunked"  # as Chat and Drift store a prompt
    assert parser.parse_args(["drift"]).prefill_mode == "chunked"
    assert parser.parse_args(["generate", "--prefill-mode", "exact"]).prefill_mode == "exact"
    args = parser.parse_args(["prefill-modes", "--tokens", "300", "--precision", "int4"])
    assert (args.tokens, args.precision, args.kind) == (300, "int4", "passkey")
    with pytest.raises(SystemExit):
        parser.parse_args(["needle", "--prefill-mode", "fast"])


@pytest.mark.model
def test_cli_prefill_modes_json_and_errors(small_chunk, capsys, tmp_path):
    out_file = tmp_path / "modes.json"
    code = main(
        ["prefill-modes", "--tokens", "260", "--precision", SPEC, "--new-tokens", "2", "--json", "--out", str(out_file)]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out == json.loads(out_file.read_text()) == load_report(out_file).to_json()
    assert out["chunk"] == CHUNK and out["needle"]["chunks"] > 1 and out["drift"]["chunks"] > 1
    assert out["summary"][0]["precision"] == SPEC and set(out["modes"]) == {"exact", "chunked"}
    assert out["provenance"]["command"].startswith("python -m kvdemo prefill-modes --tokens 260")
    assert main(["prefill-modes", "--tokens", "99999", "--precision", "int4"]) == 2
    assert "exceed the model's context" in capsys.readouterr().err
    assert main(["prefill-modes", "--tokens", "300", "--precision", "full"]) == 2
    assert "quantized precision" in capsys.readouterr().err


# --- pages --------------------------------------------------------------------------------------------


def _page(path: str) -> AppTest:
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=300)
    at.run()
    at.switch_page(path).run()
    assert not at.exception, at.exception
    return at


@pytest.mark.model
def test_memory_page_measures_headroom_with_real_caches():
    at = _page("app_pages/memory.py")
    at.number_input(key="hm_budget_gb").set_value(0.001)
    at.button(key="hm_run").click().run()
    assert any("do not fit a 0.001 GB budget" in e.value for e in at.error) and "hm_result" not in at.session_state
    at.number_input(key="hm_budget_gb").set_value(0.02)
    at.number_input(key="hm_context").set_value(512)
    at.multiselect(key="hm_precisions").set_value(["full", "int4"])
    at.button(key="hm_run").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    rows = at.session_state["hm_result"].results
    assert [r.precision for r in rows] == ["full", "int4"]
    assert 0 < rows[0].measured_max_sequences < rows[1].measured_max_sequences
    charts = {c.proto.spec: c for c in at.get("plotly_chart")}
    titles = [json.loads(s)["layout"]["title"]["text"].replace("<br>", " ") for s in charts]
    assert any("measured vs formula" in t for t in titles) and any("tokens/s vs batch size" in t for t in titles)


@pytest.mark.model
def test_needle_and_drift_pages_choose_and_compare_prefill_modes(small_chunk):
    at = _page("app_pages/needle.py")
    assert at.radio(key="needle_prefill_mode").value == "chunked"
    at.text_input(key="needle_lengths").set_value("280")
    at.text_input(key="needle_depths").set_value("50")
    at.multiselect(key="needle_precisions").set_value(["full", "int4"])
    at.button(key="needle_compare").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    cell = at.session_state["needle_modes_result"]
    assert cell.chunks > 1 and cell.results[0]["precision"] == "int4"
    assert any("chunked minus exact" in m.value for m in at.markdown)
    for mode in ("exact", "chunked"):
        at.radio(key="needle_prefill_mode").set_value(mode)
        at.button(key="needle_run").click().run()
        assert at.session_state["needle_result"].prefill_mode == mode
        rows = {r.precision: r for r in at.session_state["needle_result"].rows}
        assert rows["int4"].answer_logprob == cell.results[0][mode]["answer_logprob"]

    at.switch_page("app_pages/drift.py").run()
    assert at.radio(key="drift_prefill_mode").value == "chunked"
    at.number_input(key="drift_tokens").set_value(300)
    at.number_input(key="drift_new_tokens").set_value(2)
    at.multiselect(key="drift_precisions").set_value(["int4"])
    at.button(key="drift_compare").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    modes = at.session_state["drift_modes_result"]
    assert modes.chunks > 1 and modes.results[0]["chunked"]["mean_js"] != modes.results[0]["exact"]["mean_js"]
    tables = [d.value for d in at.dataframe if "JS chunked/exact" in d.value.columns]
    assert len(tables) == 1 and list(tables[0]["precision"]) == ["int4"]


@pytest.mark.model
def test_chat_prefill_mode_is_threaded_to_the_session():
    at = _page("app_pages/chat.py")
    assert at.radio(key="chat_prefill_mode").value == "chunked"
    assert at.session_state["chat_session"].prefill_mode == "chunked"
    at.radio(key="chat_prefill_mode").set_value("exact").run()
    assert not at.exception
    assert at.session_state["chat_session"].prefill_mode == "exact"
