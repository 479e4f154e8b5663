"""The benchmark against transformers' caches (kvdemo.contest, its report kvdemo.results.bench): byte counting of
transformers' caches, goal judging, and the quick bench end to end (in process and through the CLI)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, QuantizedCache
from transformers.utils import is_hqq_available, is_optimum_quanto_available

from kvdemo import machine, ppl, runner
from kvdemo.contest import contenders, decode
from kvdemo.contest.run import run_bench
from kvdemo.results import bench
from kvdemo.results.bench import BenchReport, BenchSizes, ContenderResult, NeedleSummary

ROOT = Path(__file__).resolve().parent.parent
B, H, T, D = 1, 2, 256, 64  # toy cache: batch, kv heads, tokens, head_dim


def _toy_config() -> LlamaConfig:
    return LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=H, hidden_size=H * D)


def _toy_states(seed: int = 0, tokens: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, tokens, D, generator=g), torch.randn(B, H, tokens, D, generator=g)  # [B, H, T, D]


def _fill(cache, tokens: int = T):
    for layer in range(2):
        k, v = _toy_states(layer, tokens)
        cache.update(k, v, layer)
    return cache


def test_dynamic_cache_bytes_are_its_tensors():
    cache = _fill(DynamicCache(config=_toy_config()))
    expected = 2 * 2 * B * H * T * D * 4  # layers x (K, V) x elements x fp32
    assert contenders.cache_bytes(cache) == {"live": expected, "allocated": expected}


@pytest.mark.skipif(not is_optimum_quanto_available(), reason="optimum-quanto not installed")
@pytest.mark.parametrize("nbits", [4, 2])
def test_quanto_cache_bytes_count_packed_codes_and_scales(nbits):
    cache = _fill(QuantizedCache(backend="quanto", config=_toy_config(), nbits=nbits))
    elements = B * H * T * D
    groups = elements // 64  # quanto default q_group_size 64, contiguous along head_dim
    per_tensor = elements * nbits // 8 + groups * 2 * 4  # packed codes + fp32 scale and shift per group
    assert contenders.cache_bytes(cache)["live"] == 2 * 2 * per_tensor
    q = cache.layers[0]._quantized_keys
    assert type(q) is not torch.Tensor  # a quanto QTensor: its reported shape is not its storage
    assert q.numel() * q.element_size() != contenders.tensor_bytes(q)


@pytest.mark.skipif(
    not (is_optimum_quanto_available() and machine.quanto_extension_built()),
    reason="optimum-quanto's C++ extension is not built (dequantizing would build it: minutes)",
)
def test_quanto_cache_bytes_include_the_residual():
    cache = _fill(QuantizedCache(backend="quanto", config=_toy_config(), nbits=4))
    before = contenders.cache_bytes(cache)["live"]
    for layer in range(2):
        k, v = _toy_states(10 + layer, tokens=3)
        cache.update(k, v, layer)  # 3 < residual_length: kept in full precision
    assert contenders.cache_bytes(cache)["live"] - before == 2 * 2 * B * H * 3 * D * 4


def test_fp8_cache_bytes_and_tensor_bytes_containers():
    cache = _fill(QuantizedCache(backend="fp8", config=_toy_config()))
    per_tensor = B * H * T * D + 4  # one byte per element + a fp32 per-tensor scale
    assert contenders.cache_bytes(cache)["live"] == 2 * 2 * per_tensor
    x = torch.zeros(3, 5, dtype=torch.float16)
    assert contenders.tensor_bytes({"a": (x, [x, None]), "shape": torch.Size([3, 5]), "n": 4}) == 2 * 3 * 5 * 2


@pytest.mark.skipif(not is_hqq_available(), reason="hqq not installed")
def test_hqq_cache_bytes_count_codes_and_meta():
    cache = _fill(QuantizedCache(backend="hqq", config=_toy_config(), nbits=4))
    codes, meta = cache.layers[0]._quantized_keys
    elements = B * H * T * D
    meta_bytes = 2 * (elements // 64) * meta["scale"].element_size()  # scale + zero per group of 64
    assert codes.numel() * codes.element_size() == elements // 2
    assert contenders.cache_bytes(cache)["live"] == 2 * 2 * (elements // 2 + meta_bytes)


def test_sizes_and_contenders_are_validated():
    with pytest.raises(ValueError, match="ppl length"):
        BenchSizes(ppl_prefix=2048, ppl_lengths=(2048,))
    with pytest.raises(ValueError, match="chunk"):  # kvdemo's decode path takes at most 16 queries
        run_bench(SimpleNamespace(max_context=1 << 20), sizes=BenchSizes(chunk=64))
    with pytest.raises(ValueError, match="multiple of residual"):
        BenchSizes(new_tokens=100)  # a round that holds a flush in one contender and not in another
    run, skipped = contenders.contenders(quick=False)
    names = [c.name for c in run] + [s.contender for s in skipped]
    assert names[:8] == [
        "full",
        "kvdemo-int8",
        "kvdemo-k8v4",
        "kvdemo-k4v8",
        "kvdemo-int4",
        "kvdemo-int4:ktoken:g64",
        "kvdemo-int2",
        "kvdemo-fp8",
    ]
    assert {"hf-quanto-int4", "hf-quanto-int2", "hf-hqq-int4", "hf-fp8"} <= set(names)
    assert {f"kvdemo-{p}" for p in ("int3", "nuq4:o1", "nuq3:o1", "nuq2:o1:s1", "int4:hadamard", "nvfp4")} <= set(names)
    assert all(s.reason for s in skipped)
    for sizes in bench.SIZES.values():  # the timed decode window crosses every quantized contender's flush
        assert sizes.new_tokens * sizes.rounds >= sizes.residual and sizes.new_tokens % sizes.residual == 0
    assert bench.FULL.new_tokens * bench.FULL.rounds >= 2 * bench.FULL.residual


def test_every_quantized_contender_shares_the_residual():
    from kvdemo.precision import parse_precision

    assert contenders.kvdemo_precision("int4", 128) == "int4"
    assert contenders.kvdemo_precision("int4", 64) == "int4:g64:r64"  # the group shrinks to fit the residual
    scheme = parse_precision(contenders.kvdemo_precision("int4:ktoken:g64", 128))
    assert (scheme.key_axis, scheme.group_size, scheme.residual, scheme.key_bits) == ("token", 64, 128, 4)
    for quick, residual in ((False, 128), (True, bench.QUICK.residual)):
        run, skipped = contenders.contenders(quick=quick)
        every = run + [c for c in contenders.contenders(quick=quick)[0] if c.name in {s.contender for s in skipped}]
        for c in every:
            if c.backend == "kvdemo":
                assert parse_precision(c.precision).residual == residual, c.name
            elif c.backend in ("quanto", "hqq"):
                assert c.hf_options["residual_length"] == residual and c.hf_options["q_group_size"] == 64
        assert "kvdemo-int4:ktoken:g64" in [c.name for c in run]


@pytest.mark.skipif(not is_hqq_available(), reason="hqq not installed")
def test_stored_prompt_keeps_the_same_tail_exact_in_every_cache():
    """Needle fairness: 200 stored tokens with residual 128 leave tokens [128, 200) exact in kvdemo's cache
    and in transformers' (which would quantize all 200 if they came in one update)."""
    from kvdemo.cache import QuantizedKVCache

    states = [_toy_states(layer, tokens=200) for layer in range(2)]
    theirs = QuantizedCache(backend="hqq", config=_toy_config(), nbits=4)
    ppl.store_states(theirs, states, residual=128)
    assert contenders.held_exact(theirs) == 72
    assert theirs.layers[0]._quantized_keys[1]["shape"][-2] == 128  # the quantized part: tokens [0, 128)
    ours = QuantizedKVCache("int4", 2)
    ppl.store_states(ours, states, residual=128)
    assert ours.layers[0].length == 200
    assert contenders.held_exact(ours) == 2 * 2 * B * H * 72 * D * 4  # layers x (K, V) x 72 exact fp32 tokens
    one_update = QuantizedCache(backend="hqq", config=_toy_config(), nbits=4)
    ppl.store_states(one_update, states)
    assert contenders.held_exact(one_update) == 0
    assert contenders.held_exact(DynamicCache(config=_toy_config())) is None


