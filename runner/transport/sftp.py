"""A node's files over the verified SSH connection's SFTP session (no shell: an exec costs the node
a login), each read bounded: what `Remote` (runner/transport/ssh.py) offers for files."""

from __future__ import annotations

import os
import stat
import threading
import time
from typing import TYPE_CHECKING

import paramiko

from runner.core import safe_path
from runner.core.errors import UserError

if TYPE_CHECKING:
    from runner.inventory import Node

# What one command's stdout (and, apart, its stderr) or one file read whole may hold. The largest
# honest ones: a batch of sha256sum lines (runner/transport/digest.py), a listing of a run dir's files.
MAX_OUTPUT = 8 << 20
PROC_NET_LIMIT = 64 << 20  # /proc/net/tcp{,6}: 150 bytes a socket, a busy server has 100k of them
# A listing bigger than this is not a run dir (a node answering with a tree that never ends).
WALK_MAX_FILES = 1_000_000
# `.` and `..`: listed besides a directory's own entries, and not kept (a node may repeat them too).
DOT_ENTRIES = 2


SFTP_SILENCE_S = 120.0
SFTP_OPEN_S = 10.0


def close_quietly(chan: paramiko.Channel) -> None:
    """Close a channel from a watchdog: the connection may be gone already (nothing left to end)."""
    try:
        chan.close()
    except (EOFError, OSError, paramiko.SSHException):
        pass


class WatchedSFTP(paramiko.SFTPClient):
    """paramiko's SFTP client whose every answer (one packet: at most 16 MiB, paramiko refuses more)
    must arrive whole within `limit` seconds of being waited for. The channel's own timeout bounds
    only the silence between two reads: a node that sends an answer one byte at a time, each just
    inside it, would hold its caller for ever. One watchdog thread per session (transfers read
    thousands of packets a second: no timer per packet) closes the channel when an answer is late;
    the reader then fails with one UserError naming the node."""

    def __init__(self, chan: paramiko.Channel, node: str, limit: float):
        self._node, self._limit = node, limit
        self._since: float | None = None  # when the packet being read was first waited for
        self._cut = False
        chan.settimeout(limit)
        threading.Thread(target=self._watch, args=(chan,), daemon=True, name="sftp-watchdog").start()
        super().__init__(chan)  # the version exchange is the first packet watched

    def _watch(self, chan: paramiko.Channel) -> None:
        while not chan.closed:
            time.sleep(min(5.0, self._limit / 4))
            since = self._since
            if since is not None and time.monotonic() - since > self._limit:
                self._cut = True
                close_quietly(chan)
                return

    def _read_packet(self):
        self._since = time.monotonic()
        try:
            return super()._read_packet()
        except (EOFError, OSError, paramiko.SSHException):
            if self._cut:
                raise UserError(f"node {self._node}: an SFTP answer took over {self._limit:.0f}s to arrive whole; "
                                "the node is too slow or is not a plain sshd (check its link)") from None
            raise
        finally:
            self._since = None


def _close_unheard(sftp: paramiko.SFTPClient, handle: bytes) -> None:
    """Close a directory handle left before its EOF without waiting for the answer: the node that
    listed without end may never give one. paramiko drops the answer, when it comes, as one no
    request waits for; a session already gone has nothing left to close."""
    try:
        # paramiko's own (not in its stubs)
        sftp._async_request(type(None), paramiko.sftp.CMD_CLOSE, handle)  # type: ignore[attr-defined]
    except (EOFError, OSError, paramiko.SSHException):
        pass


