"""The sandbox's daemons as processes of this machine: started and checked (`run`), found by pid
file or by what their command line names, stopped with a grace period; ports and mounts they hold."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from pathlib import Path

import psutil

from runner.core.errors import UserError


def unmount_below(root: Path) -> None:
    """Lazily unmount every mount point under root (deepest first)."""
    prefix = str(root).rstrip("/") + "/"
    points = [p.mountpoint for p in psutil.disk_partitions(all=True) if p.mountpoint.startswith(prefix)]
    for mp in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], capture_output=True)


def port_free(addr: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError:
            return False
    return True


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"{' '.join(cmd[:2])} failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def remove_stale_pid(path: Path) -> None:
    pid = read_pid(path)
    if pid is None or not psutil.pid_exists(pid):
        path.unlink(missing_ok=True)


def is_proc(pid: int, name: str) -> bool:
    try:
        return name in psutil.Process(pid).name()
    except psutil.Error:
        return False


def processes_mentioning(*needles: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if proc.pid != os.getpid() and any(n in cmd for n in needles):
            found.append(proc)
    return found


def terminate(pid: int, grace: float = 10.0) -> None:
    try:
        proc = psutil.Process(pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(grace)
    except psutil.TimeoutExpired:
        try:
            proc.kill()
            proc.wait(5)
        except psutil.Error:
            pass
    except psutil.Error:
        pass


def terminate_tree(pid: int, grace: float = 10.0) -> None:
    """`pid` and every process below it, found before any is signalled: an sshd's sessions are its
    children until it ends, then init's, and their command line ("sshd: root") names no node.
    A session whose client never closed (a namespace's link removed under it) lived on after
    `sandbox down`."""
    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        below = []
    terminate(pid, grace)
    for proc in below:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(below, timeout=5)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()