def test_logit_kl_is_zero_for_equal_rows_and_positive_otherwise():
    g = torch.Generator().manual_seed(0)
    a = torch.log_softmax(torch.randn(5, 50, generator=g), -1)
    b = torch.log_softmax(torch.randn(5, 50, generator=g), -1)
    assert torch.allclose(ppl.logit_kl(a, a), torch.zeros(5), atol=1e-6)
    kl = ppl.logit_kl(a, b)
    assert (kl > 0).all()
    assert kl[0] == pytest.approx(float((a[0].exp() * (a[0] - b[0])).sum()), rel=1e-6)


def _contender(name, ppl_delta=0.0, speed=1.0, ratio=1.0, kl=0.0, needle_delta=None) -> ContenderResult:
    """A row with the figures the judging reads (at 4096 tokens) and empty maps elsewhere."""
    at = {"4096": ppl_delta}
    return ContenderResult(
        name, "kvdemo", "kvdemo", 4, "kvdemo", {}, {}, {}, {"4096": ratio}, {}, {}, {}, at, {}, {"4096": kl},
        NeedleSummary([], None, 0, 0), needle_delta, {"4096": speed}, {"4096": [speed]}, {}, {}, {}, 1.0, 1.0,
    )  # fmt: skip


def _report(*rows: ContenderResult, sizes: BenchSizes = bench.FULL) -> BenchReport:
    return BenchReport({}, "m", False, "full", sizes, {}, list(rows), [], 0.0)


