"""Perplexity over a stored cache (kvdemo.ppl): the bench's protocol as a function and a command."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvdemo import ppl, runner
from kvdemo.cli import main
from kvdemo.documents import token_ids
from kvdemo.layout import Layout, region_bytes
from kvdemo.memory import fp16_cache_bytes
from kvdemo.precision import parse_precision
from kvdemo.progress import Cancelled
from kvdemo.results import ablation
from kvdemo.results.ppl import HELD_OUT_NAME, Blocks, PplReport, PplRow, interval_note, interval_text, result_rows
from kvdemo.texts import held_out_ids

pytestmark = pytest.mark.model

TOKENS, PREFIX = 512, 128


@pytest.fixture(scope="module")
def scored(lm):
    return ppl.run_ppl(lm, ["int8", "int2"], tokens=TOKENS, prefix=PREFIX)


def test_full_precision_ppl_is_the_models_own_teacher_forced_ppl(lm, scored):
    """Independent oracle: one plain forward of the whole text (the model's SDPA, no kvdemo cache) scores
    positions [N/2, N) as the protocol's exact prefix + 16-token chunks through a full cache do."""
    ids = held_out_ids(lm, TOKENS)
    with runner.attention_impl(lm, "sdpa"), torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([ids])).logits[0].float()  # [N, V]: row i predicts ids[i + 1]
    lo = TOKENS // 2
    nll = F.cross_entropy(logits[lo - 1 : TOKENS - 1], torch.tensor(ids[lo:]))
    full = scored.results[0]
    assert full.precision == "full" and full.delta_vs_full == 0 and full.logit_kl == 0
    assert full.ppl == pytest.approx(math.exp(float(nll)), rel=1e-3)


def test_rows_order_cost_and_size(lm, scored):
    rows = {r.precision: r for r in scored.results}
    assert list(rows) == ["full", "int8", "int2"]
    assert abs(rows["int8"].delta_vs_full) < 0.05 * rows["full"].ppl  # 8-bit keys/values: close to full
    assert rows["int2"].delta_vs_full > rows["int8"].delta_vs_full + 0.1  # 2 bits cost clearly more
    assert rows["int2"].logit_kl > rows["int8"].logit_kl > 0
    assert rows["full"].ratio_vs_fp16 == pytest.approx(1.0) and rows["full"].bits_per_element == 16
    last = TOKENS - 1  # the cache holds every token but the last: the prefix in one update, then chunks of 16
    updates = [PREFIX] + [min(s + 16, last) - s for s in range(PREFIX, last, 16)]
    for name in ("int8", "int2"):  # sizes on the 16-bit basis, to the byte of the layout's formula
        r, spec = rows[name], parse_precision(name)
        assert r.stored_tokens == last
        at16 = region_bytes(Layout(spec).regions(updates), lm.num_layers, lm.kv_heads, lm.head_dim, spec, 16)
        fp16 = fp16_cache_bytes(lm.num_layers, lm.kv_heads, lm.head_dim, last)
        assert r.ratio_vs_fp16 == round(fp16 / at16["total"], 4) > 1.5, r


def test_report_keeps_its_blocks_and_the_intervals_they_give(scored):
    """The per-block means reproduce each row's perplexity (count-weighted, as the positions are), every row
    carries the 95% intervals its blocks give, and 2 bits cost more than 8 on every resampled text here."""
    from kvdemo.cli.ppl import format_text

    b = scored.blocks
    assert b.size == ppl.BLOCK and sum(b.nll_counts) == TOKENS // 2  # every scored position, once
    assert sum(b.kl_counts) == TOKENS // 2 // 4  # the KL's kept positions (every 4th)
    drawn = ppl.resampled_figures(b)
    rows = {r.precision: r for r in scored.results}
    for name, r in rows.items():
        nll = sum(m * c for m, c in zip(b.nll[name], b.nll_counts, strict=True)) / sum(b.nll_counts)
        assert math.exp(nll) == pytest.approx(r.ppl, rel=1e-4)
        for measure in ("delta_vs_full", "logit_kl"):
            assert getattr(r, f"{measure}_ci95") == ppl.interval95(drawn[measure][name])
            low, high = getattr(r, f"{measure}_ci95")
            assert low <= getattr(r, measure) + 1e-3 and getattr(r, measure) - 1e-3 <= high
    assert rows["full"].delta_vs_full_ci95 == [0.0, 0.0]
    assert rows["int2"].delta_vs_full_ci95[0] > rows["int8"].delta_vs_full_ci95[1]
    assert float((drawn["delta_vs_full"]["int2"] - drawn["delta_vs_full"]["int8"]).min()) > 0
    text = format_text(scored)
    assert "delta 95%" in text and f"[{rows['int2'].delta_vs_full_ci95[0]:+.3f}," in text
    assert PplReport.from_json(scored.to_json()) == scored


