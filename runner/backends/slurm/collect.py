"""`runner collect` of a Slurm run: the run dir on the shared filesystem to artifacts/<run>/slurm/.

Through the login node it is the SSH runner's collect of one "node" whose workdir is the shared
one (tar stream, sha256 on both ends, incremental). Without a login node the shared filesystem
is mounted here, and the same guarantees come from a local copy: unchanged files (size and mtime
in the manifest) are skipped, a copy is placed only once its sha256 equals the source's.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
from dataclasses import replace
from pathlib import Path

from runner.backends.results import CollectReport
from runner.backends.slurm.jobs import resolve_run, workdir
from runner.backends.slurm.shell import LocalShell, LoginShell
from runner.core import safe_path
from runner.delivery import disk_room
from runner.delivery.collect_files import (
    MANIFEST,
    ROOM_HINT,
    NodeCollect,
    collect_node,
    finish,
    own_name,
)
from runner.transport.digest import sha256_file
from runner.transport.ssh import Remote

DEST_NAME = "slurm"   # artifacts/<run>/slurm/: one shared run dir, not one per node


def mirror_local(src: Path, dest: Path, res: NodeCollect, run_id: str = "") -> None:
    man_path = dest / MANIFEST
    manifest: dict[str, dict] = json.loads(man_path.read_text()) if man_path.exists() else {}
    staging = dest / f".collect-staging-{os.getpid()}"
    listed = []
    for path in sorted(p for p in src.rglob("*") if p.is_file() and not p.is_symlink()):
        if why := own_name(str(path.relative_to(src))):  # the job's file under collect's own names
            res.errors.append(why)
            continue
        try:
            listed.append((path, path.lstat()))
        except OSError:
            res.vanished += 1
    todo = [(p, st) for p, st in listed if not _unchanged(manifest.get(str(p.relative_to(src))), dest, src, p, st)]
    disk_room.check_room(dest, sum(st.st_size for _, st in todo), f"collect of run {run_id or src.name} "
                         f"({len(todo)} new or changed files)", ROOM_HINT)
    dest.mkdir(parents=True, exist_ok=True)
    root_fd = None
    try:
        res.files = len(listed)
        res.skipped = len(listed) - len(todo)
        if todo:  # each file is opened from here, one component at a time, never through a link
            try:
                root_fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as exc:
                res.errors.append(f"{src}: {exc.strerror}")
                return
        for path, st in todo:
            rel = str(path.relative_to(src))
            try:  # a link already in dest (or staging) must not carry the file out of it
                local, staged = safe_path.under(dest, rel), safe_path.under(staging, rel)
            except ValueError as exc:
                res.errors.append(str(exc))
                continue
            staged.parent.mkdir(parents=True, exist_ok=True)
            try:
                want = _copy_listed(root_fd, path.relative_to(src).parts, st, staged)
            except _Replaced as exc:
                res.errors.append(f"{rel}: {exc}")
                continue
            except OSError as exc:
                res.errors.append(f"{rel}: {exc.strerror}")
                continue
            got = sha256_file(staged)
            if got != want or staged.stat().st_size != st.st_size:
                res.errors.append(f"{rel}: changed while being copied (sha256 differs); collect again")
                continue
            local.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staged, local)
            manifest[rel] = {"size": st.st_size, "mtime": int(st.st_mtime), "sha256": want}
            res.copied += 1
            res.bytes_copied += st.st_size
    finally:
        if root_fd is not None:
            os.close(root_fd)
        shutil.rmtree(staging, ignore_errors=True)
        tmp = man_path.with_name(man_path.name + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        tmp.replace(man_path)


class _Replaced(Exception):
    """A listed file whose path, when it came to be copied, no longer led to the regular file the
    listing saw: the run dir is shared with the job, which may have swapped it for a link."""


_DIR = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC   # NONBLOCK: a FIFO put there cannot hang the open
_LINK_ERRNOS = (errno.ELOOP, errno.ENOTDIR, errno.EMLINK)            # what a link refused by O_NOFOLLOW gives
_CHUNK = 1 << 22


def _open_listed(root_fd: int, parts: tuple[str, ...], st: os.stat_result) -> int:
    """A read descriptor on root/parts, opened one component at a time relative to the one before,
    no component followed if it is a link, and only if it is still the regular file (same device
    and inode) the listing saw; _Replaced otherwise, OSError (e.g. vanished) as it comes."""
    dir_fd = root_fd
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                fd = os.open(part, _FILE if last else _DIR, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno not in _LINK_ERRNOS:
                    raise
                where = "it" if last else f"{'/'.join(parts[:i + 1])!r} on its path"
                try:
                    link = stat.S_ISLNK(os.lstat(part, dir_fd=dir_fd).st_mode)
                except OSError:
                    link = False
                now = "a symlink" if link else ("not a regular file" if last else "not a directory")
                raise _Replaced(f"{where} is now {now} (replaced since it was listed); not followed, "
                                "not collected; collect again") from None
            if dir_fd != root_fd:
                os.close(dir_fd)
            dir_fd = fd
        fst = os.fstat(dir_fd)
        if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise _Replaced("no longer the regular file that was listed (replaced since the listing); "
                            "not collected; collect again")
    except BaseException:
        if dir_fd != root_fd:
            os.close(dir_fd)
        raise
    return dir_fd


def _copy_listed(root_fd: int, parts: tuple[str, ...], st: os.stat_result, staged: Path) -> str:
    """Copy the listed file to staged from one descriptor (_open_listed): its bytes, times and
    permission bits (no setuid, setgid or sticky bit, as collect over SSH places files; no extended
    attributes: the job's), reading at most its listed size plus one byte: a file
    that grew since the listing comes out longer than listed, and is named by the size check, but
    no more of it is read. The source's sha256, from a second read of the same descriptor."""
    limit = st.st_size + 1
    fd = _open_listed(root_fd, parts, st)
    try:
        with open(staged, "wb") as out:
            n = 0
            while n < limit and (chunk := os.read(fd, min(_CHUNK, limit - n))):
                out.write(chunk)
                n += len(chunk)
            out.flush()
            now = os.fstat(fd)
            os.utime(out.fileno(), ns=(now.st_atime_ns, now.st_mtime_ns))
            os.chmod(out.fileno(), stat.S_IMODE(now.st_mode) & 0o777)
        h, off = hashlib.sha256(), 0
        while off < limit and (chunk := os.pread(fd, min(_CHUNK, limit - off), off)):
            h.update(chunk)
            off += len(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)


def _unchanged(m: dict | None, dest: Path, src: Path, path: Path, st: os.stat_result) -> bool:
    """Copied before, as the manifest says, and the copy still there at that size (a name that
    resolves out of dest is not unchanged: placing it names the link)."""
    if not (m and m.get("size") == st.st_size and m.get("mtime") == int(st.st_mtime)):
        return False
    try:
        local = safe_path.under(dest, str(path.relative_to(src)))
    except ValueError:
        return False
    return local.exists() and local.stat().st_size == st.st_size


def collect_run(backend, run: str | None, dest: str, plots: bool) -> CollectReport:
    """The run dir to dest/<run>/slurm/: through the login node as one SSH node's collect, or, on
    this machine, a verified local mirror of the shared filesystem; then merged and plotted."""
    inv = backend.inventory
    sh = backend.shell()
    try:
        wd = workdir(sh, inv)
        run_id = resolve_run(sh, wd, run)
        target = Path(dest) / run_id / DEST_NAME
        if isinstance(sh, LocalShell):
            res = NodeCollect(DEST_NAME, dest=str(target))
            mirror_local(Path(wd) / "runs" / run_id, target, res, run_id)
        else:
            assert isinstance(sh, LoginShell)
            node = replace(inv.slurm.login, name=DEST_NAME, workdir=wd)
            with Remote(node, backend.accept_new_host_keys) as r:
                res = collect_node(r, run_id, Path(dest))
    finally:
        sh.close()
    return CollectReport(run_id=run_id, dest=Path(dest) / run_id, nodes=[res], errors=list(res.errors),
                         summary=finish(Path(dest) / run_id, plots))
