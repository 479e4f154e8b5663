"""Findings: verdicts computed from the numbers (they flip when the numbers do; no verdict text is a literal),
a tiny run on the embedded model (its cache, its progress in tokens, Cancel keeping what finished), the
shipped report (its JSON through the dataclass unchanged), the HTML offline in headless Chromium with zero
network requests, the PDF's pages, the CLI, the page under AppTest, and custom needles scored after their
own lead-in."""

from __future__ import annotations

import copy
import json
import random
import re
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from kvdemo import layout, needle
from kvdemo.findings import render, run, verdicts
from kvdemo.precision import parse_precision
from kvdemo.progress import Cancelled
from kvdemo.results import findings as results
from kvdemo.results.ablation import load_ablation
from kvdemo.results.findings import Findings, Measurement, NeedleAnswer, Window
from kvdemo.results.kv_split import load_kv_split

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
WINDOWS = [96, 448, 1024, 1952]
LENGTHS = [512, 1024, 2000]
INFO = {"layers": 30, "kv_heads": 3, "head_dim": 64, "dtype": "float32", "max_context": 8192}


def _run(label: str, nll: list[float], needle_lp: list[float], kl: float = 0.0, weights: str = "loaded") -> Measurement:
    """A measurement as `measure_spec` returns it, with its cache bytes from the layout formula."""
    spec = parse_precision(label)
    regions = layout.Layout(spec).regions([2048])
    nbytes = layout.region_bytes(regions, 30, 3, 64, label, 32)["total"]
    return Measurement(
        precision=label,
        spec=spec.to_dict(),
        windows=[Window(s, 64, v, kl) for s, v in zip(WINDOWS, nll, strict=True)],
        needles=[
            NeedleAnswer(length=n, tokens=n, key=k, distance=n - 80, logprob=lp, found=lp > -1)
            for n, lp in zip(LENGTHS, needle_lp, strict=True)
            for k in ("a", "b")
        ],
        cache_bytes=nbytes,
        cache_tokens=2048,
        updates=[2048],
        seconds=1.0,
        weights=weights,
    )


def fake(loss: dict[str, tuple[float, float]] | None = None) -> Findings:
    """A findings report of every default precision: loss[label] = (NLL delta up to 512 tokens, at the end);
    the needle loss follows the same shape (x 10 nats); KL = mean NLL delta."""
    loss = loss or {}
    base_nll, base_lp = [3.0, 2.9, 2.8, 2.8], [-0.2, -0.3, -0.4]
    runs = {}
    for label in verdicts.default_precisions():
        a, b = (0.0, 0.0) if label == "full" else loss.get(label, (0.001, 0.002))
        ramp = [a, a, (a + b) / 2, b]  # the first two windows end by 512 tokens: the short end
        lp_ramp = [-10 * x for x in (a, (a + b) / 2, b)]
        runs[label] = _run(
            label,
            [x + d for x, d in zip(base_nll, ramp, strict=True)],
            [x + d for x, d in zip(base_lp, lp_ramp, strict=True)],
            kl=sum(ramp) / 4,
        )
    stack = {}
    for kv in verdicts.STACK_KV:
        a, b = (0.0, 0.0) if kv == "full" else loss.get(kv, (0.001, 0.002))
        stack[kv] = _run(kv, [x + 0.02 + a for x in base_nll], [x - 0.5 for x in base_lp], weights="int8")
        stack[kv].windows = stack[kv].windows[:2]
    found = Findings(
        model="fake",
        model_info=INFO,
        sizes=run.MEDIUM,
        precisions=verdicts.default_precisions(),
        measurements={"loaded:main": runs, "int8:stack": stack},
        version="findings-1",
        embedded=True,
        text={"stack_prompts": [{"length": 512}, {"length": 1024}]},
        seconds=1.0,
        stopped="done",
    )
    found.claims = verdicts.evaluate(found)
    return found


