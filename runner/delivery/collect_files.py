"""A run dir's files brought from a node: listed over SFTP (every name checked), only what is new or
changed since the last collect (the manifest), streamed as one tar per batch and each file
verified by its sha256 before it takes its place; then the report (merged timelines, plots,
summary) both backends print."""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import stat
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from contract.memory import size_text
from runner.core import safe_path
from runner.core.errors import UserError
from runner.core.node_output import visible
from runner.delivery import disk_room
from runner.delivery.collect_report import merge_timelines, render_plots, summarize
from runner.planning.paths import node_paths
from runner.transport import stream
from runner.transport.digest import HASH_BATCH, remote_sha256, sha256_file
from runner.transport.ssh import Remote

log = logging.getLogger("runner.collect")
MANIFEST = ".collect-manifest.json"
# Names collect keeps for itself in a node's dest dir (the manifest, its .tmp, the staging dir): a
# node file under such a name is not taken (a `.collect-manifest.json/x` made the manifest's path a
# directory, and every later collect of the node failed).
OWN_PREFIX = ".collect-"


def own_name(rel: str) -> str | None:
    """The error for a listed name under one collect keeps for itself (OWN_PREFIX), else None."""
    if rel.split("/", 1)[0].startswith(OWN_PREFIX):
        return f"{visible(rel)}: not collected: names that begin {OWN_PREFIX} are collect's own here"
    return None
MAX_ERRORS_SHOWN = 5
# The stream is unpacked by runner/delivery/untar.py (Python's tarfile, whatever this machine's tar
# is): only the names asked for, only as regular files, bytes and names only (owner, mode, time and
# links from the node are never applied; placing sets each mode and mtime after verification).
# -I: no PYTHON* variable, user site or script dir shapes what it imports (the standard library only).
UNTAR = [sys.executable, "-I", str(Path(__file__).with_name("untar.py"))]
# What a batch's stream may carry beyond the listed bytes: files of a live run that grew since the
# listing (their logs; verification then names them). Past it the node is sending what was not listed.
GROWTH = 64 << 20
ROOM_HINT = "free space there, or collect into a larger filesystem with --dest"

@dataclass
class NodeCollect:
    node: str
    files: int = 0
    copied: int = 0
    skipped: int = 0
    vanished: int = 0
    bytes_copied: int = 0
    dest: str = ""
    errors: list[str] = field(default_factory=list)


def _unchanged(local: Path, m: dict | None, st: paramiko.SFTPAttributes) -> bool:
    if not (m and local.exists() and m.get("size") == st.st_size and m.get("mtime") == st.st_mtime):
        return False
    ls = local.stat()
    return ls.st_size == st.st_size and int(ls.st_mtime) == int(st.st_mtime or 0)


@dataclass
class NodeListing:
    """What a node lists of a run dir and what of it is new or changed here: the first half of a
    collect, before any byte is written (so every node's listing can be checked against the room
    there is first: runner/delivery/disk_room.py)."""
    remote: Remote
    rd: str
    dest: Path
    files: int
    todo: list
    manifest: dict
    refused: list[str] = field(default_factory=list)  # names collect keeps for itself, one error each

    @property
    def need(self) -> int:
        return sum(st.st_size or 0 for _, st in self.todo)


def list_node(remote: Remote, run_id: str, dest_root: Path) -> NodeListing:
    rd = node_paths(remote.node, remote.home).run(run_id)
    dest = dest_root / run_id / remote.node.name
    files = remote.walk(rd)
    refused = [why for rel, _ in files if (why := own_name(rel))]
    if refused:
        files = [(rel, st) for rel, st in files if not own_name(rel)]
    man_path = dest / MANIFEST
    manifest: dict[str, dict] = json.loads(man_path.read_text()) if files and man_path.exists() else {}
    # Every name was checked by the walk (runner/transport/ssh.py); placing checks where each one resolves.
    todo = [(rel, st) for rel, st in files if not _unchanged(dest / rel, manifest.get(rel), st)]
    return NodeListing(remote, rd, dest, len(files), todo, manifest, refused)


def check_room(ls: NodeListing, dest_root: Path, run_id: str) -> None:
    """Refuse one node's collect, before anything is written, when what it lists would not leave
    dest_root's filesystem its reserve."""
    disk_room.check_room(dest_root, ls.need, f"collect of run {run_id} from {ls.remote.node.name} "
                         f"({len(ls.todo)} new or changed files)", ROOM_HINT)


