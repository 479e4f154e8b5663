"""The measured tables in docs/ (and README's results table) against the report files shipped in assets/reports/:
every number a table prints must be the report's value at the printed precision, and the text above each table
names the report's date. Figures the prose quotes beside a table are checked where that is cheap, by value, not
by wording. Reads files only (no model), so it runs in seconds."""

import json
import re
import statistics
from pathlib import Path

import pytest

from kvdemo import ppl
from kvdemo.results import ablation, bench, needle
from kvdemo.results.ablation import AblationReport
from kvdemo.results.bench import BenchReport
from kvdemo.results.drift import DriftReport
from kvdemo.results.kv_split import KvSplitReport
from kvdemo.results.measured import MeasuredHeadroom, ScaleReport
from kvdemo.results.needle import NeedleGrid, repeats_markdown
from kvdemo.results.ppl import PplReport, codebooks_markdown, markdown_table

ROOT = Path(__file__).resolve().parent.parent
REPORTS = ROOT / "assets" / "reports"


def _page(name: str) -> str:
    """README.md, or the docs page `name` (e.g. "methods.md")."""
    return (ROOT / name if name == "README.md" else ROOT / "docs" / name).read_text()


def _report(name: str) -> dict:
    return json.loads((REPORTS / name).read_text())


def _tables(text: str) -> list[tuple[int, list[str], list[list[str]]]]:
    """Every markdown table in `text`: (character offset, header cells, body rows of cells)."""
    out, lines, offset, i = [], text.split("\n"), [0], 0
    for line in lines:
        offset.append(offset[-1] + len(line) + 1)
    while i < len(lines):
        if lines[i].lstrip().startswith("|") and i + 1 < len(lines) and re.match(r"\s*\|[-| :]+\|\s*$", lines[i + 1]):
            start, rows = i, []
            i += 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            out.append((offset[start], _cells(lines[start]), rows))
        else:
            i += 1
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table(text: str, header: list[str]) -> tuple[int, list[list[str]]]:
    found = [(at, rows) for at, head, rows in _tables(text) if head == header]
    assert len(found) == 1, f"the page should hold exactly one table with header {header}, found {len(found)}"
    return found[0]


def _printed(cell: str, value: float) -> bool:
    """Whether `cell` (e.g. "1.08e-05", "+0.012", "49,397,760", "0.50x") is `value` at the cell's precision."""
    text = cell.replace(",", "").rstrip("x").lstrip("+").strip()
    if "e" in text:
        digits = len(text.split("e")[0].partition(".")[2])
        return float(f"{value:.{digits}e}") == float(text)
    digits = len(text.partition(".")[2])
    return f"{value:.{digits}f}".replace("-0.000", "0.000") == text.replace("-0.000", "0.000")


def _says_date(text: str, at: int, date: str, within: int = 2500) -> None:
    """The text just above a table (the paragraph introducing it) names the report's date."""
    assert date[:10] in text[max(0, at - within) : at], f"the text above the table at {at} should say {date[:10]}"


def _has_table(text: str, table: str, date: str) -> None:
    """`table` (as a report's printer prints it) is in `text`, and the text above it names `date`."""
    assert table in text, f"the page's table differs from its report:\n{table.splitlines()[0]}"
    _says_date(text, text.index(table), date)


def _fraction(cell: str) -> tuple[int, int]:
    a, b = cell.split("/")
    return int(a), int(b)


def _section(text: str, start: str, end: str | None = None) -> str:
    """`text` from the line `start` to the line `end` (or its end)."""
    at = text.index(start)
    return text[at : text.index(end, at) if end else len(text)]


def _quotes(text: str, value: float, digits: int, suffix: str = "") -> bool:
    """Whether `text` quotes `value` rounded to `digits` decimals (then `suffix`, e.g. "x")."""
    return f"{value:.{digits}f}{suffix}" in text


# --- README's results table ----------------------------------------------------------------------------


def test_readme_results_table_is_the_ppl_report():
    """README's one results table: the `ppl` report's table as `kvdemo.results.ppl.markdown_table` prints it, row
    for row, with a link into docs/ on each row; the text above it names the report's command and date."""
    readme, report = _page("README.md"), _report("ppl.json")
    printed = markdown_table(PplReport.from_json(report)).split("\n")
    header = _cells(printed[0]) + ["read more"]
    at, rows = _table(readme, header)
    assert [cells[:-1] for cells in rows] == [_cells(line) for line in printed[2:]]
    for cells in rows:
        assert re.fullmatch(r"\[[^\]]+\]\(docs/[\w-]+\.md(#[\w-]+)?\)", cells[-1]), cells
    _says_date(readme, at, report["date"])
    assert report["command"] in readme[max(0, at - 2500) : at]


