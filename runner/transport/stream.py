"""One byte stream between local processes and a command on a node, carried by OpenSSH (C speed,
no GIL; paramiko managed a quarter of scp's rate), watched for stalls. Used by `push` (local
`tar [| gzip]` -> node `docker load`) and `collect` (node `tar` -> runner/delivery/untar.py).

A stream that moves less than STALL_BYTES in `stall_s` is killed (a node that sends or reads one
byte at a time is as stuck as one that sends none), and OpenSSH's ServerAlive probes end one
whose node stopped answering at the SSH level: a frozen node never blocks the runner forever. A
download may also be bounded in bytes (`max_bytes`: what was listed, plus the format's overhead).
Every process is reaped on every path, and stderr goes to a pipe that a thread always drains,
keeping only its last bytes (an unread pipe could stall a process; a file would grow with whatever
a node writes).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from runner.transport.link_rate import compress_stream
from runner.transport.ssh import Remote

CHUNK = 1 << 20
STALL_S = 120.0  # collect: under STALL_BYTES from a node in this long and it is given up (push sets its own)
STALL_BYTES = 64 << 10  # ~550 B/s over STALL_S: a Pi on a poor Wi-Fi link (1 MB/s) moves that in 0.07 s


class Watchdog:
    """Kills the processes when under STALL_BYTES moved in stall_s (`progress` counts them)."""

    def __init__(self, procs: list[subprocess.Popen], stall_s: float):
        self.procs, self.stall_s = procs, stall_s
        self.last = time.monotonic()  # when the last STALL_BYTES were complete
        self._since_last = 0
        self.fired = False
        self._done = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="stream-watchdog").start()

    def _run(self) -> None:
        while not self._done.wait(min(5.0, self.stall_s / 4)):
            if time.monotonic() - self.last > self.stall_s:
                self.fired = True
                for p in self.procs:
                    if p.poll() is None:
                        p.kill()
                return

    def progress(self, n: int) -> None:
        self._since_last += n
        if self._since_last >= STALL_BYTES:
            self.last, self._since_last = time.monotonic(), 0

    def stop(self) -> None:
        self._done.set()


class StderrTail:
    """A pipe for processes' stderr, drained as it fills by a thread that keeps its last KEEP bytes:
    what an error message quotes, never more, however much a node or a local tool writes there."""

    KEEP = 64 << 10

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        self._buf = bytearray()
        self._t = threading.Thread(target=self._drain, daemon=True, name="stderr-tail")
        self._t.start()

    def fileno(self) -> int:
        """The write end, for Popen(stderr=...fileno()): an fd, as the type of Popen's stderr wants."""
        return self._w

    def _drain(self) -> None:
        try:
            while chunk := os.read(self._r, self.KEEP):
                self._buf += chunk
                if len(self._buf) > 2 * self.KEEP:
                    del self._buf[:-self.KEEP]
        finally:
            os.close(self._r)

    def close_writer(self) -> None:
        """Once every writer was started: the reader sees the end when the last of them exits."""
        if self._w >= 0:
            os.close(self._w)
            self._w = -1

    def lines(self) -> list[str]:
        """The kept bytes' lines (the first may be cut short)."""
        self.close_writer()
        self._t.join(10)  # a writer's leftover child may hold the pipe: what came so far will do
        return bytes(self._buf[-self.KEEP:]).decode(errors="replace").strip().splitlines()

    def text(self, n: int = 300) -> str:
        """The last n characters, on one line."""
        return " ".join(self.lines())[-n:]