def judge(found: Findings) -> dict[str, results.Verdict]:
    return {c.id: c.verdict for c in verdicts.evaluate(found)}


# --- verdicts come from the numbers ---------------------------------------------------------------------


def test_key_value_verdict_flips_with_the_numbers():
    keys_worse = judge(fake({"k4v8": (0.05, 0.1), "k8v4": (0.001, 0.002)}))["keys"]
    values_worse = judge(fake({"k4v8": (0.001, 0.002), "k8v4": (0.05, 0.1)}))["keys"]
    assert keys_worse.holds is True and values_worse.holds is False
    assert keys_worse.word == "holds" and values_worse.word == "does not hold"
    assert keys_worse.text != values_worse.text


def test_long_range_verdict_flips_with_the_numbers():
    grows = judge(fake({"int4": (0.001, 0.2)}))["long_range"]
    flat = judge(fake({p: (0.001, 0.002) for p in verdicts.default_precisions()}))["long_range"]
    assert grows.holds is True and "int4" in grows.text
    assert flat.holds is False


def _needle_ramp(found: Findings, label: str, deltas: list[float]) -> Findings:
    """`found` with `label`'s needle answers moved to full's log-prob plus `deltas` (one per prompt length)."""
    full = {(n.length, n.key): n.logprob for n in found.run_of("full").needles}
    by_length = dict(zip(LENGTHS, deltas, strict=True))
    run_ = found.run_of(label)
    run_.needles = [replace(n, logprob=full[(n.length, n.key)] + by_length[n.length]) for n in run_.needles]
    return found


def test_long_range_does_not_hold_when_a_measure_improves_with_length():
    """The shipped int4 case: NLL loss grows past the threshold at the end, but the needle answers get better
    with length (-0.14 nats at 512 tokens, +0.40 at 8000): the numbers do not say loss grows with context."""
    found = _needle_ramp(fake({"int4": (0.004, 0.03)}), "int4", [-0.14, 0.1, 0.40])
    verdict = judge(found)["long_range"]
    assert verdict.holds is False
    assert "Mixed, so not counted: int4" in verdict.text and "needle log p improves with length" in verdict.text
    (row,) = [r for r in verdicts.verdict_long_range(found)[1]["rows"] if r["precision"] == "int4"]
    assert row["long_fail"] and row["improves_with_length"] == ["needle log p"] and not row["holds"]
    # the opposite case: the needle answers get worse with length too, so the claim holds for int4
    worse = _needle_ramp(fake({"int4": (0.004, 0.03)}), "int4", [-0.14, -0.4, -0.9])
    verdict = judge(worse)["long_range"]
    assert verdict.holds is True and "degrades for int4" in verdict.text and "Mixed" not in verdict.text


def test_decision_box_words_follow_the_rule_and_the_numbers():
    """safe / recommended / risky / breaks from the numbers: int4 over the NLL budget at the end is risky,
    the same int4 within it saves the most memory and is recommended; fp8 and int8 pass either way."""
    from kvdemo.findings import decision

    broken = {p: (0.2, 0.3) for p in verdicts.default_precisions()}
    ok = {"fp8": (0.001, 0.002), "int8": (0.001, 0.002)}
    words = {d.precision: d for d in decision.decide(fake(broken | ok | {"int4": (0.004, 0.03)}))}
    assert words["int4"].word == "risky" and "+0.0300 > the 0.01" in words["int4"].why
    assert words["fp8"].word == "recommended" and words["int8"].word == "safe"  # fp8 saves a little more
    assert words["int2"].word == "breaks" and all(":" not in p for p in words)
    assert "+0.0300 at the end" in words["int4"].evidence() and "3.66x smaller than 16-bit" in words["int4"].evidence()
    words = {d.precision: d.word for d in decision.decide(fake(broken | ok | {"int4": (0.001, 0.002)}))}
    assert words["int4"] == "recommended" and words["fp8"] == words["int8"] == "safe"
    # the needle checks: answers that lose log-prob at the longest prompt make a format risky
    lost = _needle_ramp(fake(broken | ok | {"int4": (0.001, 0.002)}), "int4", [0.0, -0.2, -0.6])
    (d,) = [d for d in decision.decide(lost) if d.precision == "int4"]
    assert d.word == "risky" and "needle log p -0.60" in d.why
    assert decision.summary(decision.decide(lost)).startswith("recommended: fp8 · safe: int8 · risky: int4")


