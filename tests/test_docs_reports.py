"""README's measured tables against the report files shipped in assets/reports/: every number a table
prints must be the report's value at the printed precision, and the text above each table names the
report's date. Reads files only (no model), so it runs in well under a second."""

import json
import re
import statistics
from pathlib import Path

from kvdemo import bench, needle, ppl
from kvdemo.cli.needle import repeats_markdown

ROOT = Path(__file__).resolve().parent.parent
REPORTS = ROOT / "assets" / "reports"
README = (ROOT / "README.md").read_text()


def _report(name: str) -> dict:
    return json.loads((REPORTS / name).read_text())


def _tables() -> list[tuple[int, list[str], list[list[str]]]]:
    """Every markdown table in README: (character offset, header cells, body rows of cells)."""
    out, lines, offset, i = [], README.split("\n"), [0], 0
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


def _table(header: list[str]) -> tuple[int, list[list[str]]]:
    found = [(at, rows) for at, head, rows in _tables() if head == header]
    assert len(found) == 1, f"README should hold exactly one table with header {header}, found {len(found)}"
    return found[0]


def _printed(cell: str, value: float) -> bool:
    """Whether `cell` (e.g. "1.08e-05", "+0.012", "49,397,760", "0.50x") is `value` at the cell's precision."""
    text = cell.replace(",", "").rstrip("x").lstrip("+").strip()
    if "e" in text:
        digits = len(text.split("e")[0].partition(".")[2])
        return float(f"{value:.{digits}e}") == float(text)
    digits = len(text.partition(".")[2])
    return f"{value:.{digits}f}".replace("-0.000", "0.000") == text.replace("-0.000", "0.000")


def _says_date(at: int, date: str, within: int = 2500) -> None:
    """The README text just above a table (the paragraph introducing it) names the report's date."""
    assert date[:10] in README[max(0, at - within) : at], f"the text above the table at {at} should say {date[:10]}"


def _fraction(cell: str) -> tuple[int, int]:
    a, b = cell.split("/")
    return int(a), int(b)


# --- bench -------------------------------------------------------------------------------------------


def test_bench_table_is_the_reports_table():
    """The README carries the bench report's table as `kvdemo.bench.markdown_table` prints it."""
    report = _report("bench.json")
    table = bench.markdown_table(report).split("\n\n")[0]
    assert table in README, "README's table for assets/reports/bench.json differs from the report"
    _says_date(README.index(table), report["machine"]["date"])


def test_key_vs_value_table_is_the_reports():
    report = _report("bench.json")
    text = bench.markdown_table(report)
    block = text[text.index("| measure | 4-bit keys |") :].split("\n\n")[0].strip()
    assert block in README


