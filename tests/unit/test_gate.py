"""runner.agents.gate, as the worker containers run it: no torchrun without the runner's go-file (one line,
exit 3, after its timeout); torchrun with the given arguments once the file appears."""

from __future__ import annotations

import re
import subprocess
import sys
import time

from tests.support.runner_helpers import wait_for
from tests.support.trainer_run import REPO, trainer_env

TORCHRUN_ARGS = ["--standalone", "--nproc-per-node", "1", "--no-python", "sh", "-c",
                 "echo started rank=$RANK at $(date +%s.%N)"]


def gate(go_file, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner.agents.gate", str(go_file), str(timeout), "--", *TORCHRUN_ARGS],
                          capture_output=True, text=True, cwd=REPO, env=trainer_env(), timeout=120)


def test_no_go_file_no_torchrun(tmp_path):
    proc = gate(tmp_path / "go", 1)
    assert proc.returncode == 3
    assert "started" not in proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "runner gate: no go from the runner within 1s (the master's port never listened, or the runner stopped); "
        "not starting torchrun"]


def test_go_file_starts_torchrun_with_its_arguments(tmp_path):
    """The gate imports torch first, then waits: the go-file is written only once the import is
    done (torch's library mapped into the gate), and torchrun's worker still ran after it."""
    import psutil

    go = tmp_path / "go"
    proc = subprocess.Popen([sys.executable, "-m", "runner.agents.gate", str(go), "120", "--", *TORCHRUN_ARGS],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=trainer_env())
    try:
        gate_proc = psutil.Process(proc.pid)
        wait_for(lambda: proc.poll() is not None or any("libtorch" in m.path for m in gate_proc.memory_maps()), 300)
        assert proc.poll() is None, proc.communicate()  # waiting for the go-file, not done
        written = time.time()
        go.touch()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    m = re.search(r"started rank=0 at ([\d.]+)", out)
    assert m, out
    assert float(m[1]) >= written  # torchrun's worker ran only after the go-file appeared
