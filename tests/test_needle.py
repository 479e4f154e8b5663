"""Needle in a haystack: prompt length, depth placement, sentence-boundary insertion, scoring, custom
needles in a user document, the runner's shared prefill, files, figures and the CLI."""

import argparse
import csv
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvdemo import needle, runner, texts
from kvdemo.cli import needle as needle_cli
from kvdemo.figures.needle import FULL_MISSED, needle_difference_figure, needle_figures, needle_heatmap_figure
from kvdemo.precision import parse_precision
from kvdemo.progress import Cancelled
from kvdemo.results.needle import (
    CSV_COLUMNS,
    NeedleGrid,
    NeedleRow,
    difference_line,
    found_check,
    found_line,
    grid_csv,
    load_grid,
    paired_difference,
    repeats_markdown,
    save_grid,
    summarize,
    wilson_interval,
)

ROOT = Path(__file__).resolve().parent.parent
DOC_NEEDLE = "The secret ingredient in the lighthouse keeper's soup is smoked paprika."
DOC_QUESTION = "What is the secret ingredient in the lighthouse keeper's soup?"
DOC_ANSWER = "smoked paprika"


def _args(**kw) -> argparse.Namespace:
    base = dict(
        precision="full,int4",
        lengths="256",
        depths="50",
        kind="passkey",
        haystack_file="",
        needle="",
        question="",
        answer="",
        seed=0,
        repeats=1,
        out="",
        json=True,
        model="embedded",
        device="cpu",
        dtype="float32",
    )
    return argparse.Namespace(**(base | kw))


def _row(precision: str, length: int, depth: float, correct: bool, logprob: float, seed: int = 0) -> NeedleRow:
    return NeedleRow(
        length=length,
        depth=depth,
        precision=precision,
        answer="12345." if correct else "I do not know.",
        correct=correct,
        answer_logprob=logprob,
        expected="12345",
        kind="passkey",
        key="",
        prompt_tokens=length,
        depth_actual=depth,
        needle_position=10,
        answer_tokens=5,
        generated_tokens=3,
        stopped="answer_end",
        prefill_s=0.1,
        seconds=0.2,
        seed=seed,
    )


def _grid(rows: list[NeedleRow], depths: list[float], precisions: list[str], **kw) -> NeedleGrid:
    return NeedleGrid("m", kw.pop("kind", "passkey"), "filler", 0, [1024], depths, precisions, rows, 1.0, **kw)


def _fake_result() -> NeedleGrid:
    rows = [
        _row("full", 1024, 0.0, True, -0.1),
        _row("int4", 1024, 0.0, True, -0.3),
        _row("full", 1024, 100.0, True, -0.2),
        _row("int4", 1024, 100.0, False, -2.5),
    ]
    return _grid(rows, [0.0, 100.0], ["full", "int4"])


# --- scoring -------------------------------------------------------------------------------------------


def test_exact_match_normalisation():
    assert needle.answer_matches("68213", " 68213.")
    assert needle.answer_matches("68213", "The pass key is 68,213!")
    assert needle.answer_matches("Smoked Paprika", "It is smoked  paprika, of course")
    assert needle.answer_matches("smoked paprika", "SMOKED-PAPRIKA")
    assert not needle.answer_matches("68213", "682130")  # whole numbers only
    assert not needle.answer_matches("68213", "6821")
    assert not needle.answer_matches("paprika", "paprikas")
    assert not needle.answer_matches("", "anything")
    assert needle.normalize("  Ａ１,000 \u201cx\u201d ") == "a1000 x"  # NFKC, separators, quotes


def test_summary_counts_agreement_with_full():
    s = {r["precision"]: r for r in summarize(_fake_result().rows)}
    assert s["full"]["accuracy"] == 1.0 and s["full"]["agree_with_full"] == 2
    assert s["int4"]["correct"] == 1 and s["int4"]["agree_with_full"] == 1
    assert s["int4"]["mean_logprob_change"] == pytest.approx(((-0.3 + 0.1) + (-2.5 + 0.2)) / 2)


