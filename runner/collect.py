"""`runner collect [RUN]`: mirror each node's run dir to artifacts/<run-id>/<node>/ over SFTP.

Incremental: a file whose size and mtime match the manifest and the local copy is skipped (mtimes
are copied). Verified: every transferred file's size and sha256 must equal what the node had
(`sha256sum` on the node, names fed on stdin so no command line grows with the file count);
a file that does not match fails the collect naming node and file, and never replaces a good
local copy (downloads go to a temp file that is renamed only once verified).

Then what spans nodes: per-rank timeline pieces (`timeline_batch{k}_rank{r}.json`, the Pi guide's
seed format) spread over several nodes are merged into `artifacts/<run-id>/` when the trainer did
not merge them itself, and plots are rendered (`trainer.plots`: Gantt per timeline, loss and
tokens/s per metrics.jsonl). None of that imports torch: the host has none.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import paramiko
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from runner.errors import UserError
from runner.plan import Facts, resolve_workdir
from runner.session import Cluster, add_inventory_args, load, parallel
from runner.ssh import Remote, is_loopback
from runner.status import gather, resolve_run

log = logging.getLogger("runner.collect")
MANIFEST = ".collect-manifest.json"
HASH_BATCH = 1000        # names per sha256sum round trip: stdin and stdout stay far below SSH windows
HASH_RATE = 20e6         # bytes/s a slow node (Pi, SD card) hashes at least: sets the command timeout
MAX_ERRORS_SHOWN = 5


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


# ---------------------------------------------------------------------------- hashing on the node

def parse_sha256sum(out: str) -> dict[str, str]:
    """GNU sha256sum lines; a leading backslash means the name has \\\\ and \\n escaped."""
    sums = {}
    for line in out.split("\n"):
        escaped = line.startswith("\\")
        if escaped:
            line = line[1:]
        if len(line) < 66 or not re.fullmatch(r"[0-9a-f]{64}", line[:64]):
            continue
        name = line[66:]
        if escaped:
            name = re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r", "\\": "\\"}.get(m[1], m[1]), name)
        sums[name] = line[:64]
    return sums


def remote_sha256(remote: Remote, root: str, names: list[str], total_bytes: int = 0) -> tuple[dict[str, str], dict[str, str]]:
    """({name: sha256}, {name: why it could not be hashed}) for files under root on the node."""
    sums: dict[str, str] = {}
    failed: dict[str, str] = {}
    timeout = 120 + total_bytes / HASH_RATE
    for i in range(0, len(names), HASH_BATCH):
        batch = names[i:i + HASH_BATCH]
        res = remote.run(["sh", "-c", f"cd {shlex.quote(root)} && xargs -0 sha256sum --"],
                         stdin=b"\0".join(n.encode() for n in batch), timeout=timeout)
        got = parse_sha256sum(res.out)
        if res.rc not in (0, 123):  # 123: some files failed (named on stderr); else sha256sum/xargs itself did
            why = res.err.strip().splitlines()[-1:] or [f"exit {res.rc}"]
            raise UserError(f"node {remote.node.name}: hashing files in {root} failed (exit {res.rc}): {why[0][:200]}")
        for n in batch:
            if n in got:
                sums[n] = got[n]
            else:
                why = [ln for ln in res.err.splitlines() if n in ln]
                failed[n] = why[0].strip()[:200] if why else f"sha256sum gave no digest (exit {res.rc})"
    return sums, failed


# ---------------------------------------------------------------------------- transfer

def _unchanged(local: Path, m: dict | None, st: paramiko.SFTPAttributes) -> bool:
    if not (m and local.exists() and m.get("size") == st.st_size and m.get("mtime") == st.st_mtime):
        return False
    ls = local.stat()
    return ls.st_size == st.st_size and int(ls.st_mtime) == int(st.st_mtime or 0)


def collect_node(remote: Remote, run_id: str, dest_root: Path, progress=None) -> NodeCollect:
    rd = remote_run_dir(remote, run_id)
    dest = dest_root / run_id / remote.node.name
    res = NodeCollect(remote.node.name, dest=str(dest))
    files = remote.walk(rd)
    res.files = len(files)
    if not files:
        return res
    dest.mkdir(parents=True, exist_ok=True)
    man_path = dest / MANIFEST
    manifest: dict[str, dict] = json.loads(man_path.read_text()) if man_path.exists() else {}
    todo = [(rel, st) for rel, st in files if not _unchanged(dest / rel, manifest.get(rel), st)]
    res.skipped = len(files) - len(todo)
    task = progress.add_task(remote.node.name, total=sum(st.st_size or 0 for _, st in todo) or 1) if progress else None
    try:
        for i in range(0, len(todo), HASH_BATCH):
            _collect_batch(remote, rd, dest, todo[i:i + HASH_BATCH], manifest, res, progress, task)
    finally:  # what was verified so far counts, even when a later batch failed
        tmp = man_path.with_name(man_path.name + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        tmp.replace(man_path)
    return res


def _collect_batch(remote: Remote, rd: str, dest: Path, batch: list, manifest: dict, res: NodeCollect,
                   progress, task) -> None:
    staging = dest / f".collect-staging-{os.getpid()}"
    try:
        # The node hashes while the same files stream here (both from its page cache): the two
        # passes overlap instead of adding up.
        with ThreadPoolExecutor(1) as pool:
            hashing = pool.submit(remote_sha256, remote, rd, [r for r, _ in batch],
                                  sum(st.st_size or 0 for _, st in batch))
            stream_tar(remote, rd, [r for r, _ in batch], staging, progress, task)
            sums, failed = hashing.result()
        _place_batch(remote, rd, dest, staging, batch, sums, failed, manifest, res)
    finally:
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
            place_verified(staging / rel, dest / rel, st.st_size or 0, sums[rel], st.st_mtime)
        except (OSError, ValueError) as exc:
            manifest.pop(rel, None)
            res.errors.append(f"{rel}: {exc}")
            continue
        manifest[rel] = {"size": st.st_size, "mtime": st.st_mtime, "sha256": sums[rel]}
        res.copied += 1
        res.bytes_copied += st.st_size or 0


def stream_tar(remote: Remote, rd: str, rels: list[str], staging: Path, progress=None, task=None) -> None:
    """The node tars the files (names NUL-separated on stdin), OpenSSH carries the stream (C speed,
    no GIL: paramiko's SFTP managed a quarter of scp's rate), a local tar unpacks it into staging.
    Files the node's tar could not read are simply absent from staging; the caller verifies."""
    staging.mkdir(parents=True, exist_ok=True)
    remote_cmd = f"cd {shlex.quote(rd)} && tar --null -T - -cf -"
    # stderr to files, not pipes nobody reads while the stream runs (a node's tar warning about
    # every vanished file could fill a pipe and stall the transfer).
    ssh_err, untar_err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    ssh = subprocess.Popen([*remote.openssh_argv(compress=not is_loopback(remote.node.host)), remote_cmd],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=ssh_err)
    untar = subprocess.Popen(["tar", "-x", "-C", str(staging), "-f", "-"], stdin=subprocess.PIPE, stderr=untar_err)

    def feed() -> None:  # from a thread: the node's tar writes while it still reads names
        try:
            ssh.stdin.write(b"\0".join(r.encode() for r in rels))
            ssh.stdin.close()
        except OSError:
            pass  # ssh ended early; its exit code and the verification say what went wrong

    feeder = threading.Thread(target=feed, daemon=True)
    try:
        feeder.start()
        while chunk := ssh.stdout.read(1 << 20):
            untar.stdin.write(chunk)
            if progress is not None:
                progress.update(task, advance=len(chunk))
        untar.stdin.close()
        untar.wait(timeout=600)
        ssh.wait(timeout=600)
        feeder.join(timeout=10)
        if untar.returncode != 0:
            why = b"".join(_tail(f) for f in (untar_err, ssh_err)).decode(errors="replace").strip()
            raise UserError(f"node {remote.node.name}: unpacking the files from {rd} failed: {why[-200:]}")
        if ssh.returncode != 0:  # e.g. a file gone since the listing: verification names each one
            log.debug("node %s: tar over ssh exited %d: %s", remote.node.name, ssh.returncode,
                      _tail(ssh_err).decode(errors="replace").strip())
    finally:
        for proc in (ssh, untar):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        ssh_err.close()
        untar_err.close()


