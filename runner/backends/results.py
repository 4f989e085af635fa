"""What the backends' verbs return: typed results a script uses without parsing text, the same
types on every backend (runner.api re-exports them).

- Plan: what `up` would start where (`up --dry-run` prints its render()); submit() takes it.
- Run: a started (or submitted) run; RunStatus and NodeStatus: where a run is, in ONE schema for
  `status --json` and `ls --json` on every backend (run_status.schema.json beside this file,
  docs/run-status.md; SCHEMA_VERSION changes when a field changes meaning or goes away).
- LogLine, CollectReport, CancelReport, CheckReport: what logs, collect, cancel and check give back.

Nothing here imports a backend, the transport or the inventory: the CLI and runner.api read these
types without paying for paramiko or docker.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
SCHEMA_FILE = Path(__file__).with_name("run_status.schema.json")
# A run's state on every backend (RunStatus.state); the backend's own word is RunStatus.native_state.
PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED, UNKNOWN = "pending", "running", "succeeded", "failed", "stopped", "unknown"
STATES = (PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED, UNKNOWN)
ENDED = frozenset({SUCCEEDED, FAILED, STOPPED})


@dataclass(frozen=True)
class NodeLaunch:
    """One node's part of a Plan: what its container (or Slurm task) runs. Secret-looking values
    of `env` are masked; the env_file's names are in `secret_keys`, never their values."""

    node: str
    rank: int
    host: str
    arch: str | None
    image: str | None
    command: list[str]
    env: dict[str, str]
    secret_keys: list[str]
    run_dir: str


@dataclass
class Plan:
    """What `up` would start where, computed without contacting anything (`Backend.plan`).

    `nodes` is in node-rank order (rank 0 is the master). `render()` is exactly what
    `runner up --dry-run` prints. `refusal` is the one-line reason the job cannot fit (the memory
    estimate), or None; `submit()` raises it unless the options say `ignore_sizing`.
    `detail` is the backend's own plan (runner.planning.plan.Plan for SSH, SlurmPlan for Slurm),
    for what the common fields do not say (the sbatch script, the container labels)."""

    backend: str
    inventory: str
    run_id: str
    options: Any
    text: str = field(repr=False)
    master_addr: str | None = None
    master_port: int | str | None = None
    refusal: str | None = None
    detail: Any = field(default=None, repr=False)
    # What submit() needs that is not for showing (the env_file's values, the notify spec, the
    # loaded inventory): kept out of repr, as_dict and render.
    prepared: Any = field(default=None, repr=False, compare=False)
    # Makes `nodes` from `detail` when first asked: `up --dry-run` of 10,000 nodes only renders.
    launches: Callable[[], list[NodeLaunch]] = field(default=list, repr=False, compare=False)

    @functools.cached_property
    def nodes(self) -> list[NodeLaunch]:
        """Every node's part, in node-rank order (rank 0 is the master)."""
        return self.launches()

    def render(self) -> str:
        """The plan as `runner up --dry-run` prints it (secret values masked), newline-terminated."""
        return self.text

    @property
    def ranks(self) -> dict[str, int]:
        return {n.node: n.rank for n in self.nodes}

    @property
    def images(self) -> dict[str, str | None]:
        return {n.node: n.image for n in self.nodes}

    def as_dict(self) -> dict:
        return {"backend": self.backend, "inventory": self.inventory, "run_id": self.run_id,
                "master_addr": self.master_addr, "master_port": self.master_port, "refusal": self.refusal,
                "nodes": [vars(n).copy() for n in self.nodes]}


@dataclass
class Run:
    """A run submit() started (attached: it has ended, `exit_code` says how; detached: it runs on).
    Any RunStatus's run_id names the same run: every verb also takes a run id, or a prefix of one."""

    backend: str
    inventory: str
    run_id: str
    job_id: str | None = None       # Slurm's job id
    exit_code: int | None = None    # attached runs: the runner's exit code (0 finished, 4 the job failed, 130...)
    detached: bool = False


@dataclass
class NodeStatus:
    """One node of a run. `state` is the node's own word: over SSH its container's (running,
    exited, created, ...), `finished` (its runner-status.json says how it ended), `no container`
    (a run dir, nothing running), `absent` or `unreachable`; on Slurm the job's state."""

    node: str
    rank: int | None = None
    state: str = UNKNOWN
    exit_code: int | None = None
    uptime: str | None = None
    last_metrics: str | None = None
    progress: dict | None = None
    error: str | None = None
    step_times: dict | None = None    # SSH: its ranks' step time, wait share, straggler (runner/backends/ssh/step_times.py)

    def as_dict(self) -> dict:
        return dict(vars(self))