def test_summary_and_cli_text_say_where_full_precision_itself_missed():
    rows = _fake_result().rows
    rows[2] = _row("full", 1024, 100.0, False, -4.0)  # full misses the depth-100 cell; int4 misses it too
    result = _grid(rows, [0.0, 100.0], ["full", "int4"], kind="custom")
    s = {r["precision"]: r for r in summarize(rows)}
    assert s["full"]["full_missed"] == 1 and s["int4"]["full_missed"] == 1
    text = needle_cli.format_text(result)
    assert "full precision itself missed 1 of 2 cells" in text


def test_wilson_interval_known_values():
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.277540), abs=1e-5)
    assert wilson_interval(5, 10) == pytest.approx((0.23659, 0.76341), abs=1e-5)
    assert wilson_interval(15, 15) == pytest.approx((0.796111, 1.0), abs=1e-5)
    lows = [wilson_interval(k, 30)[0] for k in range(31)]
    assert lows == sorted(lows) and len(set(lows)) == 31  # more found, a higher floor
    assert wilson_interval(110, 150)[1] - wilson_interval(110, 150)[0] < (
        wilson_interval(11, 15)[1] - wilson_interval(11, 15)[0]
    )  # ten times the runs, a narrower interval
    with pytest.raises(ValueError, match="no runs"):
        wilson_interval(0, 0)


def test_summary_pairs_repeats_by_seed():
    """Runs of the same cell with other seeds are other needles: agreement and log-prob change pair the
    same seed, never another seed's run of the cell."""
    rows = [
        _row("full", 1024, 50.0, True, -0.1, seed=0),
        _row("int2", 1024, 50.0, False, -3.0, seed=0),
        _row("full", 1024, 50.0, False, -2.0, seed=1),
        _row("int2", 1024, 50.0, True, -0.5, seed=1),
    ]
    s = {r["precision"]: r for r in summarize(rows)}
    assert s["int2"]["cells"] == 2 and s["int2"]["correct"] == 1 and s["int2"]["agree_with_full"] == 0
    assert s["int2"]["full_missed"] == 1
    assert s["int2"]["mean_logprob_change"] == pytest.approx(((-3.0 + 0.1) + (-0.5 + 2.0)) / 2)
    assert (s["int2"]["found_low"], s["int2"]["found_high"]) == pytest.approx(wilson_interval(1, 2), abs=1e-4)


@pytest.mark.parametrize(
    "found, runs, verdict",
    [
        (150, 150, "holds"),
        (60, 150, "does not hold"),
        (13, 15, "not settled by these runs"),
        (11, 15, "not settled by these runs"),
    ],
)
def test_found_check_judges_the_bar_by_the_interval(found, runs, verdict):
    rows = [_row("nuq2:o1", 1024, float(i), i < found, -1.0) for i in range(runs)]
    (summary,) = summarize(rows)
    check = found_check(summary, 13, 15)
    assert check["verdict"] == verdict and check["bar"] == "13/15" and (check["found"], check["runs"]) == (found, runs)
    line = found_line(check)
    assert line.startswith(
        f"nuq2:o1 finds the needle in >= 13/15 of cells: {verdict} (found {found}/{runs} runs, 95% ["
    )


def test_paired_difference_pairs_the_same_needle_and_settles_only_with_enough_runs():
    def runs(label, pattern, seeds):
        return [_row(label, 1024, 50.0, ok, -1.0, seed=s) for s, ok in zip(range(seeds), pattern * seeds, strict=False)]

    many = runs("nuq2:o1", [True, True, True, False], 80) + runs("int2", [True, False, False, False], 80)
    d = paired_difference(many, "nuq2:o1", "int2")
    assert (d["runs"], d["difference"]) == (80, 0.5) and d["low"] > 0 and d["verdict"] == "nuq2:o1 finds more"
    assert paired_difference(many, "nuq2:o1", "int2") == d  # seeded: the same draws every time
    assert paired_difference(many, "int2", "nuq2:o1")["verdict"] == "nuq2:o1 finds more"
    few = runs("nuq2:o1", [True, False], 4) + runs("int2", [False, True], 4)  # each finds 2, never the same needle
    f = paired_difference(few, "nuq2:o1", "int2")
    assert f["difference"] == 0 and f["low"] < 0 < f["high"] and f["verdict"] == "not settled by these runs"
    assert difference_line(d).startswith("nuq2:o1 against int2: found rate +50.0% (95% +")
    with pytest.raises(ValueError, match="share no runs"):
        paired_difference(many, "nuq2:o1", "full")
    logp = paired_difference(many, "nuq2:o1", "int2", "answer_logprob")  # every run's log p is -1.0
    assert (logp["difference"], logp["low"], logp["high"]) == (0, 0, 0) and logp[
        "verdict"
    ] == "not settled by these runs"
    rows = [_row("k4v8", 1024, 50.0, True, -0.5 - 0.01 * s, seed=s) for s in range(40)]
    rows += [_row("k8v4", 1024, 50.0, True, -0.2, seed=s) for s in range(40)]
    lower = paired_difference(rows, "k4v8", "k8v4", "answer_logprob")
    assert lower["high"] < 0 and lower["verdict"] == "k8v4 gives the answer a higher log p"
    assert difference_line(lower).startswith("k4v8 against k8v4: answer log p -0.495 nats (95% -0.")
    with pytest.raises(ValueError, match="unknown value"):
        paired_difference(rows, "k4v8", "k8v4", "seconds")