def test_prefix_must_leave_the_scored_half_after_it(lm):
    with pytest.raises(ValueError, match="2 x the exact prefix"):
        ppl.run_ppl(lm, ["int4"], tokens=256, prefix=200)


def test_cli_prints_the_documented_rows(lm, capsys, tmp_path):
    assert (
        main(["ppl", "--precision", "int4", "--tokens", "256", "--prefix", "64", "--json", "--out", str(tmp_path)]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "ppl.json").read_text()) == out
    assert out["command"].startswith("python -m kvdemo ppl --model embedded --precision int4 --tokens 256")
    assert [r["precision"] for r in out["results"]] == ["full", "int4"]
    for r in out["results"]:
        assert set(r) >= {"precision", "ppl", "delta_vs_full", "bits_per_element", "ratio_vs_fp16"}
    assert main(["ppl", "--precision", "int4", "--tokens", "999999"]) == 2
    assert "exceeds the model's context" in capsys.readouterr().err


def test_ablation_grid_and_its_checks():
    """Every ablation cell parses, NVFP4 sits in the 4-bit row only, the sink columns add exactly `:s1`, and the
    checks hold or fail on the figures given (20% of int2, nuq3:o1 no worse than int4)."""
    grid = ppl.ablation_precisions()
    assert list(grid) == [4, 3, 2] and [grid[b]["NVFP4"] for b in (4, 3, 2)] == ["nvfp4", None, None]
    for b, row in grid.items():
        assert list(row) == list(ppl.ABLATION_COLUMNS)
        specs = {col: parse_precision(p) for col, p in row.items() if p is not None}
        assert specs["int"].key_bits == specs["nuq"].key_bits == b
        assert specs["int + fp16 sink"].sinks == specs["nuq + 1% + fp16 sink"].sinks == 1
        assert specs["int"].sinks == specs["nuq + 1% outliers"].sinks == 0
        assert specs["nuq + 1% + fp16 sink"].outliers == 1.0
        whole = specs["nuq + 1% + pre-RoPE + sink"]  # KVQuant's recipe: every method of the row at once
        assert (whole.key_bits, whole.outliers, whole.pre_rope, whole.sinks) == (b, 1.0, True, 1)
    rows = {"int4": 0.12, "nuq3:o1": 0.4, "int2": 14.5, "nuq2:o1": 8.1, "nuq2:o1:s1": 1.2, "int2:s1": 7.0}
    rows |= {"nuq3:o1:prerope:s1": 0.11, "nuq2:o1:prerope:s1": 3.0}
    kl = {k: v / 30 for k, v in rows.items()} | {"nuq3:o1:prerope:s1": 0.005}  # the KL disagrees on one claim
    checks = {c.claim: c for c in ppl.ablation_checks([_row(k, v, kl[k]) for k, v in rows.items()])}
    assert len(checks) == 12  # six claims, each on the delta and on the KL
    assert not checks["nuq3:o1 delta <= int4 delta"].holds
    assert not checks["nuq2:o1 delta <= 20% of int2 delta"].holds
    assert checks["nuq2:o1:s1 delta <= 20% of int2 delta"].holds
    assert checks["nuq2:o1:s1 delta <= 20% of int2:s1 delta"].holds
    assert checks["nuq2:o1:s1 delta <= 20% of int2:s1 delta"].values == [1.2, 7.0]
    assert checks["nuq3:o1:prerope:s1 delta <= int4 delta"].holds
    assert not checks["nuq2:o1:prerope:s1 delta <= 20% of int2 delta"].holds  # 3.0 > 2.9
    assert checks["nuq3:o1:prerope:s1 logit KL <= int4 logit KL"].holds is False  # 0.005 > 0.004
    assert checks["nuq2:o1:s1 logit KL <= 20% of int2:s1 logit KL"].values == [1.2 / 30, 7.0 / 30]
    assert not checks["nuq2:o1:prerope:s1 logit KL <= 20% of int2 logit KL"].holds
    assert ppl.ablation_checks([_row("int4", 0.1, 0.01)]) == []  # a claim needs both of its precisions
    assert all(c.verdict is None for c in checks.values())  # no blocks: point verdicts only
    assert [c["claim"] for c in ablation.claim_rows(_ablation_of(list(checks.values())))] == list(checks)