# --- bench (docs/benchmark.md) --------------------------------------------------------------------------


def test_bench_table_is_the_reports_table():
    """docs/benchmark.md carries the bench report's table as `kvdemo.results.bench.markdown_table` prints it."""
    report = _report("bench.json")
    table = bench.markdown_table(BenchReport.from_json(report))
    _has_table(_page("benchmark.md"), table.split("\n\n")[0], report["machine"]["date"])


def test_bench_llamacpp_table_is_the_reports_table():
    """docs/benchmark.md's run with llama.cpp's rows: the table of assets/reports/bench_llamacpp.json as
    `markdown_table` prints it, under the text naming its date and command."""
    report = _report("bench_llamacpp.json")
    table = bench.markdown_table(BenchReport.from_json(report))
    page = _page("benchmark.md")
    _has_table(page, table.split("\n\n")[0], report["machine"]["date"])
    assert "--precision int4,llama.cpp:q8_0,llama.cpp:q4_0" in page[: page.index(table.split("\n\n")[0])]
    prose = _section(page, "### Measured: `assets/reports/bench_llamacpp.json`", "## The shipped report")
    rows = {r["contender"]: r for r in report["results"]}
    for name in ("llama.cpp:q8_0", "llama.cpp:q4_0", "kvdemo-int4"):  # paired decode ratios, each to its own full
        assert _quotes(prose, rows[name]["decode_speed_vs_full"]["1024"], 2, "x"), name
    assert (
        _quotes(prose, rows["llama.cpp:q4_0"]["ppl_delta"]["2048"], 3)
        and rows["llama.cpp:q4_0"]["ppl_delta"]["2048"] > 1
    )


def test_key_vs_value_table_is_the_reports():
    text = bench.markdown_table(BenchReport.from_json(_report("bench.json")))
    block = text[text.index("| measure | 4-bit keys |") :].split("\n\n")[0].strip()
    assert block in _page("benchmark.md")


def test_decode_window_table_matches_the_reports():
    page = _page("benchmark.md")
    at, rows = _table(
        page, ["report", "context", "contender", "decode vs full", "flushes in window", "step ms", "flush step ms"]
    )
    assert rows
    for cells in rows:
        report = _report(cells[0].strip("`").split("/")[-1])
        row = {r["contender"]: r for r in report["results"]}[cells[2].strip("`")]
        ctx = cells[1]
        assert _printed(cells[3], row["decode_speed_vs_full"][ctx]), cells
        win = row.get("decode_window", {}).get(ctx)
        if win is None:  # a report from before the window crossed flushes: it did not count them
            assert cells[4:] == ["not counted", "", ""], cells
            continue
        assert cells[4] == f"{win['flushes']} in {win['steps']} steps", cells
        assert _printed(cells[5], win["median_step_ms"]), cells
        assert cells[6] == "" if win["mean_flush_step_ms"] is None else _printed(cells[6], win["mean_flush_step_ms"])
    _says_date(page, at, _report("bench.json")["machine"]["date"])


def test_bench_prose_figures_match_the_report():
    """Figures the benchmark page quotes outside its tables, each in its section: the speed goal, quanto's
    set-up, keys against values, scheme against implementation."""
    page, report = _page("benchmark.md"), _report("bench.json")
    goals = _section(page, "## Goals", "## Keys against values")
    assert _quotes(goals, report["goals"][1]["measured"]["speedup"], 2, "x")
    setup = {r["contender"]: r["setup_s"] for r in report["results"]}["hf-quanto-int4"]
    assert _quotes(goals, setup, 2, " s")
    kv = _section(page, "## Keys against values", "## Scheme against implementation")
    assert _quotes(kv, report["key_vs_value"]["measures"]["logit_kl@4096"]["ratio"], 1, "x")
    sv, k = report["scheme_vs_implementation"], "kvdemo-int4:ktoken:g64"
    scheme = _section(page, "## Scheme against implementation", "## Issue 17's formats")
    assert _quotes(scheme, sv[f"decode speed {k} / hf-quanto-int4"], 2, "x")
    assert _quotes(scheme, sv[f"decode speed {k} / kvdemo-int4"], 2, "x")


