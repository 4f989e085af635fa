"""`python -m trainer.tools.stacks [--out DIR] [--wait S] [--py-spy auto|always|never]`: every trainer
rank's stacks in this container (or machine) into OUTPUT_DIR/hang-rank<R>.txt, before anything is
stopped. What the runner execs in each node's container on a hang (contract/stacks.py):

    docker exec --user 0:0 <container> python -m trainer.tools.stacks

Which processes: the rank processes only, the ones running the training loop. Found by their
heartbeats (OUTPUT_DIR/heartbeat/rank<R>.json of this node: NODE_NAME, else the host name; the pid
checked against its start time so a reused pid is never signalled), and by /proc for a rank with
no heartbeat yet (RANK in its environment, `trainer` on its command line, this run directory as its
OUTPUT_DIR or --output-dir, a parent without that RANK: torchrun, srun and the container's init
are left out, and so are a rank's own children, inductor's compile workers). torchrun's agent only waits for its workers: its stack says nothing.

How: a live rank gets SIGUSR2, which its faulthandler answers from C even inside a collective
(trainer/runtime/stacks.py); never sent to a process that does not catch it (SigCgt), whose default
action would end it. A stopped rank (state T), or one whose handler wrote nothing, is read by py-spy
(`--nonblocking` on a stopped one: py-spy's default suspends the process and fails on one already
stopped). On NCCL the rank's flight-recorder pipe is written to as well. Files are written without
following links, and handed to OUTPUT_DIR's owner when this runs as root (the exec's `--user 0:0`
is for py-spy's ptrace rights). Torch-free: it starts in a fraction of a second on a Pi.

Prints one line per rank; exits 0 when every rank's stacks were taken, 3 when some were not, 1 when
no rank was found.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from contract import heartbeat as fmt
from contract import stacks as names

MAX_STACKS = 4 << 20          # bytes kept of one rank's stacks
PY_SPY_TIMEOUT_S = 30.0
SETTLE_S = 0.3                # a handler's output unchanged this long is complete


@dataclass
class Rank:
    rank: int
    pid: int
    beat: fmt.Heartbeat | None
    state: str = "?"
    offset: int = 0           # the staging file's size before the signal
    text: str = ""
    method: str = ""
    nccl: str = ""


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in ticks) of a process, None when it is gone."""
    try:
        rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return rest[0], int(rest[1]), int(rest[19])
    except (OSError, IndexError, ValueError):
        return None


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()[:1 << 20]
    except OSError:
        return {}
    return dict(e.split("=", 1) for e in raw.decode(errors="replace").split("\0") if "=" in e)


def _catches(pid: int, sig: int) -> bool:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _mine(beat: fmt.Heartbeat) -> bool:
    node = os.environ.get("NODE_NAME")
    return beat.node == node if node else beat.host == socket.gethostname()


def find_ranks(out: Path) -> list[Rank]:
    """The live rank processes of this container (see the module doc)."""
    found: dict[int, Rank] = {}
    beats, _ = fmt.read_dir(out)
    for beat in beats.values():
        st = _proc_stat(beat.pid)
        if beat.ended or not _mine(beat) or st is None or (beat.pid_start and st[2] != beat.pid_start):
            continue
        env_rank = _environ(beat.pid).get("RANK")
        if env_rank is not None and env_rank != str(beat.rank):
            continue
        found[beat.pid] = Rank(beat.rank, beat.pid, beat)
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in found or int(entry) == os.getpid():
            continue
        pid = int(entry)
        env, st = _environ(pid), _proc_stat(pid)
        if st is None or not env.get("RANK", "").isdigit() or _environ(st[1]).get("RANK") == env["RANK"]:
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()[:1 << 16].split(b"\0")
        except OSError:
            continue
        trainer = b"trainer" in argv or any(a.endswith(b"/trainer") for a in argv)
        if trainer and _writes_to(out, env, argv):
            found[pid] = Rank(int(env["RANK"]), pid, None)
    return sorted(found.values(), key=lambda r: r.rank)


