"""A rank stuck after its last word (issue 57, a teardown hang), with a real gloo run: 2 ranks under
torchrun; rank 1's process is sent SIGSTOP the moment its heartbeat says `done` (its file polled),
so it never exits and torchrun waits for it, as a container whose rank hangs in
destroy_process_group or NCCL's teardown would. The phase rule stays quiet (every heartbeat says
ended: the gap), and contract.hang.Watch.teardown, told which ranks' processes still run by the
SSH watch's own probe (runner/backends/ssh/teardown.py PROBE, here on this machine's pids), names
rank 1 alone; the stacks helper then reads the stopped process (py-spy), as for any hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from contract import hang as rule
from contract import heartbeat as fmt
from runner.backends.ssh import teardown
from tests.distributed.test_hang import kill_all, stacks_tool, until
from tests.support.trainer_run import start_trainer

STEPS = 4
BUDGET_S = 2.0  # the job's hang timeout, and the teardown floor lowered to 0: a 2-s teardown budget


def stop_at_done(out: Path, rank: int, proc: subprocess.Popen, timeout: float = 300) -> fmt.Heartbeat:
    """Poll rank's heartbeat file every millisecond; SIGSTOP its process as soon as it says done
    (the process then still runs its teardown: trainer.close, destroy_process_group, exit)."""
    path = fmt.path_of(out, rank)
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        try:
            b = fmt.read(path)
        except (OSError, ValueError):
            b = None
        if b is not None and b.phase == "done":
            os.kill(b.pid, signal.SIGSTOP)
            return b
        time.sleep(0.001)
    raise AssertionError(f"rank {rank} never said done while the run ran (exit {proc.returncode})")


def teardown_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def running(beats: dict[int, fmt.Heartbeat]) -> set[int]:
    """The SSH watch's probe, run here: the ranks whose process (pid and start time) still runs."""
    args = [f"{b.rank}:{b.pid}:{b.pid_start}" for b in beats.values()]
    p = subprocess.run([sys.executable, "-c", teardown.PROBE, *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return {int(x) for x in p.stdout.split()}


@pytest.mark.multiproc
def test_a_rank_stopped_after_done_is_named_as_a_teardown_hang(tmp_path):
    out = tmp_path / "run"
    proc = start_trainer(out, "configs/tiny.yaml", "--train.steps", str(STEPS), "--watch.heartbeat_s", "0.05",
                         nproc=2, log=tmp_path / "torchrun.log")
    stuck = None
    try:
        stuck = stop_at_done(out, 1, proc)
        # the stop lands asynchronously: state T within a moment, or the process had already exited
        state = until(lambda: (st := teardown_state(stuck.pid)) in ("T", "gone", "Z") and st, proc, timeout=10)
        assert state == "T", f"rank 1 exited before it was stopped (state {state})"
        watch = rule.Watch(hang_timeout_s=BUDGET_S, teardown_min_s=0.0)
        quiet: list[str] = []

        def judge() -> rule.Verdict | None:
            now = time.monotonic()
            beats = fmt.read_dir(out)[0]
            for b in beats.values():
                watch.update(b, now)
            if (v := watch.verdict(now)) is not None:
                quiet.append(v.line)
            return watch.teardown(now, running(beats))

        v = until(judge, proc, timeout=120, interval=0.2)
        beats = fmt.read_dir(out)[0]
        assert proc.poll() is None  # torchrun still waits for the stopped rank
        assert [b.phase for b in beats.values()] == ["done", "done"] and quiet == []  # the phase rule: quiet
        assert running(beats) == {1}  # rank 0 has exited; the probe tells them apart
        assert v.teardown and v.culprits == [1] and v.budget_s == BUDGET_S
        assert v.line.startswith(f"hang: rank 1 ({stuck.node}, pid {stuck.pid}) finished step {STEPS} but its "
                                 f"process has not exited for ")
        assert v.line.endswith(f"(teardown; budget {BUDGET_S:.0f} s)")
        stacks_tool(out)
        text = (out / "hang-rank1.txt").read_text()
        assert "process state T" in text.splitlines()[0] and "py-spy dump --nonblocking" in text.splitlines()[0]
        assert "MainThread" in text, text[:2000]
    finally:
        if stuck is not None:
            try:
                os.kill(stuck.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        kill_all(proc)