# --- memory (docs/memory.md) ----------------------------------------------------------------------------


def test_memory_table_matches_memory_json():
    page, report = _page("memory.md"), _report("memory.json")
    at, rows = _table(page, ["precision", "bytes", "ratio vs fp16", "bits/element"])
    results = {r["precision"]: r for r in report["results"]}
    assert len(rows) == len(results)
    for cells in rows:
        r = results[cells[0].split()[0]]
        assert int(cells[1].replace(",", "")) == r["bytes"], cells
        assert _printed(cells[2], r["ratio_vs_fp16"]), cells
        assert _printed(cells[3].split()[0], r["bits_per_element"]), cells
    _says_date(page, at, report["provenance"]["date"])
    assert report["provenance"]["command"] in page


def test_measured_headroom_table_is_the_reports_table():
    report = _report("headroom_measured.json")
    _has_table(_page("memory.md"), MeasuredHeadroom.from_json(report).markdown(), report["date"])
    for row in report["results"]:  # the bar: measured within 5% of the formula
        assert abs(row["measured_vs_formula"] - 1) <= 0.05, row


def test_production_table_is_the_mapping():
    """docs/memory.md's production table is what `production_settings(spec, 64)` prints, cell by cell."""
    from kvdemo.production import production_settings
    from kvdemo.results.ppl import measured_setting

    _, rows = _table(_page("memory.md"), ["precision", "vLLM `--kv-cache-dtype`", "SGLang `--kv-cache-dtype`",
                                          "TensorRT-LLM `KvCacheConfig(dtype=)`", "llama.cpp"])  # fmt: skip
    assert len(rows) >= 8
    for spec, vllm, sglang, trt, llama in rows:
        p = production_settings(spec, 64)
        assert f"--kv-cache-dtype {vllm.split()[0]}" in p["vllm"]["setting"], spec
        assert ("(exact)" in vllm) == (p["vllm"]["match"] == "exact"), spec
        assert f"--kv-cache-dtype {sglang.split()[0]}" in p["sglang"]["setting"], spec
        assert f'dtype="{trt.split()[0]}"' in p["tensorrt-llm"]["setting"], spec
        assert ("(exact)" in trt) == (p["tensorrt-llm"]["match"] == "exact"), spec
        assert llama.split("`")[1] in p["llama.cpp"]["setting"], spec
        measured = measured_setting("llama.cpp", p["llama.cpp"]["setting"])  # a row of ppl_llamacpp.json
        assert ("([measured](llamacpp.md))" in llama) == bool(measured), spec


# --- drift (docs/drift.md) ------------------------------------------------------------------------------


def test_drift_table_matches_drift_json():
    page, report = _page("drift.md"), DriftReport.from_json(_report("drift.json"))
    at, rows = _table(page, ["precision", "mean JS", "mean KL", "top-10 overlap", "output cosine", "logit KL mean"])
    assert len(rows) == len(report.results)
    for cells in rows:
        r = report.result(cells[0])
        values = [r.mean_js, r.mean_kl, r.topk_overlap, r.output_cosine, r.logit_kl_mean]
        assert all(_printed(c, v) for c, v in zip(cells[1:], values, strict=True)), cells
    _says_date(page, at, report.provenance["date"])
    assert report.provenance["command"] in page
    head = page[max(0, at - 600) : at]
    assert f"prompt {report.prompt_tokens} tokens, {report.new_tokens} queries" in head


def test_drift_prose_ratios_match_drift_json():
    """The ratios the drift page quotes under its table: attention JS and the end-to-end logit KL of 4-bit keys
    over 4-bit values (k4v8 / k8v4), and what `:s4`'s sinks do to int4's logit KL (int4 / int4:s4)."""
    page = _page("drift.md")
    prose = page[page.rindex("|") :]
    results = {r["precision"]: r for r in _report("drift.json")["results"]}
    kl = {name: statistics.fmean(r["logit_kl"]) for name, r in results.items()}
    assert _quotes(prose, results["k4v8"]["mean_js"] / results["k8v4"]["mean_js"], 1, "x")
    assert _quotes(prose, kl["k4v8"] / kl["k8v4"], 1, "x")
    assert _quotes(prose, kl["int4"] / kl["int4:s4"], 1, "x")


# --- needle (docs/needle.md) ----------------------------------------------------------------------------


