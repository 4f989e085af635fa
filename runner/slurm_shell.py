"""Where Slurm commands run: this machine (a login node already) or `slurm.login` over SSH.

One small interface (run, files) so submit/status/down/collect are written once: LocalShell runs
subprocesses and touches local files; LoginShell goes through runner.ssh.Remote (verified host
keys, SFTP). Commands are argv lists, never strings with values pasted in.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from runner.errors import UserError
from runner.slurm_inventory import SlurmInventory
from runner.ssh import Remote, Result


class LocalShell:
    where = "this machine"

    def run(self, argv: list[str], timeout: float = 60.0, stdin: bytes | None = None) -> Result:
        try:
            p = subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout,
                               stdin=None if stdin is not None else subprocess.DEVNULL)
        except FileNotFoundError:
            return Result(127, "", f"{argv[0]}: command not found")
        except subprocess.TimeoutExpired:
            raise UserError(f"`{' '.join(argv[:3])}` did not answer within {timeout:.0f}s on {self.where}") from None
        return Result(p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace"))

    def put_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        tmp = f"{path}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)  # secrets are never 0644, even briefly
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(data)
        os.replace(tmp, path)

    def read_bytes(self, path: str, offset: int = 0) -> bytes | None:
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                return fh.read()
        except OSError:
            return None

    def makedirs(self, path: str, mode: int = 0o755) -> None:
        os.makedirs(path, mode=mode, exist_ok=True)

    def home(self) -> str:
        return str(Path.home())

    def close(self) -> None:
        pass


class LoginShell:
    def __init__(self, remote: Remote):
        self.remote = remote
        self.where = f"login node {remote.node.host}"

    def run(self, argv: list[str], timeout: float = 60.0, stdin: bytes | None = None) -> Result:
        return self.remote.run(argv, timeout=timeout, stdin=stdin)

    def put_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.remote.put_bytes(path, data, mode)

    def read_bytes(self, path: str, offset: int = 0) -> bytes | None:
        try:
            with self.remote.sftp.open(path, "rb") as fh:
                fh.seek(offset)
                return fh.read()
        except OSError:
            return None

    def makedirs(self, path: str, mode: int = 0o755) -> None:
        self.remote.makedirs(path, mode)

    def home(self) -> str:
        return self.remote.run(["sh", "-c", 'echo "$HOME"']).out.strip()

    def close(self) -> None:
        self.remote.close()


Shell = LocalShell | LoginShell


def open_shell(inv: SlurmInventory, accept_new_host_keys: bool = False) -> Shell:
    if inv.slurm.login is None:
        return LocalShell()
    return LoginShell(Remote(inv.slurm.login, accept_new_host_keys).connect())
