"""A node that answers slowly on purpose: one byte at a time, each just inside the wait between
reads. Every bound on what a node sends is also a bound on how long it takes: the runner gives up
at the command's timeout, not at the 8 MiB output cap (at one byte a second, three months)."""

from __future__ import annotations

import threading
import time

import pytest

from runner.errors import UserError
from runner.transport import sftp
from runner.transport.ssh import Remote
from tests.hostile_node import HostileNode

TRICKLE = "while :; do printf .; sleep 0.3; done"  # a byte every 0.3 s, forever


def _bounded(fn, limit: float):
    """fn() in a thread: (its result or exception, seconds), or a failure once limit passed (the
    defect this file tests is a hang: it must fail the test, not hang the suite)."""
    out: list = []
    t0 = time.monotonic()

    def go() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        pytest.fail(f"still blocked after {limit:.0f} s")
    return out[0], time.monotonic() - t0


def test_a_command_that_trickles_output_times_out_at_its_timeout(tmp_path):
    with HostileNode(tmp_path / "node", fourth=31) as node, Remote(node.node()).connect() as r:
        got, took = _bounded(lambda: r.run(TRICKLE, timeout=2), 30)
        assert isinstance(got, UserError), got
        assert "command timed out after 2s" in str(got), got
        assert took < 15, took
        assert r.run("echo ok", timeout=10).out == "ok\n"  # the connection still serves the next command


def test_a_command_that_trickles_stderr_times_out_too(tmp_path):
    with HostileNode(tmp_path / "node", fourth=32) as node, Remote(node.node()).connect() as r:
        got, took = _bounded(lambda: r.run(f"({TRICKLE}) >&2", timeout=2), 30)
        assert isinstance(got, UserError) and "timed out after 2s" in str(got), got
        assert took < 15, took


def test_an_sftp_answer_trickled_byte_by_byte_fails_at_the_limit_and_the_next_read_works(tmp_path, monkeypatch):
    monkeypatch.setattr(sftp, "SFTP_SILENCE_S", 1.5)  # each trickled byte (0.2 s apart) is well inside it
    node = HostileNode(tmp_path / "node", fourth=33)
    (tmp_path / "node" / "home" / "big").write_bytes(b"x" * 4096)  # its answer: 20 min at 0.2 s a byte
    (tmp_path / "node" / "home" / "small").write_text("ok")
    with node, Remote(node.node()).connect() as r:
        node.trickle_over = 1000
        got, took = _bounded(lambda: r.read_text(str(tmp_path / "node" / "home" / "big")), 30)
        assert isinstance(got, UserError), got
        assert "an SFTP answer took over 2s" in str(got) and str(got).startswith("node "), got
        assert took < 10, took
        assert r.read_text(str(tmp_path / "node" / "home" / "small")) == "ok"  # a fresh session


def test_a_stream_that_moves_a_byte_at_a_time_is_stalled(tmp_path):
    """The stall was 'no byte for stall_s': a node sending one byte inside it kept a collect open for ever."""
    from runner.transport import stream

    out = tmp_path / "out.bin"
    with HostileNode(tmp_path / "node", fourth=34) as node, Remote(node.node()).connect() as r:
        got, took = _bounded(lambda: stream.ssh_stream(r, "while :; do printf .; sleep 0.1; done",
                                                       [["sh", "-c", f"cat > {out}"]], upload=False, stall_s=1.5), 40)
    assert not isinstance(got, BaseException), got
    assert got.stalled and 0 < got.moved < stream.STALL_BYTES, got
    assert took < 20, took


def test_collect_stops_a_tar_stream_past_what_was_listed(tmp_path):
    """The node adds a 100 MiB member nobody asked for; the local tar unpacked all of it. Now the stream
    stops at the listed bytes plus the bound's slack, and the node is named."""
    from runner.delivery.collect_files import GROWTH, stream_tar, tar_bound

    rd = tmp_path / "node" / "home" / "rd"
    rd.mkdir(parents=True)
    (rd / "a.txt").write_text("hello")
    with open(rd / "junk.bin", "wb") as fh:
        fh.truncate(GROWTH + (36 << 20))  # sparse on the node; 100 MiB in the stream
    node = HostileNode(tmp_path / "node", fourth=35)
    node.rewrite = lambda c: c.replace("-cf -", "-cf - --add-file=junk.bin") if "tar --null" in c else c
    staging = tmp_path / "staging"
    batch = [("a.txt", type("St", (), {"st_size": 5})())]
    with node, Remote(node.node()).connect() as r:
        with pytest.raises(UserError) as err:
            stream_tar(r, str(rd), ["a.txt"], staging, max_bytes=tar_bound(batch))
    assert str(err.value).startswith(f"node evil: the stream of files from {rd} went past 64 MiB, the 1 listed files'")
    written = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
    assert written <= tar_bound(batch), written
    assert tar_bound(batch) == 5 + 1024 + 512 + 511 + 1024 + 10240 + GROWTH


def test_collect_summary_shows_a_jobs_terminal_controls_as_text(tmp_path, capsys):
    """collect's summary printed lines made from the job's metrics.jsonl as they were: a `step` could
    carry a clipboard write (OSC 52), a title change and a line erase."""
    import json

    from runner.delivery.collect_files import report

    (tmp_path / "node-0").mkdir()
    (tmp_path / "node-0" / "metrics.jsonl").write_text(json.dumps(
        {"loss": 1.0, "step": "\u001b]52;c;cm0gLXJmIH4K\u0007\u001b]0;owned\u0007\r\u001b[2K"}) + "\n")
    report([], tmp_path, no_plots=True)
    out = capsys.readouterr().out
    assert "final loss 1.0000" in out, out
    assert not any(c in out for c in "\x1b\x07\r"), repr(out)
    assert "final loss 1.0000 at step ?  (" in out, repr(out)  # a step that is not an integer is not shown


@pytest.mark.parametrize("record", [
    '{"step": 3, "loss": 1.0, "step_time_s": NaN}', '{"step": 3, "loss": 1.0, "step_time_s": 1e308}',
    '{"step": 3, "loss": 1.0, "step_time_s": -1e308}', '{"step": 3, "loss": 1.0, "tokens_per_s": Infinity}',
    '{"step": 3, "loss": ' + "9" * 400 + '}', '{"step": 3, "loss": NaN}', '{"step": true, "loss": 1.0}',
])
def test_status_progress_survives_what_a_job_writes_in_its_metrics(record):
    """runner status ended in a traceback (ValueError, OverflowError) on these lines of metrics.jsonl."""
    from contract import metrics

    good = '{"step": 2, "loss": 2.5, "step_time_s": 0.5, "tokens_per_s": 100}'
    prog = metrics.progress(metrics.parse(good + "\n" + record), total=10)
    text = str(prog)
    assert text.startswith("step 3/10") or text.startswith("step 2/10  loss 2.5000"), text
    assert "ETA 0:00:0" in text or "ETA" not in text, text
    assert metrics.summary(metrics.parse(good + "\n" + record)).startswith("final loss "), record


@pytest.mark.parametrize("layout", ['"x"', '{"nodes": 3, "pp": 2}', '[1, 2]', 'null'])
def test_status_elastic_history_survives_any_layout_shape(layout):
    from runner.elastic import parse_events, render_events

    lines = render_events(parse_events('{"event": "layout", "time": "t", "layout": ' + layout + '}'))
    assert len(lines) == 1 and "layout pp " in lines[0], lines