def _paired_lines(text: str) -> list[tuple[str, str, str]]:
    """(a, b, value) of every "- A against B: found rate|answer log p ..." line in `text`."""
    values = {label: value for value, label in needle.PAIRED_VALUES.items()}
    found = re.findall(r"^- (\S+) against (\S+): (found rate|answer log p) ", text, re.M)
    return [(a, b, values[label]) for a, b, label in found]


def test_multikey_grid_is_its_repeats_report():
    """The needle page's multikey grid (`--repeats 10`): table, paired lines and the figures its prose quotes."""
    page, report = _page("needle.md"), _report("needle_multikey.json")
    grid = NeedleGrid.from_json(report)
    assert report["kind"] == "multikey" and report["repeats"] == 10
    assert report["provenance"]["command"] in page
    _has_table(page, repeats_markdown(grid.rows, grid.repeats), report["provenance"]["date"])
    assert report["summary"] == needle.summarize(grid.rows)
    text = _section(page, "## Measured: multikey in prose")
    stated = _paired_lines(text)
    assert len(stated) >= 6
    for a, b, value in stated:
        assert needle.difference_line(needle.paired_difference(grid.rows, a, b, value)) in text
    summary = {s["precision"]: s for s in report["summary"]}
    misses = re.search(r"misses (\d+) of the (\d+) needles", text)
    assert misses and (int(misses[1]), int(misses[2])) == (
        summary["full"]["cells"] - summary["full"]["correct"],
        summary["full"]["cells"],
    )
    prose = text[text.rindex("\n- ") :].split("\n\n", 1)[1]  # the paragraph after the paired lines
    for precision in ("k8v4", "k4v8", "int4"):  # the answer log p each loses against full precision
        assert f"{-summary[precision]['mean_logprob_change']:.3f}" in prose, precision


# --- long contexts (docs/long-contexts.md) ---------------------------------------------------------------


def test_prefill_modes_table_is_the_reports():
    page, report = _page("long-contexts.md"), _report("prefill_modes.json")
    at, rows = _table(
        page,
        ["precision", "needle log p full", "exact", "chunked", "chunked - exact", "drift JS exact", "JS chunked"]
        + ["logit KL exact", "logit KL chunked", "KL chunked/exact"],
    )
    _says_date(page, at, report["provenance"]["date"])
    for s, cells in zip(report["summary"], rows, strict=True):
        assert cells[0] == f"`{s['precision']}`"
        for cell, key in zip(
            cells[1:5], ["log p full", "log p exact", "log p chunked", "log p chunked - exact"], strict=True
        ):
            assert _printed(cell, s[key]), (cell, key)
        for cell, key in zip(cells[5:9], ["JS exact", "JS chunked", "logit KL exact", "logit KL chunked"], strict=True):
            assert _printed(cell, s[key]), (cell, key)
        assert _printed(cells[9], s["logit KL chunked/exact"])


def test_scale_table_is_the_reports_table():
    report = _report("scale.json")
    _has_table(_page("long-contexts.md"), ScaleReport.from_json(report).markdown(), report["date"])
    rows = {r["tokens"]: r for r in report["rows"] if r["precision"] == "int4"}
    assert set(rows) >= {16384, 32768, 65536}
    for r in rows.values():
        assert r["peak_bytes"] == r["weights_bytes"] + r["cache_bytes"] + r["workspace_bytes"]


# --- perplexity (docs/perplexity.md) ---------------------------------------------------------------------


def test_ppl_table_is_the_reports_table():
    page, report = _page("perplexity.md"), _report("ppl.json")
    _has_table(page, markdown_table(PplReport.from_json(report)), report["date"])
    assert report["command"] in page
    assert report["results"][0]["precision"] == "full" and report["results"][0]["delta_vs_full"] == 0


# --- kernels (docs/kernels.md) ---------------------------------------------------------------------------


def test_gpu_run_figures_match_its_report():
    """The first GPU run's figures in docs/kernels.md come from assets/reports/gpu/."""
    gpu = ROOT / "assets" / "reports" / "gpu"
    report = json.loads((gpu / "gpu_attention.json").read_text())
    goals = report["goals"]
    text = _section(_page("kernels.md"), "## First GPU run", "## The methods' layouts in the kernel")
    assert _quotes(text, goals["int4_speedup_64k_b8"]["measured"], 2, "x of SDPA")
    assert _quotes(text, goals["int8_speedup_64k_b8"]["measured"], 2, "x (goal")
    assert _quotes(text, goals["int4_speedup_64k_b8"]["best_launch_setting"]["speedup"], 2, "x")
    assert _quotes(text, goals["quantize_fraction_of_copy"]["measured"], 2, " of copy bandwidth")
    assert re.search(r"62 passed, 4 skipped", (gpu / "gpu_tests.txt").read_text()) and "62 passed, 4 skipped" in text


