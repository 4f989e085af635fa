"""Launch the trainer the way users do (single process or torchrun) and read what it wrote.

Shared by every trainer test so that equivalence tests compare like with like.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from tests import REPO
from tests.support.trainer_zygote import torchrun_argv, zygote_for

HOOKS = REPO / "tests" / "hooks"  # the switch of the trainer's test hooks (trainer/runtime/hold.py)
# job.sync entry giving a runner job's containers that folder at the same path (hold_env's PYTHONPATH).
HOOKS_SYNC = {"src": str(HOOKS), "dst": str(HOOKS)}


def free_port() -> int:
    """A loopback port nothing listens on now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                   "MASTER_", "SLURM_", "OMPI_"))}
    # Two cores: one thread per process keeps multi-process runs from thrashing and makes
    # fp32 reductions reproducible.
    env.setdefault("OMP_NUM_THREADS", "1")
    # What the trainer sets in its own process at import (trainer/data/text_sources.py): set here too, so
    # the env is the same before and after a test imports that module in the test process (the
    # warm trainer serves only runs whose import-time env equals its own: tests/support/trainer_zygote.py).
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    # torch's inductor writes its default cache dir into os.environ the first time it looks (an
    # in-process compile or dry run); name the same dir from the start.
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
    # Inductor compiles in the run's own process: its pool of compile workers, started from a run
    # forked by the warm trainer, never answered (the run waited for its first kernel until the
    # test's timeout; tests/distributed/test_trainer_speed.py with an empty cache), and on two cores a pool
    # buys nothing.
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    # tests/hooks first: its sitecustomize switches on the trainer's test hooks (trainer/runtime/hold.py)
    # in every process started here. An extra PYTHONPATH (hold_env's) is put in front, not instead.
    paths = [str(HOOKS), str(REPO), *env.get("PYTHONPATH", "").split(os.pathsep)]
    if extra:
        env.update(extra)
        paths = [*extra.get("PYTHONPATH", "").split(os.pathsep), *paths]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    return env


def trainer_cmd(out_dir: Path, *args: str, nproc: int = 1, node: tuple[int, int, int] | None = None) -> list[str]:
    """`trainer ... --output-dir out_dir`; nproc > 1 goes through torchrun --standalone, and
    node=(nnodes, node_rank, port) makes it one "node" of a static rendezvous on 127.0.0.1:port."""
    run = [sys.executable, "-m", "torch.distributed.run"]
    if node is not None:
        nnodes, rank, port = node
        cmd = [*run, "--nnodes", str(nnodes), "--node-rank", str(rank), "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "trainer"]
    elif nproc == 1:
        cmd = [sys.executable, "-m", "trainer"]
    else:
        cmd = [*run, "--standalone", f"--nproc-per-node={nproc}", "-m", "trainer"]
    return [*cmd, *args, "--output-dir", str(out_dir)]


def _run(cmd: list[str], entry: str, argv: list[str], env: dict[str, str] | None, timeout: float,
         fresh: bool) -> subprocess.CompletedProcess:
    """`cmd` as a process, or (fresh=False) `entry` with `argv` forked from the session's warm
    trainer (tests/support/trainer_zygote.py: the same run without importing torch and transformers again)."""
    full_env = trainer_env(env)
    zygote = None if fresh else zygote_for(full_env, trainer_env(), REPO)
    if zygote is None:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)
    rc, out, err = zygote.run(entry, argv, full_env, REPO, timeout)
    return subprocess.CompletedProcess(cmd, rc, out, err)


def run_trainer(out_dir: Path, *args: str, nproc: int = 1, env: dict[str, str] | None = None,
                timeout: float = 600, check: bool = True, fresh: bool = False) -> subprocess.CompletedProcess:
    """Run `trainer` to the end (see trainer_cmd); raise with its output if it fails and check is set.
    The run is forked from the session's warm trainer (tests/support/trainer_zygote.py; several processes:
    torchrun's own CLI with its workers forked) unless `fresh` (a test of what a new interpreter
    does: import-time behaviour, memory, start-up) or, for several processes, `check` is off."""
    cmd = trainer_cmd(out_dir, *args, nproc=nproc)
    argv = [*args, "--output-dir", str(out_dir)]
    if nproc == 1:
        proc = _run(cmd, "trainer", argv, env, timeout, fresh)
    else:
        proc = _run(cmd, "torchrun", torchrun_argv(nproc, REPO / "tests" / "support" / "trainer_entry.py", argv), env, timeout,
                    fresh or not check)
    if check and proc.returncode != 0:
        raise AssertionError(f"trainer exited {proc.returncode}\ncmd: {' '.join(cmd)}\n"
                             f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}")
    return proc


