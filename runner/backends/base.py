"""The one interface every backend implements: where a run of the job goes (the SSH nodes of an
inventory, a Slurm cluster, ...) behind the same typed verbs, which the CLI and runner.api call.

A backend is made for one loaded inventory (`runner.api.backend_for`) and has
- `plan(options)`: pure, contacts nothing; a Plan whose render() is what `up --dry-run` prints;
- `submit(plan, detach)`: start it (submit it, for a scheduler), attached unless detach; a Run;
- `describe(run)`, `runs()`: RunStatus, one schema on every backend (results.py);
- `logs(run, nodes, follow)`: LogLines; `cancel(run, grace_s)`; `collect(run, dest)`;
- `exec_argv(run, node, command)`: the argv that runs a command beside the run's job on a node;
- `check()`, `push()`, `sync()`, `profile()` where the backend has them: one where it does not
  says so in one UserError naming the backend and what to do instead (`unsupported`).

Its options are a dataclass (`Options`, runner/backends/options.py); its inventories the ones it
`claims` (by their top-level sections) and `read_inventory` parses. Adding a backend is one
package under runner/backends/ and one line in runner/backends/__init__.py's BACKENDS.

Nothing heavy is imported here or by a backend's class module: what a verb needs it imports
when it runs (the CLI's start-up, bench/startup.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Union

from runner.backends.options import UpOptions, options_for
from runner.core.errors import Unsupported
from runner.core.fanout import DEFAULT_PARALLEL

if TYPE_CHECKING:  # the results' module is imported by the verbs that make them (start-up: bench/startup.py)
    from runner.backends.results import (
        CancelReport,
        CheckReport,
        CollectReport,
        LogLine,
        Plan,
        Run,
        RunStatus,
    )


VERBS = ("up", "status", "logs", "ls", "down", "collect")
NOTIFY_ENV = "RUNNER_NOTIFY"  # runner/backends/notify.py's ENV_NAME: the user's standing --notify
RunRef = Union["Run", "RunStatus", str, None]  # a run, its status, its id or a prefix of it; None: the latest


def run_id_of(run: RunRef) -> str | None:
    return run if run is None or isinstance(run, str) else run.run_id


class Backend:
    """Where a run goes; one instance per loaded inventory (runner.api.backend_for)."""

    name: ClassVar[str]          # what --scheduler calls it
    label: ClassVar[str]         # how messages name its runs ("Slurm")
    Options: ClassVar[type[UpOptions]] = UpOptions

    def __init__(self, inventory: Any, *, accept_new_host_keys: bool = False, parallel: int = DEFAULT_PARALLEL):
        self.inventory = inventory
        self.accept_new_host_keys = accept_new_host_keys
        self.parallel = parallel

    # -- which inventories are this backend's ------------------------------------------------
    @staticmethod
    def claims(keys: set[str]) -> bool:
        """Whether `scheduler="auto"` sends an inventory with these top-level sections here."""
        raise NotImplementedError

    @classmethod
    def accepts(cls, keys: set[str], path: str) -> None:
        """Raise UserError when `--scheduler NAME` names this backend for an inventory it cannot run."""

    @classmethod
    def read_inventory(cls, path: str, parsed: tuple, *, job: str | None, with_job: bool, check_files: bool) -> Any:
        """The inventory this backend runs, from the file's parsed YAML (runner.inventory.schema.read_yaml)."""
        raise NotImplementedError

    @classmethod
    def owns(cls, inventory: Any) -> bool:
        """Whether `inventory` (a loaded one) is of the kind this backend runs."""
        raise NotImplementedError

    @property
    def path(self) -> str:
        return str(self.inventory.path)

    def options(self, options: UpOptions | Mapping[str, Any] | None = None) -> UpOptions:
        """options as this backend's Options; another backend's option is refused in one line."""
        from runner.backends import BACKENDS

        return options_for(type(self), options, list(BACKENDS.values()), self.path)

    def unsupported(self, verb: str, instead: str) -> Unsupported:
        """The one error for a verb this backend does not have."""
        return Unsupported(f"`runner {verb}` is not for {self.label} runs ({self.path}): {instead}")

    # -- the verbs ---------------------------------------------------------------------------
    def plan(self, options: UpOptions | Mapping[str, Any] | None = None) -> Plan:
        """What `up` would start where; reads no key and contacts nothing."""
        raise NotImplementedError

    def submit(self, plan: Plan, detach: bool = False) -> Run:
        """Start the planned run; attached (the default) until it ends, detached once it is started."""
        raise NotImplementedError

    def describe(self, run: RunRef = None) -> RunStatus:
        """The run's status (run: a Run, a run id or prefix; None: the latest run)."""
        raise NotImplementedError

    def runs(self) -> list[RunStatus]:
        """Every run found, newest first (a lighter status each: no per-node progress)."""
        raise NotImplementedError

    def logs(self, run: RunRef = None, nodes: list[str] | None = None, follow: bool = False,
             tail: int | str = "all", logs_dir: str | None = None) -> Iterator[LogLine]:
        """The run's output, line by line (iterating it connects); follow: until the run ends; tail:
        the last lines of each node's; logs_dir (SSH): where `up` kept the output of runs whose
        containers are gone. A backend that keeps no such logs refuses logs_dir."""
        raise NotImplementedError

    def cancel(self, run: RunRef = None, grace_s: float | None = None, keep_runs: int | None = None) -> CancelReport:
        """Stop the run: SIGTERM (Slurm: USR1), the grace period for the preempt checkpoint, then
        stop; keep_runs (SSH): then remove every node's run dirs but the N newest (a backend whose
        run dirs are not its nodes' refuses it)."""
        raise NotImplementedError

    def collect(self, run: RunRef = None, dest: str = "artifacts", plots: bool = True,
                quiet: bool = True) -> CollectReport:
        """Mirror the run's files to dest/<run-id>/ (incremental, verified), then merge and plot."""
        raise NotImplementedError

    def exec_argv(self, run: RunRef, node: str, command: list[str], tty: bool = False,
                  host: bool = False) -> list[str]:
        """The argv (to run here) that runs command beside the run's job on node."""
        raise NotImplementedError

    def check(self) -> CheckReport:
        raise self.unsupported("check", "nothing to check before a run")

    def push(self, full: bool = False, build: bool = False, direct: bool = False) -> list:
        raise self.unsupported("push", "the job's image reaches its nodes another way")

    def sync(self) -> list:
        raise self.unsupported("sync", "job.sync is for SSH nodes")

    def profile(self, refresh: bool = False, no_push: bool = False, min_seconds: float = 2.0,
                timeout: float = 900.0, trainer_args: list[str] | None = None, quiet: bool = False) -> Any:
        raise self.unsupported("profile", "parallel.partition auto is for SSH nodes")

    def shapes(self, arch: str | None = None, gpus_per_node: int | None = None) -> list[tuple[str, int, int]]:
        """The job's nodes in rank order as (arch, gpus, processes): what `export` makes pods of."""
        raise NotImplementedError

    def wait(self, run: RunRef, timeout_s: float | None = None, poll_s: float = 2.0) -> RunStatus:
        """describe() until the run has ended (succeeded, failed or stopped); TimeoutError after
        timeout_s. For a detached run (submit(plan, detach=True))."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            st = self.describe(run)
            if st.ended:
                return st
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {st.run_id} still {st.state} after {timeout_s:g}s")
            time.sleep(poll_s)


def up_job(options: UpOptions, detach: bool, job, inventory: str) -> tuple[dict[str, str], object]:
    """What every backend's `up` does first with the job: the trainer args appended, the env_file's
    secrets read and masked in all output, and the notify spec (options.notify, $RUNNER_NOTIFY or
    job.notify) parsed (a malformed one is refused for a plan too). (secrets, notify spec or None)."""
    from runner.core.redact import hide_job

    if options.trainer_args:
        job.args = list(job.args) + list(options.trainer_args)
    from runner.planning import hang_budget

    hang_budget.apply(job, getattr(options, "hang_timeout", None))  # --hang-timeout / job.hang_timeout
    secrets = job.secrets()
    hide_job(job, secrets)
    if options.notify is None and not os.environ.get(NOTIFY_ENV, "").strip() and getattr(job, "notify", None) is None:
        return secrets, None  # nothing to tell: the notifier (urllib, ssl) is not even imported
    from types import SimpleNamespace

    from runner.backends.notify import from_args

    return secrets, from_args(SimpleNamespace(notify=options.notify, detach=detach), job, inventory)


def dry_run_id(options: UpOptions) -> str:
    """The run id a plan shows: the run `resume` names, else a placeholder."""
    return options.resume if options.resume not in (None, "latest") else "<new run id>"


def sizing_text(inv, memory_field: str = "inventory memory") -> tuple[str | None, str | None]:
    """(the sizing table as a plan shows it, the one-line refusal or None), as check_sizing prints
    and refuses; (None, None) for a job.command (not the trainer: nothing to size)."""
    from runner.planning.sizing import NotSized, refusal, size_job

    if inv.job.command:
        return None, None
    try:
        sizing = size_job(inv, None, memory_field)
    except NotSized as e:
        return f"sizing: not estimated here: {e}", None
    return sizing.render(), refusal(sizing, str(inv.path))