def test_methods_compile_table_is_the_compile_report():
    """The methods' sm_90 compile table: registers, spills and instructions per token from the shipped report."""
    page, report = _page("kernels.md"), _report("compile_sm90_quick.json")
    assert report["command"] in page
    at, rows = _table(
        page,
        [
            "decode variant (head_dim 128, 16 query rows)",
            "key axis",
            "registers",
            "spills",
            "warp instructions per token",
        ],
    )
    _says_date(page, at, report["date"])
    decode = {
        (r["format"], r["axis"]): r
        for r in report["rows"]
        if r["kernel"] == "decode" and r["head_dim"] == 128 and r.get("block_m") == 16 and "half" not in r
    }
    assert rows[0][:2] == ["k:int4 v:int4", "channel"]  # the plain codes first, as the yardstick
    assert len(rows) == 1 + sum("method" in r for r in decode.values())
    for fmt, axis, registers, spills, issue in rows:
        r = decode[(fmt, axis)]
        assert int(registers) == r["registers"] and int(spills) == r["spill_stores"] == 0
        assert _printed(issue, r["issue_per_token"])


@pytest.mark.parametrize(
    "name,first",
    [
        ("compile_sm90_quick.json", "goal-point variant"),
        ("compile_sm90_quick_triton3.6.json", "goal-point variant, triton 3.6"),
    ],
)
def test_goal_point_loop_table_is_the_compile_report(name, first):
    """The goal-point variants' loop mix against a memory-bound loop's budgets, from the shipped compile reports
    (triton 3.9, and 3.6: the device machine's)."""
    page, report = _page("kernels.md"), _report(name)
    header = [first, "tile (warps)", "registers", "warps per SM", "loop instructions", "moves", "PRMT"]
    header += ["shared loads / stores", "barriers", "MMA", "global loads (async copies)", "spills", "issue floor ms"]
    at, rows = _table(page, [*header, "memory floor ms"])
    _says_date(page, at, report["date"], within=6000)
    goal = {r["format"]: r for r in report["rows"] if "goal_floors" in r}
    assert [row[0] for row in rows] == list(goal)
    for fmt, tile, regs, warps, loop, moves, prmt, shared, barriers, mma, loads, spills, issue, memory in rows:
        r, m = goal[fmt], goal[fmt]["loop_mix"]
        assert tile == f"{r['consts']['BLOCK_N']} ({r['num_warps']})" and int(spills) == r["spill_stores"]
        assert (int(regs), int(warps), int(loop)) == (r["registers"], r["warps_per_sm"], r["loop_instructions"])
        assert (int(moves), int(prmt), int(barriers), int(mma)) == (m["moves"], m["prmt"], m["barriers"], m["mma"])
        assert shared == f"{m['shared_loads']} / {m['shared_stores']}"
        assert loads == f"{m['global_loads']} ({m['async_copies']})"
        assert _printed(issue, r["goal_floors"]["issue_ms"]) and _printed(memory, r["goal_floors"]["memory_ms"])


# --- KVQuant's methods (docs/methods.md) -----------------------------------------------------------------


def test_methods_tables_are_the_ablation_report():
    """The methods page: ablation grid, live memory and decode speed from assets/reports/ablation.json."""
    page, report = _page("methods.md"), AblationReport.from_json(_report("ablation.json"))
    for table in (ablation.markdown(report), report.memory.markdown(), report.decode.markdown()):
        _has_table(page, table, report.ppl.date)
    assert report.ppl.command in page
    for row in report.memory.results:
        assert row.bytes == row.formula_bytes  # the live cache agrees with the layout formula to the byte
    for check in report.checks:  # each claim with its verdict over resampled text (kvdemo.ppl's bootstrap)
        assert check.verdict is not None and check.line() in page
    recomputed = ppl.ablation_checks(report.ppl.results, report.ppl.blocks)
    assert recomputed == report.checks  # the verdicts follow from the per-block figures the report keeps