def _synthetic(ppl_ours, ppl_theirs, speed_ours, speed_theirs, ratio_ours, ratio_theirs) -> BenchReport:
    return _report(
        _contender("kvdemo-int4", ppl_ours, speed_ours, ratio_ours),
        _contender("hf-quanto-int4", ppl_theirs, speed_theirs, ratio_theirs),
    )


def test_decode_speed_interleaves_single_steps_and_pairs_them(monkeypatch):
    """One untimed warm-up step per cache, then the caches take turns one step at a time; tokens/s comes from
    the median step and vs_first from the median of the paired (same-turn) ratios, not a ratio of medians."""
    import kvdemo.texts

    step_s = {"int4": [0.1, 0.1, 0.2, 0.1], "int8": [0.2, 0.1, 0.4, 0.4]}  # each cache's timed steps in turn
    calls = []

    def one_step(lm, cache, logits, steps):
        assert steps == 1
        calls.append(cache)
        timed = calls.count(cache) - 1  # the first call is the warm-up
        return (99.0 if timed == 0 else step_s[cache][timed - 1]), logits

    monkeypatch.setattr(kvdemo.texts, "held_out_ids", lambda lm, n: list(range(n)))
    monkeypatch.setattr(decode.runner, "new_cache", lambda lm, spec: spec.label)
    monkeypatch.setattr(decode.runner, "prefill", lambda lm, ids, cache, mode: None)
    monkeypatch.setattr(decode, "decode_steps", one_step)
    seen = []
    out = decode.decode_speed(None, ["int4", "int8"], context=8, steps=2, rounds=2, on_progress=seen.append)
    assert calls == ["int4", "int8"] + ["int4", "int8"] * 4
    rows = {r.precision: r for r in out.results}
    assert rows["int4"].tokens_per_s == 10.0 and rows["int4"].vs_first == 1.0
    assert rows["int8"].tokens_per_s == round(1 / 0.3, 3)
    assert rows["int8"].vs_first == 0.5  # median of 0.5, 1, 0.5, 0.25 (medians alone would say 0.333)
    assert [p.done for p in seen] == [9, 18, 22, 26] and seen[-1].total == 26  # prompt + warm-up, then rounds


def test_goals_are_judged_from_the_numbers():
    met = bench.goals(_synthetic(0.05, -0.2, 6.0, 4.9, 3.66, 3.2))
    assert [g.met for g in met] == [True, True, True]
    missed = bench.goals(_synthetic(0.3, 0.2, 5.0, 4.9, 3.1, 3.2))
    assert [g.met for g in missed] == [False, False, False]
    assert missed[1].measured["speedup"] == round(5.0 / 4.9, 3)
    alone = bench.goals(_report(sizes=BenchSizes(contexts=(4096,), ppl_lengths=(4096,))))
    assert [g.met for g in alone] == [None, None, None]


def test_load_note_judges_the_load_before_the_run_not_the_runs_own():
    """A run keeps every core busy, so the load average at its end is its own: only the start's is other load."""
    own = {"cores": 2, "load_avg_start": [0.1, 0.6, 1.0], "load_avg_end": [2.0, 2.0, 2.0]}
    assert machine.load_note(own) is None
    shared = {"cores": 2, "load_avg_start": [1.6, 1.2, 1.0], "load_avg_end": [3.5, 3.0, 2.5]}
    assert "load average 1.6 on 2 cores" in machine.load_note(shared)


def test_key_vs_value_ratios():
    keys = _contender("kvdemo-k4v8", 0.3, kl=6e-3, needle_delta=-0.4)
    values = _contender("kvdemo-k8v4", 0.05, kl=2e-3, needle_delta=-0.1)
    m = bench.key_vs_value(_report(keys, values)).measures
    assert m["ppl_delta@4096"].to_json() == {"keys_4bit": 0.3, "values_4bit": 0.05, "ratio": 6.0}
    assert m["logit_kl@4096"].ratio == 3.0
    assert m["needle_logprob_loss"].to_json() == {"keys_4bit": 0.4, "values_4bit": 0.1, "ratio": 4.0}
    values.ppl_delta["4096"] = -0.01  # values' damage below noise: no ratio, not a sign flip
    assert bench.key_vs_value(_report(keys, values)).measures["ppl_delta@4096"].ratio is None
    assert bench.key_vs_value(_report(keys)) is None


