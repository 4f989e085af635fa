"""The job's hang timeout as the runner plans it: `up --hang-timeout S` over `job.hang_timeout`, over
a `--watch.hang_timeout_s S` the job's own args carry; passed to the trainer (which sizes its
collectives' timeouts by it: contract/hang.py) and used by the runner's hang watch
(runner/backends/ssh/hang_watch.py) with the same rule, so both wings agree on what a hang is.
Pure: the job in, its args and one `--dry-run` line out."""

from __future__ import annotations

from typing import Any

from contract import hang as rule
from runner.core.errors import UserError

ARG = "--watch.hang_timeout_s"
STARTUP_ARG = "--watch.startup_timeout_s"
COLLECTIVE_ARG = "--parallel.timeout_s"


def arg_value(args: list[str], name: str) -> float | None:
    """The last `name V` (or `name=V`) of a trainer command line as seconds; None for auto or none.
    A value that is not a number is the trainer's to refuse, not the runner's: None here."""
    found: str | None = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith(name + "="):
            found = a.split("=", 1)[1]
    try:
        v = float(found) if found is not None and found != "auto" else None
    except ValueError:
        return None
    return v if v is not None and 0 < v < 1e9 else None


def apply(job: Any, option: int | None) -> int | float | None:
    """The run's hang timeout (None: auto) set on job.hang_timeout, and, where the job runs the
    trainer, appended to its args last (the trainer takes the last value of an option)."""
    if option is not None and not 10 <= option <= 86400:
        raise UserError(f"--hang-timeout {option}: give whole seconds in 10..86400 (or leave it out: auto)")
    chosen = option or getattr(job, "hang_timeout", None)
    if chosen and getattr(job, "command", None) is None:
        job.args = [*job.args, ARG, str(int(chosen))]
    job.hang_timeout = chosen or arg_value(list(job.args), ARG)
    return job.hang_timeout


def dry_run_line(job: Any) -> str | None:
    """One line for `up --dry-run`: what makes a hang for this job, and when collectives give up;
    None for a job.command (not the trainer: no heartbeats, nothing watched)."""
    args = list(getattr(job, "args", []))
    if getattr(job, "command", None) is not None:
        return None
    return "hang watch: " + rule.describe(getattr(job, "hang_timeout", None), arg_value(args, STARTUP_ARG),
                                          arg_value(args, COLLECTIVE_ARG))