def test_repeats_in_the_text_report_and_figures():
    rows = [
        _row("full", 1024, 0.0, True, -0.1, seed=0),
        _row("int2", 1024, 0.0, True, -1.0, seed=0),
        _row("full", 1024, 0.0, False, -2.0, seed=1),
        _row("int2", 1024, 0.0, False, -3.0, seed=1),
        _row("full", 1024, 0.0, True, -0.3, seed=2),
        _row("int2", 1024, 0.0, False, -2.0, seed=2),
    ]
    result = _grid(rows, [0.0], ["full", "int2"], repeats=3)
    out = result.to_json()
    assert out["repeats"] == 3 and [r["seed"] for r in out["rows"]] == [0, 0, 1, 1, 2, 2]
    text = needle_cli.format_text(result)
    assert "seeds: 0..2" in text and "2/3" in text and "1/3" in text  # full found 2 of 3, int2 1 of 3
    assert "full precision itself missed 1 of 3 runs" in text
    assert "vs full, same needles: int2 against full: found rate -33.3% (95% " in text
    heat = needle_heatmap_figure(result)
    assert heat.data[0].z[0][0] == pytest.approx(2 / 3) and heat.data[1].z[0][0] == pytest.approx(1 / 3)
    assert heat.data[1].text[0][0] == f"1/3<br>-2.00<br>({FULL_MISSED} 1)"
    diff = needle_difference_figure(result)  # same seed against same seed
    assert diff.data[0].z[0][0] == pytest.approx(((-1.0 + 0.1) + (-3.0 + 2.0) + (-2.0 + 0.3)) / 3)
    correct = needle_difference_figure(result, value="correct")
    assert correct.data[0].z[0][0] == pytest.approx((0 + 0 - 1) / 3)
    table = repeats_markdown(result.rows, result.repeats).split("\n")
    assert table[0].startswith("| precision | found, 3 grids | 95% interval | one grid: fewest..most |")
    low, high = (round(v, 4) for v in wilson_interval(1, 3))  # as the summary keeps them
    assert table[3] == f"| int2 | 1/3 | {low:.1%}..{high:.1%} | 0/1..1/1 | -2.000 | -1.200 |"
    assert table[2].startswith("| full | 2/3 |") and table[2].endswith("| -0.800 |  |")


@pytest.mark.parametrize("path", sorted((ROOT / "assets" / "reports").glob("needle_*.json")), ids=lambda p: p.name)
def test_shipped_grids_round_trip(path):
    """Every shipped needle report reads as a NeedleGrid and writes back the same JSON, key order included (the
    older ones: no seeds, no repeats, no intervals in their summaries)."""
    data = json.loads(path.read_text())
    grid = NeedleGrid.from_json(data)
    assert grid.to_json() == data and list(grid.to_json()) == list(data)
    assert len(grid.rows) == grid.planned_runs and grid.stopped == "done"