@dataclass
class RunStatus:
    """Where a run is, the same document on every backend (`runner status --json`; each row of
    `runner ls --json`). `state` is one of STATES; `native_state` the backend's own word (Slurm's
    job state, the SSH nodes' container states); fields a backend does not have are None."""

    backend: str
    inventory: str
    run_id: str
    state: str
    native_state: str
    exit_code: int | None = None
    nodes: list[NodeStatus] = field(default_factory=list)
    job_id: str | None = None
    submissions: int | None = None
    run_dir: str | None = None
    reason: str | None = None
    run_time: str | None = None
    last_metrics: str | None = None
    elastic: list[dict] = field(default_factory=list)

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def as_dict(self) -> dict:
        """The JSON document (run_status.schema.json), `schema` first."""
        d: dict[str, Any] = {"schema": SCHEMA_VERSION}
        d.update((k, v) for k, v in vars(self).items() if k != "nodes")
        d["nodes"] = [n.as_dict() for n in self.nodes]
        return d


def run_state(node_states: Iterable[tuple[str, int | None]]) -> tuple[str, str, int | None]:
    """(state, native_state, exit_code) of an SSH run from its nodes' (state, exit code): running
    while a container runs; pending while one is only created; else how the nodes ended (any
    non-zero exit: failed, the largest code; all 0: succeeded; run dirs without an end: stopped)."""
    seen = [(s, c) for s, c in node_states if s not in ("absent", "unreachable")]
    native = "/".join(sorted({s for s, _ in seen})) or "absent"
    states = {s for s, _ in seen}
    if states & {"running", "restarting", "paused"}:
        return RUNNING, native, None
    if "created" in states:
        return PENDING, native, None
    codes = [c for s, c in seen if s in ("exited", "finished", "dead") and c is not None]
    if not seen:
        return UNKNOWN, native, None
    if any(codes):
        return FAILED, native, next(c for c in codes if c)  # the first in rank order
    if codes and len(codes) == len(seen):
        return SUCCEEDED, native, 0
    return STOPPED, native, None


# Slurm's job states (scontrol's JobState) -> STATES; GONE (the controller forgot the job) goes by
# the exit code the batch script wrote.
SLURM_STATES = {
    **dict.fromkeys(("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"), PENDING),
    **dict.fromkeys(("RUNNING", "COMPLETING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED", "RESIZING"), RUNNING),
    **dict.fromkeys(("CANCELLED", "PREEMPTED"), STOPPED),
    **dict.fromkeys(("FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"), FAILED),
}


def slurm_state(native: str, exit_code: int | None, downed: bool) -> str:
    """STATES for a Slurm job's state; `downed`: `runner down` stopped it (its preempt exit is no failure)."""
    if native == "COMPLETED" or native == "GONE":
        if exit_code == 0:
            return SUCCEEDED
        if exit_code is None:
            return STOPPED if downed else UNKNOWN
        return STOPPED if downed else FAILED
    state = SLURM_STATES.get(native, UNKNOWN)
    return STOPPED if downed and state == FAILED else state


@dataclass(frozen=True)
class LogLine:
    """One line of a run's output: `[node/rank] text` as the CLI prints it (rank may be a role, or
    None for the scheduler's own output: `[slurm] ...`)."""

    node: str
    rank: int | str | None
    text: str

    @property
    def prefix(self) -> str:
        return f"[{self.node}]" if self.rank is None else f"[{self.node}/{self.rank}]"

    def __str__(self) -> str:
        return f"{self.prefix} {self.text}"


@dataclass
class CollectReport:
    """What collect brought: `nodes` (one runner.delivery.collect_files.NodeCollect per node, or the
    Slurm run dir's), into `dest` (artifacts/<run-id>); `errors` one line each (a node away, a
    file that changed while copied: collect again); `summary` the run's summary lines (from its
    metrics, written by the job: shown made visible)."""

    run_id: str
    dest: Path
    nodes: list = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


@dataclass
class CancelReport:
    """What cancel did: `lines` say it as the CLI prints it; `errors` the nodes (or the job) not
    stopped, one line each; exit_code 0, or 3 (EXIT_PARTIAL: run it again) / 1 (still running)."""

    run_id: str | None
    stopped: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    exit_code: int = 0


@dataclass
class CheckReport:
    """check(): `items` (SSH: one runner.backends.ssh.check.NodeCheck per node; Slurm: one
    SlurmCheck), `problems` one "where: what" line each; ok when there are none."""

    backend: str
    inventory: str
    items: list = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems
