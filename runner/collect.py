"""`runner collect [RUN]`: mirror each node's run dir to artifacts/<run-id>/<node>/ over SFTP.

Incremental: a file whose size and mtime match the local copy is skipped (mtimes are copied, and
the local sha256 is kept in a manifest). Verified: each transferred file's sha256 is compared with
`sha256sum` on the node. Ends with a summary of what the trainer wrote.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from runner.errors import UserError
from runner.plan import Facts, resolve_workdir
from runner.session import Cluster, add_inventory_args, load, parallel
from runner.ssh import Remote
from runner.status import gather, resolve_run

MANIFEST = ".collect-manifest.json"


@dataclass
class NodeCollect:
    node: str
    files: int = 0
    copied: int = 0
    skipped: int = 0
    bytes_copied: int = 0
    dest: str = ""
    errors: list[str] = field(default_factory=list)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def remote_run_dir(remote: Remote, run_id: str) -> str:
    home = None
    if remote.node.workdir.startswith("~"):
        home = remote.run("echo $HOME").out.strip()
    return f"{resolve_workdir(remote.node, Facts(home=home))}/runs/{run_id}"


def collect_node(remote: Remote, run_id: str, dest_root: Path, progress=None) -> NodeCollect:
    rd = remote_run_dir(remote, run_id)
    dest = dest_root / run_id / remote.node.name
    res = NodeCollect(remote.node.name, dest=str(dest))
    files = remote.walk(rd)
    if not files:
        return res
    dest.mkdir(parents=True, exist_ok=True)
    man_path = dest / MANIFEST
    manifest: dict[str, dict] = json.loads(man_path.read_text()) if man_path.exists() else {}
    todo = []
    for rel, st in files:
        local = dest / rel
        m = manifest.get(rel)
        if (local.exists() and m and m.get("size") == st.st_size and m.get("mtime") == st.st_mtime
                and local.stat().st_size == st.st_size and int(local.stat().st_mtime) == int(st.st_mtime or 0)):
            res.skipped += 1
            continue
        todo.append((rel, st))
    res.files = len(files)
    if todo:
        # One command hashes every file to fetch (argv holds file names only).
        names = " ".join(shlex.quote(r) for r, _ in todo)
        out = remote.run(["sh", "-c", f"cd {shlex.quote(rd)} && sha256sum -- {names}"], timeout=600)
        sums = {}
        for line in out.out.splitlines():
            digest, _, name = line.partition("  ")
            sums[name.lstrip("*")] = digest
        task = progress.add_task(f"{remote.node.name}", total=sum(st.st_size for _, st in todo) or 1) if progress else None
        for rel, st in todo:
            local = dest / rel
            local.parent.mkdir(parents=True, exist_ok=True)
            tmp = local.with_name(local.name + ".part")
            remote.sftp.get(f"{rd}/{rel}", str(tmp),
                            callback=(lambda done, total, t=task, last=[0]: (progress.update(t, advance=done - last[0]),
                                                                             last.__setitem__(0, done)))
                            if progress else None)
            digest = sha256_file(tmp)
            want = sums.get(rel)
            if want and want != digest:
                # The trainer may still be writing it: keep what we got but do not record it as done.
                res.errors.append(f"{rel}: sha256 mismatch (file changed during transfer?)")
                tmp.replace(local)
                manifest.pop(rel, None)
                continue
            tmp.replace(local)
            os.utime(local, (st.st_atime or st.st_mtime, st.st_mtime))
            manifest[rel] = {"size": st.st_size, "mtime": st.st_mtime, "sha256": digest}
            res.copied += 1
            res.bytes_copied += st.st_size
    man_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return res


def summarize(run_dir: Path) -> list[str]:
    """Final loss, tokens/s, where the timeline and checkpoints are."""
    lines = []
    metrics = sorted(run_dir.glob("*/metrics.jsonl"))
    for mp in metrics:
        recs = []
        for ln in mp.read_text().splitlines():
            try:
                recs.append(json.loads(ln))
            except json.JSONDecodeError:
                continue
        losses = [r for r in recs if isinstance(r.get("loss"), (int, float))]
        if losses:
            last = losses[-1]
            tps = [r["tokens_per_s"] for r in losses if isinstance(r.get("tokens_per_s"), (int, float))]
            lines.append(f"final loss {last['loss']:.4f} at step {last.get('step', '?')}"
                         + (f", tokens/s mean {sum(tps) / len(tps):.1f}" if tps else "")
                         + f"  ({mp.relative_to(run_dir.parent)})")
    for pattern, what in (("*/timeline*.json", "timeline"), ("*/*.png", "plot"), ("*/profile.csv", "profile")):
        for p in sorted(run_dir.glob(pattern)):
            lines.append(f"{what}: {p}")
    ckpts = sorted({p.parent for p in run_dir.glob("*/checkpoints/**/*") if p.is_file()})
    if ckpts:
        lines.append(f"checkpoints: {len(ckpts)} dir(s), e.g. {ckpts[-1]}")
    return lines


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("collect", help="mirror every node's run dir to artifacts/<run>/<node>/ (incremental, verified)")
    add_inventory_args(p)
    p.add_argument("run", nargs="?", help="run id or prefix (default: latest)")
    p.add_argument("--dest", default="artifacts", help="local root (default artifacts/)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=main)


def collect(cl: Cluster, run_id: str, dest: Path, quiet: bool = False) -> list[NodeCollect]:
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  disable=quiet, transient=True) as progress:
        res = parallel([cl[n.name] for n in cl.inv.ordered()], lambda r: collect_node(r, run_id, dest, progress))
    out, errors = [], []
    for r, val, err in res:
        if err is not None:
            errors.append(f"{r.node.name}: {err}")
        else:
            out.append(val)
            errors += [f"{val.node}: {e}" for e in val.errors]
    if errors:
        raise UserError(f"collect {run_id}: " + "; ".join(errors))
    return out


def main(args) -> int:
    inv = load(args, with_job=False)
    with Cluster(inv, args.accept_new_host_keys) as cl:
        run_id = resolve_run(gather(cl), args.run)
        results = collect(cl, run_id, Path(args.dest), args.quiet)
    for r in results:
        print(f"{r.node:12s} {r.files:5d} files: {r.copied} copied ({r.bytes_copied / 1e6:.2f} MB, sha256 verified), "
              f"{r.skipped} unchanged  -> {r.dest}")
    for line in summarize(Path(args.dest) / run_id):
        print(line)
    return 0
