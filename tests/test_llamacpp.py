"""llama.cpp as a contender (kvdemo/engines.py, kvdemo/llamacpp.py): the contender grammar and its cache sizes (no binding needed),
then llama-cpp-python on the embedded GGUF: its cache size against llama.cpp's own log line, the perplexity and
needle rows read against llama.cpp's f16 row, and `kvdemo probe` against two real llama.cpp servers on loopback
(f16 and q4_0 caches, started and stopped by the fixture) with every served answer checked in-process.

`make test` builds llama-cpp-python (PyPI has it as source only); these tests fail, not skip, without it."""

from __future__ import annotations

import re

import pytest
import torch

from kvdemo import llamacpp
from kvdemo.engines import CACHE_TYPES, KvTypes, LlamaCppError, baseline_of, kv_bytes, parse_kv, split_contenders

# --- the grammar and the sizes (no binding) -------------------------------------------------------------------


def test_contender_grammar():
    assert parse_kv("llama.cpp:q4_0") == KvTypes("q4_0", "q4_0")
    assert parse_kv(" LLAMA.CPP:q8_0/q4_0 ").label == "llama.cpp:q8_0/q4_0"
    assert parse_kv("llama.cpp:f16").is_quantized is False
    for bad, says in (("llama.cpp:q3_k", "unknown llama.cpp cache type"), ("int4", "not a llama.cpp contender"),
                      ("llama.cpp:q4_0/q4_0/q4_0", "unknown llama.cpp cache type")):  # fmt: skip
        with pytest.raises(LlamaCppError, match=says):
            parse_kv(bad)
    ours, theirs = split_contenders("full,int4,llama.cpp:q4_0,llama.cpp:q8_0,llama.cpp:q4_0")
    assert ours == ["full", "int4"]
    assert [k.label for k in theirs] == ["llama.cpp:f16", "llama.cpp:q4_0", "llama.cpp:q8_0"]  # f16 first, once
    assert split_contenders("full,int8") == (["full", "int8"], [])
    assert baseline_of("llama.cpp:q4_0") == "llama.cpp:f16" and baseline_of("int4") == "full"


