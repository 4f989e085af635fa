"""The launch contract every backend keeps (docs/contract.md): the torchrun line each node runs and
the variables that make torchrun hand `down`'s SIGTERM (and Slurm's SIGUSR1) to the ranks in time
for their preempt checkpoint. SSH (runner/planning/plan.py), Slurm (runner/backends/slurm/plan.py) and
the Kubernetes export build their commands from here, so the three cannot drift apart."""

from __future__ import annotations

# torchrun forwards these signals to the ranks (SIGUSR1 is Slurm's --signal; torch 2.13's default
# leaves it out and dies on it), then waits up to the shutdown timeout before SIGKILLing them: keep
# that inside the grace `down` gives, or a slow preempt checkpoint is cut off at torchrun's default
# 30 s. Env, not flags, so an older torchrun just ignores them.
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def signal_env(grace_period: float) -> dict[str, str]:
    """torchrun's PET_* signal handling for a job whose `down` waits grace_period seconds."""
    return {"PET_SIGNALS_TO_HANDLE": SIGNALS_TO_HANDLE, "PET_SHUTDOWN_TIMEOUT": str(max(1, int(grace_period) - 2))}


def entry_argv(job, config: str | None) -> list[str]:
    """What torchrun starts on each rank: the job's own program (`--no-python`, exec'd as is) or
    `-m trainer` with the run's config (None: the job has none)."""
    if job.command:
        return ["--no-python", *job.command]
    return ["-m", "trainer", *(["--config", config] if config else [])]


def direct_argv(job, config: str | None, args: list[str]) -> list[str]:
    """One process without torchrun (a node of one rank joining a running job in place: its rank
    and world come with regroup.json, not from a launcher): the job's program, or the trainer. No
    torchrun agent importing torch beside it on the node's CPU, no agent rendezvous, no second
    interpreter: 2.4 s of a newcomer's start-up on the namespaced sandbox."""
    return [*job.command, *args] if job.command else ["python", *entry_argv(job, config), *args]


# torchrun with its exit barrier mended (runner/agents/torchrun.py) where the environment that runs
# it (this project's image, or a virtualenv with this project) has it, else the torchrun on PATH:
# for the schedulers whose script runs in an environment the runner does not inspect (Slurm's task,
# a Kubernetes pod; the SSH runner reads the image's label instead: runner/planning/plan.py). `$launch`.
MENDED_TORCHRUN = "runner.agents.torchrun"
CHOOSE_TORCHRUN = f"launch=torchrun; python -c 'import {MENDED_TORCHRUN}' 2>/dev/null && launch='python -m {MENDED_TORCHRUN}'"


def torchrun_argv(job, nnodes: int | str, node_rank: int | str, nproc: int, master_addr: str,
                  master_port: int | str, config: str | None, args: list[str]) -> list[str]:
    """One node's torchrun: static rendezvous at the master, no restarts of its own (the runner
    decides about restarts: `--max-restarts`, Slurm's `--requeue`)."""
    return ["torchrun", "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--nproc-per-node", str(nproc),
            "--master-addr", master_addr, "--master-port", str(master_port),
            "--rdzv-backend", "static", "--max-restarts", "0", *entry_argv(job, config), *args]