def _row(precision: str, delta: float, kl: float) -> PplRow:
    return PplRow(precision, 10.0 + delta, delta, kl, 4.0, 4.0, 1000, 100)


def _ablation_of(checks) -> ablation.AblationReport:
    report = PplReport("m", None, 256, 64, 16, [128, 256], "", [_row("full", 0.0, 0.0)])
    return ablation.AblationReport(report, [], [], checks)


def test_codebooks_option_scores_nuq_with_that_file(lm, capsys, tmp_path):
    """`--codebooks FILE`: the nuq precisions use that file's levels (the model's own levels saved to a file give
    the same figures; levels squeezed to half their span cost more), the report says what they were fitted
    on, and a missing file or one of another model is refused with the reason."""
    from kvdemo import codebooks

    own = codebooks.for_model(lm)
    own.save(tmp_path / "own.safetensors")
    squeezed = codebooks.Codebooks({k: v * 0.5 for k, v in own.tensors.items()}, own.metadata | {"date": "squeezed"})
    squeezed.save(tmp_path / "squeezed.safetensors")
    argv = ["ppl", "--precision", "int4,nuq4", "--tokens", "256", "--prefix", "64", "--json"]
    runs = {}
    for name in ("", "own", "squeezed"):
        extra = ["--codebooks", str(tmp_path / f"{name}.safetensors")] if name else []
        extra += ["--out", str(tmp_path / "reports" / f"{name or 'default'}.json")]  # a .json file, not a folder
        assert main(argv + extra) == 0
        runs[name] = json.loads(capsys.readouterr().out)
        assert json.loads((tmp_path / "reports" / f"{name or 'default'}.json").read_text()) == runs[name]
    rows = {name: {r["precision"]: r for r in out["results"]} for name, out in runs.items()}  # the JSON printed
    assert rows["own"] == rows[""]  # the same levels, read from a file
    assert rows["squeezed"]["int4"] == rows[""]["int4"]  # uniform codes take no codebook
    assert rows["squeezed"]["nuq4"]["logit_kl"] > 2 * rows[""]["nuq4"]["logit_kl"]
    assert runs[""]["codebooks"] == codebooks.describe(own) and "squeezed" in runs["squeezed"]["codebooks"]
    assert runs["own"]["command"].endswith(f"--codebooks {tmp_path / 'own.safetensors'}")
    assert not (tmp_path / "reports" / "ppl.json").exists()
    assert ppl.run_ppl(lm, ["int4"], tokens=256, prefix=64).codebooks is None  # no nuq precision: nothing to say
    assert main(argv + ["--codebooks", str(tmp_path / "missing.safetensors")]) == 2
    assert "codebook file not found" in capsys.readouterr().err
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    assert main(argv + ["--codebooks", str(tmp_path / "junk.safetensors")]) == 2
    assert "is not a codebook file" in capsys.readouterr().err
    codebooks.Codebooks({}, {"layers": str(lm.num_layers)}).save(tmp_path / "empty.safetensors")
    assert main(argv + ["--codebooks", str(tmp_path / "empty.safetensors")]) == 2
    assert "holds no codebooks" in capsys.readouterr().err
    codebooks.Codebooks(own.tensors, own.metadata | {"layers": "2"}).save(tmp_path / "other.safetensors")
    assert main(argv + ["--codebooks", str(tmp_path / "other.safetensors")]) == 2
    assert "a 2-layer model" in capsys.readouterr().err