def _tail(fh, n: int = 400) -> bytes:
    fh.seek(0)
    return fh.read()[-n:]


def place_verified(staged: Path, local: Path, size: int, want: str, mtime: float | None) -> None:
    """Move a staged file into place only if its size and sha256 are the node's; raise
    ValueError/OSError otherwise, leaving an older good copy as it was."""
    if not staged.is_file():
        raise ValueError("not transferred (removed or unreadable on the node since it was hashed; "
                         "rerun collect when the run has finished)")
    got = staged.stat().st_size
    if got != size:
        raise ValueError(f"size {got} bytes after transfer, {size} on the node (still being written? "
                         "rerun collect when the run has finished)")
    h = hashlib.sha256()
    with open(staged, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    if h.hexdigest() != want:
        raise ValueError("sha256 after transfer differs from the node's (changed during transfer? "
                         "rerun collect when the run has finished)")
    if mtime is not None:
        os.utime(staged, (mtime, mtime))
    local.parent.mkdir(parents=True, exist_ok=True)
    staged.replace(local)


# ---------------------------------------------------------------------------- timelines and plots

PIECE = re.compile(r"timeline_batch(\d+)_rank(\d+)\.json")
MERGED = re.compile(r"timeline_batch(\d+)_all(\.trace)?\.json")
# The seed format's action names -> the trainer's (trainer/profiling/trace.py SEED_ACTIONS, inverted).
SEED_NAMES = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight", "SEND_F": "send_F",
              "RECV_F": "recv_F", "SEND_B": "send_B", "RECV_B": "recv_B", "ALL_REDUCE": "dp_reduce"}
SEED_KEYS = {"rank", "action", "stage_idx", "mb_idx", "start_ns", "end_ns"}


def merge_timelines(run_dir: Path) -> list[Path]:
    """Merge per-rank seed pieces of a batch found on several nodes, unless a merged file exists.
    Writes timeline_batch{k}_all.json (seed, as the trainer would) and its Chrome trace
    timeline_batch{k}_all.trace.json into run_dir. Times are kept as the ranks wrote them."""
    done = {int(m[1]) for p in run_dir.glob("*/timeline_batch*.json") if (m := MERGED.fullmatch(p.name))}
    pieces: dict[int, dict[int, Path]] = {}
    for p in sorted(run_dir.glob("*/timeline_batch*_rank*.json")):
        m = PIECE.fullmatch(p.name)
        if m and int(m[1]) not in done:
            pieces.setdefault(int(m[1]), {}).setdefault(int(m[2]), p)
    out = []
    for k, ranks in sorted(pieces.items()):
        if len({p.parent for p in ranks.values()}) < 2:
            continue  # one node's own timeline (a single process writes _rank0.json): nothing spans nodes
        seed = run_dir / f"timeline_batch{k}_all.json"
        if seed.exists() and seed.stat().st_mtime >= max(p.stat().st_mtime for p in ranks.values()):
            continue  # merged by an earlier collect from these very pieces
        records, nodes = _read_pieces(ranks)
        if not records:
            continue
        _write(seed, json.dumps(records, indent=2))
        meta = {"merged_by": "runner collect", "sources": sorted(str(p.relative_to(run_dir)) for p in ranks.values())}
        trace = seed_to_chrome(records, nodes, k, meta)
        out += [seed, _write(run_dir / f"timeline_batch{k}_all.trace.json", json.dumps(trace))]
    return out


def _read_pieces(ranks: dict[int, Path]) -> tuple[list[dict], dict[int, str]]:
    records, nodes = [], {}
    for rank, p in sorted(ranks.items()):
        try:
            data = json.loads(p.read_text())
            if not isinstance(data, list) or not all(isinstance(r, dict) and SEED_KEYS <= set(r) for r in data):
                raise ValueError("not a list of seed-format records")
        except ValueError as exc:
            log.warning("timeline piece %s not merged: %s", p, exc)
            return [], {}
        nodes[rank] = p.parent.name
        records += sorted(data, key=lambda r: (r["rank"], r["start_ns"]))
    return records, nodes


def seed_to_chrome(records: list[dict], nodes: dict[int, str], batch: int, meta: dict) -> dict:
    """The seed flat records as a Chrome trace shaped like the trainer's (ts/dur in µs from the
    first action); process names carry the node the piece came from."""
    origin = min((r["start_ns"] for r in records), default=0)
    events: list[dict] = []
    for rank in sorted({r["rank"] for r in records}):
        mine = sorted((r for r in records if r["rank"] == rank), key=lambda r: r["start_ns"])
        stages = sorted({r["stage_idx"] for r in mine if r["stage_idx"] is not None})
        name = f"{nodes.get(rank, '')}/rank{rank}/stage{'+'.join(map(str, stages)) or '-'}"
        events += [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": name}},
                   {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}]
        for r in mine:
            action = SEED_NAMES.get(r["action"], str(r["action"]).lower())
            events.append({"ph": "X", "name": action if r["mb_idx"] is None else f"{action} mb{r['mb_idx']}",
                           "pid": rank, "tid": 0, "ts": round((r["start_ns"] - origin) / 1e3, 3),
                           "dur": round((r["end_ns"] - r["start_ns"]) / 1e3, 3),
                           "args": {"stage": r["stage_idx"], "microbatch": r["mb_idx"], "peer": None, "bytes": 0}})
            for t, up, down in r.get("net_series") or []:
                events.append({"ph": "C", "name": "net Mbit/s", "pid": rank, "tid": 0,
                               "ts": round((t - origin) / 1e3, 3), "args": {"up": up, "down": down}})
    stages = {r["stage_idx"] for r in records if r["stage_idx"] is not None}
    mbs = {r["mb_idx"] for r in records if r["mb_idx"] is not None}
    other = dict(meta, batch=batch, origin_ns=origin, pp=len(stages) or "?", microbatches=len(mbs) or "?")
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def render_plots(run_dir: Path) -> list[Path]:
    """Gantt per timeline (run dir and node dirs), metrics.png per metrics.jsonl. A plot newer than
    its input is kept, so a second collect renders nothing. Problems are warnings: the files
    themselves were collected and verified."""
    try:
        from trainer import plots
    except ImportError as exc:
        log.warning("plots skipped: %s (pip install matplotlib)", exc)
        return []
    made = []
    merged_here = {int(m[1]) for p in run_dir.glob("timeline_batch*.json") if (m := MERGED.fullmatch(p.name))}
    for d in [run_dir, *sorted(p for p in run_dir.iterdir() if p.is_dir())]:
        for f in plots.timeline_files(d):
            k = int(re.match(r"timeline_batch(\d+)", f.name)[1])
            if d != run_dir and k in merged_here and PIECE.fullmatch(f.name):
                continue  # one rank's piece: its Gantt is the merged one in run_dir
            out = d / f"timeline_batch{k}_gantt.png"
            made += _render(f, out, _gantt, plots, f, d, k, out)
        mpath = d / "metrics.jsonl"
        if mpath.is_file():
            out = d / "metrics.png"
            made += _render(mpath, out, _metrics_plot, plots, mpath, out)
    return [p for p in made if p is not None]


def _render(src: Path, out: Path, fn, *args) -> list[Path | None]:
    if out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        return []
    try:
        return [fn(*args)]
    except Exception as exc:  # noqa: BLE001 - a bad plot input must not fail a verified collect
        log.warning("plot %s not rendered from %s: %s", out.name, src, exc)
        return []