def test_a_cancelled_grid_keeps_its_settings_and_summarizes_its_rows():
    from kvdemo.results.needle import partial_grid

    planned = _grid([], [0.0, 100.0], ["full", "int4"], repeats=2)
    partial = partial_grid(NeedleGrid.from_json(planned.to_json()), _fake_result().rows[:3], 2.5)
    assert (partial.stopped, partial.planned_runs, len(partial.rows)) == ("cancelled", 8, 3)
    assert partial.summary == summarize(partial.rows) and partial.summary[1]["cells"] == 1


def test_multikey_texts_are_rulers():
    m = needle.make_task("multikey", random.Random(5))
    assert m.instruction == needle.MULTIKEY_INSTRUCTION == needle.INSTRUCTIONS["multikey"]
    assert m.question == needle.MULTIKEY_QUESTION.format(key=m.key)
    assert m.answer_prefix == needle.MULTIKEY_LEAD_IN.format(key=m.key)
    assert m.needle == needle.MULTIKEY_NEEDLE.format(key=m.key, value=m.answer)


# --- text handling -------------------------------------------------------------------------------------


def test_sentence_starts_skip_abbreviations():
    text = 'Mr. Darcy came. She left! "Yes," said J. Smith.\n\nChapter 2\n\nNew para. lower case.'
    starts = needle.sentence_starts(text)
    assert starts[0] == 0 and starts[-1] == len(text)
    assert text.index("Darcy") not in starts  # "Mr." is no sentence end
    assert text.index("Smith") not in starts  # neither is an initial
    for word in ("She", '"Yes', "Chapter", "New"):
        assert text.index(word) in starts
    assert text.index("lower") not in starts  # a sentence starts with a capital


def test_insert_keeps_the_text_around_the_needle():
    text = "One two. Three four.\n\nFive six."
    b = text.index("Three")
    body, at = needle.insert_at(text, b, "NEEDLE.")
    assert body == "One two. NEEDLE. Three four.\n\nFive six." and body[at:].startswith("NEEDLE.")
    body, at = needle.insert_at(text, text.index("Five"), "NEEDLE.")
    assert body == "One two. Three four.\n\nNEEDLE.\n\nFive six."
    assert needle.insert_at(text, 0, "N.")[0] == "N. " + text
    assert needle.insert_at(text, len(text), "N.") == (text + " N.", len(text) + 1)
    cut = "A sentence cut in the"
    assert needle.insert_at(cut, len(cut), "N.")[0] == cut + "\n\nN."


# --- tasks and settings --------------------------------------------------------------------------------


def test_tasks_are_seeded_and_well_formed():
    a = needle.make_task("passkey", needle.cell_rng(3, 1024, 50))
    b = needle.make_task("passkey", needle.cell_rng(3, 1024, 50))
    c = needle.make_task("passkey", needle.cell_rng(4, 1024, 50))
    assert a == b and a.answer != c.answer
    assert len(a.answer) == 5 and a.needle == f"The pass key is {a.answer}. Remember it. {a.answer} is the pass key."
    m = needle.make_task("multikey", random.Random(0), num_keys=5)
    assert len(m.distractors) == 4 and len(m.answer) == 7 and m.answer.isdigit()
    keys = [re.split(r" for | is", n)[1] for n in [m.needle, *m.distractors]]
    assert len(set(keys)) == 5 and keys[0] == m.key and m.key in m.question and m.key in m.answer_prefix
    assert f"for {m.key} is: {m.answer}." in m.needle


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"kind": "custom", "needle": "", "question": "q?", "answer": "a"}, "non-empty needle"),
        (
            {"kind": "custom", "needle": "The code is 7.", "question": "Code?", "answer": "8"},
            "must appear in the needle",
        ),
        ({"kind": "custom", "needle": "The code is 7.", "question": " ", "answer": "7"}, "non-empty question"),
        ({"kind": "passkey", "needle": "x"}, "only with kind 'custom'"),
        ({"kind": "haystack"}, "allowed: passkey, multikey, custom"),
    ],
)
def test_bad_needles_are_value_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        needle.make_task(kw.pop("kind"), random.Random(0), **kw)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"depths": "0,150"}, "outside 0..100"),
        ({"depths": "a,b"}, "comma-separated numbers"),
        ({"lengths": ""}, "at least one value"),
        ({"haystack_file": "/nonexistent/doc.txt"}, "haystack file not found"),
        ({"kind": "custom", "needle": "The code is 7.", "question": "Code?", "answer": "9"}, "must appear"),
        ({"precision": "int5"}, "unknown precision"),
        ({"repeats": 0}, "--repeats must be 1..20"),
        ({"repeats": 21}, "--repeats must be 1..20"),
    ],
)
def test_cli_settings_fail_before_loading_the_model(kw, message):
    with pytest.raises(ValueError, match=message):
        needle_cli.run_cli(_args(**kw))


