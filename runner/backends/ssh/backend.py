"""`SshBackend`: the inventory's own nodes, reached over SSH, one container per node
(runner/backends/ssh/launch.py starts it, runner/backends/ssh/node_runs.py finds and stops it). The
default for any inventory with a `nodes:` list. Each verb imports its module when it runs."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from runner.backends.base import Backend, RunRef, run_id_of
from runner.backends.options import UpOptions, option
from runner.core.errors import UserError

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

_MAX_RESTARTS_ELSEWHERE = ("is for SSH runs; on Slurm use --requeue (the job requeues itself after a preemption and "
                           "resumes from the latest checkpoint)")
_ELASTIC_ELSEWHERE = ("is for SSH runs: a Slurm allocation does not shrink node by node; use --requeue (a preempted "
                      "job resumes from its latest checkpoint)")


@dataclass
class SshUpOptions(UpOptions):
    """`up` options of SSH runs (UpOptions' and these).

    Attributes:
        arch: for a plan: the arch of nodes the inventory leaves to the probe, `NODE=ARCH` or `ARCH` for all.
        max_restarts: on failure, relaunch with --resume up to N times.
        elastic: a lost node does not end the run (job.elastic sets min_nodes and rejoin).
        no_push: do not push images (a node that lacks one is refused before anything starts).
        rendezvous_timeout: seconds to wait for the master's port to listen.
        reclaim_timeout: after losing a node, seconds to keep trying to reach it and remove its container.
        logs_dir: where each node's container output is kept (logs_dir/<run>/<node>/).
        hang_timeout: seconds without progress that make a hang (None: job.hang_timeout, else auto).
    """

    arch: list[str] = option([], "--arch", "(ssh) for --dry-run: arch of a node whose inventory entry has none (or ARCH "
                             "for all)", action="append", metavar="NODE=ARCH")
    max_restarts: int = option(0, "--max-restarts", "(ssh) on failure, relaunch with --resume up to N times (default 0)",
                               refusal=_MAX_RESTARTS_ELSEWHERE, type=int, metavar="N")
    elastic: bool = option(False, "--elastic", "(ssh) a lost node does not end the run: it goes on over the nodes left, and "
                           "takes the node back when it answers (job.elastic sets min_nodes and rejoin)",
                           refusal=_ELASTIC_ELSEWHERE, action="store_true")
    no_push: bool = option(False, "--no-push", "(ssh) do not push images (fail if a node lacks one)", action="store_true")
    rendezvous_timeout: float = option(120.0, "--rendezvous-timeout", "(ssh) seconds to wait for the master's port to "
                                       "listen (default 120)", type=float, metavar="S")
    reclaim_timeout: float = option(60.0, "--reclaim-timeout", "(ssh) after losing a node, keep trying S seconds to reach "
                                    "it and remove its container (default 60)", type=float, metavar="S")
    hang_timeout: int | None = option(None, "--hang-timeout", "seconds a rank may make no progress before the run is "
                                      "a hang (default: job.hang_timeout, else auto: max(120, 10 x the median step); "
                                      "docs/hangs.md)", type=int, metavar="S")
    logs_dir: str = option("artifacts", "--logs-dir", "(ssh) where per-node logs are kept (artifacts/<run>/<node>/)",
                           metavar="DIR")


class SshBackend(Backend):
    """The inventory's nodes over SSH: plan, submit, describe, runs, logs, cancel, collect,
    exec_argv, check, push, sync, profile."""

    name: ClassVar[str] = "ssh"
    label: ClassVar[str] = "SSH"
    Options: ClassVar[type[UpOptions]] = SshUpOptions

    @staticmethod
    def claims(keys: set[str]) -> bool:
        return True  # the fallback: an inventory no other backend claims lists nodes

    @classmethod
    def read_inventory(cls, path: str, parsed: tuple, *, job: str | None, with_job: bool, check_files: bool):
        from runner.inventory import load_inventory

        return load_inventory(path, job_path=job, with_job=with_job, check_files=check_files, parsed=parsed)

    @classmethod
    def owns(cls, inventory: Any) -> bool:
        return hasattr(inventory, "nodes") and not hasattr(inventory, "slurm")

    def cluster(self, partial: bool = True, inventory: Any = None):
        """The nodes, connected (partial: going on with those that answer), closed on exit."""
        from runner.transport.cluster import Cluster

        return Cluster(inventory or self.inventory, self.accept_new_host_keys, partial=partial, workers=self.parallel)

    def plan(self, options: UpOptions | dict | None = None) -> Plan:
        from runner.backends.ssh.dry_run import make

        return make(self, self.options(options))

    def submit(self, plan: Plan, detach: bool = False) -> Run:
        from runner.backends.ssh.launch import submit

        return submit(self, plan, detach)

    def describe(self, run: RunRef = None) -> RunStatus:
        from runner.backends.ssh.status import describe

        return describe(self, run_id_of(run))

    def runs(self) -> list[RunStatus]:
        from runner.backends.ssh.status import runs

        return runs(self)

    def logs(self, run: RunRef = None, nodes: list[str] | None = None, follow: bool = False,
             tail: int | str = "all", logs_dir: str | None = None) -> Iterator[LogLine]:
        """The run's container output; a run whose containers are gone: what `up` kept in logs_dir."""
        from runner.backends.ssh.status import logs

        return logs(self, run_id_of(run), nodes, follow, tail, logs_dir or "artifacts")

    def cancel(self, run: RunRef = None, grace_s: float | None = None, keep_runs: int | None = None) -> CancelReport:
        """Stop the run on every node; keep_runs: then remove all run dirs but the N newest."""
        from runner.backends.ssh.down import cancel

        return cancel(self, run_id_of(run), grace_s, keep_runs)

    def collect(self, run: RunRef = None, dest: str = "artifacts", plots: bool = True,
                quiet: bool = True) -> CollectReport:
        from runner.backends.ssh.collect import collect_run

        return collect_run(self, run_id_of(run), dest, plots, quiet)

    def exec_argv(self, run: RunRef, node: str, command: list[str], tty: bool = False,
                  host: bool = False) -> list[str]:
        from runner.backends.ssh.node_exec import exec_argv

        return exec_argv(self, run_id_of(run), node, command, tty, host)

    def check(self) -> CheckReport:
        from runner.backends.results import CheckReport
        from runner.backends.ssh.check import run_checks

        checks = run_checks(self.inventory, self.accept_new_host_keys, self.parallel)
        return CheckReport("ssh", self.path, checks, [f"{c.node}: {', '.join(c.problems)}" for c in checks if c.problems])

    def push(self, full: bool = False, build: bool = False, direct: bool = False) -> list:
        """Every node gets the job's image (only the layers it lacks); one PushResult per node."""
        from runner.backends.ssh.nodes_setup import push

        return push(self, full, build, direct)

    def sync(self) -> list:
        """job.sync's files to every node (only what a node lacks); one result per node and source."""
        from runner.backends.ssh.nodes_setup import sync

        return sync(self)

    def profile(self, refresh: bool = False, no_push: bool = False, min_seconds: float = 2.0,
                timeout: float = 900.0, trainer_args: list[str] | None = None, quiet: bool = False) -> Any:
        """Measure every node for the job's pipeline (parallel.partition auto): (profile, split,
        uniform split, problem) as runner/profile/auto.py's plan_from_profile gives them."""
        from runner.backends.ssh.nodes_setup import profile

        return profile(self, refresh, no_push, min_seconds, timeout, trainer_args or [], quiet)

    def shapes(self, arch: str | None = None, gpus_per_node: int | None = None) -> list[tuple[str, int, int]]:
        inv, out = self.inventory, []
        for n in inv.ordered():
            a = n.arch or arch
            if a is None:
                raise UserError(f"{inv.path}:{n.line}: node {n.name}: arch unknown (not in the inventory); "
                                "add `arch:` or pass --arch amd64|arm64")
            if n.gpus == "all" and gpus_per_node is None:
                raise UserError(f"{inv.path}:{n.line}: node {n.name}: gpus: all cannot be requested from Kubernetes; "
                                "pass --gpus-per-node N (or give the node a count)")
            gpus = gpus_per_node if gpus_per_node is not None else int(n.gpus or 0)
            out.append((a, gpus, inv.job.nproc_per_node or n.slots))
        return out
