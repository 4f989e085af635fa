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


# Fields of a metrics.jsonl record that measure time or memory: different on every run.
TIMING_FIELDS = frozenset({"tokens_per_s", "tokens_per_s_per_device", "samples_per_s", "mfu", "memory_bytes",
                           "memory_mb", "step_time_s", "time"})


def numeric_metrics(out_dir: Path) -> list[dict]:
    """metrics.jsonl without its timing fields: what two runs of one job must log bit for bit."""
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in read_metrics(out_dir)]


def checkpoint_tensors(step_dir: Path) -> dict:
    """Every tensor of a DCP checkpoint directory (model, optimizer), keyed by its flattened name;
    read in this process with torch's own DCP -> torch.save conversion."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            elif isinstance(v, torch.Tensor):
                out[f"{prefix}{k}"] = v
        return out

    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "state.pt"
        dcp_to_torch_save(str(step_dir), str(dst))
        return flat(torch.load(dst, weights_only=False))