# --- keys or values: where a precision's loss sits ------------------------------------------------------


def test_kv_split_roles_keep_the_options_and_move_bits_within_a_family():
    assert ppl.kv_split_precisions("nuq3:o1:s1") == {
        "as given": "nuq3:o1:s1",
        "keys alone": "knuq3v8:o1:s1",
        "values alone": "k8vnuq3:o1:s1",
        "both at int8": "int8:o1:s1",
        "a bit to the keys": "knuq4vnuq2:o1:s1",
        "a bit to the values": "knuq2vnuq4:o1:s1",
    }
    int3 = ppl.kv_split_precisions("int3:g64")
    assert (int3["a bit to the keys"], int3["a bit to the values"]) == ("k4v2:g64", "k2v4:g64")
    for name in ("as given", "a bit to the keys", "a bit to the values"):  # the same mean bits
        assert parse_precision(int3[name]).bits_per_element(64)["mean"] == pytest.approx(3.375 + 0.125)
    assert set(ppl.kv_split_precisions("int4")) == {
        "as given",
        "keys alone",
        "values alone",
        "both at int8",
    }  # no 5 or 3+5
    assert ppl.kv_split_precisions("k8v4") == {"as given": "k8v4", "keys alone": "int8", "both at int8": "int8"}
    assert "a bit to the keys" not in ppl.kv_split_precisions("nuq2:o1")  # no 1-bit values
    with pytest.raises(ValueError, match="no loss to split"):
        ppl.kv_split_precisions("full")


def _split_report(kl: dict[str, list[float]]) -> PplReport:
    """A report with per-block logit KL (and flat NLL) for each precision, full first."""
    names = ["full", *kl]
    blocks = Blocks(64, 500, 0, {n: [1.0] * 8 for n in names}, {"full": [0.0] * 8, **kl}, [64] * 8, [16] * 8)
    results = [PplRow(n, math.e, 0.0, sum(kl.get(n, [0.0] * 8)) / 8, 4.0, 4.0, 1000, 100) for n in names]
    return PplReport("m", None, 1024, 512, 16, [512, 1024], "", results, blocks)


def test_split_summary_shares_and_settles_each_role_against_the_precision():
    wobble = [0.9, 1.1] * 4
    kl = {
        "nuq3:o1": [0.02 * w for w in wobble],
        "knuq3v8:o1": [0.015 * w for w in wobble],
        "k8vnuq3:o1": [0.005 * w for w in wobble],
        "int8:o1": [1e-5] * 8,
        "knuq4vnuq2:o1": [0.02 * w for w in reversed(wobble)],  # same mean, other blocks: not settled
        "knuq2vnuq4:o1": [0.05 * w for w in wobble],
    }
    roles = ppl.kv_split_precisions("nuq3:o1")
    s = ppl.split_summary(_split_report(kl), roles)
    assert s.precision == "nuq3:o1" and s.kl_share == {"keys alone": 0.75, "values alone": 0.25}
    by_role = {c.role: c for c in s.comparisons}
    assert set(by_role) == set(roles) - {"as given"}
    assert by_role["keys alone"].verdict == "lower" and by_role["a bit to the values"].verdict == "higher"
    assert by_role["a bit to the keys"].verdict == "not settled by this text"
    low, high = by_role["a bit to the values"].difference_ci95
    assert by_role["a bit to the values"].difference == pytest.approx(0.03) and low <= 0.03 <= high
    assert s.sentence().startswith("nuq3:o1: its keys alone reach 75% of its logit KL, its values alone 25%; ")


