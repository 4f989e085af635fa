"""Where Slurm commands run: this machine (a login node already) or `slurm.login` over SSH.

One small interface (run, files) so submit/status/down/collect are written once: LocalShell runs
subprocesses and touches local files; LoginShell goes through runner.transport.ssh.Remote (verified host
keys, SFTP). Commands are argv lists, never strings with values pasted in. Whatever they print
and whatever a file holds is read up to a cap (the cluster's tools and files are not trusted more
than a node's).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

from runner.core.errors import UserError
from runner.core.node_output import read_capped
from runner.inventory.slurm import SlurmInventory
from runner.transport.ssh import MAX_OUTPUT, Remote, Result


class LocalShell:
    where = "this machine"

    def run(self, argv: list[str], timeout: float = 60.0, stdin: bytes | None = None,
            max_output: int = MAX_OUTPUT) -> Result:
        """argv's exit code and output, each stream read up to max_output bytes (as a node's:
        runner/transport/ssh.py): more is one UserError, the process killed."""
        try:
            # Its own session and group: what it starts dies with it (and stops holding the pipes).
            p = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except FileNotFoundError:
            return Result(127, "", f"{argv[0]}: command not found")
        got: dict[str, tuple[bytearray, bool]] = {}

        def drain(name: str, pipe) -> None:
            got[name] = read_capped(pipe.read1, max_output)
            if got[name][1]:
                kill_group(p)

        readers = [threading.Thread(target=drain, args=(n, f), daemon=True) for n, f in (("stdout", p.stdout),
                                                                                         ("stderr", p.stderr))]
        for t in readers:
            t.start()
        try:
            if stdin is not None:
                try:
                    p.stdin.write(stdin)
                    p.stdin.close()
                except BrokenPipeError:
                    pass  # it ended without reading all of it: its exit code says why
            p.wait(timeout)
            for t in readers:
                t.join(timeout)
        except subprocess.TimeoutExpired:
            raise UserError(f"`{' '.join(argv[:3])}` did not answer within {timeout:.0f}s on {self.where}") from None
        finally:
            if p.poll() is None:
                kill_group(p)
                p.wait()
            for f in (p.stdout, p.stderr):
                f.close()
        over = [n for n, (_, too_much) in got.items() if too_much]
        if over:
            raise UserError(f"`{' '.join(argv[:3])}` wrote more than {max_output >> 20} MiB to {over[0]} on "
                            f"{self.where}; treated as failed (a command's output is capped)")
        out, err = (bytes(got.get(n, (b"", False))[0]) for n in ("stdout", "stderr"))
        return Result(p.returncode, out.decode(errors="replace"), err.decode(errors="replace"))

    def put_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Created with mode (O_EXCL, never through a link someone left at the temporary name)."""
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            os.unlink(tmp)  # one a dead runner left
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fh.fileno(), mode)  # exactly mode, past the umask (the open made it no wider)
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            remove_quietly(tmp)
            raise

    def read_bytes(self, path: str, offset: int = 0, limit: int = MAX_OUTPUT) -> bytes | None:
        """At most limit bytes from offset (from the end when negative); None when unreadable."""
        try:
            with open(path, "rb") as fh:
                fh.seek(_start(offset, os.fstat(fh.fileno()).st_size))
                return fh.read(limit)
        except OSError:
            return None

    def remove(self, path: str) -> None:
        remove_quietly(path)

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

    def read_bytes(self, path: str, offset: int = 0, limit: int = MAX_OUTPUT) -> bytes | None:
        """At most limit bytes from offset (from the end when negative); None when unreadable."""
        try:
            with self.remote.sftp.open(path, "rb") as fh:
                fh.seek(_start(offset, fh.stat().st_size or 0))
                return fh.read(limit)
        except OSError:
            return None

    def remove(self, path: str) -> None:
        try:
            self.remote.sftp.remove(path)
        except OSError:
            pass

    def makedirs(self, path: str, mode: int = 0o755) -> None:
        self.remote.makedirs(path, mode)

    def home(self) -> str:
        return self.remote.run(["sh", "-c", 'echo "$HOME"']).out.strip()

    def close(self) -> None:
        self.remote.close()


Shell = LocalShell | LoginShell


def _start(offset: int, size: int) -> int:
    return max(0, size + offset) if offset < 0 else offset


def kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def open_shell(inv: SlurmInventory, accept_new_host_keys: bool = False) -> Shell:
    if inv.slurm.login is None:
        return LocalShell()
    return LoginShell(Remote(inv.slurm.login, accept_new_host_keys).connect())
