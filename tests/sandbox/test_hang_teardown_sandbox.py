"""A rank that never exits after `done`, under `runner up` on the sandbox cluster (issue 57, a
teardown hang): the reduced Pi pipeline (pp 3, one stage a node) runs a few steps; rank 1's process
is sent SIGSTOP (from this machine, by its host pid, found beforehand) the moment its heartbeat file
says `done`, so it never exits: its container keeps running, and so do node-0's and node-2's, whose
torchrun agents wait for node-1's at the exit barrier. Before, every heartbeat said ended, the hang
watch stayed quiet and `runner up` waited for ever. Now the watch finds every rank ended and
containers still running past the teardown budget (max(60 s, the 15-s hang timeout)), asks the
running containers which ranks' processes are still there (runner/backends/ssh/teardown.py), names
rank 1 on node-1 in one line, takes the stacks (py-spy reads the stopped process), stops the run,
and exits 5, without the relaunch --max-restarts asks for after other failures (its training had
ended). The wait's own timeout bounds it (no duration is measured)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from contract import hang as rule
from contract import heartbeat as fmt
from tests import IMAGE, REPO
from tests.support.runner_helpers import node_workdir, runner_cmd, wait_for

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]
CONFIG = "configs/pi-qwen3-3stage-tiny.yaml"
HANG_S = 15
STEPS = 6


def host_pid(run_id: str, rank: int, ns_pid: int) -> int | None:
    """The pid on this machine of the rank whose heartbeat says `ns_pid` (its container's pid)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            nspid = next((ln.split()[1:] for ln in status.splitlines() if ln.startswith("NSpid:")), [])
            if not nspid or int(nspid[-1]) != ns_pid:
                continue
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"RUN_ID={run_id}".encode() in env and f"RANK={rank}".encode() in env:
            return int(entry)
    return None


def read(path: Path) -> fmt.Heartbeat | None:
    try:
        return fmt.read(path)
    except (OSError, ValueError):  # not there yet
        return None


def state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_rank_that_does_not_exit_after_done_is_a_hang(sandbox, pushed, tmp_path):
    job = tmp_path / "teardown-job.yaml"
    job.write_text(yaml.safe_dump({"job": {
        "image": IMAGE, "config": str(REPO / CONFIG), "master_port": "auto", "grace_period": 5,
        "args": ["--train.steps", str(STEPS), "--profile_batch", "none", "--parallel.partition", "uniform_transformer",
                 "--watch.heartbeat_s", "0.2"],
        "env": {"OMP_NUM_THREADS": "1"}}}))
    logs = tmp_path / "logs"
    logs.mkdir()
    out_f, err_f = (logs / "up.out").open("w"), (logs / "up.err").open("w")
    proc = subprocess.Popen(runner_cmd("up", "-i", str(sandbox), "--job", str(job), "--logs-dir", str(logs),
                                       "--hang-timeout", str(HANG_S), "--max-restarts", "1"),
                            stdout=out_f, stderr=err_f, text=True, cwd=REPO)
    pid = None
    try:
        run_id = wait_for(lambda: (m := re.search(r"run (\S+) started", (logs / "up.out").read_text())) and m[1], 180)
        path = fmt.path_of(node_workdir(sandbox, "node-1") / "runs" / run_id, 1)
        first = wait_for(lambda: read(path), 180, interval=0.05)
        pid = wait_for(lambda: host_pid(run_id, 1, first.pid), 30, interval=0.1)
        done = None
        while proc.poll() is None and done is None:  # its last word: stopped at once, before it exits
            b = read(path)
            if b is not None and b.phase == "done":
                os.kill(pid, signal.SIGSTOP)
                done = b
            time.sleep(0.001)
        assert done is not None and done.step == STEPS, (logs / "up.err").read_text()[-3000:]
        assert wait_for(lambda: state(pid) in ("T", "Z", "gone") and state(pid), 10) == "T"
        budget = rule.teardown_budget(done.median_step_s, HANG_S)
        assert budget == rule.TEARDOWN_MIN_S
        try:  # the budget from the last rank's done, a poll, the probe, the stacks, the stop
            proc.wait(timeout=budget + 60)
        except subprocess.TimeoutExpired:
            pytest.fail("runner up still running after the teardown budget + 60 s:\n"
                        + (logs / "up.err").read_text()[-3000:])
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out_f.close()
        err_f.close()
    err = (logs / "up.err").read_text()
    assert proc.returncode == 5, err[-3000:]
    # its training had ended: --max-restarts 1 does not launch it again (launch.py trained_out)
    assert (logs / "up.out").read_text().count(f"run {run_id} started") == 1, err[-3000:]
    assert "restart 1/1" not in err, err[-3000:]
    hang = [ln for ln in err.splitlines() if ln.startswith("runner: hang: ")]
    assert len(hang) == 1, err[-3000:]
    assert re.match(rf"runner: hang: rank 1 \(node-1, pid {done.pid}\) finished step {STEPS} but its process has "
                    rf"not exited for \d+ s \(teardown; budget {budget:.0f} s\); taking every rank's stacks", hang[0]), \
        hang[0]
    assert "runner: stacks taken on " in err, err[-3000:]
    run_dir = node_workdir(sandbox, "node-1") / "runs" / run_id
    stacks = (run_dir / "hang-rank1.txt").read_text()
    assert "process state T" in stacks and "py-spy dump --nonblocking" in stacks, stacks[:1000]
    status = json.loads((run_dir / "runner-status.json").read_text())
    assert status["error"].startswith("hang: rank 1 (node-1"), status
