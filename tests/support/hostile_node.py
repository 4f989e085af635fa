"""A node whose sshd is the attacker's: a real SSH server (paramiko's server side, in this
process) on a loopback address of this session's test net, serving this machine's real
filesystem over SFTP and running commands with the real `sh`, that lies exactly where a test
tells it to (a listing with names a real filesystem cannot hold, a file claimed as a regular
one). The runner talks to it with its real code: paramiko for SFTP and commands, the OpenSSH
client for streams. No sandbox, no docker: a few milliseconds to start.

Not a fake of what the runner does: everything the runner sends is carried out for real, only the
node's answers can be forged, which is what a hostile node can do.
"""

from __future__ import annotations

import getpass
import os
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import paramiko
from paramiko import SFTPAttributes, SFTPHandle, SFTPServer, SFTPServerInterface
from paramiko.sftp import SFTP_OK

from runner.inventory import Node
from runner.inventory.hostkeys import known_hosts_name
from tests.conftest import net_addr

# (path asked for, the real entries) -> the entries the node answers with
Lister = Callable[[str, list[SFTPAttributes]], list[SFTPAttributes]]


def entry(name: str, kind: str = "file", size: int = 0) -> SFTPAttributes:
    """A listing entry with any name (a real filesystem holds no '/' in a name, nor `..` as a file)."""
    a = SFTPAttributes()
    a.filename = name
    a.st_mode = (stat.S_IFDIR | 0o755) if kind == "dir" else (stat.S_IFREG | 0o644)
    a.st_size, a.st_uid, a.st_gid, a.st_atime, a.st_mtime = size, 0, 0, 1_700_000_000, 1_700_000_000
    return a


class _Handle(SFTPHandle):
    def stat(self):
        try:
            return SFTPAttributes.from_stat(os.fstat(self.readfile.fileno()))
        except OSError as e:
            return SFTPServer.convert_errno(e.errno)

    def chattr(self, attr):
        try:
            SFTPServer.set_file_attr(self.filename, attr)
            return SFTP_OK
        except OSError as e:
            return SFTPServer.convert_errno(e.errno)


def _errno(fn):
    def wrapped(*a, **k):
        try:
            return fn(*a, **k)
        except OSError as e:
            return SFTPServer.convert_errno(e.errno)
    return wrapped


class _FS(SFTPServerInterface):
    """SFTP on the real filesystem; list_folder passes through the node's Lister."""

    def __init__(self, server, node: HostileNode, *a, **k):
        super().__init__(server, *a, **k)
        self.node = node

    def canonicalize(self, path):
        p = path if os.path.isabs(path) else os.path.join(self.node.home, path)
        return os.path.normpath(p)

    def list_folder(self, path):
        out = []
        try:
            for name in os.listdir(path):
                a = SFTPAttributes.from_stat(os.lstat(os.path.join(path, name)))
                a.filename = name
                out.append(a)
        except OSError as e:
            if not self.node.lister:
                return SFTPServer.convert_errno(e.errno)
        return self.node.lister(path, out) if self.node.lister else out  # a lister may answer for any path

    @_errno
    def stat(self, path):
        return SFTPAttributes.from_stat(os.stat(path))

    @_errno
    def lstat(self, path):
        return SFTPAttributes.from_stat(os.lstat(path))

    @_errno
    def open(self, path, flags, attr):
        fd = os.open(path, flags, getattr(attr, "st_mode", None) or 0o666)
        if flags & os.O_WRONLY:
            mode = "ab" if flags & os.O_APPEND else "wb"
        elif flags & os.O_RDWR:
            mode = "a+b" if flags & os.O_APPEND else "r+b"
        else:
            mode = "rb"
        h = _Handle(flags)
        h.filename, h.readfile = path, os.fdopen(fd, mode)
        h.writefile = h.readfile
        return h

    @_errno
    def remove(self, path):
        os.remove(path)
        return SFTP_OK

    @_errno
    def rename(self, oldpath, newpath):
        if os.path.exists(newpath):
            raise FileExistsError(17, "exists")
        os.rename(oldpath, newpath)
        return SFTP_OK

    @_errno
    def posix_rename(self, oldpath, newpath):
        os.rename(oldpath, newpath)
        return SFTP_OK

    @_errno
    def mkdir(self, path, attr):
        os.mkdir(path)
        return SFTP_OK

    @_errno
    def rmdir(self, path):
        os.rmdir(path)
        return SFTP_OK

    @_errno
    def chattr(self, path, attr):
        SFTPServer.set_file_attr(path, attr)
        return SFTP_OK

    @_errno
    def readlink(self, path):
        return os.readlink(path)


