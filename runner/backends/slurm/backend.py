"""`SlurmBackend`: a run is one batch job; the verbs load the `slurm:` inventory and go to
submit (up, down), status (status, logs, ls, over one login shell) and collect."""

from __future__ import annotations

from typing import ClassVar

from runner.backends.base import Option
from runner.core.errors import UserError


class SlurmBackend:
    name: ClassVar[str] = "slurm"
    label: ClassVar[str] = "Slurm"
    options: ClassVar[tuple[Option, ...]] = (
        Option("up", ("--requeue",), {"action": "store_true",
                                      "help": "(slurm) a preempted job goes back in the queue and resumes from its "
                                              "latest checkpoint"},
               elsewhere="SSH runs use --max-restarts"),
    )

    @staticmethod
    def claims(keys: set[str]) -> bool:
        return "slurm" in keys and "nodes" not in keys  # both: SSH unless --scheduler slurm

    @staticmethod
    def accepts(keys: set[str], inventory: str) -> None:
        if keys and "slurm" not in keys:
            raise UserError(f"{inventory}: --scheduler slurm needs a `slurm:` section (partition, nodes, ...)")

    @staticmethod
    def _inventory(args, verb: str):
        from runner.inventory.slurm import load_slurm_inventory

        dry = verb == "up" and args.dry_run
        return load_slurm_inventory(args.inventory, job_path=getattr(args, "job", None), check_files=not dry,
                                    with_job=verb == "up")

    def dryrun(self, args) -> int:
        from runner.backends.slurm.submit import cmd_dry_run

        return cmd_dry_run(args, self._inventory(args, "up"))

    def up(self, args) -> int:
        from runner.backends.slurm.submit import cmd_up
        from runner.inventory.choice import remember_inventory

        inv = self._inventory(args, "up")
        remember_inventory(args.inventory)
        return cmd_up(args, inv)

    def down(self, args) -> int:
        from runner.backends.slurm.submit import cmd_down

        return cmd_down(args, self._inventory(args, "down"))

    def collect(self, args) -> int:
        from runner.backends.slurm.collect import cmd_collect

        return cmd_collect(args, self._inventory(args, "collect"))

    def _on_login(self, verb: str, args) -> int:
        from runner.backends.slurm import status
        from runner.backends.slurm.shell import open_shell

        inv = self._inventory(args, verb)
        sh = open_shell(inv, args.accept_new_host_keys)
        try:
            return getattr(status, f"cmd_{verb}")(args, inv, sh)
        finally:
            sh.close()

    def status(self, args) -> int:
        return self._on_login("status", args)

    def logs(self, args) -> int:
        return self._on_login("logs", args)

    def ls(self, args) -> int:
        return self._on_login("ls", args)
