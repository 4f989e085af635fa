"""What the verbs' parsers share (the inventory, --scheduler, --parallel) and the one way a verb
reaches its backend: runner.api's load_inventory and backend_for.

Parsers only at import: this module, like every verb module's top, imports no backend, no
inventory reader, no paramiko or docker (`runner --help` builds every parser; bench/startup.py).
"""

from __future__ import annotations

import argparse

from runner.backends import SCHEDULERS
from runner.core.fanout import add_parallel_arg

# runner/inventory/choice.py's default_inventory() is what fills -i when it is left out (imported
# only then: the inventory package reads YAML and SSH configs).
INVENTORY_HELP = ("inventory YAML (default: $RUNNER_INVENTORY, else the last `runner up` here, else "
                  "hosts/local.yaml)")


def add_inventory_args(p: argparse.ArgumentParser, scheduler: bool = True) -> None:
    """-i, --accept-new-host-keys, --parallel and (scheduler) --scheduler: every verb that runs on
    an inventory's nodes or cluster."""
    p.add_argument("-i", "--inventory", default=None, help=INVENTORY_HELP)
    p.add_argument("--accept-new-host-keys", action="store_true",
                   help="trust and record host keys not yet in known_hosts (default: refuse)")
    add_parallel_arg(p)
    if scheduler:
        p.add_argument("--scheduler", choices=SCHEDULERS, default="auto",
                       help="ssh nodes or a Slurm cluster (default auto: slurm for an inventory with a "
                            "`slurm:` section and no `nodes:`)")


def open_backend(args: argparse.Namespace, *, with_job: bool = True, check_files: bool = True):
    """The backend the command's inventory goes to (runner.api), its YAML read once: with_job=False
    leaves the job section unread (status, logs, ls, down, collect, exec), check_files=False the
    files only a connection needs (a dry-run, an export)."""
    from runner import api

    scheduler = getattr(args, "scheduler", "auto")
    inv = api.load_inventory(args.inventory, job=getattr(args, "job", None), scheduler=scheduler, with_job=with_job,
                             check_files=check_files)
    return api.backend_for(inv, scheduler, accept_new_host_keys=args.accept_new_host_keys, parallel=args.parallel)


def console(width: int | None = None):
    """A rich console: a terminal's width, or `width` (200) columns into a pipe (rich's 80 would
    wrap every row)."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal and width is None else Console(width=width or 200)