def test_cli_kv_split_runs_every_role_once_and_writes_its_report(lm, capsys, tmp_path):
    from kvdemo.cli.ppl import format_text
    from kvdemo.results.kv_split import KvSplitReport

    precisions = "full,int3:g16:r16,k4v2:g16:r16"  # 16-token blocks: short text, quantized past
    argv = ["ppl", "--precision", precisions, "--kv-split", "--tokens", "128", "--prefix", "32", "--json"]
    assert main(argv + ["--out", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "ppl_kv_split.json").read_text()) == out
    assert out["command"].startswith(f"python -m kvdemo ppl --model embedded --kv-split --precision {precisions}")
    names = [r["precision"].removesuffix(":g16:r16") for r in out["results"]]
    assert names == ["full", "int3", "k3v8", "k8v3", "int8", "k4v2", "k2v4", "k4v8", "k8v2"]  # k4v2: int3's and its own
    assert [s["precision"] for s in out["splits"]] == ["int3:g16:r16", "k4v2:g16:r16"]
    rows = {r["precision"]: r for r in out["results"]}
    int3, k3v8 = rows["int3:g16:r16"]["logit_kl"], rows["k3v8:g16:r16"]["logit_kl"]
    assert int3 > 0 and out["splits"][0]["kl_share"]["keys alone"] == round(k3v8 / int3, 4)
    assert out["splits"][1]["roles"]["a bit to the values"] == "int3:g16:r16"
    report = KvSplitReport.from_json(out)
    table = report.markdown()
    assert table.count("\n") == 2 + len(out["splits"][0]["roles"]) + len(out["splits"][1]["roles"]) - 1
    assert "| int3:g16:r16 | keys alone | k3v8:g16:r16 |" in table
    assert report.lines()[0].startswith("- int3:g16:r16: its keys alone reach ")
    assert table in format_text(report)
    assert main(["ppl", "--precision", "full", "--kv-split", "--tokens", "128", "--prefix", "32"]) == 2
    assert "--kv-split needs a quantized precision" in capsys.readouterr().err


def test_a_given_text_is_scored_named_and_reported_row_by_row(lm):
    """run_ppl on (name, ids) scores those ids: full precision equals one plain forward of them (the model's own
    teacher-forced perplexity), the report names the text, progress counts tokens of model work (the exact prefix
    once, then every scored token of each cache, `work_tokens` in all), each row reaches `Progress.row` as its
    cache finishes (delta set, intervals not yet), a stop request ends the run with the finished rows, and a
    text shorter than --tokens is refused with both counts."""
    from kvdemo.texts import prose

    ids = token_ids(prose()[:4000], lm.tokenizer)
    assert ids == lm.tokenizer(prose()[:4000], add_special_tokens=False)["input_ids"] and len(ids) >= 256
    seen = []
    out = ppl.run_ppl(lm, ["int2"], tokens=256, prefix=64, text=("notes.txt", ids), on_progress=seen.append)
    per_cache = 1 + -(-(256 - 1 - 64) // 16)  # the first scored token, then 16-token chunks of the 191 fed tokens
    assert [p.unit for p in seen] == ["tokens"] * len(seen) and seen[-1].total == ppl.work_tokens(256, 64, 1)
    assert seen[0].done == 64 and seen[-1].done == seen[-1].total  # the exact prefix first, every token at the end
    assert [p.done for p in seen] == sorted(p.done for p in seen) and len(seen) == 1 + 2 * (per_cache + 1)
    rows = [p.row for p in seen if p.row is not None]
    with runner.attention_impl(lm, "sdpa"), torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([ids[:256]])).logits[0].float()
    nll = F.cross_entropy(logits[127:255], torch.tensor(ids[128:256]))
    assert out.text == "notes.txt" and out.results[0].ppl == pytest.approx(math.exp(float(nll)), rel=1e-3)
    assert [r.precision for r in rows] == ["full", "int2"]
    assert rows[1].delta_vs_full == out.results[1].delta_vs_full > 0
    assert rows[1].delta_vs_full_ci95 is None and out.results[1].delta_vs_full_ci95 is not None
    calls = []

    def after_full() -> bool:  # polled before each chunk: stop once full precision is scored
        calls.append(1)
        return len(calls) > per_cache

    with pytest.raises(Cancelled) as stopped:
        ppl.run_ppl(lm, ["int2"], tokens=256, prefix=64, text=("notes.txt", ids), should_stop=after_full)
    assert [r.precision for r in stopped.value.partial] == ["full"]
    assert stopped.value.partial[0].ppl == out.results[0].ppl
    with pytest.raises(ValueError, match="short.txt has 100 tokens; scoring 256"):
        ppl.run_ppl(lm, ["int4"], tokens=256, prefix=64, text=("short.txt", ids[:100]))


