"""Launch the trainer the way users do (single process or torchrun) and read what it wrote.

Shared by every trainer test so that equivalence tests compare like with like.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def trainer_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                   "MASTER_", "SLURM_", "OMPI_"))}
    # Two cores: one thread per process keeps multi-process runs from thrashing and makes
    # fp32 reductions reproducible.
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if extra:
        env.update(extra)
    return env


def run_trainer(out_dir: Path, *args: str, nproc: int = 1, env: dict[str, str] | None = None,
                timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    """Run `trainer` with --output-dir out_dir; nproc > 1 goes through torchrun --standalone."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "trainer"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "trainer"]
    cmd += [*args, "--output-dir", str(out_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=trainer_env(env),
                          cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"trainer exited {proc.returncode}\ncmd: {' '.join(cmd)}\n"
                             f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(out_dir: Path) -> list[dict]:
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(out_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(out_dir)]