def test_axis_sinks_and_tradeoff_follow_the_numbers():
    good = fake({"int4:ktoken": (0.05, 0.05), "int2:ktoken": (0.5, 0.5), "int2": (0.3, 0.3), "int2:s4": (0.1, 0.1)})
    bad = fake({"int4": (0.05, 0.05), "int2": (0.5, 0.5), "int2:ktoken": (0.3, 0.3), "int2:s4": (0.5, 0.5)})
    assert judge(good)["axis"].holds is True and judge(bad)["axis"].holds is False
    assert judge(good)["sinks"].holds is False  # sinks help, the residual pair is equal: not both
    assert judge(bad)["sinks"].holds is False
    tight = results.tradeoff(good, budget=0.0)
    loose = results.tradeoff(good, budget=1.0)
    assert tight["pick"]["precision"] == "full"
    ok = [p for p in loose["points"] if p["needle_delta"] >= -results.THRESHOLDS["needle_ok_nats"]]
    assert loose["pick"]["multiplier"] == max(p["multiplier"] for p in ok)  # the needle threshold holds too
    assert any(p["pareto"] for p in loose["points"])
    assert {"vllm", "llama.cpp", "transformers"} <= set(loose["production"])
    rows = results.production_rows(loose["production"])
    assert [r["engine"] for r in rows][:2] == ["vllm", "sglang"] and all(r["setting"] for r in rows)


def test_no_verdict_text_is_a_literal():
    """Every measured claim's text changes when its numbers change."""
    a = judge(fake({p: (0.01, 0.03) for p in verdicts.default_precisions()}))
    b = judge(fake({p: (0.02, 0.09) for p in verdicts.default_precisions()}))
    for claim in ("long_range", "keys", "axis", "sinks", "stacking"):
        assert a[claim].text != b[claim].text, claim
    small = judge(fake({p: (0.001, 0.003) for p in verdicts.default_precisions()}))["tradeoff"]
    smaller = judge(fake({p: (0.0005, 0.001) for p in verdicts.default_precisions()}))["tradeoff"]
    assert small.text != smaller.text
    cap_a = verdicts.evaluate(fake(), config={"context": 8192})[0].verdict.text
    cap_b = verdicts.evaluate(fake(), config={"context": 65536})[0].verdict.text
    assert cap_a != cap_b


def test_thresholds_are_read_from_the_findings():
    found = fake({"k4v8": (0.004, 0.004), "k8v4": (0.001, 0.001)})
    assert judge(found)["keys"].holds is True
    found.thresholds = found.thresholds | {"noise_nll_nats": 0.1, "noise_kl_nats": 0.1, "noise_needle_nats": 9}
    assert judge(found)["keys"].holds is False


def test_capacity_uses_the_headroom_code_and_the_live_bytes():
    verdict, data = verdicts.verdict_capacity(fake())
    cap = data["capacity"]
    assert verdict.holds is True and cap["multiplier"]["full"] == 1.0
    assert cap["multiplier"]["int4"] > cap["multiplier"]["int8"] > 1.0
    assert all(abs(r["error_vs_formula"]) < 1e-9 for r in cap["live"])
    found = fake()
    found.run_of("int4").cache_bytes *= 1.5  # the cache holds more than the formula says
    assert verdicts.verdict_capacity(found)[0].holds is False


