"""bench/gpu_families.py on this CPU-only machine: `--smoke` runs its whole harness (one process per
row, the JSON rewritten after each) with one tiny row; the numbers only have to exist."""

from __future__ import annotations

import json
import subprocess
import sys

from tests import REPO
from tests.trainer_run import trainer_env


def test_gpu_families_smoke(tmp_path):
    out = tmp_path / "gpu_families.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_families", "--smoke", "--json", str(out)], cwd=REPO,
                          env=trainer_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["preset"] for r in data["rows"]] == ["tiny-t5"]
    for r in data["rows"]:
        assert "error" not in r, r
        assert r["step_time_s"] > 0 and r["samples_per_s"] > 0 and r["estimate_gib"] > 0 and r["params"] > 0
        assert r["datasets_imported"] is False  # synthetic data: `datasets` stays unimported on the GPU host
    assert "| tiny-t5 | 4 x 16 tok |" in proc.stdout