def admit(listings: list[NodeListing], dest_root: Path) -> tuple[list[NodeListing], list[str]]:
    """The nodes whose listed files fit together under dest_root keeping its reserve, in inventory
    order, and one error for each node that does not fit (nothing of it is written: a node that
    lists more than there is room for costs only its own files; the next collect, with room, takes
    what this one left)."""
    where, free, keep = disk_room.room(dest_root)
    left = free - keep
    admitted, refused = [], []
    for ls in listings:
        if ls.need <= left:
            admitted.append(ls)
            left -= ls.need
        else:
            refused.append(f"{ls.remote.node.name}: nothing collected: its {len(ls.todo)} new or changed files need "
                           f"{size_text(ls.need)}, and {where} has {size_text(max(left, 0))} of room left "
                           f"({size_text(free)} free, {size_text(keep)} of it kept free); {ROOM_HINT}")
    return admitted, refused


def fetch_listed(ls: NodeListing, progress=None) -> NodeCollect:
    """The second half: the listed files streamed, verified and placed; the manifest kept."""
    remote, rd, dest, manifest = ls.remote, ls.rd, ls.dest, ls.manifest
    res = NodeCollect(remote.node.name, files=ls.files, skipped=ls.files - len(ls.todo), dest=str(dest),
                      errors=list(ls.refused))
    if not ls.files:
        return res
    dest.mkdir(parents=True, exist_ok=True)
    man_path = dest / MANIFEST
    todo = ls.todo
    task = progress.add_task(remote.node.name, total=ls.need or 1) if progress else None
    try:
        for i in range(0, len(todo), HASH_BATCH):
            _collect_batch(remote, rd, dest, todo[i:i + HASH_BATCH], manifest, res, progress, task)
    finally:  # what was verified so far counts, even when a later batch failed
        tmp = man_path.with_name(man_path.name + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        tmp.replace(man_path)
    return res


def collect_node(remote: Remote, run_id: str, dest_root: Path, progress=None) -> NodeCollect:
    """One node's run dir, listed, checked against the room here, then fetched."""
    ls = list_node(remote, run_id, dest_root)
    check_room(ls, dest_root, run_id)
    return fetch_listed(ls, progress)


def _collect_batch(remote: Remote, rd: str, dest: Path, batch: list, manifest: dict, res: NodeCollect,
                   progress, task) -> None:
    staging = dest / f".collect-staging-{os.getpid()}"
    # The node hashes while the same files stream here (both from its page cache): the two
    # passes overlap instead of adding up.
    pool = ThreadPoolExecutor(1)
    try:
        hashing = pool.submit(remote_sha256, remote, rd, [r for r, _ in batch], sum(st.st_size or 0 for _, st in batch))
        stream_tar(remote, rd, [r for r, _ in batch], staging, progress, task, max_bytes=tar_bound(batch),
                   size=sum(st.st_size or 0 for _, st in batch))
        sums, failed = hashing.result()
        _place_batch(remote, rd, dest, staging, batch, sums, failed, manifest, res)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a stalled stream does not wait for its hashes
        shutil.rmtree(staging, ignore_errors=True)


def _place_batch(remote: Remote, rd: str, dest: Path, staging: Path, batch: list, sums: dict, failed: dict,
                 manifest: dict, res: NodeCollect) -> None:
    todo = []
    for rel, st in batch:
        if rel not in failed:
            todo.append((rel, st))
        elif remote.stat(f"{rd}/{rel}") is None:  # deleted since the listing (e.g. checkpoint rotation)
            log.warning("node %s: %s vanished during collect; not collected", remote.node.name, rel)
            res.vanished += 1
            manifest.pop(rel, None)
        else:
            res.errors.append(f"{rel}: cannot hash on the node: {failed[rel]}")
    for rel, st in todo:
        try:
            place_verified(staging, dest, rel, st.st_size or 0, sums[rel], st.st_mtime, st.st_mode)
        except (OSError, ValueError) as exc:
            manifest.pop(rel, None)
            res.errors.append(f"{rel}: {exc}")
            continue
        manifest[rel] = {"size": st.st_size, "mtime": st.st_mtime, "sha256": sums[rel]}
        res.copied += 1
        res.bytes_copied += st.st_size or 0


def tar_bound(batch: list) -> int:
    """The most bytes a tar of the listed (name, attributes) may take, plus GROWTH: each member's
    header, a GNU long-name header and its name's blocks, padding to 512; the end blocks and the
    10 KiB record."""
    members = sum(st.st_size or 0 for _, st in batch) + sum(
        1024 + 512 * (len(rel.encode()) // 512 + 1) + 511 for rel, _ in batch)
    return members + 1024 + 10240 + GROWTH


def stream_tar(remote: Remote, rd: str, rels: list[str], staging: Path, progress=None, task=None,
               max_bytes: int | None = None, size: int | None = None) -> None:
    """The node tars the files (names NUL-separated on stdin), OpenSSH carries the stream, and
    runner/delivery/untar.py unpacks those names, and no others, into staging. Files the node did not send are absent from
    staging; the caller verifies every file. A stream over max_bytes (tar_bound of what was listed)
    is stopped there: a node cannot fill this disk with what it was not asked for."""
    staging.mkdir(parents=True, exist_ok=True)
    on_chunk = (lambda n: progress.update(task, advance=n)) if progress is not None else None
    names = b"\0".join(r.encode() for r in rels)
    with tempfile.NamedTemporaryFile(prefix="collect-names-") as listed:
        listed.write(names)
        listed.flush()
        res = stream.ssh_stream(remote, f"cd {shlex.quote(rd)} && tar --null -T - -cf -",
                                [[*UNTAR, str(staging), listed.name]],
                                upload=False, stdin_data=names, on_chunk=on_chunk, max_bytes=max_bytes,
                                size=size)
    if res.over:
        raise UserError(f"node {remote.node.name}: the stream of files from {rd} went past {max_bytes >> 20} MiB, "
                        f"the {len(rels)} listed files' size plus {GROWTH >> 20} MiB; stopped it (the node sends what "
                        "was not listed: check it)")
    if res.stalled:
        raise UserError(f"node {remote.node.name}: the stream of files from {rd} stalled (under "
                        f"{stream.STALL_BYTES >> 10} KiB in {stream.STALL_S:.0f}s; node frozen or link down); "
                        "stopped it, rerun collect")
    if res.ssh_rc == 255 and not res.moved:
        raise UserError(f"node {remote.node.name}: the file stream did not connect: {res.ssh_err or 'ssh failed'}")
    if res.unfinished or any(res.local_rcs):
        why = res.ssh_err if res.ssh_rc and not res.moved else res.local_err or res.ssh_err
        raise UserError(f"node {remote.node.name}: unpacking the files from {rd} failed: {why[-200:]}")
    if res.ssh_rc:  # e.g. a file gone since the listing: verification names each one
        log.debug("node %s: tar over ssh exited %s: %s", remote.node.name, res.ssh_rc, res.ssh_err)


def place_verified(staging: Path, dest: Path, rel: str, size: int, want: str, mtime: float | None,
                   mode: int | None = None) -> None:
    """Move staging/rel to dest/rel only if it is a regular file with the node's size and sha256,
    and both paths stay under their roots through any link on the way (a link may already sit in
    dest); raise ValueError/OSError otherwise, leaving an older good copy as it was. It takes the
    listed mtime and the listed mode's permission bits (0644 without one) less this process's umask:
    no setuid, setgid or sticky bit from the node."""
    staged = safe_path.under(staging, rel)
    local = safe_path.under(dest, rel)
    try:
        st = os.lstat(staged)
    except FileNotFoundError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        raise ValueError("not transferred as a regular file (removed, replaced or unreadable on the node since "
                         "it was listed; rerun collect when the run has finished)")
    if st.st_size != size:
        raise ValueError(f"size {st.st_size} bytes after transfer, {size} on the node (still being written? "
                         "rerun collect when the run has finished)")
    if sha256_file(staged) != want:
        raise ValueError("sha256 after transfer differs from the node's (changed during transfer? "
                         "rerun collect when the run has finished)")
    os.chmod(staged, (0o644 if mode is None else stat.S_IMODE(mode)) & 0o777 & ~_UMASK)
    if mtime is not None:
        os.utime(staged, (mtime, mtime))
    local.parent.mkdir(parents=True, exist_ok=True)
    staged.replace(local)


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


_UMASK = _umask()


# ---------------------------------------------------------------------------- CLI

def report(results: list, run_dir: Path, no_plots: bool) -> None:
    """One line per node collected, then (unless no_plots) merged timelines and plots, then the
    run's summary. What did arrive is merged, plotted and summarised even when a node failed or was away."""
    for r in results:
        print(node_line(r))
    for line in finish(run_dir, not no_plots):
        print(line)


def node_line(r: NodeCollect) -> str:
    """What collect says of one node's files."""
    return (f"{r.node:12s} {r.files:5d} files: {r.copied} copied ({r.bytes_copied / 1e6:.2f} MB, size and sha256 "
            f"verified), {r.skipped} unchanged" + (f", {r.vanished} vanished" if r.vanished else "") + f"  -> {r.dest}")


def finish(run_dir: Path, plots: bool) -> list[str]:
    """After the files: (plots) merged timelines and plots, then the run's summary lines, made
    visible (from the job's own files: no terminal controls reach the screen)."""
    if plots and run_dir.is_dir():
        merge_timelines(run_dir)
        render_plots(run_dir)
    return [visible(line) for line in summarize(run_dir)]


def collect_error(run_id: str, errors: list[str]) -> str:
    more = f" (+{len(errors) - MAX_ERRORS_SHOWN} more)" if len(errors) > MAX_ERRORS_SHOWN else ""
    return f"collect {run_id}: " + "; ".join(errors[:MAX_ERRORS_SHOWN]) + more