def test_the_tradeoff_figure_follows_the_budget_the_claim_was_judged_with():
    found = fake({p: (0.004, 0.008) for p in verdicts.default_precisions()})
    loose, tight = (verdicts.judged(found, budget=b) for b in (1.0, 0.0))
    from kvdemo.figures.findings import findings_tradeoff_figure

    lines = [[s["y0"] for s in findings_tradeoff_figure(f).to_dict()["layout"]["shapes"]] for f in (loose, tight)]
    assert lines == [[1.0], [0.0]]


def test_shipped_report_verdict_flips_when_its_numbers_change():
    shipped = results.load()
    if shipped is None:
        pytest.skip("no shipped report yet")
    found = Findings.from_json(shipped.to_json())
    runs = found.runs()
    full = runs["full"]
    for label, extra in (("k4v8", 1.0), ("k8v4", 0.0)):
        runs[label].windows = [replace(w, nll=w.nll + extra, kl=extra) for w in full.windows]
        runs[label].needles = [replace(n, logprob=n.logprob - 10 * extra) for n in full.needles]
    assert judge(found)["keys"].holds is True
    runs["k4v8"], runs["k8v4"] = runs["k8v4"], runs["k4v8"]
    assert judge(found)["keys"].holds is False


def test_shipped_report_is_complete():
    shipped = results.load()
    if shipped is None:
        pytest.skip("no shipped report yet")
    assert [c.id for c in shipped.claims] == [c.id for c in verdicts.CLAIMS]
    grid = verdicts.stacking_grid(shipped)
    weights = {r["weights"] for r in grid if r["nll_delta"] is not None}
    kvs = {r["kv"] for r in grid if r["nll_delta"] is not None}
    assert len(weights) >= 2 and len(kvs) >= 4
    for name in ("findings.json", "findings.html"):
        assert (results.REPORT_DIR / name).is_file()


def test_shipped_report_round_trips_through_its_dataclass_unchanged():
    """findings.json -> Findings -> JSON gives the file's JSON back, key for key (order included)."""
    written = json.loads((results.REPORT_DIR / "findings.json").read_text(encoding="utf-8"))
    again = Findings.from_json(written).to_json()
    assert again == written
    assert json.dumps(again) == json.dumps(written)  # the same order of keys
    assert isinstance(Findings.from_json(written).run_of("int4").windows[0], Window)


def test_a_report_saved_loads_back_equal(tmp_path):
    found = fake()
    again = results.load(results.save(found, tmp_path))
    assert again.to_json() == found.to_json()
    assert [c.verdict for c in again.claims] == [c.verdict for c in found.claims]


def test_a_cancelled_run_keeps_its_finished_measurements():
    found = fake()
    skeleton = replace(found, measurements={}, claims=[]).to_json()
    rows = [found.run_of("full").to_json(), found.run_of("int8", "int8").to_json()]
    kept = results.kept_after_cancel(skeleton, rows, 12.5)
    assert kept.stopped == "cancelled" and kept.seconds == 12.5
    assert list(kept.measurements) == ["loaded:main", "int8:stack"]
    assert kept.run_of("int8", "int8") == found.run_of("int8", "int8")


def test_docs_verdict_table_matches_the_shipped_report():
    shipped = results.load()
    if shipped is None:
        pytest.skip("no shipped report yet")
    page = (ROOT / "docs" / "findings.md").read_text(encoding="utf-8")
    for row in render.verdict_rows(shipped):
        assert f"| {row['claim']} | {row['verdict']} | {row['numbers']} |" in page, row["claim"]


def test_docs_carry_the_decision_rule_its_shipped_words_and_the_glossary():
    from kvdemo.findings import decision
    from kvdemo.findings.glossary import GLOSSARY

    shipped = results.load()
    if shipped is None:
        pytest.skip("no shipped report yet")
    page = (ROOT / "docs" / "findings.md").read_text(encoding="utf-8")
    decisions = decision.decide(shipped)
    assert f"On the shipped report (the same files and command as below): {decision.summary(decisions)}." in page
    for row in decision.rows(decisions):
        assert f"| {row['format']} | {row['verdict']} | {row['why']} | {row['evidence']} |" in page
    assert f"over {decision.BREAKS_NLL_NATS} nats/token" in page
    for term, meaning in GLOSSARY.items():
        assert f"| {term} | {meaning} |" in page