def test_llamacpp_rows_name_their_engine_and_baseline_and_old_rows_write_back_unchanged():
    """A row's engine and baseline are written only when not the defaults (transformers, full), so a report from
    before llama.cpp rows writes back as it was; with llama.cpp rows the table reads each against its baseline
    and the figures hatch them."""
    from kvdemo.figures.bench import bench_figures

    old = _contender("kvdemo-int4")
    assert not {"engine", "baseline", "load_s"} & set(old.to_json())
    assert ContenderResult.from_json(old.to_json()) == old
    rows = []
    for name in ("full", "llama.cpp:f16", "llama.cpp:q4_0"):
        r = _contender(name)
        r.ratio_vs_fp16 = r.ratio_allocated_vs_fp16 = {"4096": 1.0}
        r.ppl, r.prefill_s, r.decode_window = {"4096": 20.0}, {"4096": 1.0}, {}
        r.needle = NeedleSummary.of([bench.NeedleCell(4096, 50, 50.0, -0.1, True)])
        if name != "full":
            r.engine, r.baseline, r.load_s = "llama.cpp", "llama.cpp:f16", 0.2
        rows.append(r)
    assert rows[2].to_json()["baseline"] == "llama.cpp:f16" and ContenderResult.from_json(rows[2].to_json()) == rows[2]
    sizes = BenchSizes(contexts=(4096,), ppl_lengths=(4096,))
    report = BenchReport(
        {"cpu": "x", "cores": 2, "torch_threads": 2, "device": "cpu", "dtype": "float32", "torch": "t",
         "transformers": "t", "optimum-quanto": None, "hqq": None, "date": "d", "load_avg_start": [0.1],
         "load_avg_end": [0.1]}, "m", False, "custom", sizes, {}, rows, [], 0.0,
        engine={"engine": "llama-cpp-python 0", "gguf": "m.gguf", "flags": "flash attention on"},
    )  # fmt: skip
    table = bench.markdown_table(report)
    assert table.startswith("| contender | read against | ratio vs fp16 @4096 |")
    assert "| `full` |  |" in table and "| `llama.cpp:f16` |  |" in table
    assert "| `llama.cpp:q4_0` | `llama.cpp:f16` |" in table and "llama.cpp rows: llama-cpp-python 0 on m.gguf" in table
    assert BenchReport.from_json(report.to_json()).to_json() == report.to_json()
    memory = bench_figures(report)[0]
    assert list(memory.data[0].marker.pattern.shape) == ["", "/", "/"] and "llama.cpp" in memory.layout.title.text


# --- with the model ------------------------------------------------------------------------------


@pytest.mark.model
def test_stored_exact_states_equal_a_real_prefill(lm):
    """The bench stores one exact prefill into every cache; that must be what the model's prefill stores."""
    from kvdemo.texts import prose_ids

    ids = prose_ids(lm, 296)
    states, first = ppl.exact_states(lm, ids[:280])
    run, _ = contenders.contenders(quick=True)
    for c in run:
        with runner.attention_impl(lm, c.attention):
            real = c.make_cache(lm)
            logits = runner.prefill(lm, ids[:280], real)
            after_real = runner.forward(lm, ids[280:], real)
            stored = c.make_cache(lm)
            ppl.store_states(stored, states)
            after_stored = runner.forward(lm, ids[280:], stored)
        torch.testing.assert_close(logits, first, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(after_stored, after_real, rtol=1e-5, atol=1e-4)
        assert contenders.cache_bytes(stored) == contenders.cache_bytes(real), c.name
    assert lm.model.config._attn_implementation == "kvdemo"  # restored after every switch


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    """One quick bench for every test here, run as a user runs it: `python -m kvdemo bench --quick --json --out`
    in a new process (report on stdout, progress on stderr)."""
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "kvdemo", "bench", "--quick", "--json", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout), out, proc.stderr.splitlines()


