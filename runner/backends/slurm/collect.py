"""`runner collect` of a Slurm run: the run dir on the shared filesystem to artifacts/<run>/slurm/.

Through the login node it is the SSH runner's collect of one "node" whose workdir is the shared
one (tar stream, sha256 on both ends, incremental). Without a login node the shared filesystem
is mounted here, and the same guarantees come from a local copy: unchanged files (size and mtime
in the manifest) are skipped, a copy is placed only once its sha256 equals the source's.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

from runner import safe_path
from runner.backends.slurm.jobs import resolve_run, workdir
from runner.backends.slurm.shell import LocalShell, LoginShell, open_shell
from runner.delivery import disk_room
from runner.delivery.collect_files import (
    MANIFEST,
    ROOM_HINT,
    NodeCollect,
    collect_error,
    collect_node,
    report,
)
from runner.errors import EXIT_PARTIAL, UserError
from runner.inventory.slurm import SlurmInventory
from runner.transport.digest import sha256_file
from runner.transport.ssh import Remote

DEST_NAME = "slurm"   # artifacts/<run>/slurm/: one shared run dir, not one per node


def mirror_local(src: Path, dest: Path, res: NodeCollect, run_id: str = "") -> None:
    man_path = dest / MANIFEST
    manifest: dict[str, dict] = json.loads(man_path.read_text()) if man_path.exists() else {}
    staging = dest / f".collect-staging-{os.getpid()}"
    listed = []
    for path in sorted(p for p in src.rglob("*") if p.is_file() and not p.is_symlink()):
        try:
            listed.append((path, path.stat()))
        except OSError:
            res.vanished += 1
    todo = [(p, st) for p, st in listed if not _unchanged(manifest.get(str(p.relative_to(src))), dest, src, p, st)]
    disk_room.check_room(dest, sum(st.st_size for _, st in todo), f"collect of run {run_id or src.name} "
                         f"({len(todo)} new or changed files)", ROOM_HINT)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        res.files = len(listed)
        res.skipped = len(listed) - len(todo)
        for path, st in todo:
            rel = str(path.relative_to(src))
            try:  # a link already in dest (or staging) must not carry the file out of it
                local, staged = safe_path.under(dest, rel), safe_path.under(staging, rel)
            except ValueError as exc:
                res.errors.append(str(exc))
                continue
            staged.parent.mkdir(parents=True, exist_ok=True)
            try:
                shutil.copy2(path, staged)
                want = sha256_file(path)
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
        shutil.rmtree(staging, ignore_errors=True)
        tmp = man_path.with_name(man_path.name + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        tmp.replace(man_path)


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


def cmd_collect(args, inv: SlurmInventory) -> int:
    sh = open_shell(inv, args.accept_new_host_keys)
    try:
        wd = workdir(sh, inv)
        run_id = resolve_run(sh, wd, args.run)
        dest = Path(args.dest) / run_id / DEST_NAME
        if isinstance(sh, LocalShell):
            res = NodeCollect(DEST_NAME, dest=str(dest))
            mirror_local(Path(wd) / "runs" / run_id, dest, res, run_id)
        else:
            assert isinstance(sh, LoginShell)
            node = replace(inv.slurm.login, name=DEST_NAME, workdir=wd)
            with Remote(node, args.accept_new_host_keys) as r:
                res = collect_node(r, run_id, Path(args.dest))
    finally:
        sh.close()
    report([res], Path(args.dest) / run_id, args.no_plots)
    if res.errors:
        raise UserError(collect_error(run_id, res.errors), exit_code=EXIT_PARTIAL)
    return 0