# --- files ------------------------------------------------------------------------------------------------


def test_html_is_standalone():
    html = render.render_html(fake())
    assert html.count("<section") == len(verdicts.CLAIMS) + 1 + (load_ablation() is not None) + (
        load_kv_split() is not None
    )  # the claims, KVQuant's methods and keys vs values when shipped, the glossary
    assert "Plotly.newPlot" in html
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=[\"']?https?:", html)  # nothing loaded from a network


def test_html_carries_what_the_page_shows_for_the_chosen_config_without_toolbars():
    """The HTML names the chosen config, has the decision box, the pick's production settings, KVQuant's
    methods, keys vs values and the glossary; no plotly toolbar on screen or in print."""
    from kvdemo.findings import decision
    from kvdemo.findings.glossary import GLOSSARY

    config = results.capacity_config("llama-3.1-70b", "h100-80gb", 2, 32768)
    found = fake()
    html = render.render_html(found, config)
    assert "Capacity and the recommendation for llama-3.1-70b on 2 x h100-80gb, 32,768 tokens" in html
    assert decision.summary(decision.decide(found, config)) in html and "Should I turn it on?" in html
    assert "Production settings of the pick" in html
    if load_ablation() is not None:
        assert "KVQuant's methods at 4, 3 and 2 bits" in html
    if load_kv_split() is not None:
        assert "Keys or values: where the loss sits" in html
    assert all(term in html for term in GLOSSARY)
    assert '"displayModeBar": false' in html and '"displayModeBar": true' not in html
    assert re.search(r"@media print \{[^}]*\}[^@]*\.modebar[^}]*display: none", html)
    assert render.config_line(verdicts.judged(found)) not in html  # the default config is not what it says


def test_the_shipped_pdf_is_offered_only_for_the_shipped_config_and_budget():
    shipped = results.load()
    if shipped is None:
        pytest.skip("no shipped report yet")
    assert render.shipped_pdf_fits(verdicts.judged(shipped, results.DEFAULT_CONFIG), shipped)
    other = results.capacity_config("llama-3.1-70b", "h100-80gb", 2, 32768)
    assert not render.shipped_pdf_fits(verdicts.judged(shipped, other), shipped)
    assert not render.shipped_pdf_fits(verdicts.judged(shipped, None, 0.05), shipped)  # another budget
    assert not render.shipped_pdf_fits(fake(), shipped)


@pytest.mark.browser
def test_pdf_for_another_config_differs_from_the_shipped_one_and_names_it():
    from pypdf import PdfReader

    shipped = results.load()
    if shipped is None or render.chromium() is None:
        pytest.skip("no shipped report or no chromium")
    other = verdicts.judged(shipped, results.capacity_config("llama-3.1-70b", "h100-80gb", 2, 32768))
    pdf = render.pdf_bytes(other)
    assert pdf is not None and pdf != (results.REPORT_DIR / "findings.pdf").read_bytes()
    import io

    text = " ".join(page.extract_text() for page in PdfReader(io.BytesIO(pdf)).pages)
    assert "llama-3.1-70b on 2 x h100-80gb" in text and "Should I turn it on?" in text and "Glossary" in text