def _writes_to(out: Path, env: dict[str, str], argv: list[bytes]) -> bool:
    """The process's run directory is `out` (OUTPUT_DIR, or --output-dir on its command line): on
    a machine shared by several jobs (Slurm without containers, a test) only this run's ranks."""
    dirs = [env.get("OUTPUT_DIR", "")]
    for i, a in enumerate(argv):
        text = a.decode(errors="replace")
        if text in ("--output-dir", "--output_dir") and i + 1 < len(argv):
            dirs.append(argv[i + 1].decode(errors="replace"))
        elif text.startswith(("--output-dir=", "--output_dir=")):
            dirs.append(text.split("=", 1)[1])
    want = os.path.realpath(out)
    return any(d and os.path.realpath(d) == want for d in dirs)


def _staging_fd(out: Path, rank: int) -> int | None:
    """The rank's staging file, opened without following a link at either component."""
    try:
        d = os.open(out / fmt.DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fd = os.open(f"stacks-rank{rank}.txt", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=d)
    except OSError:
        return None
    finally:
        os.close(d)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _staging_size(out: Path, rank: int) -> int:
    fd = _staging_fd(out, rank)
    if fd is None:
        return -1
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _read_from(out: Path, rank: int, offset: int) -> str:
    fd = _staging_fd(out, rank)
    if fd is None:
        return ""
    try:
        os.lseek(fd, max(offset, 0), os.SEEK_SET)
        return os.read(fd, MAX_STACKS).decode(errors="replace")
    finally:
        os.close(fd)


def _py_spy(pid: int, stopped: bool) -> tuple[str, str]:
    exe = shutil.which("py-spy")
    if exe is None:
        return "", "py-spy is not installed"
    argv = [exe, "dump", "--pid", str(pid)] + (["--nonblocking"] if stopped else [])
    try:
        p = subprocess.run(argv, capture_output=True, timeout=PY_SPY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "", f"py-spy gave no answer in {PY_SPY_TIMEOUT_S:g} s"
    text = (p.stdout + p.stderr)[:MAX_STACKS].decode(errors="replace")
    if p.returncode != 0:
        reason = next((ln for ln in text.splitlines() if "Error" in ln or "ermission" in ln), text[:200])
        return "", f"py-spy failed: {reason.strip()[:200]} (container: --cap-add SYS_PTRACE; exec: --user 0:0)"
    return text, "py-spy dump" + (" --nonblocking" if stopped else "")


def _poke_nccl(r: Rank) -> float | None:
    """Write to the rank's flight-recorder pipe if it has one (a FIFO, never a link); when written."""
    path = names.nccl_pipe(tempfile.gettempdir(), r.pid, r.rank)
    try:
        if not stat.S_ISFIFO(os.lstat(path).st_mode):
            return None
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.write(fd, b"1")
            return time.time()
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


def _header(r: Rank, out: Path) -> str:
    lines = [f"# stacks of rank {r.rank} (pid {r.pid}, process state {r.state}) taken "
             f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} by trainer.tools.stacks: {r.method or 'nothing'}"]
    if r.beat is not None:
        b = r.beat
        lines.append(f"# heartbeat: node {b.node}, {b.where()}; no progress for {max(0.0, time.time() - b.progress_at):.0f} s"
                     + (f" (budget {b.budget_s:.0f} s)" if b.budget_s else ""))
    if r.nccl:
        lines.append(f"# NCCL flight recorder: {r.nccl}")
    return "\n".join(lines) + "\n\n"


def write_file(out: Path, rank: int, text: str) -> Path:
    """hang-rank<R>.txt in OUTPUT_DIR: a new file renamed over the name (a link there is replaced,
    never followed), owned by OUTPUT_DIR's owner when written by root."""
    d = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        final = names.HANG_FILE.format(rank=rank)
        tmp = f".{final}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=d)
        try:
            os.write(fd, text.encode())
            if os.geteuid() == 0:
                owner = os.fstat(d)
                os.fchown(fd, owner.st_uid, owner.st_gid)
        finally:
            os.close(fd)
        os.replace(tmp, final, src_dir_fd=d, dst_dir_fd=d)
    finally:
        os.close(d)
    return out / final


def take(out: Path, ranks: list[Rank], wait_s: float, py_spy: str) -> None:
    """Signal every live rank at once, wait for their handlers, read the rest with py-spy."""
    sig = getattr(signal, names.SIGNAL)
    signalled = []
    for r in ranks:
        st = _proc_stat(r.pid)
        r.state = st[0] if st else "gone"
        if r.state in ("T", "t", "Z", "X", "gone") or not _catches(r.pid, sig):
            continue
        r.offset = _staging_size(out, r.rank)
        try:
            os.kill(r.pid, sig)
            signalled.append(r)
        except OSError:
            continue
    asked = {r.rank: t for r in ranks if (t := _poke_nccl(r)) is not None}
    deadline, last, quiet = time.monotonic() + wait_s, None, time.monotonic()
    while signalled and time.monotonic() < deadline:  # until every file grew and then stopped growing
        sizes = [_staging_size(out, r.rank) for r in signalled]
        if sizes != last:
            last, quiet = sizes, time.monotonic()
        elif all(s > r.offset for s, r in zip(sizes, signalled, strict=True)) and time.monotonic() - quiet > SETTLE_S:
            break
        time.sleep(0.05)
    for r in signalled:
        r.text = _read_from(out, r.rank, r.offset)
        r.method = "faulthandler (SIGUSR2)" if r.text.strip() else ""
    for r in ranks:
        if r.state in ("Z", "X", "gone"):
            r.method = "none: the process has ended"
            continue
        if py_spy == "always" or (py_spy == "auto" and not r.text.strip()):
            text, how = _py_spy(r.pid, r.state in ("T", "t"))
            r.text += ("\n# py-spy:\n" if r.text else "") + text
            r.method = (f"{r.method}, {how}" if r.method else how) if text else (r.method or how)
    for rank, t in asked.items():
        trace = out / f"{names.NCCL_TRACE}{rank}"
        while time.monotonic() < deadline and not (trace.is_file() and trace.stat().st_mtime >= t - 1):
            time.sleep(0.1)
        r = next(x for x in ranks if x.rank == rank)
        r.nccl = f"{trace.name}" if trace.is_file() and trace.stat().st_mtime >= t - 1 else "asked, no dump yet"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.tools.stacks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="the run directory (default: $OUTPUT_DIR, else /out)")
    ap.add_argument("--wait", type=float, default=5.0, help="seconds to wait for the ranks' handlers (default 5)")
    ap.add_argument("--py-spy", choices=("auto", "always", "never"), default="auto",
                    help="auto: only for ranks whose handler did not answer (a stopped one)")
    args = ap.parse_args(argv)
    out = Path(args.out or os.environ.get("OUTPUT_DIR") or "/out")
    ranks = find_ranks(out)
    if not ranks:
        print(f"stacks: no trainer rank of this node runs here (none in {out / fmt.DIR} nor in /proc)")
        return 1
    take(out, ranks, args.wait, args.py_spy)
    missing = 0
    for r in ranks:
        ok = bool(r.text.strip())
        missing += not ok
        path = write_file(out, r.rank, _header(r, out) + (r.text if ok else f"no stacks: {r.method}\n"))
        frames = sum(1 for ln in r.text.splitlines() if ln.lstrip().startswith(("File ", "at ")) or " (" in ln)
        print(f"rank {r.rank} (pid {r.pid}, state {r.state}): "
              + (f"{frames} frame lines by {r.method} -> {path}" if ok else f"no stacks ({r.method}) -> {path}"))
    return names.EXIT_PARTIAL if missing else 0


if __name__ == "__main__":
    sys.exit(main())