def test_save_grid_json_and_csv(tmp_path):
    result = _fake_result()
    paths = save_grid(result, tmp_path / "out")
    data = json.loads(Path(paths["json"]).read_text())
    assert data["rows"][3]["correct"] is False and data["summary"][1]["precision"] == "int4"
    assert load_grid(paths["json"]) == result  # the file reads back as the grid it was written from
    with open(paths["csv"], newline="") as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == 4 and list(lines[0]) == CSV_COLUMNS
    assert lines[3]["precision"] == "int4" and float(lines[3]["answer_logprob"]) == -2.5
    assert Path(paths["csv"]).read_bytes() == grid_csv(result).encode()  # the page's download is the same file
    text = needle_cli.format_text(result)
    assert "== int4" in text and "MISS" in text and "1/2" in text


def test_figures_from_a_grid():
    out = _fake_result()
    heat, diff, curve = needle_figures(out)
    assert [t.type for t in heat.data] == ["heatmap", "heatmap"]
    assert [list(r) for r in heat.data[1].z] == [[1.0], [0.0]]  # int4: found at depth 0, missed at depth 100
    assert diff.data[0].z[1][0] == pytest.approx(-2.3)  # int4 - full at depth 100
    assert diff.data[0].zmin == -diff.data[0].zmax
    assert [t.name for t in curve.data] == ["full", "int4"]
    assert needle_heatmap_figure(out, "answer_prob").data[0].z[0][0] == pytest.approx(0.904837, abs=1e-5)
    with pytest.raises(ValueError, match="no 'full' rows"):
        needle_difference_figure(_grid(out.rows[1::2], [0.0, 100.0], ["int4"]))


# --- prompts on the embedded model's tokenizer ---------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("kind", ["passkey", "multikey", "custom"])
def test_prompt_length_within_one_percent(lm, kind):
    doc = texts.held_out()
    for length in (300, 1000, 3000):
        rng = needle.cell_rng(0, length, 40)
        if kind == "custom":
            task = needle.make_task(kind, rng, DOC_NEEDLE, DOC_QUESTION, DOC_ANSWER)
            hay = doc
        else:
            task = needle.make_task(kind, rng)
            hay = needle.default_haystack(kind)[1]
        p = needle.build_prompt(lm, task, hay, length, 40, rng)
        assert length * 0.99 <= p.length <= length, (kind, length, p.length)
        prefix_ids, answer_ids = needle.split_answer(lm, task.answer_prefix, task.answer)
        assert p.answer_ids == answer_ids
        # the chat template of the model, as runner.chat_ids applies it, then the answer prefix
        messages = [{"role": "user", "content": p.text}]
        assert p.ids == runner.chat_ids(lm, messages) + prefix_ids
        assert p.text.count(task.needle) == 1 and all(p.text.count(d) == 1 for d in task.distractors)
        assert p.text.endswith("\n\n" + task.question)


@pytest.mark.model
def test_depth_placement_on_filler(lm):
    task = needle.make_task("passkey", random.Random(1))
    tok = lm.tokenizer
    for depth in (0, 10, 33, 50, 90, 100):
        p = needle.build_prompt(lm, task, needle.FILLER, 2000, depth, joiner=" ")
        assert abs(p.depth_actual - depth) <= 1.0, (depth, p.depth_actual)
        found = tok.decode(p.ids[p.needle_position : p.needle_position + p.needle_tokens]).strip()
        assert found == task.needle
        share = (p.needle_position - p.body_start) / (p.body_tokens - p.needle_tokens)
        assert share == pytest.approx(depth / 100, abs=0.01)
        assert p.body_start <= p.needle_position < p.context_len


