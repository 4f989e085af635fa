"""`SlurmBackend`: a run is one batch job; the verbs go to submit (plan, submit, cancel), status
(describe, runs, logs, over one login shell), collect, node_exec and jobs (check). Each verb
imports its module when it runs."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from runner.backends.base import Backend, RunRef, run_id_of
from runner.backends.options import UpOptions, option
from runner.core.errors import Unsupported, UserError

if TYPE_CHECKING:
    from runner.backends.results import (
        CancelReport,
        CheckReport,
        CollectReport,
        LogLine,
        Plan,
        Run,
        RunStatus,
    )


@dataclass
class SlurmUpOptions(UpOptions):
    """`up` options of Slurm runs (UpOptions' and these).

    Attributes:
        requeue: a preempted job goes back in the queue and resumes from its latest checkpoint.
        hang_timeout: seconds without progress that make a hang (the trainer's collectives give up after it
            plus a grace: contract/hang.py).
    """

    requeue: bool = option(False, "--requeue", "(slurm) a preempted job goes back in the queue and resumes from its "
                           "latest checkpoint", refusal="is for Slurm runs (--scheduler slurm); SSH runs use "
                           "--max-restarts", action="store_true")
    hang_timeout: int | None = option(None, "--hang-timeout", "seconds a rank may make no progress before the run is "
                                      "a hang (default: job.hang_timeout, else auto: max(120, 10 x the median step); "
                                      "docs/hangs.md)", type=int, metavar="S")


class SlurmBackend(Backend):
    """A Slurm cluster, from this machine or its login node (slurm.login): plan, submit, describe,
    runs, logs, cancel, collect, exec_argv, check."""

    name: ClassVar[str] = "slurm"
    label: ClassVar[str] = "Slurm"
    Options: ClassVar[type[UpOptions]] = SlurmUpOptions

    @staticmethod
    def claims(keys: set[str]) -> bool:
        return "slurm" in keys and "nodes" not in keys  # both: SSH unless --scheduler slurm

    @classmethod
    def accepts(cls, keys: set[str], path: str) -> None:
        if keys and "slurm" not in keys:
            raise UserError(f"{path}: --scheduler slurm needs a `slurm:` section (partition, nodes, ...)")

    @classmethod
    def read_inventory(cls, path: str, parsed: tuple, *, job: str | None, with_job: bool, check_files: bool):
        from runner.inventory.slurm import load_slurm_inventory

        return load_slurm_inventory(path, job_path=job, check_files=check_files, with_job=with_job, parsed=parsed)

    @classmethod
    def owns(cls, inventory: Any) -> bool:
        return hasattr(inventory, "slurm")

    def shell(self):
        """Where Slurm's commands run: this machine, or the login node over SSH (closed by the caller)."""
        from runner.backends.slurm.shell import open_shell

        return open_shell(self.inventory, self.accept_new_host_keys)

    def plan(self, options: UpOptions | dict | None = None) -> Plan:
        from runner.backends.slurm.submit import make_plan

        return make_plan(self, self.options(options))

    def submit(self, plan: Plan, detach: bool = False) -> Run:
        from runner.backends.slurm.submit import submit_plan

        return submit_plan(self, plan, detach)

    def describe(self, run: RunRef = None) -> RunStatus:
        from runner.backends.slurm.status import describe

        return describe(self, run_id_of(run))

    def runs(self) -> list[RunStatus]:
        from runner.backends.slurm.status import runs

        return runs(self)

    def logs(self, run: RunRef = None, nodes: list[str] | None = None, follow: bool = False,
             tail: int | str = "all", logs_dir: str | None = None) -> Iterator[LogLine]:
        if logs_dir is not None:
            raise Unsupported(f"--logs-dir is for SSH runs: a Slurm run's output stays in its run dir ({self.path}: "
                            "slurm.workdir)")
        from runner.backends.slurm.status import logs

        return logs(self, run_id_of(run), nodes, follow, tail)

    def cancel(self, run: RunRef = None, grace_s: float | None = None, keep_runs: int | None = None) -> CancelReport:
        if keep_runs is not None:
            raise Unsupported(f"--keep-runs is for SSH runs: a Slurm run's dir is on the shared filesystem "
                            f"({self.path}: slurm.workdir); remove old ones there")
        from runner.backends.slurm.submit import cancel

        return cancel(self, run_id_of(run), grace_s)

    def collect(self, run: RunRef = None, dest: str = "artifacts", plots: bool = True,
                quiet: bool = True) -> CollectReport:
        from runner.backends.slurm.collect import collect_run

        return collect_run(self, run_id_of(run), dest, plots)

    def exec_argv(self, run: RunRef, node: str, command: list[str], tty: bool = False,
                  host: bool = False) -> list[str]:
        from runner.backends.slurm.node_exec import exec_argv

        return exec_argv(self, run_id_of(run), node, command, tty, host)

    def check(self) -> CheckReport:
        """The login node (or this machine) answers, Slurm's client tools are there, and the
        partition exists with enough nodes: what `up` checks before it submits."""
        from runner.backends.slurm.jobs import check

        return check(self)

    def push(self, full: bool = False, build: bool = False, direct: bool = False) -> list:
        how = {"oci": "container oci: `runner up` exports the image to slurm.bundle_dir once per image id",
               "pyxis": "container pyxis: each node's enroot pulls slurm.image (or job.image) when the job starts",
               "none": "container none: the tasks run slurm.venv's trainer; install it there"}
        raise self.unsupported("push", how[self.inventory.slurm.container])

    def sync(self) -> list:
        raise self.unsupported("sync", "a Slurm job reads its files from the cluster's shared filesystem; copy them "
                               "under slurm.workdir and point the job there")

    def profile(self, refresh: bool = False, no_push: bool = False, min_seconds: float = 2.0,
                timeout: float = 900.0, trainer_args: list[str] | None = None, quiet: bool = False) -> Any:
        raise self.unsupported("profile", "it measures SSH nodes for parallel.partition auto; on Slurm give the "
                               "split (parallel.partition: custom:...) or profile the same machines as SSH nodes")

    def shapes(self, arch: str | None = None, gpus_per_node: int | None = None) -> list[tuple[str, int, int]]:
        s, job = self.inventory.slurm, self.inventory.job
        gpus = s.gpus_per_node if gpus_per_node is None else gpus_per_node
        return [(arch or s.arch, gpus, job.nproc_per_node or gpus or 1)] * s.nodes