def test_claim_7_labels_do_not_overlap_and_stay_in_the_plot():
    """The trade-off chart's labels are annotations placed apart (near-coincident points: fp8 / fp8-e5m2 /
    int8 at ~1.9x, k8v4 / k4v8 at ~2.6x), on the shipped report and on a fake one."""
    from kvdemo.figures.findings import PLOT_PX, _overlap, findings_tradeoff_figure, label_boxes

    for found in filter(None, (results.load(), fake())):
        fig = findings_tradeoff_figure(found)
        assert fig.data[0].mode == "markers"  # no text printed at the points themselves
        labels = [a for a in fig.layout.annotations if a.name == "label"]
        assert sorted(a.text for a in labels) == sorted(
            p["precision"] for p in found.claim("tradeoff").data["tradeoff"]["points"]
        )
        boxes = label_boxes(
            [a.x for a in labels], [a.y for a in labels], [a.text for a in labels], [(a.ax, a.ay) for a in labels],
            list(fig.layout.xaxis.range), list(fig.layout.yaxis.range),
        )  # fmt: skip
        assert not [(i, j) for i in range(len(boxes)) for j in range(i) if _overlap(boxes[i], boxes[j])]
        assert all(b[0] >= 0 and b[1] >= 0 and b[2] <= PLOT_PX[0] and b[3] <= PLOT_PX[1] for b in boxes)


@pytest.mark.browser
def test_html_opens_offline_with_zero_network_requests(tmp_path):
    from playwright.sync_api import sync_playwright

    page_file = tmp_path / "findings.html"
    page_file.write_text(render.render_html(fake()), encoding="utf-8")
    url = page_file.as_uri()
    requests = []
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
        )
        try:
            page = browser.new_page()
            page.on("request", lambda r: requests.append(r.url))
            page.goto(url, wait_until="load", timeout=60_000)
            page.wait_for_selector(".js-plotly-plot .main-svg", timeout=60_000)
            plots = page.locator(".js-plotly-plot").count()
        finally:
            browser.close()
    assert plots >= len(verdicts.CLAIMS)
    assert [r for r in requests if r != url] == []


@pytest.mark.browser
def test_pdf_has_a_page_or_more_per_claim(tmp_path):
    from pypdf import PdfReader

    if render.chromium() is None:
        pytest.skip("no chromium")
    files = render.write_report(fake(), tmp_path)
    pages = len(PdfReader(files["pdf"]).pages)
    assert pages >= len(verdicts.CLAIMS) + 1  # the verdict table, then each claim from a new page
    for name in render.DOC_FIGURES:  # docs/findings.md's figures come from the same command
        png = Path(files[name]).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name


def test_cli_parser_has_findings():
    from kvdemo.cli import build_parser

    args = build_parser().parse_args(
        ["findings", "--quick", "--out", "x", "--precision", "int4,k8v4", "--shard", "1/2"]
    )
    assert args.quick and args.out == "x" and args.precision == "int4,k8v4"
    assert run.parse_shard(args.shard) == (1, 2)
    with pytest.raises(ValueError, match="0 <= k < N"):
        run.parse_shard("2/2")


def test_cli_rejudge_writes_the_files_again_from_the_same_measurements(tmp_path):
    from kvdemo.cli import build_parser
    from kvdemo.cli.findings import run_cli

    found = fake()
    found.claims = []  # a report whose claims are missing or stale: judged again, measurements untouched
    results.save(found, tmp_path / "in")
    args = build_parser().parse_args(
        ["findings", "--rejudge", str(tmp_path / "in" / "findings.json"), "--out", str(tmp_path / "out"), "--no-pdf"]
    )
    out = run_cli(args)
    again = results.load(tmp_path / "out")
    assert again.measurements == results.load(tmp_path / "in").measurements and [c.id for c in again.claims] == [
        c.id for c in verdicts.CLAIMS
    ]
    assert set(out["files"]) == {"json", "html"}


def test_cli_text_reads_the_claims():
    from kvdemo.cli.findings import format_text

    text = format_text(fake().to_json() | {"files": {"json": "out/findings.json"}})
    assert "3. Keys are more sensitive than values: " in text and text.endswith("written: out/findings.json")


def test_units_run_full_precision_first_and_the_grid_last():
    todo = run.units(["int4", "k8v4"], run.MEDIUM)
    assert todo[0] == run.Unit("loaded", "full", "main")
    assert {u.text for u in todo if u.weights == "loaded"} == {"main"}
    assert [u.precision for u in todo if u.weights == "int8"] == list(verdicts.STACK_KV)
    assert {u.precision for u in todo} >= set(verdicts.claim_precisions())