@pytest.mark.model
def test_depth_and_sentence_boundaries_in_prose(lm):
    task = needle.make_task("multikey", random.Random(2))
    for depth in (0, 25, 50, 75, 100):
        p = needle.build_prompt(lm, task, texts.prose(), 3000, depth, random.Random(depth))
        assert abs(p.depth_actual - depth) <= 4.0, (depth, p.depth_actual)
        at = p.text.index(task.needle)
        before, after = p.text[:at], p.text[at + len(task.needle) :]
        body_start = p.text.index("\n\n") + 2
        assert at == body_start or re.search(r"([.!?][\"')\]]*\s+|\n\s*\n)$", before), before[-40:]
        assert after.startswith("\n\n") or re.match(r"\s+[\"'(\[]?[A-Z0-9]", after), after[:40]
        assert not re.search(r"\b(Mr|Mrs|Dr)\.\s+$", before)


@pytest.mark.model
def test_custom_needle_in_a_user_document(lm):
    doc = "\n\n".join(texts.held_out().split("\n\n")[:40])  # a user's own document, ~2.3k tokens
    task = needle.make_task("custom", random.Random(0), DOC_NEEDLE, DOC_QUESTION, DOC_ANSWER)
    p = needle.build_prompt(lm, task, doc, 1500, 60)
    assert abs(p.depth_actual - 60) <= 5 and p.haystack_copies == 1
    assert p.text.startswith(needle.INSTRUCTIONS["custom"] + "\n\nCHAPTER 1\n\nThe family of Dashwood")
    assert lm.tokenizer.decode(p.answer_ids).strip() == DOC_ANSWER
    short = "Only two sentences here. The document is short."
    p = needle.build_prompt(lm, task, short, 400, 50)
    assert p.haystack_copies > 1 and p.text.count(short) > 3 and 396 <= p.length <= 400
    with pytest.raises(ValueError, match="no text"):
        needle.build_prompt(lm, task, "  \n ", 400, 50)
    with pytest.raises(ValueError, match="too short"):
        needle.build_prompt(lm, task, doc, 60, 50)


# --- the runner ----------------------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("spec", ["int4", "k8v4", "int2:g32:s4"])
def test_transplant_equals_a_direct_prefill(lm, spec):
    ids = runner.chat_ids(lm, [{"role": "user", "content": texts.prose()[:1200]}])  # ~280 tokens
    full = runner.new_cache(lm, "full")
    runner.prefill(lm, ids, full, chunk=len(ids))
    moved = needle.transplant(lm, full, spec)
    direct = runner.new_cache(lm, spec)
    runner.prefill(lm, ids, direct, chunk=len(ids))
    assert moved.nbytes() == direct.nbytes()
    for a, b in zip(moved.layers, direct.layers, strict=True):
        pa, pb = a.packed(), b.packed()
        assert pa.regions == pb.regions and pa.regions.has_codes
        for part in ("keys", "values"):
            x, y = getattr(pa, part), getattr(pb, part)
            for t1, t2 in [(x.sinks, y.sinks), (x.residual, y.residual)] + [
                (getattr(x.quantized, f), getattr(y.quantized, f)) for f in ("codes", "scale", "zero")
            ]:
                assert (t1 is None and t2 is None) or torch.equal(t1, t2), part
    with pytest.raises(ValueError, match="full-precision source"):
        needle.transplant(lm, direct, "int8")


@pytest.mark.model
def test_tiny_grid_end_to_end(lm, tmp_path):
    seen = []
    result = needle.run_grid(lm, [256], [0, 100], "int4", kind="passkey", on_progress=seen.append)
    assert result.precisions == ["full", "int4"] and result.stopped == "done"  # full precision is always a row
    rows = [p for p in seen if p.row is not None]  # a cell's prefill is reported too, without a row
    assert [(p.done, p.total, p.unit) for p in rows] == [(n, 1024, "tokens") for n in (256, 512, 768, 1024)]
    assert [p.row.precision for p in rows] == ["int4", "full", "int4", "full"]  # full reuses the prefilled cache
    assert needle.work_tokens([256], [0, 100], "int4") == 1024
    assert [(r.depth, r.precision) for r in result.rows] == [(0, "full"), (0, "int4"), (100, "full"), (100, "int4")]
    for r in result.rows:
        assert 253 <= r.prompt_tokens <= 256 and r.answer_tokens == 5 and r.expected.isdigit()
        assert r.correct == needle.answer_matches(r.expected, r.answer)
        assert r.answer_logprob < 0 and 1 <= r.generated_tokens <= 12
    by_cell = {}
    for r in result.rows:
        by_cell.setdefault(r.depth, set()).add((r.prefill_s, r.prompt_tokens, r.needle_position))
    assert all(len(v) == 1 for v in by_cell.values())  # one shared prefill and prompt per cell
    assert any(r.correct for r in result.rows if r.precision == "full")  # the passkey is found at 256 tokens
    paths = save_grid(result, tmp_path)
    assert json.loads(Path(paths["json"]).read_text())["rows"][0]["precision"] == "full"
    assert len(needle_figures(result)) == 3