def test_oracle_codebooks_table_is_its_report_beside_the_ablation():
    """The "is the calibration the limit?" table: the `ppl --codebooks` report (levels fitted on the scored text)
    beside the ablation's cells with the shipped levels, both scored on the same text (full precision equal)."""
    page = _page("methods.md")
    oracle, shipped = _report("ppl_oracle_codebooks.json"), _report("ablation.json")
    table = codebooks_markdown(PplReport.from_json(shipped), PplReport.from_json(oracle), "shipped", "oracle")
    _has_table(page, table, oracle["date"])
    assert oracle["command"] in page and "--codebooks /tmp/oracle/heldout.safetensors" in oracle["command"]
    assert "calibrate --text held-out --tokens 4096 --out /tmp/oracle/heldout.safetensors" in page
    assert "the text kvdemo ppl scores" in oracle["codebooks"] and "4096 tokens" in oracle["codebooks"]
    assert oracle["results"][0]["ppl"] == shipped["results"][0]["ppl"]  # the same text, the same reference
    kl = {r["precision"]: r["logit_kl"] for r in oracle["results"]}
    assert kl["nuq3:o1"] > kl["int4"]  # the verdict the page states: the 3-bit gap is not the calibration's


def test_kv_split_table_and_lines_are_its_report():
    """The "Keys or values" section: the `ppl --kv-split` report's table and one line per precision, its splits
    recomputed from its rows and blocks, and the precisions it shares with the ablation scored as the ablation
    scored them (the same text, protocol and codes)."""
    page, split = _page("methods.md"), KvSplitReport.from_json(_report("ppl_kv_split.json"))
    report, grid = _report("ppl_kv_split.json"), _report("ablation.json")
    assert report["command"] in page
    _has_table(page, split.markdown(), report["date"])
    for line in split.lines():
        assert line in page
    assert split.splits == [ppl.split_summary(split.ppl, s.roles) for s in split.splits]
    theirs = {r["precision"]: r for r in grid["results"]}
    shared = [r for r in report["results"] if r["precision"] in theirs]
    assert len(shared) >= 5  # full, int4, int3, nuq4:o1, nuq3:o1, ...
    for r in shared:
        assert (r["ppl"], r["logit_kl"]) == (theirs[r["precision"]]["ppl"], theirs[r["precision"]]["logit_kl"])


def test_kv_split_prose_figures_are_its_report():
    """Figures the "Keys or values" section quotes: the shares' ranges, the KL and deltas it names, the floor of
    both parts at int8, and the two bit moves' verdicts."""
    report = _report("ppl_kv_split.json")
    text = _section(_page("methods.md"), "## Keys or values: where the loss sits", "## Memory and decode speed")
    keys = [s["kl_share"]["keys alone"] for s in report["splits"]]
    values = [s["kl_share"]["values alone"] for s in report["splits"]]
    both = [k + v for k, v in zip(keys, values, strict=True)]
    for shares in (keys, values, both):  # "keys alone reach 76% to 88% ..."
        assert f"{min(shares):.0%} to {max(shares):.0%}" in text
    kl = {r["precision"]: r["logit_kl"] for r in report["results"]}
    delta = {r["precision"]: r["delta_vs_full"] for r in report["results"]}
    for name in ("knuq3v8:o1", "k4v8", "k8vnuq3:o1", "k8v4"):
        assert f"{kl[name]:.2e}" in text, name
    for name in ("k2v4", "knuq2vnuq4:o1"):
        assert f"{name} {delta[name]:+.3f}" in text
    floor = max(kl[s["roles"]["both at int8"]] for s in report["splits"])
    assert f"{floor:.2e}" in text[: text.index("|")]  # the int8 floor, quoted above the table
    verdicts = {c["precision"]: c["verdict"] for s in report["splits"] for c in s["comparisons"]}
    assert verdicts["knuq4vnuq2:o1"] == verdicts["k4v2"] == "higher"  # "both settle worse"


# --- the 2-bit methods on the passkey (docs/methods-passkey.md) -------------------------------------------


def test_methods_passkey_table_is_the_needle_report():
    """The passkey grid (nuq2:o1 against int2, with and without the fp16 sink)."""
    page, report = _page("methods-passkey.md"), _report("needle_passkey.json")
    assert report["kind"] == "passkey" and report["provenance"]["command"] in page
    at, rows = _table(page, ["precision", "passkey found", "mean log p", "vs full", "agree with full"])
    _says_date(page, at, report["provenance"]["date"][:10])
    summary = {s["precision"]: s for s in report["summary"]}
    assert [cells[0] for cells in rows] == [s["precision"] for s in report["summary"]]
    for precision, found, logp, change, agree in rows:
        s = summary[precision]
        assert _fraction(found) == (s["correct"], s["cells"]) and _printed(logp, s["mean_answer_logprob"])
        if precision == "full":
            assert change == agree == ""
        else:
            assert _printed(change, s["mean_logprob_change"]) and _fraction(agree) == (s["agree_with_full"], s["cells"])