def run_trainers(runs: list[tuple[Path, tuple[str, ...]]], nproc: int = 1, timeout: float = 900) -> None:
    """Run several `trainer` commands of one world size one after another in the same processes
    (tests/support/trainer_sequence.py: one torchrun, one process group), paying Python's, torch's and
    transformers' start-up (~90% of a tiny run's CPU) once; each is still the trainer's own entry
    point with its own output directory. One run goes through run_trainer."""
    if len(runs) == 1:
        run_trainer(runs[0][0], *runs[0][1], nproc=nproc, timeout=timeout)
        return
    argvs = [[*args, "--output-dir", str(out)] for out, args in runs]
    spec = Path(runs[0][0]).parent / f".trainer-sequence-{len(argvs)}-{nproc}.json"
    spec.write_text(json.dumps(argvs))
    head = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                 f"--nproc-per-node={nproc}"]
    cmd = [*head, "-m", "tests.support.trainer_sequence", str(spec)]
    if nproc == 1:
        proc = _run(cmd, "sequence", [str(spec)], None, timeout, False)
    else:
        proc = _run(cmd, "torchrun", torchrun_argv(nproc, REPO / "tests" / "support" / "trainer_sequence.py", [str(spec)]), None,
                    timeout, False)
    if proc.returncode != 0:
        raise AssertionError(f"trainer sequence exited {proc.returncode}\ncmd: {' '.join(cmd)} ({spec})\n"
                             f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}")


def start_trainer(out_dir: Path, *args: str, nproc: int = 1, env: dict[str, str] | None = None,
                  log: Path | None = None, node: tuple[int, int, int] | None = None) -> subprocess.Popen:
    """Start `trainer` in the background (its own session, so signals reach only what a test sends
    them to); output to `log` (merged) or to pipes. `node`: see trainer_cmd."""
    cmd = trainer_cmd(out_dir, *args, nproc=nproc, node=node)
    if log is not None:
        with log.open("w") as f:
            return subprocess.Popen(cmd, cwd=REPO, env=trainer_env(env), stdout=f, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
    return subprocess.Popen(cmd, cwd=REPO, env=trainer_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


# --- holding a run at a known point (trainer/runtime/hold.py) ---------------------------------------

def hold_env(*points: str) -> dict[str, str]:
    """Env that holds every rank at each "POINT:STEP" until release() (e.g. hold_env("step:3")).
    The hold is test support, switched on only by tests/hooks/ on PYTHONPATH (trainer/runtime/hold.py):
    a runner job that holds also needs HOOKS_SYNC in its job.sync (Slurm reads the folder in place)."""
    return {"TRAINER_TEST_HOLD": ",".join(points), "PYTHONPATH": str(HOOKS)}


def held(out_dir: Path, point: str, ranks, what: str = "held") -> bool:
    """Whether every rank in `ranks` is held at `point` ("step-3"), or (what="signalled") has also
    received its preemption signal there."""
    return all((Path(out_dir) / ".hold" / f"{point}.{what}.rank{r}").is_file() for r in ranks)


def release(out_dir: Path, point: str) -> None:
    """Let every rank held at `point` go (safe before any rank got there: they will not wait)."""
    d = Path(out_dir) / ".hold"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{point}.go").write_text("")


def read_metrics(out_dir: Path) -> list[dict]:
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(out_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(out_dir)]


# Fields of a metrics.jsonl record that measure time or memory: different on every run.
TIMING_FIELDS = frozenset({"tokens_per_s", "tokens_per_s_per_device", "samples_per_s", "mfu", "memory_bytes",
                           "memory_gib", "memory_reserved_gib", "step_time_s", "time", "dp_sync_s",
                           "rank_step_s", "rank_wait_s", "stragglers"})


# On the first record of each start (a resume too): where that start's layout began. A straight
# run and one resumed midway log the same numbers, not the same starts.
START_FIELDS = frozenset({"layout"})


def numeric_metrics(out_dir: Path) -> list[dict]:
    """metrics.jsonl without its timing and start fields: what two runs of one job must log bit for bit."""
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS | START_FIELDS} for r in read_metrics(out_dir)]


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