def test_table_rows_figure_and_note_say_what_the_report_holds(scored):
    from kvdemo.figures.ppl import ppl_frontier_figure

    rows = result_rows(scored.results)
    assert [r["precision"] for r in rows] == ["full", "int8", "int2"]
    int2 = scored.results[2]
    assert rows[2]["delta 95%"] == interval_text(int2.delta_vs_full_ci95)
    assert rows[2]["x smaller than fp16"] == round(int2.ratio_vs_fp16, 2)
    no_intervals = PplRow.from_json({k: v for k, v in int2.to_json().items() if "ci95" not in k})
    assert result_rows([no_intervals])[0]["KL 95%"] == ""
    (trace,) = ppl_frontier_figure(scored).data  # the quantized precisions, full precision left out
    assert list(trace.text) == ["int8", "int2"] and list(trace.y) == [r.logit_kl for r in scored.results[1:]]
    assert trace.error_y.array[1] == pytest.approx(int2.logit_kl_ci95[1] - int2.logit_kl)
    assert scored.text_name == HELD_OUT_NAME
    note = interval_note(scored)
    assert "4 blocks of 64 tokens" in note and "rough" in note  # 256 scored tokens
    long_model, short_model = SimpleNamespace(max_context=131072), SimpleNamespace(max_context=8192)
    assert ppl.longest_text(long_model) == ppl.HELD_OUT_TOKENS and ppl.longest_text(short_model) == 8192
    assert ppl.longest_text(short_model, 300) == 300 and ppl.longest_text(short_model, 9000) == 8192
    assert ppl.work_tokens(2048, 512, 3) == 512 + 1536 * 4


def test_cli_scores_a_document_and_says_so(lm, capsys, tmp_path):
    from kvdemo.texts import prose

    doc = tmp_path / "chapter.md"
    doc.write_text(prose()[:4000])
    argv = ["ppl", "--precision", "int4", "--tokens", "256", "--prefix", "64", "--document", str(doc)]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == "chapter.md" and out["command"].endswith(f"--document {doc}")
    assert [r["precision"] for r in out["results"]] == ["full", "int4"]
    assert main(argv) == 0 and "perplexity of chapter.md, tokens [128, 256)" in capsys.readouterr().out
    assert main([*argv, "--kv-split", "--json"]) == 0  # the split scores the same text
    split = json.loads(capsys.readouterr().out)
    assert split["text"] == "chapter.md" and split["splits"][0]["precision"] == "int4"
    by_name = {r["precision"]: r for r in split["results"]}
    assert by_name["full"]["ppl"] == out["results"][0]["ppl"] and by_name["int4"]["ppl"] == out["results"][1]["ppl"]
    assert main(["ppl", "--ablation", "--document", str(doc)]) == 2
    assert "--ablation scores the held-out prose" in capsys.readouterr().err
    assert main(["ppl", "--document", str(tmp_path / "missing.txt")]) == 2
    assert "document not found" in capsys.readouterr().err
    assert main([*argv[:-4], "--tokens", "4096", "--prefix", "1024", "--document", str(doc)]) == 2
    assert "chapter.md has" in capsys.readouterr().err
