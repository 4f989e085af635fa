"""A stuck rank under an attached `runner up --scheduler slurm` on the session Slurm cluster (issue 57,
the Slurm side of the hang watch): the reduced Pi pipeline (pp 3, one rank a node) runs with
`--hang-timeout 10`; once every rank is past its first steps, rank 1's process (a plain process on
the host: container none) is sent SIGSTOP. The runner reads the heartbeats from the run dir, names
node-1 and rank 1 in one line, takes every rank's stacks through one `srun --overlap` step of the
job (the live ranks through their faulthandler, the stopped one through py-spy), kills the job
and exits 5; submitted from this machine and through the login node. The bound is the hang timeout plus 60 s from the stop (the wait's own timeout; the
duration itself is not asserted)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from contract import heartbeat as fmt
from tests import IMAGE
from tests.support.runner_helpers import REPO, runner_cmd, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.sandbox]
CONFIG = str(REPO / "configs" / "pi-qwen3-3stage-tiny.yaml")
HANG_S = 10
LOOP_FRAMES = ("train_step", "_loop")


def _job(tmp: Path) -> Path:
    p = tmp / "hang-job.yaml"
    p.write_text(yaml.safe_dump({"job": {
        "image": IMAGE, "config": CONFIG, "master_port": "auto", "grace_period": 5,
        "args": ["--train.steps", "100000", "--profile_batch", "none", "--parallel.partition", "uniform_transformer"],
        "env": {"OMP_NUM_THREADS": "1"}}}))
    return p


@pytest.mark.parametrize("via", ["here", "login"])
def test_stopped_rank_named_stacked_and_job_cancelled_with_the_hang_code(slurm, tmp_path, via):
    """via here: submitted from this machine, the run dir read locally; login: through the login
    node, the run dir read over SFTP and the stacks step started there."""
    out_p, err_p = tmp_path / "up.out", tmp_path / "up.err"
    inv, env = (slurm.local, slurm.env) if via == "here" else (slurm.inv, {})
    with out_p.open("w") as out_f, err_p.open("w") as err_f:
        proc = subprocess.Popen(runner_cmd("up", "-i", str(inv), "--job", str(_job(tmp_path)),
                                           "--hang-timeout", str(HANG_S)),
                                stdout=out_f, stderr=err_f, text=True, cwd=REPO, env={**os.environ, **env})
    stuck, job = None, None
    try:
        m = wait_for(lambda: re.search(r"^run (\S+) submitted: Slurm job (\d+)", out_p.read_text(), re.M), 120)
        run_id, job = m[1], m[2]
        rd = slurm.shared / "runs" / run_id
        # every rank past its first steps: the steady budget (the hang timeout) is the one in force
        beats = wait_for(lambda: (b := fmt.read_dir(rd)[0]) and len(b) == 3
                         and all(x.steps_timed >= 2 and x.step > 5 for x in b.values()) and b, 180)
        stuck = beats[1]
        assert stuck.node == "node-1"
        os.kill(stuck.pid, signal.SIGSTOP)
        proc.wait(timeout=HANG_S + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            if job is not None:
                subprocess.run(["scancel", job], env={**os.environ, **slurm.env}, timeout=60)
    err = err_p.read_text()
    assert proc.returncode == 5, err[-3000:] + out_p.read_text()[-3000:]
    hang = [ln for ln in err.splitlines() if ln.startswith("runner: hang: ")]
    assert len(hang) == 1, err[-3000:]
    assert re.match(rf"runner: hang: rank 1 \(node-1, pid {stuck.pid}\) at step \d+, \w+.*: no progress for \d+ s "
                    rf"\(budget {HANG_S} s\); its process is stopped or frozen", hang[0]), hang[0]
    assert "runner: stacks of 3/3 rank(s) in hang-rank<R>.txt in the run dir" in err, err[-3000:]
    assert f"runner: error: run {run_id}: node node-1 (rank 1) failed: hang: rank 1" in err, err[-3000:]
    assert (rd / "slurm" / "down").exists()  # no requeue after a hang
    files = sorted(p.name for p in rd.glob("hang-rank*.txt"))
    assert files == ["hang-rank0.txt", "hang-rank1.txt", "hang-rank2.txt"], files
    for r in range(3):
        text = (rd / f"hang-rank{r}.txt").read_text()
        assert any(f in text for f in LOOP_FRAMES), (r, text[:2000])
    one = (rd / "hang-rank1.txt").read_text()
    assert "process state T" in one and "py-spy dump --nonblocking" in one, one[:1000]
    assert "faulthandler (SIGUSR2)" in (rd / "hang-rank0.txt").read_text()
    # the job is over: no rank of it left running (stopped or not)
    wait_for(lambda: not any(_runs(b.pid) for b in fmt.read_dir(rd)[0].values()), 30)


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