def transfer_progress(quiet: bool = False, eta: bool = True):
    """The bytes bar of every bulk transfer (push, sync, collect): one per node, gone when done."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    cols = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn()]
    console = Console()
    # Off where nothing would be drawn (output to a file or a pipe): rich's bar still ends with a
    # blank line there.
    return Progress(*cols, *([TimeRemainingColumn()] if eta else []), console=console,
                    disable=quiet or not console.is_terminal, transient=True)


def pump(src, dst, dog: Watchdog, on_chunk: Callable[[int], None] | None = None,
         max_bytes: int | None = None) -> tuple[int, bool]:
    """Copy src to dst as bytes arrive; (bytes, True) when the reader went away mid-stream. Past
    max_bytes nothing more is written: (bytes so far, counting the piece that went over, False)."""
    moved = 0
    try:
        while buf := src.read1(CHUNK):
            if max_bytes is not None and moved + len(buf) > max_bytes:
                return moved + len(buf), False
            dst.write(buf)
            moved += len(buf)
            dog.progress(len(buf))
            if on_chunk is not None:
                on_chunk(len(buf))
        return moved, False
    except (BrokenPipeError, ConnectionResetError):
        return moved, True


@dataclass
class StreamResult:
    moved: int = 0
    broken: bool = False      # the receiving side closed mid-stream
    stalled: bool = False     # the watchdog killed it
    over: bool = False        # more than max_bytes came: stopped there
    unfinished: bool = False  # the receiver was still busy finish_s after the last byte
    ssh_rc: int | None = None
    local_rcs: list[int | None] = field(default_factory=list)
    ssh_err: str = ""
    local_err: str = ""


def ssh_stream(remote: Remote, remote_cmd: str, local: list[list[str]], *, upload: bool,
               stdin_data: bytes | None = None, on_chunk: Callable[[int], None] | None = None,
               stall_s: float | None = None, aes: bool = False, finish_s: float = 600.0,
               max_bytes: int | None = None, size: int | None = None) -> StreamResult:
    """upload=True: the chain `local[0] | local[1] ...` feeds `remote_cmd` on the node.
    upload=False: `remote_cmd`'s output feeds local[0]; stdin_data (e.g. file names) goes to
    remote_cmd's stdin meanwhile. finish_s: how long the receiver may take after the last byte
    (a `docker load` still unpacking). max_bytes: a download that brings more is stopped there
    (`over`) and its processes killed. size: the bytes it is expected to carry, when known (a small
    stream is not worth a link probe). Returns what happened; the caller words the error."""
    stall = STALL_S if stall_s is None else stall_s
    res = StreamResult()
    ssh_err, local_err = StderrTail(), StderrTail()
    procs: list[subprocess.Popen] = []
    # Compression only where it pays (runner/transport/link_rate.py: never on loopback, and off a
    # link faster than this host's zlib), and never on what gzip already packed.
    compress = not any(cmd[:1] == ["gzip"] for cmd in local) and compress_stream(remote, upload, aes, size)
    argv = [*remote.openssh_argv(compress=compress, aes=aes), remote_cmd]
    src = dst = ssh = feeder = None
    try:
        if upload:
            prev = None
            for cmd in local:
                p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL if prev is None else prev, stdout=subprocess.PIPE,
                                     stderr=local_err.fileno())
                if prev is not None:
                    prev.close()  # the next process holds the only read end: SIGPIPE reaches its writer
                prev = p.stdout
                procs.append(p)
            ssh = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=ssh_err.fileno())
            procs.append(ssh)
            src, dst = prev, ssh.stdin
        else:
            ssh = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=ssh_err.fileno())
            procs.append(ssh)
            sink = subprocess.Popen(local[0], stdin=subprocess.PIPE, stderr=local_err.fileno())
            procs.append(sink)
            src, dst = ssh.stdout, sink.stdin
            feeder = threading.Thread(target=_feed, args=(ssh.stdin, stdin_data or b""), daemon=True)
            feeder.start()
        ssh_err.close_writer()  # every process holds its own copy now
        local_err.close_writer()
        dog = Watchdog(procs, stall)
        try:
            res.moved, res.broken = pump(src, dst, dog, on_chunk, max_bytes)
        finally:
            dog.stop()  # after the last byte the receiver may legitimately be busy for minutes
        res.stalled = dog.fired
        res.over = max_bytes is not None and res.moved > max_bytes
        if res.over:
            _reap(procs)  # the rest is not read; the receiver has only what came within the bound
        _close(src, dst)  # a writer still at it (the receiver died) gets EPIPE, not a hang
        receiver = ssh if upload else procs[-1]
        res.unfinished = _wait(receiver, finish_s) is None
        if res.broken or res.stalled or res.over or res.unfinished or receiver.returncode:
            _reap(procs)  # the other side may still be blocked on its pipe
        for p in procs:
            _wait(p, 60)
        res.local_rcs = [p.poll() for p in procs if p is not ssh]  # None: still running (stuck)
        if feeder is not None:
            feeder.join(timeout=10)
    finally:
        _close(src, dst)
        _reap(procs)
        res.ssh_rc = ssh.returncode if ssh is not None else None
        res.local_rcs = res.local_rcs or [p.returncode for p in procs if p is not ssh]
        res.ssh_err, res.local_err = ssh_err.text(), local_err.text()
    return res


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except OSError:
        pass  # ssh ended early; its exit code and the caller's verification say why


def _wait(p: subprocess.Popen, timeout: float) -> int | None:
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def _close(*files) -> None:
    for f in files:
        if f is not None:
            try:
                f.close()
            except OSError:  # flushing into a pipe whose reader is gone: nothing left to save
                pass


def _reap(procs: list[subprocess.Popen]) -> None:
    """Kill whatever still runs and wait for it."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # stuck in the kernel: do not hang on it
            pass
