"""A container's output read to its end (runner/transport/container_logs.py).

Docker 20.10, the engine of Debian 12 and of the sandbox nodes, ends a follow when the container
exits even where its reader of the json-file log is behind: on this machine, 6 of 12 containers
that printed 40,001 lines and exited under load came out of the follow short, by 15,000-33,000
lines each (a contiguous tail), while `docker logs` had every line. Which follow comes up short
is the engine's race, so the tests cut the follow where they choose (its frames counted through
`_frames`, the one seam) on a real engine reached as `up` reaches it (a sandbox node over SSH),
and check that what the follow gave and `rest()` then gave are every byte the engine kept, once,
at every cut: before any frame, in the middle, inside one long line whose 16 KiB pieces share one
timestamp, before the last frame, after it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from runner.transport import container_logs
from runner.transport.container_logs import FollowedLog, log_chunks, stamp_ns
from tests.support.runner_helpers import remotes

# 1 + 300 short lines, one line of 100,000 bytes (the engine keeps it as 7 pieces of at most 16 KiB,
# each stamped as the first), then a last line without a newline: 309 frames.
JOB = r"""
import sys
w = sys.stdout
w.write('first\n')
for i in range(300):
    w.write(f'line {i}\n')
w.write('y' * 100000 + '\n')
w.write('last, no newline')
w.flush()
"""
EXPECTED = (b"first\n" + b"".join(b"line %d\n" % i for i in range(300)) + b"y" * 100000 + b"\n"
            + b"last, no newline")
FRAMES = 1 + 300 + 7 + 1


def image_of(sandbox) -> str:
    from runner.inventory import load_inventory

    return load_inventory(sandbox).job.image


def follow_cut_at(monkeypatch, frames: int) -> None:
    """The engine's follow ends after `frames` frames (as docker 20.10's does at an exit, where it
    chooses); what rest() reads is the engine's answer untouched."""
    real = container_logs._frames

    def cut(container, params):
        seen = 0
        for first, piece in real(container, params):
            if params["follow"] and first:
                seen += 1
                if seen > frames:
                    return
            yield first, piece

    monkeypatch.setattr(container_logs, "_frames", cut)


@pytest.fixture(scope="module")
def exited(sandbox, pushed):
    """A container on node-0 that ran JOB and exited, through the node's engine over SSH: one for
    every cut (each reads it afresh)."""
    import secrets

    r = remotes(sandbox)["node-0"]
    name = f"logs-cut-{secrets.token_hex(4)}"
    with r:
        c = r.docker().containers.run(image_of(sandbox), ["python", "-c", JOB], name=name, detach=True)
        try:
            assert c.wait(timeout=120)["StatusCode"] == 0
            yield c
        finally:
            c.remove(force=True)


def test_the_engine_keeps_the_job_as_the_test_counts_it(exited):
    """The ground truth the cuts are held to: the engine's whole log is the job's bytes, in 309 frames."""
    assert b"".join(log_chunks(exited, follow=False)) == EXPECTED
    log = FollowedLog(exited)
    assert b"".join(log.follow()) == EXPECTED and b"".join(log.rest()) == b""
    assert log.caught_up == 0 and log.at_newest == 1 and log.timed


@pytest.mark.parametrize("cut", [0, 1, 150, 301, 302, 304, 308, FRAMES])
def test_a_follow_cut_anywhere_is_completed_once(exited, monkeypatch, cut):
    follow_cut_at(monkeypatch, cut)
    log = FollowedLog(exited)
    followed = b"".join(log.follow())
    rest = b"".join(log.rest())
    assert followed + rest == EXPECTED, (len(followed), len(rest), len(EXPECTED))
    assert log.caught_up == FRAMES - cut


def test_the_watcher_shows_and_keeps_the_lines_after_the_cut_and_reports_them(sandbox, pushed, tmp_path,
                                                                             monkeypatch):
    """`up`'s watcher with the engine's follow ending 100 frames in: every one of 2,003 lines reaches
    the terminal once, in order, the kept container.log is the engine's log byte for byte, and the
    failure's report ends with the job's last lines (before: its lines 1-100, the traceback gone)."""
    from runner.backends.ssh.watch import Watcher

    follow_cut_at(monkeypatch, 100)
    code = ("import sys\nfor i in range(2000): print('step', i)\nprint('Traceback (most recent call last):')\n"
            "print('  File \"train.py\", line 1')\nprint('RuntimeError: boom', flush=True)\nsys.exit(3)")
    r = remotes(sandbox)["node-0"]
    name = f"logs-watch-{tmp_path.name[-20:]}".replace("_", "-")
    shown: list[str] = []
    sink = SimpleNamespace(write=lambda s: shown.extend(s.splitlines()), flush=lambda: None)
    with r:
        c = r.docker().containers.run(image_of(sandbox), ["python", "-c", code], name=name, detach=True)
        try:
            plan = SimpleNamespace(run_id="logs-watch", nodes=[SimpleNamespace(node="node-0", rank=0, container=name)],
                                   grace_period=1)
            outcome = Watcher({"node-0": r}, plan, tmp_path / "logs", out=sink).run()
            engine = b"".join(log_chunks(c, follow=False))
        finally:
            c.remove(force=True)
    job = [f"step {i}" for i in range(2000)] + ["Traceback (most recent call last):", '  File "train.py", line 1',
                                                "RuntimeError: boom"]
    assert shown == [f"[node-0/0] {ln}" for ln in job], (len(shown), shown[-3:])
    assert outcome is not None and outcome.exit_code == 3, outcome
    assert outcome.last_lines[-3:] == job[-3:], outcome.last_lines
    assert (tmp_path / "logs" / "node-0" / "container.log").read_bytes() == engine == ("\n".join(job) + "\n").encode()


