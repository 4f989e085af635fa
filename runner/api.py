"""The runner's Python API: what the `runner` command line itself calls, for scripts, notebooks and
CI jobs that plan, start, watch, stop and collect runs without parsing text.

```python
from runner.api import backend_for, load_inventory

backend = backend_for(load_inventory("hosts/local.yaml"))  # an SshBackend; a `slurm:` inventory: SlurmBackend
plan = backend.plan({"trainer_args": ["--train.steps", "20"]})
print(plan.render())                      # what `runner up --dry-run` prints; plan.nodes, plan.ranks: data
run = backend.submit(plan, detach=True)   # started on every node (master first)
status = backend.wait(run)                # a RunStatus once it succeeded, failed or was stopped
for line in backend.logs(run):            # LogLine: node, rank, text; str(line) is `[node/rank] text`
    print(line)
report = backend.collect(run, dest="artifacts")   # files verified, timelines merged, plots drawn
```

Two calls make a backend: `load_inventory(path)` reads the YAML once and returns the kind of
inventory it is (SSH nodes, or a `slurm:` section), and `backend_for(inventory)` the backend that
runs that kind. Every backend has the same verbs (runner/backends/base.py: `plan`, `submit`,
`describe`, `runs`, `logs`, `cancel`, `collect`, `exec_argv`, `wait`; `check`, `push`, `sync`,
`profile` where it has them) and returns the same types: `Plan`, `Run`, `RunStatus` (one JSON
schema for every backend: `run_status_schema()`), `LogLine`, `CollectReport`, `CancelReport`,
`CheckReport`.

Options of `up` are a dataclass per backend (`SshUpOptions`, `SlurmUpOptions`, both `UpOptions`),
or a mapping of their fields; an option of another backend is refused (`Unsupported`). Expected
failures raise `UserError` or a subclass (`.exit_code`: the code the CLI exits with: `Unsupported`
2, `NotReady` 1, `Partial` 3, `JobFailed` 4) with the one-line message the CLI prints;
nothing here calls sys.exit or prints a traceback for them. Importing this module imports neither
torch nor the trainer, nor (until a verb needs them) paramiko or docker.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from runner.backends import BACKENDS, SCHEDULERS, backend_class, class_of
from runner.backends.base import Backend
from runner.backends.options import UpOptions
from runner.backends.results import (
    SCHEMA_FILE,
    SCHEMA_VERSION,
    STATES,
    CancelReport,
    CheckReport,
    CollectReport,
    LogLine,
    NodeLaunch,
    NodeStatus,
    Plan,
    Run,
    RunStatus,
)
from runner.backends.slurm.backend import SlurmBackend, SlurmUpOptions
from runner.backends.ssh.backend import SshBackend, SshUpOptions
from runner.core.errors import (
    EXIT_HUNG,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_NOT_READY,
    EXIT_OK,
    EXIT_PARTIAL,
    EXIT_USER,
    JobFailed,
    NotReady,
    Partial,
    Unsupported,
    UserError,
)
from runner.core.fanout import DEFAULT_PARALLEL

if TYPE_CHECKING:
    from runner.inventory import Inventory as SshInventory
    from runner.inventory.slurm import SlurmInventory

    Inventory = SshInventory | SlurmInventory

__all__ = [
    "BACKENDS", "DEFAULT_PARALLEL", "EXIT_HUNG", "EXIT_INTERRUPTED", "EXIT_JOB_FAILED", "EXIT_NOT_READY", "EXIT_OK", "EXIT_PARTIAL",
    "EXIT_USER", "SCHEDULERS", "SCHEMA_VERSION", "STATES", "Backend", "CancelReport", "CheckReport", "CollectReport",
    "Inventory", "JobFailed", "LogLine", "NodeLaunch", "NodeStatus", "NotReady", "Partial", "Plan", "Run", "RunStatus",
    "SlurmBackend", "SlurmInventory", "SlurmUpOptions", "SshBackend", "SshInventory", "SshUpOptions", "Unsupported",
    "UpOptions", "UserError", "backend_for", "load_inventory", "run_status_schema",
]


def load_inventory(path: str | os.PathLike[str], *, job: str | os.PathLike[str] | None = None,
                   scheduler: str = "auto", with_job: bool = True, check_files: bool = False) -> Inventory:
    """Read and check an inventory; its YAML is parsed once, and what it holds decides its kind.

    Args:
        path: the inventory YAML (hosts/*.yaml).
        job: a YAML file with a job section that replaces the inventory's (`runner up --job`).
        scheduler: "auto" (an inventory with a `slurm:` section and no `nodes:` is a Slurm
            inventory, any other an SSH one), or a backend's name ("ssh", "slurm") to read the
            section that backend runs (an inventory may hold both).
        with_job: False leaves the job section unread (what status, logs, down and collect need).
        check_files: True also refuses now a missing file that only a connection needs (an
            identity_file, known_hosts), as the CLI's verbs that connect do. Left False (the
            default), an inventory loads and plans on a laptop without the cluster's keys, and a
            missing key is refused in one line when a verb connects with it.

    Returns:
        An SSH inventory (`runner.inventory.Inventory`: nodes, job) or a Slurm one
        (`runner.inventory.slurm.SlurmInventory`: slurm, job).

    Raises:
        UserError: the first problem, one line naming file, line and field.
    """
    from runner.inventory.schema import read_yaml

    path = str(path)
    parsed = read_yaml(path, "inventory")
    root = parsed[0]
    keys = set(root.value) if root is not None and isinstance(root.value, dict) else set()
    cls = backend_class(keys, scheduler, path)
    inventory: Inventory = cls.read_inventory(path, parsed, job=str(job) if job is not None else None,
                                              with_job=with_job, check_files=check_files)
    return inventory


def backend_for(inventory: Inventory, scheduler: str = "auto", *, accept_new_host_keys: bool = False,
                parallel: int = DEFAULT_PARALLEL) -> Backend:
    """The backend that runs a loaded inventory.

    Args:
        inventory: what load_inventory returned.
        scheduler: "auto" (the inventory's kind decides), or the backend's name, which must be
            the kind's (load_inventory(path, scheduler=NAME) reads the section NAME runs).
        accept_new_host_keys: trust and record host keys not yet in known_hosts (default: refuse).
        parallel: how many nodes are contacted at once.

    Returns:
        An SshBackend or a SlurmBackend (both Backend), holding the inventory.

    Raises:
        UserError: scheduler names another backend than the inventory's kind.
    """
    cls = class_of(inventory)
    if scheduler not in ("auto", cls.name):
        if scheduler not in BACKENDS:
            raise UserError(f"scheduler {scheduler!r}: no such backend (choose from {', '.join(SCHEDULERS)})")
        raise UserError(f"{inventory.path}: loaded as a {cls.label} inventory, not for --scheduler {scheduler}; "
                        f"load it with load_inventory(path, scheduler={scheduler!r})")
    return cls(inventory, accept_new_host_keys=accept_new_host_keys, parallel=parallel)


def run_status_schema() -> dict[str, Any]:
    """The JSON Schema every RunStatus.as_dict() (`runner status --json`, each `ls --json` row)
    validates against, on every backend (docs/run-status.md)."""
    schema: dict[str, Any] = json.loads(SCHEMA_FILE.read_text())
    return schema


def __getattr__(name: str) -> Any:
    """The inventory types, imported only when asked for (they pull in the YAML and SSH config readers)."""
    if name in ("Inventory", "SshInventory", "SlurmInventory"):
        from runner.inventory import Inventory as SshInventory
        from runner.inventory.slurm import SlurmInventory

        return {"SshInventory": SshInventory, "SlurmInventory": SlurmInventory,
                "Inventory": SshInventory | SlurmInventory}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
