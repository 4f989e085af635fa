"""The Gantt chart's bounds (contract/plots.py): its timeline is a file a job wrote, drawn on the
user's machine by `runner collect` and `trainer plot`. A trace with more ranks (pids) than MAX_ROWS
or more slices than MAX_BARS, or a malformed slice, is refused with one ValueError before
matplotlib draws anything (collect turns it into one warning line); before, the figure grew 0.8
inch per distinct pid (4,000 pids in a 0.24 MiB trace: 48 s and 3.9 GB) and bad values raised
whatever Python raised, or were drawn (NaN, infinity)."""

from __future__ import annotations

import json
import logging
import struct

import pytest

from contract import plots


def trace(pids, per_pid=1, name="proc"):
    ev = []
    for p in pids:
        ev.append({"ph": "M", "name": "process_name", "pid": p, "tid": 0, "args": {"name": f"{name}{p}"}})
        for i in range(per_pid):
            ev.append({"ph": "X", "name": f"forward mb{i}", "pid": p, "tid": 0, "ts": 10.0 * i, "dur": 8.0,
                       "args": {"stage": p, "microbatch": i}})
    return {"traceEvents": ev}


def png_size(path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])  # width, height


@pytest.fixture
def no_drawing(monkeypatch):
    """Matplotlib is never reached: a refused trace costs no figure at all."""
    def refuse():
        raise AssertionError("matplotlib was reached for a trace that should be refused")

    monkeypatch.setattr(plots, "_pyplot", refuse)


def test_more_ranks_than_the_cap_are_refused_before_any_figure(tmp_path, no_drawing):
    out = tmp_path / "g.png"
    for t in (trace(range(plots.MAX_ROWS + 1)),                                   # slices on each
              {"traceEvents": trace(range(plots.MAX_ROWS + 1))["traceEvents"][::2]},  # process names only
              trace(range(4000))):                                                # the audit's trace
        with pytest.raises(ValueError, match=f"over {plots.MAX_ROWS:,} ranks .*; not drawn"):
            plots.gantt(t, out, "t")
    assert not out.exists()


def test_more_slices_than_the_cap_are_refused(tmp_path, monkeypatch, no_drawing):
    monkeypatch.setattr(plots, "MAX_BARS", 10)
    with pytest.raises(ValueError, match="over 10 slices.*; not drawn"):
        plots.gantt(trace([0, 1], per_pid=6), tmp_path / "g.png", "t")
    assert not (tmp_path / "g.png").exists()


def test_a_trace_at_the_caps_edge_still_renders(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "MAX_ROWS", 4)
    monkeypatch.setattr(plots, "MAX_BARS", 12)
    out = plots.gantt(trace(range(4), per_pid=3), tmp_path / "g.png", "edge")
    assert out == tmp_path / "g.png" and png_size(out)[1] > 300  # four rows drawn
    with pytest.raises(ValueError, match="over 4 ranks"):
        plots.gantt(trace(range(5), per_pid=1), tmp_path / "five.png", "t")
    with pytest.raises(ValueError, match="over 12 slices"):
        plots.gantt(trace(range(4), per_pid=4), tmp_path / "sixteen.png", "t")
    assert not (tmp_path / "five.png").exists() and not (tmp_path / "sixteen.png").exists()


GOOD = {"ph": "X", "name": "forward mb0", "pid": 0, "tid": 0, "ts": 0.0, "dur": 5.0, "args": {"stage": 0, "microbatch": 0}}


@pytest.mark.parametrize("change", [
    {"ts": "1"}, {"ts": None}, {"ts": float("nan")}, {"ts": float("inf")}, {"ts": True}, {"ts": 10 ** 400},
    {"dur": "5"}, {"dur": float("-inf")}, {"dur": [5]}, {"ts": 1.7e308, "dur": 1.7e308},  # the end overflows
    {"pid": "0"}, {"pid": 1.5}, {"pid": True}, {"pid": None}, {"pid": [0]},
    {"name": 7}, {"args": None}, {"args": {"stage": [0], "microbatch": 0}}, {"args": {"stage": 0, "microbatch": {}}},
])
def test_a_malformed_slice_refuses_the_trace(tmp_path, no_drawing, change):
    bad = {**GOOD, **change}
    with pytest.raises(ValueError, match="event 1 is not a slice with an integer pid, numeric ts and dur"):
        plots.gantt({"traceEvents": [GOOD, bad]}, tmp_path / "g.png", "t")
    assert not (tmp_path / "g.png").exists()


@pytest.mark.parametrize("t, why", [
    ({"traceEvents": {"0": GOOD}}, "no traceEvents list"),
    ({}, "no traceEvents list"),
    ({"traceEvents": [GOOD, 3]}, "event 1 is not an object"),
    ({"traceEvents": [{"ph": "M", "name": "process_name", "pid": "0", "args": {"name": "a"}}]}, "process_name"),
    ({"traceEvents": [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": ["a"]}}]}, "process_name"),
    ({"traceEvents": [{"ph": "C", "name": "net Mbit/s", "pid": 0, "ts": 1, "args": {"up": 1}}]}, "no ranks"),
])
def test_a_malformed_trace_is_refused(tmp_path, no_drawing, t, why):
    with pytest.raises(ValueError, match=why):
        plots.gantt(t, tmp_path / "g.png", "t")
    assert not (tmp_path / "g.png").exists()


def test_a_long_row_name_or_title_is_cut_not_drawn_as_a_huge_image(tmp_path):
    t = trace([0], per_pid=2, name="n" * 20_000)
    out = plots.gantt(t, tmp_path / "g.png", "title " + "t" * 20_000)
    width, height = png_size(out)
    assert width < 5000 and height < 1000, (width, height)


def test_collect_warns_once_and_writes_no_plot_for_a_trace_past_the_cap(tmp_path, caplog, no_drawing):
    from runner.delivery.collect_report import render_plots

    run = tmp_path / "run"
    run.mkdir()
    src = run / "timeline_batch1_all.json"
    src.write_text(json.dumps(trace(range(plots.MAX_ROWS + 1))))
    with caplog.at_level(logging.WARNING):
        assert render_plots(run) == []
    assert not (run / "timeline_batch1_gantt.png").exists()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "not rendered from" in lines[0] and str(src) in lines[0], lines
    assert f"over {plots.MAX_ROWS:,} ranks (pids), more rows than a Gantt chart draws; not drawn" in lines[0]


def test_trainer_plot_warns_for_a_refused_trace_and_draws_the_rest(tmp_path, capsys):
    """`trainer plot` on a run dir: a trace past the cap was a ValueError traceback ending the
    command; now one warning naming the file, and the other timeline is still drawn."""
    from trainer.tools.plots import main

    (tmp_path / "timeline_batch1_all.json").write_text(json.dumps(trace(range(plots.MAX_ROWS + 1))))
    (tmp_path / "timeline_batch2_all.json").write_text(json.dumps(trace([0, 1], per_pid=2)))
    assert main([str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [str(tmp_path / "timeline_batch2_gantt.png")]
    assert err == (f"trainer: warning: timeline_batch1_all.json not plotted: timeline: over {plots.MAX_ROWS:,} "
                   "ranks (pids), more rows than a Gantt chart draws; not drawn\n")
    assert not (tmp_path / "timeline_batch1_gantt.png").exists()


@pytest.mark.parametrize("other, summary", [
    ("not a dict", None),
    ({"schedule": ["1f1b"], "pp": {"a": 1}, "merged_by": 3}, '{"theoretical_bubble": 0.2}'),
    ({"pp": 2}, '{"measured_bubble": "high", "theoretical_bubble": null}'),
    ({"pp": 2}, "[1, 2"),
    ({"pp": 2}, '{"measured_bubble": 0.25, "theoretical_bubble": "x"}'),
])
def test_a_malformed_title_source_leaves_its_field_out(tmp_path, other, summary):
    """gantt_title read the job's otherData and summary as they should be: a list for `schedule`
    drew as a list, a summary without measured_bubble was a KeyError, one that did not parse a
    ValueError, so `trainer plot` ended in a traceback and collect left the chart out."""
    path = None
    if summary is not None:
        path = tmp_path / "timeline_batch1_summary.json"
        path.write_text(summary)
    title = plots.gantt_title({"otherData": other}, 1, path)
    assert title.startswith("batch 1: ") and "[" not in title and "{" not in title, title
    if other == {"pp": 2} and summary.startswith('{"measured_bubble": 0.25'):
        assert title == "batch 1: pp=2 microbatches=?; bubble 0.25 measured"
    else:
        assert "bubble" not in title, title