def listdir_within(sftp: paramiko.SFTPClient, path: str, limit: int) -> list[paramiko.SFTPAttributes] | None:
    """A directory's entries on the node (without `.` and `..`), or None when it holds more than
    limit. Counted entry by entry as each READDIR answer is parsed: paramiko's listdir_attr keeps
    every entry until the node says EOF, which a hostile node never does (3M entries held 2.4 GB),
    and its listdir_iter reads 50 answers ahead and leaves the handle open when left early. So a
    listing costs at most limit entries and one answer (16 MiB), whatever count the answer claims;
    the handle is closed however the listing ends."""
    # paramiko's own request calls (what listdir_attr does, a step at a time): not in its stubs.
    request, adjust_cwd = sftp._request, sftp._adjust_cwd  # type: ignore[attr-defined]
    t, msg = request(paramiko.sftp.CMD_OPENDIR, adjust_cwd(path))
    if t != paramiko.sftp.CMD_HANDLE:
        raise paramiko.SFTPError("Expected handle")
    handle = msg.get_binary()
    out: list[paramiko.SFTPAttributes] = []
    seen = 0  # every entry parsed, the dots too: a node repeating `.` without end is bounded as well
    ended = False
    try:
        while True:
            try:
                t, msg = request(paramiko.sftp.CMD_READDIR, handle)
            except EOFError:  # the end of the directory
                ended = True
                break
            if t != paramiko.sftp.CMD_NAME:
                raise paramiko.SFTPError("Expected name response")
            for _ in range(msg.get_int()):  # the node's count: past the packet's end, empty entries
                filename, longname = msg.get_text(), msg.get_text()
                # as listdir_attr (paramiko's own, not in its stubs)
                attr = paramiko.SFTPAttributes._from_msg(msg, filename, longname)  # type: ignore[attr-defined]
                seen += 1
                if filename not in (".", ".."):
                    out.append(attr)
                if len(out) > limit or seen > limit + DOT_ENTRIES:
                    return None
    finally:
        if not ended:  # over limit, a name not UTF-8, a late answer: the handle is not left open
            _close_unheard(sftp, handle)
    request(paramiko.sftp.CMD_CLOSE, handle)  # as listdir_attr: the directory ended, its node answers
    return out