def test_cache_sizes_are_ggml_blocks():
    # SmolLM2-135M: 30 layers, 3 kv heads x 64 = 192 elements per row
    f16 = kv_bytes(30, 192, 1000, KvTypes("f16", "f16"))
    assert f16 == 30 * 1000 * 2 * 192 * 2
    q4 = kv_bytes(30, 192, 1000, KvTypes("q4_0", "q4_0"))
    assert q4 == 30 * 1000 * 2 * (192 // 32) * 18  # a block: fp16 scale + 32 nibbles
    assert f16 / q4 == pytest.approx(16 / 4.5)
    mixed = KvTypes("q8_0", "q4_0")
    assert mixed.bits_per_element == pytest.approx((8.5 + 4.5) / 2)
    assert kv_bytes(30, 192, 1000, mixed) == 30 * 1000 * (6 * 34 + 6 * 18)
    with pytest.raises(LlamaCppError, match="multiple of 32"):
        kv_bytes(1, 48, 1, KvTypes("q4_0", "q4_0"))


def test_a_model_without_a_gguf_file_is_refused_by_name():
    from types import SimpleNamespace

    hub = SimpleNamespace(name="HuggingFaceTB/SmolLM2-135M-Instruct", source="HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(LlamaCppError, match="run a GGUF file"):
        llamacpp.gguf_path(hub)
    assert llamacpp.gguf_path(SimpleNamespace(name="x", source="~/models/x.gguf")).name == "x.gguf"


# --- the engine on the embedded GGUF --------------------------------------------------------------------------

engine_tests = [pytest.mark.model, pytest.mark.llamacpp]


@pytest.fixture(scope="module")
def gguf():
    from kvdemo.models import embedded_gguf

    assert llamacpp.available() is None, llamacpp.available()  # `make test` installs it: a failure, not a skip
    return embedded_gguf()


@pytest.mark.model
@pytest.mark.llamacpp
def test_cache_size_matches_llamacpps_own_log(gguf, capfd):
    from llama_cpp import Llama

    for kv in (KvTypes("f16", "f16"), KvTypes("q4_0", "q4_0"), KvTypes("q8_0", "iq4_nl")):
        t_k, t_v = CACHE_TYPES[kv.key].ggml_type, CACHE_TYPES[kv.value].ggml_type
        llm = Llama(str(gguf), n_ctx=512, type_k=t_k, type_v=t_v, flash_attn=True, verbose=True)
        cells = llm.n_ctx()
        llm.close()
        log = capfd.readouterr().err
        m = re.search(r"K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB", log)
        assert m, log[-2000:]
        assert (m.group(1), m.group(3)) == (kv.key, kv.value)
        logged = (float(m.group(2)) + float(m.group(4))) * 2**20
        assert kv_bytes(30, 192, cells, kv) == pytest.approx(logged, abs=0.01 * 2**20)  # the log rounds to 0.01 MiB
        # this llama.cpp Hadamard-rotates a quantized cache when the head size is a multiple of 64 (docs/llamacpp.md)
        rotated = int(kv.is_quantized)
        assert f"attn_rot_k = {rotated}" in log and f"attn_rot_v = {rotated}" in log, log[-2000:]


@pytest.mark.model
@pytest.mark.llamacpp
def test_feeding_in_chunks_gives_the_logits_of_one_call(gguf, lm):
    from kvdemo.texts import held_out_ids

    ids = held_out_ids(lm, 200)[:200]
    engine = llamacpp.Engine(gguf, KvTypes("f16", "f16"), n_ctx=256)
    try:
        whole = engine.feed(ids)
        engine.keep(0)
        pieces = engine.feed(ids, chunk=16)
        engine.keep(150)  # forget the last 50: feeding them again gives their logits again
        again = engine.feed(ids[150:])
    finally:
        engine.close()
    assert whole.shape == (200, lm.config.vocab_size)
    # llama.cpp's matmul kernels change with the batch size, so 16-token calls move logits by up to about one
    # (measured: 95% of argmaxes agree); the same calls again give the same logits to the bit
    assert (whole.argmax(-1) == pieces.argmax(-1)).float().mean() > 0.9
    assert torch.equal(pieces[150:], again)
    # the engine follows the text: its next-token guesses match the text far above chance
    assert (whole[:-1].argmax(-1) == torch.tensor(ids[1:])).float().mean() > 0.25


@pytest.mark.model
@pytest.mark.llamacpp
def test_ppl_rows_read_against_llamacpps_own_f16_row(lm):
    from kvdemo.ppl import run_ppl

    report = run_ppl(lm, ["int4", "llama.cpp:q8_0", "llama.cpp:q4_0"], tokens=512, prefix=128)
    rows = {r.precision: r for r in report.results}
    assert list(rows) == ["full", "int4", "llama.cpp:f16", "llama.cpp:q8_0", "llama.cpp:q4_0"]
    f16, q8, q4 = rows["llama.cpp:f16"], rows["llama.cpp:q8_0"], rows["llama.cpp:q4_0"]
    assert f16.delta_vs_full == 0 and f16.logit_kl == 0 and f16.ratio_vs_fp16 == 1.0
    assert q4.delta_vs_full == pytest.approx(q4.ppl - f16.ppl, abs=1e-3)  # its own engine's full row
    assert 0 < q8.logit_kl < q4.logit_kl
    assert q4.bits_per_element == pytest.approx(4.5) and q4.ratio_vs_fp16 == pytest.approx(16 / 4.5, rel=1e-3)
    assert q4.live_bytes == kv_bytes(30, 192, 511, KvTypes("q4_0", "q4_0")) and q4.stored_tokens == 511
    assert q4.delta_vs_full_ci95[0] <= q4.delta_vs_full <= q4.delta_vs_full_ci95[1]
    assert f16.delta_vs_full_ci95 == [0.0, 0.0]  # resampled against itself
    assert report.engine["engine"].startswith("llama-cpp-python ") and report.engine["gguf"].endswith(".gguf")
    # the two engines run the same weights on the same tokens: their full rows agree to a few percent
    assert rows["full"].ppl == pytest.approx(f16.ppl, rel=0.1)


@pytest.mark.model
@pytest.mark.llamacpp
def test_needle_rows_pair_with_llamacpps_f16_row(lm):
    from kvdemo.needle import run_grid
    from kvdemo.results.needle import differences_from_full, summarize

    seen = []
    grid = run_grid(lm, [300], [50], "full,int4,llama.cpp:q4_0", max_new_tokens=12, on_progress=seen.append)
    assert grid.precisions == ["full", "int4", "llama.cpp:f16", "llama.cpp:q4_0"]
    assert seen[-1].done == seen[-1].total == 4 * 300  # llama.cpp's rows are counted in the progress total
    rows = {r.precision: r for r in grid.rows}
    assert rows["llama.cpp:f16"].correct, rows["llama.cpp:f16"].answer  # a 300-token passkey: found
    assert rows["llama.cpp:f16"].answer_logprob > -2
    summary = {s["precision"]: s for s in summarize(grid.rows)}
    mine, theirs = rows["llama.cpp:q4_0"], rows["llama.cpp:f16"]
    assert summary["llama.cpp:q4_0"]["mean_logprob_change"] == pytest.approx(
        mine.answer_logprob - theirs.answer_logprob, abs=1e-3
    )
    pairs = {(d["a"], d["b"]) for d in differences_from_full(grid.rows)}
    assert pairs == {("int4", "full"), ("llama.cpp:q4_0", "llama.cpp:f16")}


@pytest.mark.model
@pytest.mark.llamacpp
def test_logits_of_the_rows_asked_for_are_those_of_every_row(gguf, lm, monkeypatch):
    """The engine computes only the logits a caller asks for (the prefix's last row, the answer's rows); with every
    row computed and the unused ones dropped, as before, the needle answer's log-prob, its reply and the
    perplexity NLL come out the same (llama.cpp's batches are the same either way; only the output rows differ)."""
    from kvdemo.texts import held_out_ids

    ids = held_out_ids(lm, 200)[:200]
    context, suffix, answer = ids[:160], ids[160:180], ids[180:184]
    eos = {lm.tokenizer.eos_token_id}
    kv = KvTypes("q4_0", "q4_0")
    engine = llamacpp.Engine(gguf, kv, n_ctx=224)
    try:
        every = engine.feed(ids)
        engine.keep(0)
        torch.testing.assert_close(engine.feed(ids, last=7), every[-7:], rtol=0, atol=1e-5)
        assert engine.feed(ids[:0], last=1).shape == (0, lm.config.vocab_size) and engine.n_tokens == 200
        asked = llamacpp.needle_answer(engine, context, suffix, answer, 6, eos, lambda t: None, lambda: False)
        asked_nll, asked_kept = llamacpp.score_text(engine, ids, 64, 16, 4)
        feed = llamacpp.Engine.feed

        def every_row(self, ids, chunk=None, last=None):  # the old way: every row's logits, the unused dropped
            rows = feed(self, ids, chunk)
            return rows if last is None else rows[len(rows) - min(last, len(rows)) :]

        monkeypatch.setattr(llamacpp.Engine, "feed", every_row)
        before = llamacpp.needle_answer(engine, context, suffix, answer, 6, eos, lambda t: None, lambda: False)
        before_nll, before_kept = llamacpp.score_text(engine, ids, 64, 16, 4)
    finally:
        engine.close()
    assert asked[0] == pytest.approx(before[0], abs=1e-4) and asked[1:] == before[1:]
    torch.testing.assert_close(asked_nll, before_nll, rtol=0, atol=1e-4)
    torch.testing.assert_close(asked_kept, before_kept, rtol=0, atol=1e-4)


@pytest.mark.model
@pytest.mark.llamacpp
def test_bench_llamacpp_rows_beside_kvdemos(gguf, lm):
    """A tiny bench with kvdemo int4 and llama.cpp q4_0: every phase of the llama.cpp rows is there, read against
    llama.cpp's f16 row measured in the same run; its cache bytes are llama.cpp's formula, its perplexity what
    `score_text` gives on the same ids."""
    import math

    from kvdemo.contest.run import run_bench
    from kvdemo.ppl import per_length
    from kvdemo.results.bench import BenchReport, BenchSizes, markdown_table
    from kvdemo.texts import held_out_ids

    sizes = BenchSizes(contexts=(128,), ppl_prefix=64, ppl_lengths=(256,), residual=64, new_tokens=64,
                       warmup_steps=1, rounds=1, needle_lengths=(320,), needle_depths=(50,), warmup_tokens=80)  # fmt: skip
    seen = []
    # kvdemo's full row left out (test time): the llama.cpp rows have their own
    report = run_bench(lm, sizes=sizes, precisions="int4,llama.cpp:q4_0", only=["kvdemo-int4", "llama.cpp:q4_0"],
                       on_progress=seen.append)  # fmt: skip
    rows = report.rows()
    assert list(rows) == ["kvdemo-int4", "llama.cpp:f16", "llama.cpp:q4_0"]  # f16 comes with q4_0
    f16, q4, int4 = rows["llama.cpp:f16"], rows["llama.cpp:q4_0"], rows["kvdemo-int4"]
    assert (int4.engine, int4.baseline) == ("transformers", "full")
    for r in (f16, q4):
        assert (r.engine, r.baseline, r.backend) == ("llama.cpp", "llama.cpp:f16", "llama.cpp")
        assert r.first_call_s > 0 and r.load_s > 0 and r.setup_s >= 0
        assert r.prefill_s["128"] > 0 and r.decode_tok_s["128"] > 0 and len(r.decode_tok_s_rounds["128"]) == 1
        win = r.decode_window["128"]
        assert win.steps == 64 and win.flushes == 0 and win.mean_flush_step_ms is None  # no residual window
        assert math.isfinite(r.ppl["256"]) and r.needle.total == 1 and r.needle.cells[0].logprob <= 0
        kv = parse_kv(r.contender)
        assert r.cache_bytes["128"] == kv_bytes(30, 192, 128, kv)  # llama.cpp's own cache rows for 128 tokens
        assert r.cache_bytes_allocated["128"] >= kv_bytes(30, 192, 128 + 1 + 64, kv)  # its whole context
    assert q4.ratio_vs_fp16["128"] == pytest.approx(16 / 4.5, rel=1e-3) and f16.ratio_vs_fp16["128"] == 1.0
    # read against llama.cpp's f16 row, never kvdemo's full
    assert q4.ppl_delta["256"] == pytest.approx(q4.ppl["256"] - f16.ppl["256"], abs=2e-4)
    assert f16.ppl_delta["256"] == 0 and f16.logit_kl["256"] == 0 < q4.logit_kl["256"]
    assert q4.decode_speed_vs_full["128"] == pytest.approx(
        q4.decode_tok_s_rounds["128"][0] / f16.decode_tok_s_rounds["128"][0], rel=2e-3
    )
    assert q4.needle_logprob_delta == pytest.approx(q4.needle.mean_logprob - f16.needle.mean_logprob, abs=2e-4)
    # the perplexity phase is score_text's on the same ids
    engine = llamacpp.Engine(gguf, KvTypes("q4_0", "q4_0"), n_ctx=256)
    try:
        nll, _ = llamacpp.score_text(engine, held_out_ids(lm, 256), 64, 16, 4)
    finally:
        engine.close()
    assert q4.ppl["256"] == pytest.approx(round(per_length(nll, nll[::4], 64, [256], 4)[0]["256"], 4), abs=1e-4)
    assert report.engine["engine"].startswith("llama-cpp-python ") and "llama.cpp" in report.method
    table = markdown_table(report)
    assert "| contender | read against |" in table and "| `llama.cpp:q4_0` | `llama.cpp:f16` |" in table
    assert BenchReport.from_json(report.to_json()).to_json() == report.to_json()
    assert seen[-1].done == seen[-1].total  # the planned tokens were all done, and no more planned
    assert [p.done for p in seen].index(seen[-1].total) >= len(seen) - 2


def test_bench_refuses_llamacpp_rows_without_a_gguf_file():
    from types import SimpleNamespace

    from kvdemo.contest.run import run_bench
    from kvdemo.results.bench import QUICK

    hub = SimpleNamespace(name="hub/model", source="hub/model", max_context=8192)
    with pytest.raises(LlamaCppError, match="run a GGUF file"):
        run_bench(hub, sizes=QUICK, precisions="int4,llama.cpp:q4_0")


def test_cli_bench_without_the_binding_prints_the_install_message(monkeypatch, capsys):
    from kvdemo.cli import main

    monkeypatch.setattr(llamacpp, "available", lambda: llamacpp.INSTALL)
    monkeypatch.setattr("kvdemo.models.load_model", lambda *a, **k: _embedded_stub())
    code = main(["bench", "--quick", "--precision", "int4,llama.cpp:q4_0", "--out", ""])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: llama.cpp contenders need llama-cpp-python") and "Traceback" not in err


def _embedded_stub():
    from types import SimpleNamespace

    from kvdemo.models import DEFAULT_MODEL

    return SimpleNamespace(name="SmolLM2", source=DEFAULT_MODEL, max_context=8192)


@pytest.mark.model
def test_needle_grid_refuses_a_bad_llamacpp_type_before_any_work(lm):
    from kvdemo.needle import NeedleError, run_grid

    with pytest.raises(NeedleError, match="unknown llama.cpp cache type"):
        run_grid(lm, [300], [50], "full,llama.cpp:q2_k")


# --- two llama.cpp servers on loopback, probed side by side -----------------------------------------------------


@pytest.fixture(scope="module")
def servers(gguf):
    """llama.cpp's server with an f16 cache and one with q4_0, on free loopback ports; stopped after the module."""
    import contextlib

    from kvdemo.probe.local import start_servers

    with contextlib.ExitStack() as stack:
        yield start_servers(stack, gguf, [KvTypes("f16", "f16"), KvTypes("q4_0", "q4_0")], n_ctx=1536)


@pytest.mark.model
@pytest.mark.llamacpp
def test_probe_two_llamacpp_servers_matches_llamacpp_in_process(servers, gguf):
    from kvdemo.probe import questions, run_probe
    from kvdemo.probe.local import in_process_checks
    from kvdemo.results.probe import found_rates

    lengths, depths = [300, 700], [10, 90]
    report = run_probe(servers, lengths, depths, max_tokens=16, timeout_s=120, concurrency=1)  # the server's order
    assert [e["name"] for e in report.endpoints] == ["llama.cpp-f16", "llama.cpp-q4_0"]
    assert len(report.cells) == 8 and all(c.found is not None for c in report.cells), [c.error for c in report.cells]
    assert all(c.prompt_tokens and c.prompt_tokens > c.length * 0.8 for c in report.cells)  # usage is real
    assert all(c.reply_logprob is not None for c in report.cells)  # llama.cpp returns chat log-probs
    rates = {r["endpoint"]: r for r in found_rates(report.cells)}
    # the small model finds the 300-token passkeys; at 700 it drifts, and the server's default repeat penalty
    # (1.1) can drop a repeated digit ("40007" -> "4007")
    assert rates["llama.cpp-f16"]["found"] >= 2
    _, asked, _ = questions("passkey", lengths, depths)
    kvs = [KvTypes("f16", "f16"), KvTypes("q4_0", "q4_0")]
    checks = in_process_checks(report, asked, gguf, kvs, n_ctx=1536, max_tokens=16)
    assert len(checks) == 8
    assert all(c["same"] for c in checks), [c for c in checks if not c["same"]]


@pytest.mark.model
@pytest.mark.llamacpp
def test_echoed_answer_logprob_is_llamacpps_own_teacher_forced_one(gguf):
    """A needle prompt and its true answer echoed by llama.cpp's server (the completions API, as the probe sends
    them with --logprobs echo) give the answer the log-prob llama.cpp in-process gives the same text: the same
    tokens (the server's usage counts them), the same weights, cache type and thread count, and one batch from
    position 0 on both sides (a fresh server; n_batch 512 both), so the logits are the same; 1e-3 nats leaves room
    for the log-softmax's float sums (numpy there, torch here). The plain template does not begin with SmolLM2's
    BOS token, and llama-cpp-python 0.3.36 then shifts the echoed log-probs by one: the probe sees it and says so
    instead of scoring garbage. (The server's echo sorts the vocabulary at every prompt token in Python: a short
    prompt keeps this test quick.)"""
    from kvdemo.probe import Client, Endpoint, questions
    from kvdemo.probe.echo import answer_logprob_from_echo, echo_body, echo_prompt

    q = questions("passkey", [120], [50])[1][0]
    sent, answer = echo_prompt("chatml", q), q.task.answer
    kv = KvTypes("f16", "f16")
    with llamacpp.server(gguf, kv, n_ctx=512, alias="m") as url:
        client = Client(Endpoint("local", url, "m"), timeout_s=120)
        echoed = client.complete(echo_body("m", sent))
        served = answer_logprob_from_echo(echoed, sent, answer)
        plain = "user: The pass key is 68213. What is it?\n\nassistant: The pass key is 68213"
        with pytest.raises(ValueError, match="do not end with the completion"):
            answer_logprob_from_echo(client.complete(echo_body("m", plain)), plain, "68213")
    engine = llamacpp.Engine(gguf, kv, n_ctx=512)
    try:
        ids = engine.llm.tokenize(sent.encode(), add_bos=False, special=True)
        head = engine.llm.tokenize(sent[: -len(answer)].encode(), add_bos=False, special=True)
        assert ids[: len(head)] == head and len(ids) > len(head)  # the answer's tokens follow the prompt's
        logp = torch.log_softmax(engine.feed(ids), -1)  # [T, V]: row i predicts ids[i + 1]
    finally:
        engine.close()
    assert echoed["usage"]["prompt_tokens"] == len(ids)  # the server read the same tokens
    in_process = float(sum(logp[i - 1, ids[i]] for i in range(len(head), len(ids))))
    assert served == pytest.approx(in_process, abs=1e-3)
    assert -3 < served < 0  # a 120-token passkey: the model knows it


@pytest.mark.model
@pytest.mark.llamacpp
def test_cli_starts_its_own_llamacpp_servers_and_writes_the_checks(tmp_path, capsys):
    import json

    from kvdemo.cli import main

    out = tmp_path / "probe.json"
    code = main(["probe", "--llamacpp", "f16,q4_0", "--lengths", "300", "--depths", "10,90", "--max-tokens", "16",
                 "--concurrency", "1", "--out", str(out)])  # fmt: skip
    assert code in (0, None)
    saved = json.loads(out.read_text())
    assert [e["name"] for e in saved["endpoints"]] == ["llama.cpp-f16", "llama.cpp-q4_0"]
    assert len(saved["in_process_checks"]) == 4 and all(c["same"] for c in saved["in_process_checks"])
    assert "--llamacpp f16,q4_0" in saved["provenance"]["command"]
    assert "4 of 4 answers agree" in capsys.readouterr().out
