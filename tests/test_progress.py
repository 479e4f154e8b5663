"""The one progress / cancel protocol (kvdemo/progress.py): counts, time left, cancellation with the rows kept."""

import pytest

from kvdemo import progress
from kvdemo.progress import Cancelled, Progress, Tracker


def test_time_left_is_extrapolated_from_this_runs_speed():
    p = Progress(done=10, total=40, unit="cells", what="int4 at 2,048 tokens", elapsed_s=30.0)
    assert p.fraction == 0.25
    assert p.remaining_s == pytest.approx(90.0)  # 30 more cells at 3 s each
    assert p.text() == "10/40 cells: int4 at 2,048 tokens (30 s so far, about 1 min 30 s left)"
    assert Progress(0, 40, "cells", "starting", 2.0).remaining_s is None
    assert "left" not in Progress(0, 40, "cells", "starting", 2.0).text()
    assert Progress(5, 0, "cells", "", 1.0).fraction == 1.0


@pytest.mark.parametrize(
    "seconds, text",
    [(0.4, "under a second"), (45, "45 s"), (120, "2 min"), (185, "3 min 5 s"), (3720, "1 h 2 min")],
)
def test_duration_reads_as_people_say_it(seconds, text):
    assert progress.duration(seconds) == text


def test_tracker_reports_each_unit_and_keeps_its_rows():
    seen = []
    track = Tracker(3, "precisions", on_progress=seen.append)
    for label in ("full", "int8", "int4"):
        track.check()
        track.advance(label, row={"precision": label})
    assert [p.done for p in seen] == [1, 2, 3]
    assert [p.row["precision"] for p in seen] == ["full", "int8", "int4"]
    assert seen[-1].fraction == 1.0 and seen[-1].what == "int4"
    assert [r["precision"] for r in track.rows] == ["full", "int8", "int4"]


def test_should_stop_raises_cancelled_with_the_finished_rows():
    stop = {"now": False}
    track = Tracker(4, "cells", should_stop=lambda: stop["now"])
    track.check()
    track.advance("cell 1", row="row 1")
    stop["now"] = True
    with pytest.raises(Cancelled) as caught:
        track.check("the grid")
    assert caught.value.partial == ["row 1"]
    assert "the grid was stopped" in str(caught.value)


def test_a_part_moves_the_parent_count_by_its_share():
    seen = []
    track = Tracker(10, "tokens", on_progress=seen.append)
    track.advance("prefix", units=4)
    inner = track.part(6, "int4")
    inner(Progress(50, 100, "tokens", "feeding", 1.0))
    assert track.done == pytest.approx(7.0)
    assert seen[-1].what == "int4: feeding"
    inner(Progress(100, 100, "tokens", "", 2.0))
    assert track.done == pytest.approx(10.0) and seen[-1].what == "int4"
    assert Tracker(10, "tokens").part(6, "int4") is None  # nobody listens: nothing to forward


def test_before_the_first_unit_the_time_left_is_the_estimate_made_before_the_run():
    before = Progress(0, 100, "tokens", "full: reading tokens 1-2,048 of 5,168", 30.0, expected_s=200.0)
    assert before.remaining_s == pytest.approx(170.0)
    assert "about 2 min 50 s left" in before.text()
    after = Progress(50, 100, "tokens", "", 40.0, expected_s=200.0)  # then this run's own speed
    assert after.remaining_s == pytest.approx(40.0)
    seen = []
    Tracker(10, "tokens", seen.append, expected_s=12.0).report("starting")
    assert seen[0].expected_s == 12.0


@pytest.mark.model
def test_reading_a_document_moves_layer_by_layer_with_the_tokens_read(lm):
    """A chat's first read reports within each prefill chunk, per decoder layer, not once per chunk."""
    from kvdemo.chat.session import ChatSession
    from kvdemo.texts import prose

    session = ChatSession(lm, "int4", prose()[:3000], prefill_chunk=256)
    read = []
    session.prepare(on_progress=read.append)
    counts = [p.done for p in read]
    assert counts == sorted(counts) and counts[-1] == read[-1].total
    assert session.tokens_to_read() == 0  # all read: a first turn's hint counts only the question
    assert len(set(counts)) > 2 * lm.num_layers  # several chunks, each moving layer by layer
    assert all(c == int(c) for c in counts)  # whole tokens: a chunk's layers share its tokens exactly
    assert read[0].what.startswith("full: reading tokens 1-256 of ")