def test_oracle_codebooks_passkey_table_is_its_report_beside_the_passkey_grid():
    """The passkey grid rerun with the oracle codebooks (`needle --codebooks`), beside the shipped grid's rows."""
    from kvdemo.cli.needle import codebooks_markdown

    page = _page("methods-passkey.md")
    oracle, shipped = _report("needle_passkey_oracle_codebooks.json"), _report("needle_passkey.json")
    grids = NeedleGrid.from_json(shipped), NeedleGrid.from_json(oracle)
    _has_table(page, codebooks_markdown(*grids, "shipped", "oracle"), oracle["provenance"]["date"])
    assert oracle["provenance"]["command"] in page and "--codebooks" in oracle["provenance"]["command"]
    assert "the text kvdemo ppl scores" in oracle["codebooks"]
    assert (oracle["lengths"], oracle["depths"], oracle["seed"]) == (
        shipped["lengths"],
        shipped["depths"],
        shipped["seed"],
    )
    full = {(r["length"], r["depth"]): r["answer"] for r in oracle["rows"] if r["precision"] == "full"}
    assert full == {(r["length"], r["depth"]): r["answer"] for r in shipped["rows"] if r["precision"] == "full"}


def test_passkey_repeats_table_verdict_and_differences_are_the_repeats_report():
    """The passkey grid ten times (`needle --repeats 10`): its table, the 13/15 bar judged on all runs,
    the paired differences the page states, and its seed-0 runs equal to the one-grid report, answer for answer."""
    page = _page("methods-passkey.md")
    report, once = _report("needle_passkey_repeats.json"), _report("needle_passkey.json")
    grid = NeedleGrid.from_json(report)
    assert report["repeats"] == 10 and report["provenance"]["command"] in page
    _has_table(page, repeats_markdown(grid.rows, grid.repeats), report["provenance"]["date"])
    assert report["summary"] == needle.summarize(grid.rows)  # the summary follows from the rows
    summary = {s["precision"]: s for s in report["summary"]}
    text = _section(page, "## The passkey grid, ten times", "## Where retrieval breaks: the keys")
    assert needle.found_line(needle.found_check(summary["nuq2:o1"], 13, 15)) in text
    stated = _paired_lines(text)
    assert len(stated) >= 4
    for a, b, value in stated:
        assert needle.difference_line(needle.paired_difference(grid.rows, a, b, value)) in text
    timing = {"prefill_s", "seconds", "seed"}
    first = [{k: v for k, v in r.items() if k not in timing} for r in report["rows"] if r["seed"] == report["seed"]]
    assert first == [{k: v for k, v in r.items() if k not in timing} for r in once["rows"]]


def test_passkey_kv_split_table_and_lines_are_its_report():
    """2-bit keys alone and 2-bit values alone on the ten passkey grids: the table, the bar lines and the
    paired lines against nuq2:o1 (its rows from the ten-grid report: the same needles, seed by seed)."""
    page = _page("methods-passkey.md")
    report, both = _report("needle_passkey_kv_split.json"), _report("needle_passkey_repeats.json")
    grid, both_grid = NeedleGrid.from_json(report), NeedleGrid.from_json(both)
    assert report["provenance"]["command"] in page
    _has_table(page, repeats_markdown(grid.rows, grid.repeats), report["provenance"]["date"])
    assert report["summary"] == needle.summarize(grid.rows)
    needles = [(r["length"], r["depth"], r["seed"], r["expected"]) for r in report["rows"] if r["precision"] == "full"]
    assert needles == [
        (r["length"], r["depth"], r["seed"], r["expected"]) for r in both["rows"] if r["precision"] == "full"
    ]
    summary = {s["precision"]: s for s in report["summary"]}
    text = _section(page, "## Where retrieval breaks: the keys", "## Is the key code the limit?")
    for precision in ("knuq2v8:o1", "k8vnuq2:o1"):
        assert needle.found_line(needle.found_check(summary[precision], 13, 15)) in text
    rows = [r for r in both_grid.rows if r.precision != "full"] + grid.rows
    stated = _paired_lines(text)
    assert len(stated) >= 2
    for a, b, value in stated:
        assert needle.difference_line(needle.paired_difference(rows, a, b, value)) in text