@pytest.mark.parametrize("text, want", [
    (b"2026-12-01T18:35:43.236347959Z x", (1796150143_236347959, 31)),
    (b"2026-12-01T18:35:43Z x", (1796150143_000000000, 21)),
    (b"2026-12-01T18:35:43.5Z ", (1796150143_500000000, 23)),
    (b"2026-12-01T19:35:43.000000001+01:00 x", (1796150143_000000001, 36)),
    (b"2026-12-01T18:35:43.236347959Zx", None),       # no space after it
    (b"2026-13-01T18:35:43.236347959Z x", None),      # month 13
    (b"2026-12-01T18:35:43.1234567890Z x", None),     # ten digits
    (b"x2026-12-01T18:35:43Z x", None),
    (b"", None),
])
def test_a_frame_stamp_is_read_exactly_or_not_at_all(text, want):
    assert stamp_ns(text) == want


FRAME = "\x01\x00\x00\x00\x00\x00\x00"


def frame(payload: str) -> str:
    return FRAME + chr(len(payload)) + payload


@pytest.mark.parametrize("answer, shown, caught_up", [
    # frames with no stamp (an engine that ignored the ask): passed on whole, nothing read again
    (frame("hi\n") * 2, b"hi\nhi\n", 0),
    # stamped: the same log read again from the newest stamp is nothing new
    (frame("2026-12-01T18:35:43.000000001Z a\n") + frame("2026-12-01T18:35:43.000000002Z b\n"), b"a\nb\n", 0),
])
def test_an_engine_that_does_not_stamp_or_sends_the_same_log_again(tmp_path, answer, shown, caught_up):
    """A node's engine that answers every logs call alike (tests/support/fake_engine.py): unstamped frames
    are the job's bytes as they are; a second answer that repeats the first adds nothing."""
    from runner.transport.ssh import Remote
    from tests.unit.test_docker_api_answers import CONTAINER, _engine

    answers = {"/containers/[^/]+/json": {"body": CONTAINER}, "/containers/[^/]+/logs": {"raw": answer}}
    with _engine(tmp_path, answers, 71) as node, Remote(node.node()).connect() as r:
        log = FollowedLog(r.docker().containers.get("c0" * 32))
        assert b"".join(log.follow()) + b"".join(log.rest()) == shown
        assert log.caught_up == caught_up


def test_logs_follow_prints_the_lines_after_the_cut(sandbox, pushed, tmp_path, monkeypatch, capsys):
    """`runner logs RUN -f` on a running container whose engine's follow ends 50 frames in: all
    2,000 lines, once each, in order (before: the first 50)."""
    from runner.cli.main import build_parser
    from runner.cli.runs import cmd_logs
    from runner.inventory.choice import resolve_inventory
    from runner.planning.plan import LABEL_NODE, LABEL_RANK, LABEL_RUN

    follow_cut_at(monkeypatch, 50)
    run_id = "20261201-000000-" + tmp_path.name[-4:].encode().hex()[:4]
    r = remotes(sandbox)["node-1"]
    code = "import time\ntime.sleep(1)\nfor i in range(2000): print('step', i)"
    with r:
        c = r.docker().containers.run(image_of(sandbox), ["python", "-c", code], detach=True,
                                      name=f"logs-f-{tmp_path.name[-20:]}".replace("_", "-"),
                                      labels={LABEL_RUN: run_id, LABEL_NODE: "node-1", LABEL_RANK: "1"})
        try:
            args = build_parser().parse_args(["logs", run_id, "-f", "-i", str(sandbox), "--node", "node-1"])
            resolve_inventory(args)
            assert cmd_logs(args) == 0
        finally:
            c.remove(force=True)
    assert capsys.readouterr().out.splitlines() == [f"[node-1/1] step {i}" for i in range(2000)]


def test_a_failed_reading_again_is_one_warning_and_the_exit_code_stands(sandbox, pushed, tmp_path, monkeypatch,
                                                                        caplog):
    """The engine answering the second read with an error (here a 500 from the node's engine): the
    container's exit 0 is still the outcome, the node is not called lost, and one warning says the
    output may be short."""
    import docker.errors

    from runner.backends.ssh.watch import Watcher

    def refused(self, max_bytes=0):
        raise docker.errors.APIError("500 Server Error: engine busy")
        yield b""  # a generator, as rest() is

    follow_cut_at(monkeypatch, 10)
    monkeypatch.setattr(FollowedLog, "rest", refused)
    r = remotes(sandbox)["node-0"]
    name = f"logs-refused-{tmp_path.name[-20:]}".replace("_", "-")
    shown: list[str] = []
    sink = SimpleNamespace(write=lambda s: shown.extend(s.splitlines()), flush=lambda: None)
    with r:
        c = r.docker().containers.run(image_of(sandbox), ["python", "-c", "for i in range(100): print(i)"],
                                      name=name, detach=True)
        try:
            plan = SimpleNamespace(run_id="logs-refused", nodes=[SimpleNamespace(node="node-0", rank=0, container=name)])
            outcome = Watcher({"node-0": r}, plan, None, out=sink).run()
        finally:
            c.remove(force=True)
    assert outcome is None  # every node exited 0
    assert shown == [f"[node-0/0] {i}" for i in range(10)]
    warned = [m.getMessage() for m in caplog.records if "may be missing" in m.getMessage()]
    assert len(warned) == 1 and "engine busy" in warned[0] and warned[0].startswith("[node-0/0] "), warned