def test_decode_window_table_matches_the_reports():
    at, rows = _table(
        ["report", "context", "contender", "decode vs full", "flushes in window", "step ms", "flush step ms"]
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
    _says_date(at, _report("bench.json")["machine"]["date"])


# --- memory, drift, needle ----------------------------------------------------------------------------


def test_memory_table_matches_memory_json():
    report = _report("memory.json")
    at, rows = _table(["precision", "bytes", "ratio vs fp16", "bits/element"])
    results = {r["precision"]: r for r in report["results"]}
    assert len(rows) == len(results)
    for cells in rows:
        r = results[cells[0].split()[0]]
        assert int(cells[1].replace(",", "")) == r["bytes"], cells
        assert _printed(cells[2], r["ratio_vs_fp16"]), cells
        assert _printed(cells[3].split()[0], r["bits_per_element"]), cells
    _says_date(at, report["provenance"]["date"])
    assert report["provenance"]["command"] in README


def test_drift_table_matches_drift_json():
    report = _report("drift.json")
    at, rows = _table(["precision", "mean JS", "mean KL", "top-10 overlap", "output cosine", "logit KL mean"])
    results = {r["precision"]: r for r in report["results"]}
    assert len(rows) == len(results)
    for cells in rows:
        r = results[cells[0]]
        values = [r["mean_js"], r["mean_kl"], r["topk_overlap"], r["output_cosine"], statistics.fmean(r["logit_kl"])]
        assert all(_printed(c, v) for c, v in zip(cells[1:], values, strict=True)), cells
    _says_date(at, report["provenance"]["date"])
    assert report["provenance"]["command"] in README
    head = README[max(0, at - 600) : at]
    assert f"prompt {report['prompt_tokens']} tokens, {report['new_tokens']} queries" in head


def test_drift_sink_claim_matches_drift_json():
    """ "`:s4` ... cuts int4's logit KL N x": int4's mean logit KL over int4:s4's."""
    results = {r["precision"]: r for r in _report("drift.json")["results"]}
    claim = re.search(r"cuts int4's logit KL ([\d.]+)x", README)
    assert claim, "README's drift section should state the sinks' effect"
    ratio = statistics.fmean(results["int4"]["logit_kl"]) / statistics.fmean(results["int4:s4"]["logit_kl"])
    assert _printed(claim.group(1), ratio)


def _paired_lines(text: str) -> list[tuple[str, str, str]]:
    """(a, b, value) of every "- A against B: found rate|answer log p ..." line in `text`."""
    values = {label: value for value, label in needle.PAIRED_VALUES.items()}
    found = re.findall(r"^- (\S+) against (\S+): (found rate|answer log p) ", text, re.M)
    return [(a, b, values[label]) for a, b, label in found]


def _section(start: str, end: str) -> str:
    at = README.index(start)
    return README[at : README.index(end, at)]


def test_multikey_grid_is_its_repeats_report():
    """The needle section's multikey grid (`--repeats 10`): table, paired lines and the claims in its prose."""
    report = _report("needle_multikey.json")
    assert report["kind"] == "multikey" and report["repeats"] == 10
    assert report["provenance"]["command"] in README
    table = repeats_markdown(report)
    assert table in README, "README's multikey table differs from assets/reports/needle_multikey.json"
    _says_date(README.index(table), report["provenance"]["date"])
    assert report["summary"] == needle.summarize(report["rows"])
    text = _section("Measured on the embedded model (`assets/reports/needle_multikey.json`", "## Precision strings")
    stated = _paired_lines(text)
    assert len(stated) >= 6
    for a, b, value in stated:
        assert needle.difference_line(needle.paired_difference(report["rows"], a, b, value)) in text
    summary = {s["precision"]: s for s in report["summary"]}
    misses = summary["full"]["cells"] - summary["full"]["correct"]
    assert f"Full precision itself misses {misses} of the {summary['full']['cells']} needles" in text
    for precision in ("k8v4", "k4v8", "int4"):  # "... cost 0.031 nats, ... 0.161 and ... 0.206"
        assert f"{-summary[precision]['mean_logprob_change']:.3f}" in text.split("The answer's log-prob does move")[1]


def test_drift_key_value_claims_match_drift_json():
    """The drift section's key-vs-value ratios: attention JS and the end-to-end logit KL, k4v8 over k8v4."""
    results = {r["precision"]: r for r in _report("drift.json")["results"]}
    js = re.search(r"move attention ([\d.]+)x more", README)
    kl = re.search(r"the next-token logit KL above gives ([\d.]+)x", README)
    assert js and kl, "README's drift section should state both ratios"
    assert _printed(js.group(1), results["k4v8"]["mean_js"] / results["k8v4"]["mean_js"])
    ratio = statistics.fmean(results["k4v8"]["logit_kl"]) / statistics.fmean(results["k8v4"]["logit_kl"])
    assert _printed(kl.group(1), ratio)


def test_bench_prose_figures_match_the_report():
    """Figures the bench section quotes outside its tables: goals, set-up, keys vs values, scheme vs code."""
    report = _report("bench.json")
    speed = re.search(r"not met in that run\*\*: ([\d.]+)x", README)
    assert speed and _printed(speed.group(1), report["goals"][1]["measured"]["speedup"])
    setup = {r["contender"]: r["setup_s"] for r in report["results"]}["hf-quanto-int4"]
    assert re.search(rf"quanto's set-up \(`setup_s`\) was\s+{setup:.2f} s there", README)
    sv = report["scheme_vs_implementation"]
    k = "kvdemo-int4:ktoken:g64"
    m = re.search(r"`kvdemo-int4:ktoken:g64` ran at ([\d.]+)x `hf-quanto-int4` and ([\d.]+)x `kvdemo-int4`", README)
    assert m and _printed(m.group(1), sv[f"decode speed {k} / hf-quanto-int4"])
    assert _printed(m.group(2), sv[f"decode speed {k} / kvdemo-int4"])
    kv = re.search(r"4-bit keys cost ([\d.]+)x the logit KL of 4-bit values at 4k", README)
    assert kv and _printed(kv.group(1), report["key_vs_value"]["measures"]["logit_kl@4096"]["ratio"])


# --- long contexts and measured headroom (kvdemo.scale) --------------------------------------------------


def test_measured_headroom_table_is_the_reports_table():
    from kvdemo.cli.memory import measured_markdown

    report = _report("headroom_measured.json")
    table = measured_markdown(report)
    assert table in README, "README's measured-headroom table differs from assets/reports/headroom_measured.json"
    _says_date(README.index(table), report["date"])
    for row in report["results"]:  # the issue's bar: measured within 5% of the formula
        assert abs(row["measured_vs_formula"] - 1) <= 0.05, row


def test_prefill_modes_table_is_the_reports():
    report = _report("prefill_modes.json")
    at, rows = _table(
        ["precision", "needle log p full", "exact", "chunked", "chunked - exact", "drift JS exact", "JS chunked"]
        + ["logit KL exact", "logit KL chunked", "KL chunked/exact"]
    )
    _says_date(at, report["provenance"]["date"])
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
    from kvdemo.cli.scale import markdown_table

    report = _report("scale.json")
    table = markdown_table(report)
    assert table in README, "README's scale table differs from assets/reports/scale.json"
    _says_date(README.index(table), report["date"])
    rows = {r["tokens"]: r for r in report["rows"] if r["precision"] == "int4"}
    assert set(rows) >= {16384, 32768, 65536}
    for r in rows.values():
        assert r["peak_bytes"] == r["weights_bytes"] + r["cache_bytes"] + r["workspace_bytes"]


def test_ppl_table_is_the_reports_table():
    from kvdemo.cli.ppl import markdown_table

    report = _report("ppl.json")
    table = markdown_table(report)
    assert table in README, "README's ppl table differs from assets/reports/ppl.json"
    _says_date(README.index(table), report["date"])
    assert report["command"] in README
    assert report["results"][0]["precision"] == "full" and report["results"][0]["delta_vs_full"] == 0


def test_gpu_run_figures_match_its_report():
    """The first GPU run's figures in README come from assets/reports/gpu/."""
    gpu = ROOT / "assets" / "reports" / "gpu"
    report = json.loads((gpu / "gpu_attention.json").read_text())
    goals = report["goals"]
    m = re.search(r"int4 ([\d.]+)x of SDPA.*?int8 ([\d.]+)x \(goal", README, re.S)
    assert m and _printed(m.group(1), goals["int4_speedup_64k_b8"]["measured"])
    assert _printed(m.group(2), goals["int8_speedup_64k_b8"]["measured"])
    best = re.search(r"the best launch\s+setting of the sweep gave ([\d.]+)x", README)
    assert best and _printed(best.group(1), goals["int4_speedup_64k_b8"]["best_launch_setting"]["speedup"])
    q = re.search(r"at ([\d.]+) of copy bandwidth", README)
    assert q and _printed(q.group(1), goals["quantize_fraction_of_copy"]["measured"])
    assert re.search(r"62 passed, 4 skipped", (gpu / "gpu_tests.txt").read_text()) and "62 passed, 4 skipped" in README


def test_production_table_is_the_mapping():
    """README's production table is what `production_settings(spec, 64)` prints, cell by cell."""
    from kvdemo.production import production_settings

    _, rows = _table(["precision", "vLLM `--kv-cache-dtype`", "SGLang `--kv-cache-dtype`",
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


def test_methods_tables_are_the_ablation_report():
    """The methods section (issue 17): ablation grid, live memory and decode speed from assets/reports/ablation.json."""
    from kvdemo.cli.ppl import ablation_markdown, check_line, memory_markdown, speed_markdown

    report = _report("ablation.json")
    for table in (ablation_markdown(report), memory_markdown(report), speed_markdown(report)):
        assert table in README, "README's methods tables differ from assets/reports/ablation.json"
    _says_date(README.index(ablation_markdown(report)), report["date"])
    assert report["command"] in README
    for row in report["memory"]["results"]:
        assert row["bytes"] == row["formula_bytes"]  # the live cache agrees with the layout formula to the byte
    for check in report["checks"]:  # each claim with its verdict over resampled text (kvdemo.ppl's bootstrap)
        assert "verdict" in check and check_line(check) in README
    recomputed = ppl.ablation_checks({r["precision"]: r for r in report["results"]}, report["blocks"])
    assert recomputed == report["checks"]  # the verdicts follow from the per-block figures the report keeps


def test_methods_passkey_table_is_the_needle_report():
    """The methods section's passkey grid (issue 17: nuq2:o1 against int2, with and without the fp16 sink)."""
    report = _report("needle_passkey.json")
    assert report["kind"] == "passkey" and report["provenance"]["command"] in README
    at, rows = _table(["precision", "passkey found", "mean log p", "vs full", "agree with full"])
    _says_date(at, report["provenance"]["date"][:10])
    summary = {s["precision"]: s for s in report["summary"]}
    assert [cells[0] for cells in rows] == [s["precision"] for s in report["summary"]]
    for precision, found, logp, change, agree in rows:
        s = summary[precision]
        assert _fraction(found) == (s["correct"], s["cells"]) and _printed(logp, s["mean_answer_logprob"])
        if precision == "full":
            assert change == agree == ""
        else:
            assert _printed(change, s["mean_logprob_change"]) and _fraction(agree) == (s["agree_with_full"], s["cells"])


def test_passkey_repeats_table_verdict_and_differences_are_the_repeats_report():
    """The passkey grid ten times (`needle --repeats 10`): its table, the issue's 13/15 bar judged on all runs,
    the paired differences README states, and its seed-0 runs equal to the one-grid report, answer for answer."""
    report, once = _report("needle_passkey_repeats.json"), _report("needle_passkey.json")
    assert report["repeats"] == 10 and report["provenance"]["command"] in README
    table = repeats_markdown(report)
    assert table in README, "README's passkey repeats table differs from its report"
    _says_date(README.index(table), report["provenance"]["date"])
    assert report["summary"] == needle.summarize(report["rows"])  # the summary follows from the rows
    summary = {s["precision"]: s for s in report["summary"]}
    assert needle.found_line(needle.found_check(summary["nuq2:o1"], 13, 15)) in README
    text = _section("**The passkey grid, ten times.**", "**Where retrieval breaks: the keys.**")
    stated = _paired_lines(text)
    assert len(stated) >= 4
    for a, b, value in stated:
        assert needle.difference_line(needle.paired_difference(report["rows"], a, b, value)) in text
    timing = {"prefill_s", "seconds", "seed"}
    first = [{k: v for k, v in r.items() if k not in timing} for r in report["rows"] if r["seed"] == report["seed"]]
    assert first == [{k: v for k, v in r.items() if k not in timing} for r in once["rows"]]


def test_methods_compile_table_is_the_compile_report():
    """The methods' sm_90 compile table: registers, spills and instructions per token from the shipped report."""
    report = _report("compile_sm90_quick.json")
    assert report["command"] in README
    at, rows = _table(
        [
            "decode variant (head_dim 128, 16 query rows)",
            "key axis",
            "registers",
            "spills",
            "warp instructions per token",
        ]
    )
    _says_date(at, report["date"])
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


def test_oracle_codebooks_table_is_its_report_beside_the_ablation():
    """The "is the calibration the limit?" table: the `ppl --codebooks` report (levels fitted on the scored text)
    beside the ablation's cells with the shipped levels, both scored on the same text (full precision equal)."""
    from kvdemo.cli.ppl import codebooks_markdown

    oracle, ablation = _report("ppl_oracle_codebooks.json"), _report("ablation.json")
    table = codebooks_markdown(ablation, oracle, "shipped", "oracle")
    assert table in README, "README's oracle codebook table differs from its reports"
    _says_date(README.index(table), oracle["date"])
    assert oracle["command"] in README and "--codebooks /tmp/oracle/heldout.safetensors" in oracle["command"]
    assert "calibrate --text held-out --tokens 4096 --out /tmp/oracle/heldout.safetensors" in README
    assert "the text kvdemo ppl scores" in oracle["codebooks"] and "4096 tokens" in oracle["codebooks"]
    assert oracle["results"][0]["ppl"] == ablation["results"][0]["ppl"]  # the same text, the same reference
    kl = {r["precision"]: r["logit_kl"] for r in oracle["results"]}
    assert kl["nuq3:o1"] > kl["int4"]  # the verdict README states: the 3-bit gap is not the calibration's


def test_oracle_codebooks_passkey_table_is_its_report_beside_the_passkey_grid():
    """The passkey grid rerun with the oracle codebooks (`needle --codebooks`), beside the shipped grid's rows."""
    from kvdemo.cli.needle import codebooks_markdown

    oracle, shipped = _report("needle_passkey_oracle_codebooks.json"), _report("needle_passkey.json")
    table = codebooks_markdown(shipped, oracle, "shipped", "oracle")
    assert table in README, "README's oracle passkey table differs from its reports"
    _says_date(README.index(table), oracle["provenance"]["date"])
    assert oracle["provenance"]["command"] in README and "--codebooks" in oracle["provenance"]["command"]
    assert "the text kvdemo ppl scores" in oracle["codebooks"]
    assert (oracle["lengths"], oracle["depths"], oracle["seed"]) == (
        shipped["lengths"],
        shipped["depths"],
        shipped["seed"],
    )
    full = {(r["length"], r["depth"]): r["answer"] for r in oracle["rows"] if r["precision"] == "full"}
    assert full == {(r["length"], r["depth"]): r["answer"] for r in shipped["rows"] if r["precision"] == "full"}


def test_kv_split_table_and_lines_are_its_report():
    """The "Keys or values" section: the `ppl --kv-split` report's table and one line per precision, its splits
    recomputed from its rows and blocks, and the precisions it shares with the ablation scored as the ablation
    scored them (the same text, protocol and codes)."""
    from kvdemo.cli.ppl import split_lines, split_markdown

    report, ablation = _report("ppl_kv_split.json"), _report("ablation.json")
    assert report["command"] in README
    table = split_markdown(report)
    assert table in README, "README's keys-or-values table differs from assets/reports/ppl_kv_split.json"
    _says_date(README.index(table), report["date"])
    for line in split_lines(report):
        assert line in README
    assert report["splits"] == [ppl.split_summary(report, s["roles"]) for s in report["splits"]]
    theirs = {r["precision"]: r for r in ablation["results"]}
    shared = [r for r in report["results"] if r["precision"] in theirs]
    assert len(shared) >= 5  # full, int4, int3, nuq4:o1, nuq3:o1, ...
    for r in shared:
        assert (r["ppl"], r["logit_kl"]) == (theirs[r["precision"]]["ppl"], theirs[r["precision"]]["logit_kl"])


def test_kv_split_prose_figures_are_its_report():
    report = _report("ppl_kv_split.json")
    text = _section("**Keys or values: where the loss sits.**", "Memory: the live cache")
    text = text.split("On this model the keys carry the loss")[1]
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
    assert f"both parts at int8 cost a KL of {floor:.2e} at most" in README
    verdicts = {c["precision"]: c["verdict"] for s in report["splits"] for c in s["comparisons"]}
    assert verdicts["knuq4vnuq2:o1"] == verdicts["k4v2"] == "higher"  # "both settle worse"


def test_passkey_kv_split_table_and_lines_are_its_report():
    """2-bit keys alone and 2-bit values alone on the ten passkey grids: the table, the bar lines and the
    paired lines against nuq2:o1 (its rows from the ten-grid report: the same needles, seed by seed)."""
    report, both = _report("needle_passkey_kv_split.json"), _report("needle_passkey_repeats.json")
    assert report["provenance"]["command"] in README
    table = repeats_markdown(report)
    assert table in README, "README's passkey key/value table differs from its report"
    _says_date(README.index(table), report["provenance"]["date"])
    assert report["summary"] == needle.summarize(report["rows"])
    needles = [(r["length"], r["depth"], r["seed"], r["expected"]) for r in report["rows"] if r["precision"] == "full"]
    assert needles == [
        (r["length"], r["depth"], r["seed"], r["expected"]) for r in both["rows"] if r["precision"] == "full"
    ]
    summary = {s["precision"]: s for s in report["summary"]}
    text = _section("**Where retrieval breaks: the keys.**", "**Is the key code the limit?")
    for precision in ("knuq2v8:o1", "k8vnuq2:o1"):
        assert needle.found_line(needle.found_check(summary[precision], 13, 15)) in text
    rows = [r for r in both["rows"] if r["precision"] != "full"] + report["rows"]
    stated = _paired_lines(text)
    assert len(stated) >= 2
    for a, b, value in stated:
        assert needle.difference_line(needle.paired_difference(rows, a, b, value)) in text


def test_scalar_floor_tables_and_figures_are_its_report():
    """bench/scalar_floor.py's oracle key code: both tables as its `markdown` prints them, the command and
    date, the passkey pairing README states, and its knuq2v8:o1 runs equal to the key/value split's."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    import scalar_floor

    report, split = _report("scalar_floor.json"), _report("needle_passkey_kv_split.json")
    first, second = scalar_floor.markdown(report).split("\n\n")
    assert first in README and second in README, "README's scalar floor tables differ from the report"
    assert report["command"] in README
    _says_date(README.index(first), report["date"])
    text = _section("**Is the key code the limit?**", "## Supported model families")
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