class _SFTP(SFTPServer):
    """SFTP whose answers longer than the node's `trickle_over` bytes go out one byte at a time,
    `trickle_s` apart: each byte inside any wait between reads, the whole answer never."""

    def __init__(self, channel, name, server, sftp_si, node: HostileNode, *a, **k):
        super().__init__(channel, name, server, sftp_si, node, *a, **k)
        self.node = node

    def _write_all(self, out):
        if self.node.trickle_over is None or len(out) <= self.node.trickle_over:
            return super()._write_all(out)
        for b in out:
            if self.sock.closed:
                return
            self.sock.sendall(bytes([b]))
            time.sleep(self.node.trickle_s)


class _Server(paramiko.ServerInterface):
    def __init__(self, node: HostileNode):
        self.node = node

    def get_allowed_auths(self, username):
        return "publickey"

    def check_auth_publickey(self, username, key):
        return paramiko.AUTH_SUCCESSFUL if key == self.node.client_key else paramiko.AUTH_FAILED

    def check_channel_request(self, kind, chanid):
        return paramiko.OPEN_SUCCEEDED if kind == "session" else paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def check_channel_exec_request(self, channel, command):
        self.node.commands.append(command.decode(errors="replace"))
        threading.Thread(target=self.node._exec, args=(channel, command), daemon=True).start()
        return True


class HostileNode:
    """One node: start() it, hand node() to the runner, stop() it (a context manager does both)."""

    def __init__(self, tmp: Path, third: int = 23, fourth: int = 1, lister: Lister | None = None):
        self.tmp = tmp
        self.home = str(tmp / "home")
        os.makedirs(self.home, exist_ok=True)
        self.addr = net_addr(third, fourth)
        self.lister = lister
        self.commands: list[str] = []
        self.trickle_over: int | None = None  # SFTP answers over this many bytes are trickled (_SFTP)
        self.trickle_s = 0.2
        self.rewrite: Callable[[str], str] | None = None  # the command the node runs instead of the one asked
        self.host_key = paramiko.ECDSAKey.generate()
        self.client_key = paramiko.ECDSAKey.generate()
        self.key_file = tmp / "client_key"
        self.client_key.write_private_key_file(str(self.key_file))
        os.chmod(self.key_file, 0o600)
        self._sock: socket.socket | None = None
        self._transports: list[paramiko.Transport] = []
        self.port = 0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> HostileNode:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((self.addr, 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for t in self._transports:
            t.close()

    def __enter__(self) -> HostileNode:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _accept(self) -> None:
        while self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            t = paramiko.Transport(conn)
            t.add_server_key(self.host_key)
            t.set_subsystem_handler("sftp", _SFTP, _FS, self)
            self._transports.append(t)
            try:
                t.start_server(server=_Server(self))
            except (paramiko.SSHException, EOFError, OSError):
                continue

    def _exec(self, chan: paramiko.Channel, command: bytes) -> None:
        """The command, run for real with sh in the node's home; stdin, stdout, stderr and the exit
        status carried as sshd does."""
        cmd = self.rewrite(command.decode()) if self.rewrite else command.decode()
        proc = subprocess.Popen(["sh", "-c", cmd], cwd=self.home, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

        def feed() -> None:
            try:
                while data := chan.recv(1 << 16):
                    proc.stdin.write(data)
                    proc.stdin.flush()
            except (OSError, ValueError, EOFError):  # EOFError: the runner's ssh went away mid-stream
                pass
            finally:
                try:
                    proc.stdin.close()
                except OSError:
                    pass

        def pump(fd, send) -> None:
            while data := os.read(fd, 1 << 16):
                try:
                    send(data)
                except (OSError, EOFError):  # the runner went away (EOFError: paramiko's word for it)
                    proc.kill()
                    return

        threading.Thread(target=feed, daemon=True).start()
        outs = [threading.Thread(target=pump, args=(proc.stdout.fileno(), chan.sendall), daemon=True),
                threading.Thread(target=pump, args=(proc.stderr.fileno(), chan.sendall_stderr), daemon=True)]
        for t in outs:
            t.start()
        rc = proc.wait()
        for t in outs:
            t.join()
        try:
            chan.send_exit_status(rc if rc >= 0 else 128 - rc)  # killed by a signal: as sh reports it
            chan.shutdown_write()
            chan.close()
        except (OSError, EOFError):
            pass

    # -- what the runner is given -------------------------------------------------------------
    def known_hosts(self, path: Path | None = None, key: paramiko.PKey | None = None) -> Path:
        """A known_hosts file holding this node's key (or `key`, to make a mismatch)."""
        path = path or self.tmp / "known_hosts"
        k = key or self.host_key
        path.write_text(f"{known_hosts_name(self.addr, self.port)} {k.get_name()} {k.get_base64()}\n")
        return path

    def node(self, name: str = "evil", workdir: str | None = None, **kw) -> Node:
        kw.setdefault("known_hosts", str(self.known_hosts()))
        return Node(name=name, host=self.addr, port=self.port, user=getpass.getuser(),
                    identity_file=str(self.key_file), workdir=workdir or str(self.tmp / "wd"), **kw)
