"""Where a job runs: one backend per scheduler behind one interface (runner/backends/base.py),
listed in BACKENDS, the registry runner.api and the CLI go through.

- ssh/: the inventory's own nodes over SSH (the default)
- slurm/: an inventory with a `slurm:` section and no `nodes:` (or `--scheduler slurm`): sbatch
  on this machine or a login node, the same torchrun contract (docs/contract.md)

A new backend: its package here (a Backend subclass with its Options), and one line in BACKENDS.
Importing this registry costs only the backends' class modules: what a verb needs is imported
when it runs.

May import: the inventory, transport, delivery, profile, planning and core layers; never
runner.api or runner.cli.
"""

from __future__ import annotations

from typing import Any

from runner.backends.base import VERBS, Backend
from runner.backends.options import UpOptions, flag_of, own_fields
from runner.backends.slurm.backend import SlurmBackend
from runner.backends.ssh.backend import SshBackend
from runner.core.errors import UserError

# In the order `--scheduler auto` asks them; the last claims whatever is left.
BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (SlurmBackend, SshBackend)}
DEFAULT = "ssh"
SCHEDULERS = ("auto", DEFAULT, *(n for n in BACKENDS if n != DEFAULT))  # --scheduler's choices

__all__ = ["BACKENDS", "DEFAULT", "SCHEDULERS", "VERBS", "Backend", "UpOptions", "backend_class", "class_of",
           "flag_of", "own_fields"]


def backend_class(keys: set[str], scheduler: str, path: str) -> type[Backend]:
    """The backend for an inventory with these top-level sections: the one `scheduler` names
    (checked against the sections), or for "auto" the first that claims them."""
    if scheduler != "auto":
        if scheduler not in BACKENDS:
            raise UserError(f"scheduler {scheduler!r}: no such backend (choose from {', '.join(SCHEDULERS)})")
        BACKENDS[scheduler].accepts(keys, path)
        return BACKENDS[scheduler]
    return next(b for b in BACKENDS.values() if b.claims(keys))


def class_of(inventory: Any) -> type[Backend]:
    """The backend that runs a loaded inventory (its kind: SSH nodes, a Slurm section, ...)."""
    for b in BACKENDS.values():
        if b.owns(inventory):
            return b
    raise UserError(f"{getattr(inventory, 'path', inventory)}: no backend runs this kind of inventory "
                    f"({type(inventory).__name__})")