# --- custom needles: scored after their own lead-in -----------------------------------------------------------


def test_custom_needle_answer_follows_its_lead_in():
    text = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
    answer = "eat a sandwich and sit in Dolores Park on a sunny day"
    task = needle.make_task("custom", random.Random(0), text, "What is the best thing to do in San Francisco?", answer)
    assert task.answer_prefix == "The best thing to do in San Francisco is"
    assert needle.lead_in("Cardamom is the secret.", "cardamom") == ""  # the answer opens the needle


# --- on the embedded model ---------------------------------------------------------------------------------

TINY = run.TINY


@pytest.mark.model
def test_tiny_run_measures_and_reuses_its_cache(lm, tmp_path, monkeypatch):
    monkeypatch.setattr("kvdemo.configs.cache_dir", lambda: tmp_path)
    seen = []

    def measure():
        return run.run_findings(lm, ["full", "int2"], sizes=TINY, claims=False, on_progress=seen.append)

    first = measure()
    assert first.stopped == "done" and set(first.runs()) == {"full", "int2"}
    full, int2 = first.run_of("full"), first.run_of("int2")
    assert [w.start for w in full.windows] == [32, 256] and len(full.needles) == 4
    assert all(0 < w.nll < 20 for w in full.windows) and all(n.logprob <= 0 for n in full.needles)
    assert all(w.kl >= 0 for w in int2.windows) and int2.cache_bytes < full.cache_bytes
    assert any(p.what.startswith("measuring") for p in seen)
    assert seen[-1].unit == "tokens" and seen[-1].done == seen[-1].total == 2 * full.cache_tokens
    assert [p.row for p in seen if p.row is not None] == [full, int2]  # each finished measurement, as its row
    assert seen[-1].what.endswith(", 2 of 2 measurements")
    seen.clear()
    again = measure()
    assert not any(p.what.startswith("measuring") for p in seen)  # every measurement came from the cache
    assert seen[-1].total == 0  # nothing left to measure: no time to wait for
    assert again.measurements == first.measurements
    with pytest.raises(Cancelled) as stopped:
        run.run_findings(lm, ["full", "int4"], sizes=TINY, claims=False, should_stop=lambda: True)
    assert stopped.value.partial == []
    calls = []

    def after_full() -> bool:  # stop once the full-precision run has been read from the cache
        calls.append(1)
        return len(calls) > 1

    with pytest.raises(Cancelled) as stopped:
        run.run_findings(lm, ["full", "int4"], sizes=TINY, claims=False, should_stop=after_full)
    assert stopped.value.partial == [full]


@pytest.mark.model
def test_planned_tokens_count_the_work_of_the_plan_without_building_it(lm):
    the_plan = run.plan(lm, sizes=TINY)
    assert run.planned_tokens(lm, TINY) == sum(len(the_plan.text_of(u).ids) for u in the_plan.units)


@pytest.mark.model
def test_findings_page_renders_the_shipped_report():
    from streamlit.testing.v1 import AppTest

    if results.load() is None:
        pytest.skip("no shipped report yet")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=300)
    at.run()
    at.switch_page("app_pages/findings.py").run()
    assert not at.exception, at.exception
    assert "Findings" in at.title[0].value
    headers = [h.value for h in at.header]
    split = load_kv_split()
    methods = ["KVQuant's methods at 4, 3 and 2 bits"] + (["Keys or values: where the loss sits"] if split else [])
    engines = ["kvdemo's formats beside llama.cpp's cache types"]
    assert headers == [c.title for c in verdicts.CLAIMS] + engines + methods + ["Glossary"]
    from kvdemo.results.ppl import load_llamacpp_report, measured_setting, side_by_side

    (beside,) = [d.value for d in at.dataframe if "delta vs own full" in d.value.columns]  # the shipped report's
    assert beside.to_dict("records") == side_by_side(load_llamacpp_report())
    (production,) = [d.value for d in at.dataframe if "measured here" in d.value.columns]
    llama = production.set_index("engine").loc["llama.cpp"]
    assert llama["measured here"] == measured_setting("llama.cpp", llama["setting"])
    said = measured_setting("llama.cpp", "-ctk q4_0 -ctv q4_0 -fa on")  # a row of the shipped report
    assert said.startswith("measured: -ctk q4_0 -ctv q4_0 -fa on with llama-cpp-python ")
    from kvdemo.findings import decision

    (box,) = [d.value for d in at.dataframe if {"format", "verdict", "evidence"} <= set(d.value.columns)]
    assert box.to_dict("records") == decision.rows(decision.decide(results.load()))
    assert any(b.label == "Download PDF report" for b in at.get("download_button"))  # the shipped PDF fits
    table = _verdict_table(at)  # AppTest finds no dataframe by key: by its columns
    assert list(table["verdict"]) == [c.verdict.word for c in verdicts.evaluate(results.load())]
    ablation = load_ablation()  # the methods section: the shipped ablation's claims and their two verdicts
    (claims,) = [d.value for d in at.dataframe if "over resampled text" in d.value.columns]
    assert list(claims["over resampled text"]) == [c.verdict for c in ablation.checks]
    (costs,) = [d.value for d in at.dataframe if "decode vs int4" in d.value.columns]
    speed = {r.precision: r.vs_first for r in ablation.decode.results}
    ratio = {r.precision: round(r.ratio_vs_fp16, 2) for r in ablation.memory.results}
    assert list(costs["precision"]) == list(dict.fromkeys([*ratio, *speed]))
    for _, row in costs.iterrows():  # each figure from its part of the report, blank where it measured none
        name, vs, smaller = row["precision"], row["decode vs int4"], row["x smaller than fp16 @4096"]
        assert vs == speed[name] if name in speed else pd.isna(vs)
        assert smaller == ratio[name] if name in ratio else pd.isna(smaller)
    assert any(ablation.ppl.command in c.value for c in at.caption)
    if split is not None:  # the keys-or-values section: the shipped split's rows and sentences
        (rows,) = [d.value for d in at.dataframe if "stored as" in d.value.columns]
        assert rows.to_dict("records") == split.rows()
        said = [m.value for m in at.markdown]
        assert all(line in said for line in split.lines())
        assert any(split.ppl.command in c.value for c in at.caption)
    at.select_slider(key="findings_context").set_value(131072).run()
    assert not at.exception, at.exception
    assert "131,072" in _verdict_table(at)["numbers"].iloc[0]
    assert any("131,072 tokens per sequence" in m.value for m in at.markdown)  # the config the files carry
    assert not any(b.label == "Download PDF report" for b in at.get("download_button"))  # not the shipped one
    assert at.button(key="findings_make_pdf").label.startswith("Make the PDF for this config")


def _verdict_table(at):
    (table,) = [d.value for d in at.dataframe if {"verdict", "numbers"} <= set(d.value.columns)]
    return table


def test_shipped_verdicts_come_back_when_judged_again():
    shipped = results.load()
    if shipped is None:
        pytest.skip("no shipped report yet")
    again = verdicts.evaluate(copy.deepcopy(shipped))
    assert [c.verdict for c in again] == [c.verdict for c in shipped.claims]


def test_headroom_is_defined_in_the_docs_as_on_the_page():
    from kvdemo.findings.glossary import GLOSSARY

    memory_doc = " ".join((ROOT / "docs" / "memory.md").read_text(encoding="utf-8").split())
    assert GLOSSARY["headroom"].capitalize().split(":")[0].lower() in memory_doc.lower()
    assert f"*Headroom*: {GLOSSARY['headroom']}" in memory_doc
