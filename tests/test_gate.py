"""runner.gate, as the worker containers run it: no torchrun without the runner's go-file (one line,
exit 3, after its timeout); torchrun with the given arguments once the file appears."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

from tests.trainer_run import REPO, trainer_env

TORCHRUN_ARGS = ["--standalone", "--nproc-per-node", "1", "--no-python", "sh", "-c",
                 "echo started rank=$RANK at $(date +%s.%N)"]


def gate(go_file, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner.gate", str(go_file), str(timeout), "--", *TORCHRUN_ARGS],
                          capture_output=True, text=True, cwd=REPO, env=trainer_env(), timeout=120)


def test_no_go_file_no_torchrun(tmp_path):
    proc = gate(tmp_path / "go", 1)
    assert proc.returncode == 3
    assert "started" not in proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "runner gate: no go from the runner within 1s (the master's port never listened, or the runner stopped); "
        "not starting torchrun"]


def test_go_file_starts_torchrun_with_its_arguments(tmp_path):
    go = tmp_path / "go"
    written = {}

    def later():
        time.sleep(4)  # well after the gate's torch import: it must be waiting, not done
        go.touch()
        written["t"] = time.time()

    t = threading.Thread(target=later)
    t.start()
    proc = gate(go, 60)
    t.join()
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"started rank=0 at ([\d.]+)", proc.stdout)
    assert m, proc.stdout
    assert float(m[1]) >= written["t"]  # torchrun's worker ran only after the go-file appeared
