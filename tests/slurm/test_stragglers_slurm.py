"""A straggler under an attached `runner up --scheduler slurm` on the session Slurm cluster (issue 57,
the Slurm side of the straggler warning): the reduced Pi pipeline (pp 3, one rank a node, the ranks
plain processes on this machine: container none) runs; once every rank is past its first steps,
rank 2's process is given a third of a CPU (it is stopped for 2/3 of every 30 ms: SIGSTOP / SIGCONT,
as a CFS quota of 0.33 CPU runs it 33 ms of every 100). The runner reads the heartbeats from the
run dir and prints the SSH watch's one warning line, naming rank 2 and node-2
(runner/backends/stragglers.py); the job is then cancelled. About 40 s here, fixture aside."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from contract import heartbeat as fmt
from tests import IMAGE
from tests.support.runner_helpers import REPO, runner_cmd, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.sandbox]
CONFIG = str(REPO / "configs" / "pi-qwen3-3stage-tiny.yaml")
SLOW = 2
RUN_S, STOP_S = 0.010, 0.020   # a third of a CPU, in slices short against a step (hundreds of ms)


def _job(tmp: Path) -> Path:
    p = tmp / "straggler-job.yaml"
    p.write_text(yaml.safe_dump({"job": {
        "image": IMAGE, "config": CONFIG, "master_port": "auto", "grace_period": 5,
        "args": ["--train.steps", "100000", "--profile_batch", "none", "--data.seq_len", "256",
                 "--parallel.partition", "uniform_transformer"],
        "env": {"OMP_NUM_THREADS": "1"}}}))
    return p


def _throttle(pid: int, stop: threading.Event) -> None:
    """Run `pid` a third of the time until `stop`; it is left running."""
    try:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(STOP_S)
            os.kill(pid, signal.SIGCONT)
            time.sleep(RUN_S)
    except ProcessLookupError:
        pass
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_rank_on_a_third_of_a_cpu_is_named_once_by_the_attached_watch(slurm, tmp_path):
    out_p, err_p = tmp_path / "up.out", tmp_path / "up.err"
    with out_p.open("w") as out_f, err_p.open("w") as err_f:
        proc = subprocess.Popen(runner_cmd("up", "-i", str(slurm.local), "--job", str(_job(tmp_path))),
                                stdout=out_f, stderr=err_f, text=True, cwd=REPO, env={**os.environ, **slurm.env})
    job, stop = None, threading.Event()
    warned: list[str] = []
    try:
        m = wait_for(lambda: re.search(r"^run (\S+) submitted: Slurm job (\d+)", out_p.read_text(), re.M), 120)
        job, rd = m[2], slurm.shared / "runs" / m[1]
        beats = wait_for(lambda: (b := fmt.read_dir(rd)[0]) and len(b) == 3
                         and all(x.work and x.step > 3 for x in b.values()) and b, 180)
        assert beats[SLOW].node == "node-2"
        threading.Thread(target=_throttle, args=(beats[SLOW].pid, stop), daemon=True).start()

        def lines() -> list[str]:
            return [ln for ln in err_p.read_text().splitlines() if ln.startswith("runner: warning: straggler:")]

        warned = wait_for(lines, 90)
        time.sleep(6)  # three more rounds of the watch: still one line
        warned = lines()
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if job is not None:
            subprocess.run(["scancel", job], env={**os.environ, **slurm.env}, timeout=60)
    print(*warned, sep="\n")  # with -rP: the line, its figures
    assert len(warned) == 1, err_p.read_text()[-3000:]
    assert re.fullmatch(r"runner: warning: straggler: rank 2 \(node-2\) computes (\d+\.\d)x slower than the other "
                        r"ranks' median per FLOP it computes \(\d+\.\d{3} s busy of its \d+\.\d{3} s step\) for 5 "
                        r"steps in a row: it holds the others back", warned[0]), warned[0]
    assert float(re.search(r"computes (\d+\.\d)x", warned[0])[1]) >= 1.5
