"""Where a job runs: one backend per scheduler behind one interface (runner/backends/base.py).

- ssh: the inventory's own nodes over SSH (the default)
- slurm/: `up --scheduler slurm` (or an inventory with a `slurm:` section and no `nodes:`): sbatch
  on this machine or a login node, the same torchrun contract (docs/contract.md), follow, down,
  collect, requeue

The CLI resolves the backend once per command (`open_backend`) and calls its verb; `--scheduler`
and each backend's own flags are added to the verbs here. A new backend: its module, one line in
BACKENDS.

May import: the inventory, transport (runner.transport.ssh), delivery and run-id layers; never runner.cli.main.
"""

from __future__ import annotations

import argparse

from runner.backends.base import VERBS, Backend
from runner.backends.slurm.backend import SlurmBackend
from runner.backends.ssh.backend import SshBackend
from runner.core.errors import UserError

# In the order `--scheduler auto` asks them; the last claims whatever is left.
BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (SlurmBackend, SshBackend)}
DEFAULT = "ssh"
SCHEDULERS = ("auto", DEFAULT, *(n for n in BACKENDS if n != DEFAULT))  # --scheduler's choices


def add_scheduler_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scheduler", choices=SCHEDULERS, default="auto",
                   help="ssh nodes or a Slurm cluster (default auto: slurm for an inventory with a "
                        "`slurm:` section and no `nodes:`)")


def register(sub: argparse._SubParsersAction) -> None:
    """The verbs' parsers (defined with the SSH backend, the default; every backend takes the same
    arguments), --scheduler on every verb and each backend's own flags on the verbs they belong to,
    `--notify` on up; each verb's func becomes the dispatch to the backend its inventory goes to."""
    from runner.backends.notify import add_notify_option
    from runner.backends.ssh import collect, down, launch, status

    for module in (launch, status, down, collect):
        module.register(sub)
    for verb in VERBS:
        p = sub.choices[verb]
        add_scheduler_option(p)
        for backend in BACKENDS.values():
            for opt in backend.options:
                if opt.verb == verb:
                    p.add_argument(*opt.flags, **opt.kwargs)
        p.set_defaults(func=lambda args, verb=verb: dispatch(args, verb))
    add_notify_option(sub.choices["up"])


def dispatch(args: argparse.Namespace, verb: str) -> int:
    """The verb's method of the backend the command goes to (`up --dry-run`: its dryrun)."""
    backend = open_backend(args, verb)
    if verb == "up" and args.dry_run:
        return backend.dryrun(args)
    return getattr(backend, verb)(args)


def choose(args: argparse.Namespace) -> str:
    """The backend's name for this command: --scheduler NAME (checked against the inventory), or
    auto: the first backend that claims the inventory's top-level sections."""
    from runner.inventory.slurm import top_level_keys

    keys = top_level_keys(args.inventory)
    if args.scheduler != "auto":
        BACKENDS[args.scheduler].accepts(keys, args.inventory)
        return args.scheduler
    return next(name for name, b in BACKENDS.items() if b.claims(keys))


def open_backend(args: argparse.Namespace, verb: str) -> Backend:
    """The backend this command goes to; a flag of another backend given to it is one line."""
    name = choose(args)
    for other in BACKENDS.values():
        if other.name == name:
            continue
        for opt in other.options:
            if opt.verb == verb and getattr(args, opt.dest, None):
                more = f"; {opt.elsewhere}" if opt.elsewhere else ""
                raise UserError(f"{opt.flags[0]} is for {other.label} runs (--scheduler {other.name}){more}")
    return BACKENDS[name]()
