"""The API probe against fake OpenAI-compatible servers on loopback (tests/fake_openai.py; no model): two good
servers side by side (found rates, intervals, the difference map's data), every failure kind with its message
and the other cells kept, the key never written, Cancel keeping the finished cells, the CLI's files."""

from __future__ import annotations

import json
import math
import re

import pytest
from fake_openai import FakeServer

from kvdemo.probe import Client, Endpoint, ProbeError, WordPieces, parse_endpoint, questions, run_probe
from kvdemo.probe import client as kinds
from kvdemo.progress import Cancelled
from kvdemo.results.probe import (
    ProbeCell,
    ProbeReport,
    endpoint_difference,
    errors,
    found_rates,
    needle_grid,
    report_csv,
    report_json,
)

KEY = "sk-test-SECRET-4711"
WRONG = "sk-wrong-SECRET-0815"


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv("PROBE_KEY", KEY)
    monkeypatch.setenv("PROBE_WRONG_KEY", WRONG)
    return KEY


def fast(server: FakeServer, name: str = "fake", key_env: str = "PROBE_KEY", model: str = "fake-model") -> Endpoint:
    return Endpoint(name, server.base_url, model, key_env)


def chat(server: FakeServer, retries: int = 2, timeout_s: float = 5.0, **kw) -> Client:
    return Client(fast(server, **kw), timeout_s=timeout_s, retries=retries, backoff_s=0.0)


MESSAGES = [{"role": "user", "content": "The pass key is 12345. What is the pass key?"}]


# --- the grammar and the prompts ------------------------------------------------------------------------------


def test_endpoint_grammar_and_its_messages():
    e = parse_endpoint("local=http://127.0.0.1:8080/v1/,llama,LOCAL_KEY")
    assert (e.name, e.base_url, e.model, e.key_env) == ("local", "http://127.0.0.1:8080/v1", "llama", "LOCAL_KEY")
    assert parse_endpoint("a=https://api.example.com/v1,gpt").key_env == ""
    for bad, says in [
        ("nourl", "NAME=BASE_URL,MODEL"),
        ("a=ftp://x,m", "http://"),
        ("a=http://x,m,sk-live key", "not an environment variable name"),
        ("a=http://x, ", "model name"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_endpoint(bad)


def test_prompts_are_the_needle_prompts_at_the_estimated_length():
    name, qs, notes = questions("multikey", [1500, 600], [0, 100], seed=3)
    assert name == "prose" and [q.length for q in qs] == [600, 600, 1500, 1500]  # lengths ascending
    for q in qs:
        assert 0.99 * q.length <= q.estimated_tokens <= q.length
        assert q.task.needle in q.prompt.text and q.task.question in q.prompt.text
        assert all(d in q.prompt.text for d in q.task.distractors)
    assert [q.prompt.depth_actual for q in qs[:2]] == [0.0, 100.0]
    assert any("approximate" in n for n in notes)
    again = questions("multikey", [600], [0], seed=3)[1][0]
    assert again.prompt.text == qs[0].prompt.text  # the same needle for the same cell and seed


# --- the client: answers and every failure kind ----------------------------------------------------------------


def test_answer_usage_and_logprobs(key):
    with FakeServer(key=KEY) as server:
        reply = chat(server).chat(MESSAGES, 16)
        assert reply.text == "The answer is 12345." and reply.attempts == 1
        assert reply.prompt_tokens == WordPieces().count(MESSAGES[0]["content"])
        assert reply.token_logprobs and all(lp == -0.01 for _, lp in reply.token_logprobs)
        assert server.requests[0]["authorization"] == f"Bearer {KEY}" and server.requests[0]["logprobs"] is True
    with FakeServer(key=KEY, logprobs=False) as server:
        assert chat(server).chat(MESSAGES, 16).token_logprobs is None
        report = run_probe([fast(server)], [300], [50])
    assert report.cells[0].found and report.cells[0].reply_logprob is None  # recorded as not returned
    assert found_rates(report.cells)[0]["with_logprobs"] == 0
    with FakeServer(key=KEY, logprobs="reject") as server:
        client = chat(server)
        reply = client.chat(MESSAGES, 16)
        assert "12345" in reply.text and reply.token_logprobs is None and reply.attempts == 1
        assert [r.get("logprobs") for r in server.requests] == [True, None] and client.logprobs is False


# --- the answer's log-prob by echo (the completions API) ---------------------------------------------------------


def test_echo_prompt_and_the_answer_found_by_characters():
    from kvdemo.probe.echo import EchoUnsupported, answer_logprob_from_echo, echo_prompt, resolve_template

    q = questions("passkey", [300], [50])[1][0]
    answer = q.task.answer
    plain = echo_prompt("plain", q)
    assert plain == f"user: {q.prompt.text}\n\nassistant: The pass key is {answer}"
    assert echo_prompt("chatml", q).endswith(f"<|im_start|>assistant\nThe pass key is {answer}")
    assert echo_prompt("<s>[INST] {prompt} [/INST]", q).endswith(f"[/INST] The pass key is {answer}")
    for bad in ("llama", "{prompt} and {prompt}"):
        with pytest.raises(ValueError, match=r"plain or chatml, or a template with \{prompt\} once"):
            resolve_template(bad)
    # llama-cpp-python's way: special tokens spelled "" (so text_offset is not an offset into the prompt), the
    # first token without a log-prob, one completion token after the prompt
    sent = "<|im_start|>user\nWhat is it?<|im_end|>\n<|im_start|>assistant\nThe pass key is 68213"
    tokens = ["user", "\n", "What", " is", " it", "?", "", "\n", "ass", "istant", "\n", "The", " pass", " key", " is",
              " ", "6", "8", "2", "1", "3", "."]  # fmt: skip
    values = [None] + [-1.0] * 15 + [-0.1, -0.01, -0.02, -0.03, -0.04, -0.5]
    ok = {"choices": [{"text": sent + ".", "logprobs": {"tokens": tokens, "token_logprobs": values}}]}
    assert answer_logprob_from_echo(ok, sent, "68213") == pytest.approx(-0.2)
    joined = {"choices": [{"text": sent + ".", "logprobs": {"tokens": [*tokens[:15], " 682", "13", "."],
                                                           "token_logprobs": [*values[:15], -1.5, -0.5, -0.5]}}]}  # fmt: skip
    assert answer_logprob_from_echo(joined, sent, "68213") == pytest.approx(-2.0)  # " 682": its space comes along
    shifted = {"choices": [{"text": sent + ".", "logprobs": {"tokens": tokens[:-1], "token_logprobs": values[:-1]}}]}
    with pytest.raises(ValueError, match="do not end with the completion"):
        answer_logprob_from_echo(shifted, sent, "68213")
    garbled = {
        "choices": [{"text": sent + ".", "logprobs": {"tokens": [*tokens[:20], "4", "."], "token_logprobs": values}}]
    }
    with pytest.raises(ValueError, match="do not spell the answer"):
        answer_logprob_from_echo(garbled, sent, "68213")
    for missing in ({"choices": [{"text": sent + ".", "logprobs": None}]}, {"choices": []}, {}):
        with pytest.raises(EchoUnsupported, match="no choices"):
            answer_logprob_from_echo(missing, sent, "68213")
    with pytest.raises(EchoUnsupported, match="did not echo"):
        answer_logprob_from_echo({"choices": [{"text": ".", "logprobs": {"tokens": ["."], "token_logprobs": [-1]}}]},
                                 sent, "68213")  # fmt: skip


def test_probe_scores_the_true_answer_by_echo_hit_or_miss(key):
    with FakeServer(key=KEY, recall_tokens=400) as server:
        report = run_probe([fast(server)], [300, 700], [0, 50], logprobs="echo", concurrency=1)
        chats = [r for r in server.requests if "messages" in r]
        echoes = [r for r in server.requests if "prompt" in r]
        off = run_probe([fast(server)], [300], [0], logprobs="off")
        assert len(server.requests) == 9 and "logprobs" not in server.requests[-1]  # "off": one plain chat request
    assert off.cells[0].found and off.cells[0].answer_logprob is None and off.cells[0].reply_logprob is None
    assert all("logprobs" not in r for r in chats)  # the chat request asks for none: the answer is scored apart
    assert len(echoes) == 4 and all(r["echo"] is True and r["max_tokens"] == 1 and r["logprobs"] == 1 for r in echoes)
    assert echoes[0]["prompt"].startswith("user: ") and echoes[0]["prompt"].endswith(report.cells[0].expected)
    by = {(c.length, c.depth): c for c in report.cells}
    assert [by[700, d].found for d in (0.0, 50.0)] == [True, False]
    assert all(c.logprob_source == "echo" for c in report.cells)
    assert by[700, 0.0].answer_logprob == pytest.approx(-0.2)  # " 123" "45": two pieces of -0.1
    assert by[700, 50.0].answer_logprob == pytest.approx(-4.0)  # a miss has its log-prob too
    rates = found_rates(report.cells)[0]
    assert rates["with_logprobs"] == 4 and rates["mean_answer_logprob"] == pytest.approx((3 * -0.2 - 4.0) / 4)
    assert report.settings["logprobs"] == "echo" and report.settings["echo_template"].startswith("user: {prompt}")
    assert ProbeReport.from_json(report.to_json()).cells == report.cells
    assert "logprob_source" in report_csv(report).splitlines()[0]


@pytest.mark.parametrize(
    ("echo", "refused", "says"),
    [
        ("reject", True, r"refused the request \(HTTP 400\): echo is not supported"),
        (False, True, r"no completions at http://127\.0\.0\.1:\d+/v1/completions \(HTTP 404\)"),
        ("nofields", True, r"no choices\[0\]\.text with logprobs"),
        ("shifted", False, "do not end with the completion"),
        ("garbled", False, "do not spell the answer"),
    ],
)
def test_an_endpoint_without_echo_keeps_its_cells_and_says_why_once(key, echo, refused, says):
    with FakeServer(key=KEY, echo=echo) as server:
        report = run_probe([fast(server)], [300], [0, 50, 100], logprobs="echo", concurrency=1)
        echoes = [r for r in server.requests if "prompt" in r]
    assert len(report.cells) == 3 and all(c.found and c.answer_logprob is None for c in report.cells)
    assert all(c.logprob_source == "" and not c.error for c in report.cells)
    assert len(echoes) == (1 if refused else 3)  # a refusal is not asked again; a cell's failure is the cell's
    notes = [n for n in report.notes if "echo" in n]
    assert len(notes) == 1 and re.search(says, notes[0]), notes
    assert notes[0].startswith("fake: no answer log-probs by echo" if refused else "fake: no echo log-prob for 3 cells")


@pytest.mark.parametrize(
    ("plan", "retries", "kind", "says"),
    [
        (["500", "500"], 3, None, None),  # retried, then answered
        (["429"], 1, None, None),
        (["drop"], 1, None, None),
        (["500"] * 3, 2, kinds.SERVER, r"server error \(HTTP 500\) after every retry"),
        (["429"] * 2, 1, kinds.RATE_LIMITED, "rate limited"),
        (["badjson"], 3, kinds.MALFORMED, "not JSON"),
        (["nofields"], 3, kinds.MALFORMED, r"no choices\[0\]\.message\.content"),
        (["slow"], 0, kinds.TIMEOUT, "no answer within 0.3 s"),
    ],
)
def test_retries_and_failures(key, plan, retries, kind, says):
    slept = []
    with FakeServer(key=KEY, plan=plan, slow_s=1.5) as server:
        client = Client(fast(server), timeout_s=0.3 if "slow" in plan else 5.0, retries=retries, backoff_s=0.01,
                        sleep=slept.append)  # fmt: skip
        if kind is None:
            reply = client.chat(MESSAGES, 16)
            assert reply.attempts == len(plan) + 1 and "12345" in reply.text
            expected = [0.0] if plan == ["429"] else [0.01 * 2**i for i in range(len(plan))]
            assert slept == expected  # Retry-After: 0 honoured, else exponential backoff
        else:
            with pytest.raises(ProbeError, match=says) as err:
                client.chat(MESSAGES, 16)
            assert err.value.kind == kind and str(err.value).startswith("fake: ")
            assert len(server.requests) == (retries + 1 if kind in (kinds.SERVER, kinds.RATE_LIMITED) else 1)


def test_wrong_key_unknown_model_unreachable_and_unset_key_messages(key):
    with FakeServer(key=KEY) as server:
        with pytest.raises(ProbeError) as err:
            chat(server, key_env="PROBE_WRONG_KEY").chat(MESSAGES, 16)
        assert err.value.kind == kinds.AUTH and "check the variable PROBE_WRONG_KEY" in str(err.value)
        assert WRONG not in str(err.value)
        with pytest.raises(ProbeError, match="does not serve the model 'nope'") as err:
            chat(server, model="nope").chat(MESSAGES, 16)
        assert err.value.kind == kinds.MODEL
        with pytest.raises(ProbeError, match="PROBE_UNSET is not set") as err:
            chat(server, key_env="PROBE_UNSET").chat(MESSAGES, 16)
        assert err.value.kind == kinds.NO_KEY and not server.requests[2:]
        port = server.httpd.server_address[1]
    gone = Client(Endpoint("gone", f"http://127.0.0.1:{port}/v1", "m"), timeout_s=2, retries=1, backoff_s=0)
    with pytest.raises(ProbeError, match="gone: cannot reach http://127.0.0.1") as err:
        gone.chat(MESSAGES, 16)
    assert err.value.kind == kinds.UNREACHABLE and err.value.attempts == 2


def test_context_too_long_message(key):
    with FakeServer(key=KEY, context_tokens=10) as server:
        with pytest.raises(ProbeError, match="longer than the context the endpoint accepts") as err:
            chat(server).chat(MESSAGES * 3, 16)
        assert err.value.kind == kinds.CONTEXT and len(server.requests) == 1  # not retried


# --- the run: endpoints side by side ---------------------------------------------------------------------------

LENGTHS, DEPTHS = [300, 700, 1500], [0, 50, 100]


def test_two_endpoints_side_by_side_and_a_bad_one(key):
    """`big` recalls every needle; `small` accepts 1,000 tokens and recalls only needles in the first half of
    prompts over 400 tokens; `bad` fails now and then: the failures are cells with messages, the rest stays."""
    plan = ["500"] * 4 + ["badjson", "ok", "nofields"]
    with (
        FakeServer(key=KEY) as big,
        FakeServer(key=KEY, context_tokens=1000, recall_tokens=400) as small,
        FakeServer(key=KEY, plan=plan) as bad,
    ):
        eps = [fast(big, "big"), fast(small, "small"), fast(bad, "bad")]
        seen = []
        report = run_probe(eps, LENGTHS, DEPTHS, concurrency=1, retries=1, backoff_s=0.0, on_progress=seen.append)
        assert len(small.requests) == 7  # the first 1,500-token prompt was refused, the other two not sent
    assert len(report.cells) == report.planned_cells == 27 and report.stopped == "done"
    by = {(c.endpoint, c.length, c.depth): c for c in report.cells}
    assert all(by["big", n, d].found for n in LENGTHS for d in DEPTHS)
    assert [by["small", 700, d].found for d in DEPTHS] == [True, False, False]  # the 50% needle sits past half
    assert all(by["small", 300, d].found for d in DEPTHS)
    long_small = [by["small", 1500, d] for d in DEPTHS]
    assert all(c.found is None and c.error_kind == kinds.CONTEXT for c in long_small)
    assert sum(c.error.startswith("not sent: a 1,500-token prompt was already too long") for c in long_small) == 2
    bad_cells = [c for c in report.cells if c.endpoint == "bad"]
    assert {c.error_kind for c in bad_cells if c.error} == {kinds.SERVER, kinds.MALFORMED}
    assert sum(c.found is True for c in bad_cells) == 9 - 4  # 500 x2 twice, bad JSON, missing fields
    assert seen[-1].done == seen[-1].total and sum(p.row is not None for p in seen) == 27

    rates = {r["endpoint"]: r for r in found_rates(report.cells)}
    assert (rates["big"]["found"], rates["big"]["answered"], rates["big"]["high"]) == (9, 9, 1.0)
    assert rates["big"]["low"] == pytest.approx(0.7008, abs=1e-4)  # Wilson at 9/9
    assert (rates["small"]["found"], rates["small"]["answered"], rates["small"]["failed"]) == (4, 6, 3)
    assert rates["small"]["low"] < 4 / 6 < rates["small"]["high"]
    assert rates["big"]["with_logprobs"] == 9 and rates["big"]["mean_answer_logprob"] == pytest.approx(-0.01)
    cell = by["big", 300, 0.0]
    assert cell.prompt_tokens and abs(cell.prompt_tokens - cell.estimated_tokens) <= 20  # usage is reported
    assert cell.answer_logprob == pytest.approx(-0.01) and cell.reply_logprob == pytest.approx(-0.07)
    assert by["small", 700, 100.0].answer_logprob is None  # no answer in the reply, no answer log-prob
    per_length = {(r["endpoint"], r["length"]): r for r in found_rates(report.cells, "length")}
    assert per_length["small", 1500]["answered"] == 0 and per_length["small", 1500]["rate"] is None
    per_depth = {(r["endpoint"], r["depth"]): r for r in found_rates(report.cells, "depth")}
    assert (per_depth["small", 0.0]["found"], per_depth["small", 100.0]["found"]) == (2, 1)

    diff = endpoint_difference(report.cells, "small", "big")
    assert diff["runs"] == 6 and diff["difference"] == pytest.approx(-2 / 6, abs=1e-4)
    grid = needle_grid(report)
    assert grid.precisions == ["big", "small", "bad"] and len(grid.rows) == 9 + 6 + 5
    from kvdemo.figures.needle import needle_difference_figure, needle_heatmap_figure

    heat = needle_heatmap_figure(grid)
    assert len(heat.data) == 3 and list(heat.data[1].z[1]) == [1.0, 0.0, None]  # small: depth 50, lengths 300/700/1500
    assert not any("nan" in t for trace in heat.data for row in trace.text for t in row)
    change = needle_difference_figure(grid, "big", "correct")
    assert list(change.data[0].z[2]) == [0.0, -1.0, None]  # small - big at depth 100

    too_long = [e for e in errors(report.cells) if e["kind"] == kinds.CONTEXT]
    assert [(e["endpoint"], e["cells"]) for e in too_long] == [("small", 1), ("small", 2)]  # refused, then not sent
    again = ProbeReport.from_json(json.loads(report_json(report)))
    assert again.to_json() == report.to_json() and not math.isnan(again.seconds)
    for text in (report_json(report), report_csv(report)):
        assert KEY not in text and "PROBE_KEY" in report_json(report)


def test_endpoint_wide_failures_stop_sending_and_keep_the_other_endpoint(key):
    with FakeServer(key=KEY) as good, FakeServer(key=KEY) as other:
        eps = [
            fast(good, "good"),
            fast(other, "wrongkey", key_env="PROBE_WRONG_KEY"),
            fast(other, "nomodel", model="x"),
        ]
        report = run_probe(eps, [300], DEPTHS, concurrency=1, retries=0)
        assert len(other.requests) == 2  # one request each, then nothing more sent
    assert all(c.found for c in report.cells if c.endpoint == "good")
    wrong = [c for c in report.cells if c.endpoint == "wrongkey"]
    assert all(c.error_kind == kinds.AUTH for c in wrong) and sum(c.error.startswith("not sent") for c in wrong) == 2
    assert all(c.error_kind == kinds.MODEL for c in report.cells if c.endpoint == "nomodel")
    text = report_json(report) + report_csv(report)
    assert KEY not in text and WRONG not in text and "PROBE_WRONG_KEY" in text


def test_cancel_keeps_the_finished_cells_and_sends_nothing_more(key):
    from threading import Event

    from kvdemo.probe.run import _EndpointState, ask

    with FakeServer(key=KEY) as server:
        seen = []
        with pytest.raises(Cancelled) as stopped:
            run_probe([fast(server)], [300, 700], DEPTHS, concurrency=1, on_progress=seen.append,
                      should_stop=lambda: sum(p.row is not None for p in seen) >= 2)  # fmt: skip
        sent = len(server.requests)
        cancelled = Event()
        cancelled.set()  # what the run sets when it stops: a request still queued returns unsent
        q = questions("passkey", [300], [50])[1][0]
        assert ask(chat(server), q, _EndpointState(), 16, cancelled) is None and len(server.requests) == sent
    cells = stopped.value.partial
    assert len(cells) >= 2 and all(c.found for c in cells)
    assert [c.to_json() for c in cells] == [p.row.to_json() for p in seen if p.row is not None]


def test_requests_in_flight_stay_within_the_concurrency(key):
    with FakeServer(key=KEY, plan=["slow"] * 8, slow_s=0.2) as server:
        report = run_probe([fast(server)], [300, 700], [0, 50, 100, 25], concurrency=2)
        assert len(server.requests) == 8 and server.most_in_flight <= 2
    assert all(c.found for c in report.cells)


def test_a_key_a_header_cannot_carry_is_refused_without_quoting_it(key, monkeypatch):
    monkeypatch.setenv("PROBE_BAD_KEY", "sk-two\nlines-SECRET")
    monkeypatch.setenv("PROBE_NEWLINE_KEY", KEY + "\n")  # read from a file: the newline is dropped
    with FakeServer(key=KEY) as server:
        with pytest.raises(ProbeError, match="holds characters a key cannot have") as err:
            chat(server, key_env="PROBE_BAD_KEY").chat(MESSAGES, 16)
        assert "SECRET" not in str(err.value) and not server.requests
        assert "12345" in chat(server, key_env="PROBE_NEWLINE_KEY").chat(MESSAGES, 16).text


def test_bad_settings_are_refused_before_anything_is_sent():
    e = Endpoint("a", "http://127.0.0.1:9/v1", "m")
    for kw, says in [
        ({"endpoints": []}, "at least one endpoint"),
        ({"endpoints": [e, e]}, "must differ"),
        ({"depths": [150]}, "0..100"),
        ({"concurrency": 0}, "concurrency"),
        ({"lengths": [20]}, "too short"),
    ]:
        args = {"endpoints": [e], "lengths": [300], "depths": [50]} | kw
        with pytest.raises(ValueError, match=says):
            run_probe(**args)


def test_cli_writes_the_report_and_csv_without_the_key(key, tmp_path, capsys):
    from kvdemo.cli import main

    with FakeServer(key=KEY) as a, FakeServer(key=KEY, context_tokens=500) as b:
        out = tmp_path / "probe.json"
        argv = ["probe", "--endpoint", f"a={a.base_url},fake-model,PROBE_KEY", "--endpoint",
                f"b={b.base_url},fake-model,PROBE_KEY", "--lengths", "300,700", "--depths", "50", "--out", str(out),
                "--backoff-s", "0"]  # fmt: skip
        assert main(argv) == 0
    printed = capsys.readouterr()
    report = ProbeReport.from_json(json.loads(out.read_text()))
    assert len(report.cells) == 4 and report.provenance["command"].startswith("python -m kvdemo probe")
    assert "b: the prompt is longer than the context" in printed.out and "a: found 2/2" in printed.out
    for text in (out.read_text(), out.with_suffix(".csv").read_text(), printed.out, printed.err):
        assert KEY not in text
    assert main(["probe", "--endpoint", "oops"]) == 2
    assert "NAME=BASE_URL,MODEL" in capsys.readouterr().err


def test_cli_echo_option_is_recorded_and_a_bad_template_refused(key, tmp_path, capsys):
    from kvdemo.cli import main

    out = tmp_path / "probe.json"
    with FakeServer(key=KEY, echo="reject") as server:
        code = main(["probe", "--endpoint", f"a={server.base_url},fake-model,PROBE_KEY", "--lengths", "300",
                     "--depths", "0", "--logprobs", "echo", "--echo-template", "chatml", "--out", str(out)])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "answer log-probs: echo" in printed and "a: no answer log-probs by echo (the endpoint refused" in printed
    report = ProbeReport.from_json(json.loads(out.read_text()))
    assert report.provenance["command"].endswith("--logprobs echo --echo-template chatml")
    assert report.cells[0].found and report.cells[0].answer_logprob is None
    assert main(["probe", "--endpoint", "a=http://127.0.0.1:9/v1,m", "--logprobs", "echo", "--echo-template", "x"]) == 2
    assert "with {prompt} once" in capsys.readouterr().err


# --- the page (AppTest, the page alone: it loads no model) -------------------------------------------------------


def page():
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app_pages" / "probe.py"), default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    return at


def test_page_probes_two_endpoints_and_shows_every_failure(key):
    at = page()
    at.button(key="probe_run").click().run()
    assert any("add at least one endpoint" in e.value for e in at.error)
    at.text_area(key="probe_endpoints").set_value("oops").run()
    assert any("line 1: endpoint 'oops'" in e.value for e in at.error)
    with FakeServer(key=KEY) as big, FakeServer(key=KEY, context_tokens=500) as small:
        lines = [f"big={big.base_url},fake-model,PROBE_KEY", f"small={small.base_url},fake-model,PROBE_KEY",
                 f"wrong={big.base_url},fake-model,PROBE_WRONG_KEY"]  # fmt: skip
        at.text_area(key="probe_endpoints").set_value("\n".join(lines)).run()
        table = at.dataframe[0].value  # the endpoints as read: the key variable named, never its value
        assert list(table["key"]) == ["PROBE_KEY is set"] * 2 + ["PROBE_WRONG_KEY is set"]
        at.text_input(key="probe_lengths").set_value("300,700").run()
        at.text_input(key="probe_depths").set_value("0,100").run()
        at.button(key="probe_run").click().run()
    assert not at.exception, at.exception
    report = at.session_state["probe_result"]
    assert isinstance(report, ProbeReport) and len(report.cells) == 12
    warnings = [w.value for w in at.warning]
    assert any(w.startswith("small: the prompt is longer than the context") for w in warnings)
    assert any("wrong: the endpoint refused the key (HTTP 401)" in w for w in warnings)
    assert len(at.get("plotly_chart")) == 2  # heatmaps and the difference map
    assert len(at.get("download_button")) == 2
    shown = " ".join(str(e.value) for kind in ("markdown", "warning", "caption", "text_area") for e in at.get(kind))
    assert KEY not in shown and WRONG not in shown


def test_page_cancel_keeps_the_finished_cells(key, monkeypatch):
    from streamlit.runtime.scriptrunner_utils.exceptions import StopException

    import kvdemo.probe as probe
    from kvdemo.progress import Progress

    cell = ProbeCell("a", 300, 50.0, 0, "12345", True, "The answer is 12345.", 0.1, 310, 7)

    def one_cell_then_cancel(endpoints, lengths, depths, on_progress=None, **kw):
        on_progress(Progress(300, 1200, "tokens", "a at 300 tokens", 0.1, cell))
        raise StopException()  # what Streamlit raises in the script when the Cancel click reruns it

    monkeypatch.setattr(probe, "run_probe", one_cell_then_cancel)
    at = page()
    at.text_area(key="probe_endpoints").set_value("a=http://127.0.0.1:9/v1,m").run()
    at.text_input(key="probe_lengths").set_value("300,900").run()
    at.button(key="probe_run").click().run()
    at.button(key="probe_cancel").click().run()
    assert not at.exception, at.exception
    partial = at.session_state["probe_cancelled"]
    assert partial["rows"] == [cell.to_json()] and partial["meta"]["lengths"] == [300, 900]
    assert any("Cancelled probe (partial): 1 of 6 cells" in i.value for i in at.info)
    assert len(at.get("download_button")) == 2


def test_page_scores_answers_by_echo_and_says_which_endpoint_refused_it(key):
    at = page()
    at.radio(key="probe_logprobs").set_value("echo").run()
    at.text_input(key="probe_echo_template").set_value("no placeholder").run()
    at.button(key="probe_run").click().run()
    assert any("with {prompt} once" in e.value for e in at.error)
    with FakeServer(key=KEY) as good, FakeServer(key=KEY, echo="reject") as bad:
        lines = [f"good={good.base_url},fake-model,PROBE_KEY", f"bad={bad.base_url},fake-model,PROBE_KEY"]
        at.text_area(key="probe_endpoints").set_value("\n".join(lines)).run()
        at.text_input(key="probe_echo_template").set_value("chatml").run()
        at.text_input(key="probe_lengths").set_value("300").run()
        at.text_input(key="probe_depths").set_value("0").run()
        at.button(key="probe_run").click().run()
        assert good.requests[-1]["prompt"].startswith("<|im_start|>user\n")
    assert not at.exception, at.exception
    cells = {c.endpoint: c for c in at.session_state["probe_result"].cells}
    assert cells["good"].logprob_source == "echo" and cells["good"].answer_logprob == pytest.approx(-0.2)
    assert cells["bad"].found and cells["bad"].answer_logprob is None
    assert any(c.value.startswith("bad: no answer log-probs by echo") for c in at.caption)