@pytest.mark.model
def test_quick_bench_report_shape_and_files(quick_report):
    report, out, messages = quick_report
    assert set(report) >= {"machine", "results", "skipped", "goals", "sizes", "method", "wall_s", "files"}
    assert {"cpu", "cores", "torch", "transformers", "device", "dtype", "date"} <= set(report["machine"])
    assert messages and messages[-1].split(" (")[0].endswith(" tokens: done")  # Progress.text(), on stderr
    for name in bench.REPORT_FILES:
        assert (out / name).stat().st_size > 0
    assert json.loads((out / "bench.json").read_text()) == report
    assert bench.read_json(out) == report and BenchReport.from_json(report).to_json() == report
    assert bench.read_json(out / "missing") is None
    names = [r["contender"] for r in report["results"]]
    assert names[:2] == ["full", "kvdemo-int4"] and "hf-fp8" in names
    assert "hf-quanto-int4" in names or any(s["contender"] == "hf-quanto-int4" for s in report["skipped"])
    assert "kvdemo-int4:ktoken:g64" in names
    md = (out / "bench.md").read_text()
    assert all(f"`{n}`" in md for n in names)
    assert "plotly" in (out / "bench.html").read_text()
    assert len(report["goals"]) == 3
    assert report["scheme_vs_implementation"]["kvdemo-int4"]["ratio_vs_fp16"] > 1


@pytest.mark.model
def test_quick_decode_window_crosses_every_flush(quick_report):
    """Each timed round holds new_tokens / residual flushes of every quantized contender (kvdemo's and
    transformers' alike); the caches that never flush (DynamicCache, the fp8 backend) report none."""
    report, _, _ = quick_report
    s = report["sizes"]
    per_round = s["new_tokens"] // s["residual"]
    assert per_round >= 1
    for r in report["results"]:
        for c in map(str, s["contexts"]):
            win = r["decode_window"][c]
            assert win["steps"] == s["rounds"] * s["new_tokens"]
            if r["backend"] in ("dynamic", "fp8"):
                assert win["flushes"] == 0 and win["mean_flush_step_ms"] is None, r["contender"]
            else:
                assert win["flushes_per_round"] == [per_round] * s["rounds"], r["contender"]
                assert win["mean_flush_step_ms"] > 0


@pytest.mark.model
def test_quick_bench_values_are_sane(quick_report, lm):
    report, _, _ = quick_report
    sizes = report["sizes"]
    ctx, lengths = [str(c) for c in sizes["contexts"]], [str(n) for n in sizes["ppl_lengths"]]
    rows = {r["contender"]: r for r in report["results"]}
    full = rows["full"]
    fp16_per_token = 2 * lm.num_layers * lm.kv_heads * lm.head_dim * 2
    assert full["ratio_vs_fp16"][ctx[0]] == pytest.approx(2 / lm.dtype.itemsize)  # fp32 cache: 0.5x
    for name, r in rows.items():
        for c in ctx:
            assert r["ratio_vs_fp16"][c] == pytest.approx(fp16_per_token * int(c) / r["cache_bytes"][c], rel=1e-3)
            assert r["decode_tok_s"][c] > 0 and r["prefill_s"][c] > 0
            rounds = sorted(r["decode_tok_s_rounds"][c])
            assert rounds[0] <= r["decode_tok_s"][c] <= rounds[-1]  # the median
            if name != "full":
                assert r["ratio_vs_fp16"][c] > 1.5, name
        for n in lengths:
            assert math.isfinite(r["ppl"][n]) and 1 < r["ppl"][n] < 1000
            assert r["ppl_delta"][n] == pytest.approx(r["ppl"][n] - full["ppl"][n], abs=2e-4)
            assert r["logit_kl"][n] > 0 if name != "full" else r["logit_kl"][n] == 0  # every quantized cache is lossy
        assert r["needle"]["total"] == len(sizes["needle_lengths"]) * len(sizes["needle_depths"])
        assert all(cell["logprob"] <= 0 for cell in r["needle"]["cells"])
    assert full["ppl_delta"][lengths[0]] == 0
    # int4 is lossy: not bit-identical to full precision on real text
    assert rows["kvdemo-int4"]["ppl"][lengths[-1]] != full["ppl"][lengths[-1]]
    # kvdemo int4 stores 4-bit codes + fp16 scale and zero per group: 4.375 bits/element at the defaults,
    # more where sinks or a not yet quantized residual stay in the model's dtype
    assert 3.0 < rows["kvdemo-int4"]["ratio_vs_fp16"][ctx[-1]] <= 16 / 4.375 + 1e-3


@pytest.mark.model
def test_cli_bench_quick_json(quick_report):
    report, out, stderr = quick_report
    assert report == json.loads((out / "bench.json").read_text())
    assert report["quick"] is True and report["results"][0]["contender"] == "full"
    assert any("set-up probe" in line for line in stderr)  # progress goes to stderr, the JSON alone to stdout