def _gantt(plots, f: Path, d: Path, k: int, out: Path) -> Path:
    data = json.loads(f.read_text())
    trace = data if isinstance(data, dict) else seed_to_chrome(data, {}, k, {})
    o = trace.get("otherData", {})
    title = (f"batch {k}: " + (f"{o['schedule']} " if o.get("schedule") else "")
             + f"pp={o.get('pp', '?')} microbatches={o.get('microbatches', '?')}")
    summary = d / f"timeline_batch{k}_summary.json"
    if summary.is_file():  # as `trainer plot` titles it
        s = json.loads(summary.read_text())
        theory = s.get("theoretical_bubble")
        title += f"; bubble {s['measured_bubble']:.2f} measured" + (f", {theory:.2f} theory" if theory is not None else "")
    if o.get("merged_by"):
        title += f" (merged by {o['merged_by']})"
    return plots.gantt(trace, out, title)


def _metrics_plot(plots, mpath: Path, out: Path) -> Path | None:
    recs = []
    for line in mpath.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written when the file was collected
        if isinstance(r.get("loss"), (int, float)) and isinstance(r.get("step"), int):
            recs.append(r)
    return plots.metrics_plot(recs, out) if recs else None


def _write(path: Path, text: str) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


# ---------------------------------------------------------------------------- summary and CLI

def summarize(run_dir: Path) -> list[str]:
    """Final loss, tokens/s, where the timelines, plots and checkpoints are."""
    lines = []
    for mp in sorted(run_dir.glob("*/metrics.jsonl")):
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
    def found(pattern: str) -> list[Path]:
        return sorted([*run_dir.glob(pattern), *run_dir.glob(f"*/{pattern}")])

    for p in found("timeline_batch*.json"):
        if MERGED.fullmatch(p.name):
            lines.append(f"timeline: {p}" + ("  (merged here from the nodes' pieces)" if p.parent == run_dir else ""))
    for p in found("*.png"):
        lines.append(f"plot: {p}")
    for p in found("profile.csv"):
        lines.append(f"profile: {p}")
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
    p.add_argument("--no-plots", action="store_true", help="do not merge timelines or render plots")
    p.set_defaults(func=main)


def collect(cl: Cluster, run_id: str, dest: Path, quiet: bool = False) -> tuple[list[NodeCollect], list[str]]:
    """Every node that answers, in parallel: (results, one error string per failure). A node's
    failure never costs another node's files, nor the files this node already delivered."""
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  disable=quiet, transient=True) as progress:
        res = parallel([cl[n.name] for n in cl.reachable()], lambda r: collect_node(r, run_id, dest, progress))
    out, errors = [], []
    for r, val, err in res:
        if err is not None:
            errors.append(f"{r.node.name}: {str(err).removeprefix(f'node {r.node.name}: ')}")
        else:
            out.append(val)
            errors += [f"{val.node}: {e}" for e in val.errors]
    errors += [f"{node}: not reachable, nothing collected from it (rerun collect when it answers)"
               for node in cl.unreachable]
    return out, errors


def main(args) -> int:
    inv = load(args, with_job=False)
    with Cluster(inv, args.accept_new_host_keys, partial=True) as cl:
        run_id = resolve_run(gather(cl, containers=False), args.run)
        results, errors = collect(cl, run_id, Path(args.dest), args.quiet)
    for r in results:
        print(f"{r.node:12s} {r.files:5d} files: {r.copied} copied ({r.bytes_copied / 1e6:.2f} MB, size and sha256 "
              f"verified), {r.skipped} unchanged" + (f", {r.vanished} vanished" if r.vanished else "") + f"  -> {r.dest}")
    run_dir = Path(args.dest) / run_id
    # What did arrive is merged, plotted and summarised even when a node failed or was away.
    if not args.no_plots and run_dir.is_dir():
        merge_timelines(run_dir)
        render_plots(run_dir)
    for line in summarize(run_dir):
        print(line)
    if errors:
        more = f" (+{len(errors) - MAX_ERRORS_SHOWN} more)" if len(errors) > MAX_ERRORS_SHOWN else ""
        raise UserError(f"collect {run_id}: " + "; ".join(errors[:MAX_ERRORS_SHOWN]) + more)
    return 0
