"""`python -m trainer.tools.stacks` against small stand-in ranks (no torch): a live one answers its
SIGUSR2 handler from inside a blocking C call, a stopped one is read by py-spy, a process that does
not catch SIGUSR2 is never sent it (its default action would end it), and the files it writes
never follow a link the job left in the run directory."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from contract import heartbeat as fmt
from tests import REPO
from tests.support.runner_helpers import wait_for
from trainer.tools.stacks import write_file

RANK = textwrap.dedent("""
    import os, select, sys
    from trainer.runtime import heartbeat, stacks
    out, rank, handler, beat = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
    w = heartbeat.HeartbeatWriter(out, rank, 2, interval_s=0.05 if beat else 0)
    heartbeat.start(w)
    if handler:
        stacks.install(out, rank)
    w.step_start(4)
    w.mark("recv", peer=1 - rank)

    def blocked_in_a_collective():
        select.select([], [], [])   # a C call that never returns, the GIL released

    blocked_in_a_collective()
""")


def start_rank(out: Path, rank: int, handler: bool, beat: bool = True) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), RANK=str(rank), OUTPUT_DIR=str(out))
    env.pop("NODE_NAME", None)
    p = subprocess.Popen([sys.executable, "-c", RANK, str(out), str(rank), "1" if handler else "0",
                          "1" if beat else "0", "trainer"], env=env, start_new_session=True)
    if beat:
        wait_for(lambda: (b := fmt.read_dir(out)[0].get(rank)) is not None and b.phase == "recv", 60, 0.05)
    else:  # its handler is in place once its staging file exists
        wait_for(lambda: fmt.stacks_staging(out, rank).exists(), 60, 0.05)
        time.sleep(0.5)
    return p


def helper(out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("NODE_NAME", None)
    return subprocess.run([sys.executable, "-m", "trainer.tools.stacks", "--out", str(out), "--wait", "3"],
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def ranks(tmp_path):
    procs: list[subprocess.Popen] = []
    yield tmp_path, procs
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        p.kill()
        p.wait(timeout=30)


def test_live_rank_answers_from_inside_a_c_call_and_a_stopped_one_is_read_by_py_spy(ranks):
    out, procs = ranks
    if shutil.which("py-spy", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("py-spy is not installed (pip install -e '.[dev]')")
    procs += [start_rank(out, 0, handler=True), start_rank(out, 1, handler=True)]
    os.kill(procs[1].pid, signal.SIGSTOP)
    p = helper(out)
    assert p.returncode == 0, p.stdout + p.stderr
    live, stopped = (out / "hang-rank0.txt").read_text(), (out / "hang-rank1.txt").read_text()
    assert "faulthandler (SIGUSR2)" in live.splitlines()[0] and "blocked_in_a_collective" in live
    assert "# heartbeat: node " in live and "step 4, recv from rank 1" in live
    assert "process state T" in stopped.splitlines()[0] and "py-spy dump --nonblocking" in stopped.splitlines()[0]
    assert "blocked_in_a_collective" in stopped
    assert procs[0].poll() is None and procs[1].poll() is None  # both still there: nothing was stopped or killed
    assert Path(f"/proc/{procs[1].pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_a_process_that_does_not_catch_the_signal_is_not_sent_it(ranks):
    out, procs = ranks
    procs.append(start_rank(out, 0, handler=False))
    p = helper(out)
    time.sleep(0.5)
    assert procs[0].poll() is None  # SIGUSR2's default action would have ended it
    text = (out / "hang-rank0.txt").read_text()
    if shutil.which("py-spy", path=str(Path(sys.executable).parent)) is not None:
        assert p.returncode == 0 and "py-spy dump" in text.splitlines()[0] and "blocked_in_a_collective" in text
    else:
        assert p.returncode == 3 and "no stacks" in text


def test_no_rank_here_exits_1(tmp_path):
    p = helper(tmp_path)
    assert p.returncode == 1 and "no trainer rank" in p.stdout


def test_the_hang_file_replaces_a_link_never_follows_it(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / "hang-rank3.txt").symlink_to(victim)
    path = write_file(out, 3, "stacks\n")
    assert victim.read_text() == "keep me" and not path.is_symlink() and path.read_text() == "stacks\n"
    assert [p.name for p in out.iterdir()] == ["hang-rank3.txt"]  # no temporary file left


def test_a_rank_without_heartbeat_is_found_by_its_run_directory_only(ranks, tmp_path):
    out, procs = ranks
    other = tmp_path / "other-run"
    procs.append(start_rank(other, 0, handler=True, beat=False))  # another job's rank on this machine
    assert helper(out).returncode == 1  # not ours: left alone
    assert fmt.stacks_staging(other, 0).read_text() == ""
    p = helper(other)
    assert p.returncode == 0, p.stdout + p.stderr
    text = (other / "hang-rank0.txt").read_text()
    assert "faulthandler (SIGUSR2)" in text.splitlines()[0] and "blocked_in_a_collective" in text
    assert "# heartbeat:" not in text  # found by /proc: no heartbeat to quote