@pytest.mark.model
def test_logprob_matches_a_direct_forward(lm):
    rng = needle.cell_rng(5, 300, 50)
    task = needle.make_task("passkey", rng)
    p = needle.build_prompt(lm, task, needle.FILLER, 300, 50, rng, " ")
    (row,) = needle.run_cell(lm, task, p, [parse_precision("full")])
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([p.ids + p.answer_ids])).logits[0].float()  # [T + k, V]
    lp = torch.log_softmax(logits[len(p.ids) - 1 : -1], -1)  # predictions of the answer tokens
    direct = float(lp[torch.arange(len(p.answer_ids)), torch.tensor(p.answer_ids)].sum())
    assert row.answer_logprob == pytest.approx(direct, abs=2e-3)
    greedy = lm.tokenizer.decode([int(logits[len(p.ids) - 1].argmax())])
    assert row.answer.startswith(greedy.strip())  # the generated answer starts with the greedy token


@pytest.mark.model
def test_cancel_and_bad_lengths(lm):
    calls = []

    def on_progress(p):
        if p.row is not None:
            calls.append(p.row)

    with pytest.raises(Cancelled) as stopped:
        needle.run_grid(lm, [256], [50], "full,int8", on_progress=on_progress, should_stop=lambda: bool(calls))
    assert stopped.value.partial == calls and len(calls) == 1  # the rows done are kept
    assert calls[0].precision == "int8"  # quantized rows run first: full reuses the prefilled cache
    with pytest.raises(ValueError, match="context"):
        needle.run_grid(lm, [lm.max_context], [50], "int4")
    with pytest.raises(ValueError, match="outside 0..100"):
        needle.run_grid(lm, [256], [-1], "int4")
    with pytest.raises(ValueError, match="repeats must be 1..20"):
        needle.run_grid(lm, [256], [50], "int4", repeats=0)


@pytest.mark.model
def test_repeats_run_new_needles_seed_by_seed(lm):
    """repeats=2 runs the grid with seeds 3 and 4: seed 3's runs equal a one-seed grid at seed 3, and seed 4
    hides another passkey at the same cells."""
    one = needle.run_grid(lm, [200], [0, 100], "int4", seed=3)
    seen = []
    two = needle.run_grid(lm, [200], [0, 100], "int4", seed=3, repeats=2, on_progress=lambda p: seen.append(p.total))
    assert two.repeats == 2 and two.to_json()["repeats"] == 2 and set(seen) == {200 * 2 * 2 * 2}
    assert [(r.seed, r.depth, r.precision) for r in two.rows] == [
        (s, d, p) for s in (3, 4) for d in (0, 100) for p in ("full", "int4")
    ]  # seed by seed: a cancelled run holds whole grids first
    timing = {"prefill_s", "seconds"}

    def same(r):
        return {k: v for k, v in r.to_json().items() if k not in timing}

    assert [same(r) for r in two.rows[:4]] == [same(r) for r in one.rows]
    assert {r.expected for r in two.rows[:4]}.isdisjoint({r.expected for r in two.rows[4:]})
    (full, int4) = summarize(two.rows)
    assert full["cells"] == int4["cells"] == 4


