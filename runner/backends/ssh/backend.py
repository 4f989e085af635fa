"""The SSH backend: the inventory's own nodes, reached over SSH, one container per node
(runner/backends/ssh/launch.py starts it, runner/backends/ssh/node_runs.py finds and stops it). The default for any
inventory with a `nodes:` list."""

from __future__ import annotations

from typing import ClassVar

from runner.backends.base import Option


class SshBackend:
    name: ClassVar[str] = "ssh"
    label: ClassVar[str] = "SSH"
    options: ClassVar[tuple[Option, ...]] = ()

    @staticmethod
    def claims(keys: set[str]) -> bool:
        return True  # the fallback: an inventory no other backend claims lists nodes

    @staticmethod
    def accepts(keys: set[str], inventory: str) -> None:
        return None  # a missing `nodes:` is the inventory's own one-line error

    def dryrun(self, args) -> int:
        from runner.backends.ssh.dry_run import main

        return main(args)

    def up(self, args) -> int:
        from runner.backends.ssh.launch import main

        return main(args)

    def status(self, args) -> int:
        from runner.backends.ssh.status import cmd_status

        return cmd_status(args)

    def logs(self, args) -> int:
        from runner.backends.ssh.status import cmd_logs

        return cmd_logs(args)

    def ls(self, args) -> int:
        from runner.backends.ssh.status import cmd_ls

        return cmd_ls(args)

    def down(self, args) -> int:
        from runner.backends.ssh.down import main

        return main(args)

    def collect(self, args) -> int:
        from runner.backends.ssh.collect import main

        return main(args)
