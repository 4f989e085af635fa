"""The one interface every backend implements: where a run of the job goes (SSH nodes of an
inventory, a Slurm cluster, ...) behind the same verbs.

The verbs' parsers are defined once (runner/backends/ssh/launch.py, status.py, down.py, collect.py
build them: every backend takes the same arguments); `runner/cli/main.py` resolves the backend once per
command (`open_backend`) and calls its method for the verb: `dryrun` for `up --dry-run` (the plan
printed, nothing contacted), `up` to start or submit the run, then `status`, `logs`, `ls`, `down`
(stop), `collect`. A backend adds its own flags through `options` (refused, naming it, when a run
goes to another backend) and says which inventories are its own through `claims`. Adding a backend
is one module here and one line in runner/backends/__init__.py."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar, Protocol

from runner.core.redact import hide_job

VERBS = ("up", "status", "logs", "ls", "down", "collect")


@dataclass(frozen=True)
class Option:
    """A flag of one backend: its add_argument spelling, and what to say when it is given to a run
    that goes elsewhere (`SSH runs use --max-restarts`)."""

    verb: str
    flags: tuple[str, ...]
    kwargs: dict
    elsewhere: str = ""

    @property
    def dest(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")


class Backend(Protocol):
    name: ClassVar[str]          # what --scheduler calls it
    label: ClassVar[str]         # how messages name its runs ("Slurm")
    options: ClassVar[tuple[Option, ...]]

    @staticmethod
    def claims(keys: set[str]) -> bool:
        """Whether `--scheduler auto` sends an inventory with these top-level sections here."""

    @staticmethod
    def accepts(keys: set[str], inventory: str) -> None:
        """Raise UserError when `--scheduler NAME` names this backend for an inventory it cannot run."""

    def dryrun(self, args: argparse.Namespace) -> int:
        """`up --dry-run`: the plan printed (what would run where); reads no key, contacts nothing."""

    def up(self, args: argparse.Namespace) -> int:
        """Start the run (submit it, for a scheduler); attached unless --detach."""

    def status(self, args: argparse.Namespace) -> int: ...
    def logs(self, args: argparse.Namespace) -> int: ...
    def ls(self, args: argparse.Namespace) -> int: ...
    def down(self, args: argparse.Namespace) -> int: ...
    def collect(self, args: argparse.Namespace) -> int: ...


def up_job(args: argparse.Namespace, job, inventory: str) -> tuple[dict[str, str], object]:
    """What every backend's `up` does first with the job: the trainer args after `--` appended, the
    env_file's secrets read and masked in all output, and `--notify` (or job.notify) parsed (a
    malformed one is refused for --dry-run too). (secrets, the notify spec or None)."""
    from runner.backends.notify import from_args

    if args.trainer_args:
        job.args = list(job.args) + list(args.trainer_args)
    secrets = job.secrets()
    hide_job(job, secrets)
    return secrets, from_args(args, job, inventory)


def dry_run_id(args: argparse.Namespace) -> str:
    """The run id a dry-run shows: the run `--resume` names, else a placeholder."""
    return args.resume if args.resume not in (None, "latest") else "<new run id>"
