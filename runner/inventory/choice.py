"""Which inventory a command uses: `-i FILE`, else $RUNNER_INVENTORY, else the last `runner up` in
this directory, else hosts/local.yaml; and the options every node command shares with it."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from runner.core.errors import UserError
from runner.core.fanout import add_parallel_arg
from runner.inventory import Inventory, load_inventory

DEFAULT_INVENTORY = "hosts/local.yaml"  # what `runner sandbox up` writes
INVENTORY_ENV = "RUNNER_INVENTORY"
# The inventory of the last `runner up` / `runner sandbox up` run in a directory, kept in this file
# relative to it; RUNNER_LAST_UP names another file ("" keeps none: the test suite's runs, made
# from the checkout, must not become its default).
LAST_UP = Path(".runner") / "last-inventory"
LAST_UP_ENV = "RUNNER_LAST_UP"


def _last_up_file(cwd: Path, environ: Mapping[str, str]) -> Path | None:
    name = environ.get(LAST_UP_ENV)
    if name is None:
        return cwd / LAST_UP
    return cwd / name if name else None


def add_inventory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--inventory", default=None,
                   help=f"inventory YAML (default: ${INVENTORY_ENV}, else the last `runner up` here, "
                        f"else {DEFAULT_INVENTORY})")
    p.add_argument("--accept-new-host-keys", action="store_true",
                   help="trust and record host keys not yet in known_hosts (default: refuse)")
    add_parallel_arg(p)


def default_inventory(environ: Mapping[str, str] | None = None, cwd: Path | None = None) -> tuple[str, str]:
    """(path, where it came from) of the inventory a command without -i uses: $RUNNER_INVENTORY,
    then the last `up` in this directory (while that file exists), then hosts/local.yaml. A
    missing one is a UserError naming -i and `runner sandbox up`."""
    environ = os.environ if environ is None else environ
    cwd = Path.cwd() if cwd is None else cwd
    if environ.get(INVENTORY_ENV):
        return environ[INVENTORY_ENV], INVENTORY_ENV
    record = _last_up_file(cwd, environ)
    try:
        last = record.read_text().strip() if record else ""
    except (OSError, UnicodeDecodeError):
        last = ""
    if last and "\n" not in last and (cwd / last).is_file():
        return last, "default" if last == DEFAULT_INVENTORY else "last up"
    if not (cwd / DEFAULT_INVENTORY).is_file():
        raise UserError(f"no inventory: {DEFAULT_INVENTORY} does not exist here; name one with -i FILE (or "
                        f"{INVENTORY_ENV}=FILE), or start the local sandbox cluster with `runner sandbox up`, "
                        f"which writes {DEFAULT_INVENTORY}")
    return DEFAULT_INVENTORY, "default"


def resolve_inventory(args: argparse.Namespace) -> None:
    """Fill args.inventory of a command run without -i; an inventory taken from the last `up`
    is named on stderr (it may not be the one the user has in mind)."""
    if getattr(args, "inventory", "") is not None:
        return
    args.inventory, origin = default_inventory()
    if origin == "last up":
        sys.stderr.write(f"runner: inventory {args.inventory} (from the last `runner up` or `runner sandbox up` here; -i FILE for another)\n")


def remember_inventory(path: str | os.PathLike, cwd: Path | None = None,
                       environ: Mapping[str, str] | None = None) -> None:
    """Record path as this directory's last `up` inventory (best effort: a read-only checkout
    just keeps its default)."""
    cwd = Path.cwd() if cwd is None else cwd
    state = _last_up_file(cwd, os.environ if environ is None else environ)
    path = str(path)
    if state is None or "\n" in path:
        return
    try:
        state.parent.mkdir(parents=True, exist_ok=True)
        tmp = state.with_name(f"{state.name}.{os.getpid()}")
        tmp.write_text(path + "\n")
        os.replace(tmp, state)
    except OSError:
        pass


def load(args, *, with_job: bool = True, check_files: bool = True) -> Inventory:
    """The inventory, every problem refused here. check_files=False (a dry-run) leaves out the
    files only a connection needs (SSH keys, known_hosts): nothing is read that is not planned."""
    return load_inventory(args.inventory, job_path=getattr(args, "job", None), with_job=with_job,
                          check_files=check_files)