@pytest.mark.model
def test_cli_tiny_grid(tmp_path):
    doc = tmp_path / "notes.md"
    doc.write_text("# Notes\n\n" + "\n\n".join(texts.held_out().split("\n\n")[:12]), encoding="utf-8")
    cmd = [sys.executable, "-m", "kvdemo", "needle", "--precision", "int8", "--lengths", "300", "--depths", "50"]
    cmd += ["--kind", "custom", "--haystack-file", str(doc), "--needle", DOC_NEEDLE, "--question", DOC_QUESTION]
    cmd += ["--answer", DOC_ANSWER, "--out", str(tmp_path / "res"), "--json"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["model"] and out["haystack"] == "notes.md" and out["kind"] == "custom"
    assert [r["precision"] for r in out["rows"]] == ["full", "int8"]
    for r in out["rows"]:
        assert {"length", "depth", "precision", "answer", "correct", "answer_logprob"} <= set(r)
        assert r["expected"] == DOC_ANSWER and r["length"] == 300
    assert Path(out["files"]["csv"]).is_file() and Path(out["files"]["json"]).is_file()
    prov = out["provenance"]  # the command that reproduces the grid, its date and machine
    assert prov["command"].startswith("python -m kvdemo needle --model embedded --precision int8 --lengths 300")
    assert f"--kind custom --haystack-file {doc}" in prov["command"] and "--codebooks" not in prov["command"]
    assert prov["date"] and prov["machine"]["cores"] >= 1 and "codebooks" not in out  # int8 takes no codebook
    assert json.loads(Path(out["files"]["json"]).read_text())["provenance"] == prov  # the file has it too
    bad = subprocess.run(
        [sys.executable, "-m", "kvdemo", "needle", "--depths", "120"], cwd=ROOT, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "outside 0..100" in bad.stderr


@pytest.mark.model
def test_teacher_forcing_equals_one_by_one_decoding(lm):
    ids = runner.chat_ids(lm, [{"role": "user", "content": texts.prose()[:1100]}])
    ids = ids[: 128 * (len(ids) // 128) - 3]  # the 3rd token fed next fills a block: a flush mid-answer
    answer = lm.tokenizer(" 12345 is it", add_special_tokens=False)["input_ids"]
    for spec in ("int2", "full"):
        cache = runner.new_cache(lm, spec)
        runner.prefill(lm, ids, cache, chunk=len(ids))
        assert needle.flush_points(cache, len(answer)) == ([2] if spec == "int2" else [])
        one_by_one = runner.fork(cache)
        steps = torch.stack([runner.prefill(lm, [t], one_by_one) for t in answer])  # [k, V]
        forced = needle.forward_as_decoding(lm, answer, cache)  # [k, V]
        torch.testing.assert_close(forced, steps, atol=1e-3, rtol=1e-4)  # fp32 summation order differs
        assert cache.layers[0].quant_len == one_by_one.layers[0].quant_len


@pytest.mark.model
def test_cli_codebooks_file_is_what_the_nuq_cells_read(lm, tmp_path, capsys):
    """`needle --codebooks FILE`: the nuq cells use that file's levels (squeezed levels change the answer's
    log-prob, uniform codes do not move), and the report and its command say so."""
    from kvdemo import codebooks
    from kvdemo.cli import main

    own = codebooks.for_model(lm)
    codebooks.Codebooks({k: v * 0.5 for k, v in own.tensors.items()}, own.metadata | {"date": "squeezed"}).save(
        tmp_path / "squeezed.safetensors"
    )
    argv = ["needle", "--precision", "int4,nuq4", "--lengths", "256", "--depths", "50", "--json"]
    runs = []
    for extra in ([], ["--codebooks", str(tmp_path / "squeezed.safetensors")]):
        assert main(argv + extra) == 0
        runs.append(json.loads(capsys.readouterr().out))
    logp = [{r["precision"]: r["answer_logprob"] for r in out["rows"]} for out in runs]
    assert logp[0]["int4"] == logp[1]["int4"] and logp[0]["full"] == logp[1]["full"]
    assert logp[0]["nuq4"] != logp[1]["nuq4"]
    assert runs[0]["codebooks"] == codebooks.describe(own) and "squeezed" in runs[1]["codebooks"]
    assert runs[1]["provenance"]["command"].endswith(f"--codebooks {tmp_path / 'squeezed.safetensors'}")
    assert main(argv + ["--codebooks", str(tmp_path / "missing.safetensors")]) == 2
    assert "codebook file not found" in capsys.readouterr().err