class NodeFiles:
    """Mixed into Remote: needs its `client`, `node`, `_lock`, `_sftp` and `_home`."""

    # Set by Remote.__init__ (runner/transport/ssh.py); declared here for the type checker only.
    client: paramiko.SSHClient | None
    node: Node
    _lock: threading.Lock
    _sftp: paramiko.SFTPClient | None
    _home: str | None

    @property
    def sftp(self) -> paramiko.SFTPClient:
        with self._lock:
            if self._sftp is None or self._sftp.sock.closed:  # closed: an answer was late, a fresh session
                # A node behind a cut link answers nothing and TCP may take a quarter hour to say so:
                # an SFTP answer that is not whole within this long fails instead of hanging its caller.
                transport = self.client.get_transport() if self.client is not None else None
                assert transport is not None, "not connected"
                chan = transport.open_session(timeout=SFTP_OPEN_S)
                chan.invoke_subsystem("sftp")
                self._sftp = WatchedSFTP(chan, self.node.name, SFTP_SILENCE_S)
            return self._sftp

    def makedirs(self, path: str, mode: int = 0o755) -> None:
        """mkdir -p over SFTP (no shell: an exec costs a login shell on the node)."""
        missing = []
        p = path.rstrip("/")
        while p and self.stat(p) is None:
            missing.append(p)
            p = os.path.dirname(p)
        for d in reversed(missing):
            try:
                self.sftp.mkdir(d, mode)
                self.sftp.chmod(d, mode)  # mkdir's mode is filtered by the server's umask
            except OSError:
                if self.stat(d) is None:
                    raise UserError(f"node {self.node.name}: cannot create {d}") from None

    def read_text(self, path: str, limit: int = MAX_OUTPUT) -> str | None:
        """A file on the node (None when it cannot be read); one over limit bytes is the node's
        error, named in one UserError, not a reason to hold whatever it holds."""
        try:
            with self.sftp.open(path, "r") as fh:
                data = fh.read(limit + 1)  # to EOF or one byte past the limit, in paramiko's round trips
        except OSError:
            return None
        if len(data) > limit:
            raise UserError(f"node {self.node.name}: {path} is over {limit >> 20} MiB; refusing to read it")
        return data.decode(errors="replace")

    def listening_ports(self) -> set[int]:
        """TCP ports in LISTEN state on the node, from /proc/net/tcp{,6} over SFTP (no shell)."""
        return set(self.listeners())

    def listeners(self) -> dict[int, set[str]]:
        """{port: socket inodes} of the node's listening TCP sockets (/proc/net/tcp{,6}, over SFTP)."""
        out: dict[int, set[str]] = {}
        for f in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in (self.read_text(f, PROC_NET_LIMIT) or "").splitlines()[1:]:
                parts = line.split()
                if len(parts) > 9 and parts[3] == "0A":
                    out.setdefault(int(parts[1].rsplit(":", 1)[1], 16), set()).add(parts[9])
        return out

    def put_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write a file on the node, created with mode (secrets are never 0644, not even while the
        file is still empty: a reader that opened it then would read what comes later)."""
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            self.sftp.remove(tmp)  # one a dead runner left: open below must create the file
        except OSError:
            pass
        with self.create(tmp, mode) as fh:
            fh.write(data)
        self.sftp.posix_rename(tmp, path)

    def create(self, path: str, mode: int) -> paramiko.SFTPFile:
        """A new file on the node, opened for writing with its permissions given in the SFTP open
        (sftp-server creates it with them, less its umask): paramiko's open() sends none, so the file
        would exist 0644 until a chmod. Refused (OSError) when path exists."""
        sftp = self.sftp
        attrs = paramiko.SFTPAttributes()
        attrs.st_mode = mode
        flags = paramiko.sftp.SFTP_FLAG_WRITE | paramiko.sftp.SFTP_FLAG_CREATE | paramiko.sftp.SFTP_FLAG_EXCL
        # as paramiko's open() (its own calls, not in its stubs)
        request, adjust_cwd = sftp._request, sftp._adjust_cwd  # type: ignore[attr-defined]
        t, msg = request(paramiko.sftp.CMD_OPEN, adjust_cwd(path), flags, attrs)
        if t != paramiko.sftp.CMD_HANDLE:
            raise paramiko.SFTPError("Expected handle")
        fh = paramiko.SFTPFile(sftp, msg.get_binary(), "wb")
        try:
            fh.chmod(mode)  # exactly mode, past the node's umask (the open made it no wider)
        except BaseException:
            fh.close()
            raise
        return fh

    def stat(self, path: str) -> paramiko.SFTPAttributes | None:
        try:
            return self.sftp.stat(path)
        except FileNotFoundError:
            return None

    def walk(self, root: str) -> list[tuple[str, paramiko.SFTPAttributes]]:
        """All regular files under root as (relative path, attrs), listed over SFTP (listdir_within).

        The listing is the node's word, so every name in it is checked before it becomes a path
        (runner/core/safe_path.py: no '/', `..`, NUL or control character in a name, at most
        PATH_MAX bytes a path) and the whole walk is bounded (WALK_MAX_FILES entries, counted as
        they arrive, not once a directory is whole): a node that answers otherwise is named in one
        UserError and nothing of its listing is used."""
        out: list[tuple[str, paramiko.SFTPAttributes]] = []
        stack = [""]
        seen = 0
        while stack:
            rel = stack.pop()
            try:
                entries = listdir_within(self.sftp, f"{root}/{rel}" if rel else root, WALK_MAX_FILES - seen)
            except FileNotFoundError:
                continue
            except UnicodeDecodeError:
                raise UserError(f"node {self.node.name}: {root}/{rel}: the node listed a name that is not UTF-8; "
                                "nothing taken from it (rename the file on the node)") from None
            if entries is None:  # more than the entries the walk has left
                raise UserError(f"node {self.node.name}: {root}: more than {WALK_MAX_FILES:,} entries listed; "
                                "nothing taken from it")
            seen += len(entries)
            for e in entries:
                r = f"{rel}/{e.filename}" if rel else e.filename
                why = safe_path.name_error(e.filename) or safe_path.rel_error(r)
                if why:
                    raise UserError(f"node {self.node.name}: {root}: the node listed {safe_path.shown(r)} "
                                    f"({why}); nothing taken from it")
                if stat.S_ISDIR(e.st_mode or 0):
                    stack.append(r)
                elif stat.S_ISREG(e.st_mode or 0):
                    out.append((r, e))
        return out

    @property
    def home(self) -> str:
        """The SSH user's home on the node (where SFTP starts), asked once."""
        if self._home is None:
            self._home = self.sftp.normalize(".")
        return self._home

