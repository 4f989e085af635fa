"""bench/gpu_families.py on this CPU-only machine: `--smoke` runs its whole harness (one process per
row, the JSON rewritten after each) with one tiny row, launched as on the GPU host (the script's
path, PYTHONPATH=.) and unable to import what torch and transformers do not install; the numbers
only have to exist."""

from __future__ import annotations

import json
import subprocess
import sys

from tests import REPO
from tests.support.trainer_run import trainer_env


def test_gpu_families_smoke(tmp_path):
    # run as the GPU host runs it: the script's path, PYTHONPATH=. from the repository root
    proc = subprocess.run([sys.executable, "bench/gpu_families.py", "--smoke", "--out", str(tmp_path)], cwd=REPO,
                          env=trainer_env({"PYTHONPATH": "."}), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_families.json").read_text())
    assert [r["preset"] for r in data["rows"]] == ["tiny-t5"]
    for r in data["rows"]:
        assert "error" not in r, r
        assert r["step_time_s"] > 0 and r["samples_per_s"] > 0 and r["estimate_gib"] > 0 and r["params"] > 0
        assert r["datasets_imported"] is False  # synthetic data: `datasets` stays unimported on the GPU host
        # it ran with every distribution that torch and transformers do not install made unimportable
        assert {"datasets", "psutil", "pynvml"} <= set(r["absent"]) and r["foreign_modules"] == []
    assert "| tiny-t5 | 4 x 16 tok |" in proc.stdout