def test_scalar_floor_tables_and_figures_are_its_report():
    """bench/scalar_floor.py's oracle key code: both tables as its `markdown` prints them, the command and
    date, the passkey pairing and Gaussian figures the page quotes, and its knuq2v8:o1 runs equal to the key/value
    split's."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    import scalar_floor

    page = _page("methods-passkey.md")
    report, split = _report("scalar_floor.json"), _report("needle_passkey_kv_split.json")
    first, second = scalar_floor.markdown(report).split("\n\n")
    _has_table(page, first, report["date"])
    assert second in page, "the page's scalar floor passkey table differs from the report"
    assert report["command"] in page
    text = _section(page, "## Is the key code the limit?")
    pair = report["passkey"]["oracle_vs_nuq2"]
    low, high = pair["low"], pair["high"]
    assert f"{pair['difference']:+.1%} (95% {low:+.1%}..{high:+.1%}, over {pair['runs']} runs)" in text
    g = {r["keys"]: r["relative_mse"] for r in report["gaussian"]["rows"]}
    for value in (g["int4"], g["oracle"], g["nuq3:o1"], report["gaussian"]["distortion_rate_3_bits"]):
        assert f"{value:.4f}" in text
    timing = {"prefill_s", "seconds"}
    mine = [
        {k: v for k, v in r.items() if k not in timing}
        for r in report["passkey"]["rows"]
        if r["precision"] == "knuq2v8:o1"
    ]
    theirs = [
        {k: v for k, v in r.items() if k not in timing}
        for r in split["rows"]
        if r["precision"] == "knuq2v8:o1" and r["seed"] < report["passkey"]["repeats"]
    ]
    assert mine == theirs


def test_host_overhead_figures_are_the_report():
    """docs/kernels.md's host time per decode-attention call, before and after: assets/reports/host_overhead.json."""
    runs = {r["label"]: r for r in _report("host_overhead.json")["runs"]}
    page = _page("kernels.md")
    section = page[page.index("## The host side of a decode step") : page.index("## Checks, with and without a GPU")]
    assert f"(commit {runs['before']['commit']}) and after ({runs['after']['commit']})" in section
    assert runs["after"]["date"] in section
    before = {r["precision"]: r["us_per_call"] for r in runs["before"]["rows"]}
    for row in runs["after"]["rows"]:
        name = row["precision"]
        assert f"{name} {before[name]:.1f} -> {row['us_per_call']:.1f} us" in section, name


# --- llama.cpp beside kvdemo (docs/llamacpp.md, README) ----------------------------------------------------


def test_llamacpp_tables_are_their_report():
    from kvdemo.results.ppl import side_by_side_markdown

    report = _report("ppl_llamacpp.json")
    ppl_report = PplReport.from_json(report)
    page = _page("llamacpp.md")
    _has_table(page, side_by_side_markdown(ppl_report), report["date"])
    _has_table(page, markdown_table(ppl_report), report["date"])
    assert report["command"] in page and report["engine"]["engine"].split()[-1] in page  # the version
    rows = {r["precision"]: r for r in report["results"]}
    assert (
        rows["llama.cpp:f16"]["delta_vs_full"] == 0 and f"llama.cpp's f16: {rows['llama.cpp:f16']['ppl']:.3f}" in page
    )
    readme = _page("README.md")
    _has_table(readme, side_by_side_markdown(ppl_report), report["date"])


def test_llamacpp_needle_table_is_its_grid():
    from kvdemo.results.needle import summary_markdown

    report = _report("needle_llamacpp/needle.json")
    grid = NeedleGrid.from_json(report)
    page = _page("llamacpp.md")
    _has_table(page, summary_markdown(grid.rows), report["provenance"]["date"][:10])
    assert report["provenance"]["command"] in page
    assert {"llama.cpp:f16", "llama.cpp:q4_0", "int4"} <= set(grid.precisions)


def test_llamacpp_probe_table_is_its_report():
    from kvdemo.results.probe import ProbeReport, rates_markdown

    report = _report("probe_llamacpp.json")
    page = _page("llamacpp.md")
    _has_table(page, rates_markdown(ProbeReport.from_json(report)), report["provenance"]["date"][:10])
    assert report["provenance"]["command"] in page and "--llamacpp f16,q4_0" in report["provenance"]["command"]
    checks = report["in_process_checks"]
    assert len(checks) == sum(c["found"] is not None for c in report["cells"])  # every answered cell, checked
