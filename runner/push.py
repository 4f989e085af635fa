"""`runner push`: bring every node the image for its arch, all nodes in parallel, moving only the
layers a node lacks; fall back to a compressed full `docker save | docker load`. The node's image
id is verified afterwards; nodes that already have it are skipped."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import subprocess
import tempfile
import time
from dataclasses import dataclass

from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from runner.errors import UserError
from runner.images import Exported, export, missing_layers, node_chains, node_image_id, partial_members
from runner.session import Cluster, add_inventory_args, load, parallel, probe
from runner.ssh import Remote

log = logging.getLogger("runner.push")
CHUNK = 1 << 20


@dataclass
class PushResult:
    node: str
    tag: str
    image_id: str
    action: str            # skipped | layers | full
    layers_sent: int = 0
    layers_total: int = 0
    bytes_sent: int = 0    # archive bytes streamed (before ssh compression)
    image_bytes: int = 0
    seconds: float = 0.0


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def stream_to_load(remote: Remote, exp: Exported, members: list[str], progress=None, task=None,
                   gzip_: bool = False) -> int:
    """tar (members of the cached export) | [gzip] | ssh node docker load. Returns bytes streamed."""
    # Compression only pays off on real links; on loopback it would just burn the 2 cores.
    compress = not _loopback(remote.node.host)
    tar = subprocess.Popen(["tar", "-C", str(exp.dir), "-cf", "-", "--", *members], stdout=subprocess.PIPE)
    src = tar.stdout
    gz = None
    if gzip_:
        gz = subprocess.Popen(["gzip", "-1", "-c"], stdin=tar.stdout, stdout=subprocess.PIPE)
        tar.stdout.close()
        src = gz.stdout
    errf = tempfile.TemporaryFile()
    ssh = subprocess.Popen([*remote.openssh_argv(compress=compress and not gzip_), "docker load -q"],
                           stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=errf)
    sent = 0
    try:
        while True:
            buf = src.read(CHUNK)
            if not buf:
                break
            ssh.stdin.write(buf)
            sent += len(buf)
            if progress is not None:
                progress.update(task, advance=len(buf))
        ssh.stdin.close()
    except BrokenPipeError:
        pass
    ssh.wait(timeout=1800)
    tar.wait()
    if gz:
        gz.wait()
    errf.seek(0)
    err = errf.read().decode(errors="replace").strip()
    errf.close()
    if ssh.returncode != 0 or tar.returncode != 0:
        raise UserError(f"node {remote.node.name}: docker load failed (exit {ssh.returncode}): {err[-300:]}")
    return sent


def push_one(remote: Remote, exp: Exported, progress=None, force_full: bool = False) -> PushResult:
    t0 = time.time()
    res = PushResult(remote.node.name, exp.tag, exp.image_id, "skipped", layers_total=len(exp.layers),
                     image_bytes=exp.total_bytes)
    if not force_full and node_image_id(remote, exp.tag) == exp.image_id:
        res.seconds = time.time() - t0
        return res
    task = None
    try:
        if force_full:
            raise UserError("full push requested")
        missing = missing_layers(exp, node_chains(remote))
        members = partial_members(exp, missing)
        size = sum(exp.sizes[i] for i in missing)
        if progress is not None:
            task = progress.add_task(f"{remote.node.name}: {len(missing)}/{len(exp.layers)} layers", total=size or 1)
        res.bytes_sent = stream_to_load(remote, exp, members, progress, task)
        res.action, res.layers_sent = "layers", len(missing)
    except UserError as exc:
        if not force_full:
            log.warning("node %s: partial load failed (%s); falling back to a full compressed save|load",
                        remote.node.name, exc)
        if progress is not None:
            if task is not None:
                progress.remove_task(task)
            task = progress.add_task(f"{remote.node.name}: full image (gzip)", total=exp.total_bytes)
        members = ["manifest.json", exp.config, *exp.layers]
        res.bytes_sent = stream_to_load(remote, exp, members, progress, task, gzip_=True)
        res.action, res.layers_sent = "full", len(exp.layers)
    got = node_image_id(remote, exp.tag)
    if got != exp.image_id:
        raise UserError(f"node {remote.node.name}: image id after load is {got}, expected {exp.image_id}")
    res.seconds = time.time() - t0
    return res


def push_to_nodes(cl: Cluster, arches: dict[str, str | None], quiet: bool = False,
                  force_full: bool = False) -> list[PushResult]:
    """Each node gets job.image for its arch; exports happen once per tag."""
    tags: dict[str, str] = {}
    for n in cl.inv.nodes:
        arch = n.arch or arches.get(n.name)
        tag = cl.inv.job.image_for(arch)
        if not tag:
            raise UserError(f"{cl.inv.path}: job.image: no image for arch {arch} (node {n.name})")
        tags[n.name] = tag
    exports = {t: export(t) for t in sorted(set(tags.values()))}
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), disable=quiet, transient=True) as progress:
        def one(r: Remote) -> PushResult:
            return push_one(r, exports[tags[r.node.name]], progress, force_full)

        res = parallel([cl[n.name] for n in cl.inv.nodes], one)
    out, errors = [], []
    for r, val, err in res:
        if err is not None:
            errors.append(f"{r.node.name}: {err}")
        else:
            out.append(val)
            log.info("push %s: %s %s (%d/%d layers, %.1f MB, %.1fs)", val.node, val.tag, val.action,
                     val.layers_sent, val.layers_total, val.bytes_sent / 1e6, val.seconds)
    if errors:
        raise UserError("push failed: " + "; ".join(errors))
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("push", help="bring every node its image, moving only missing layers")
    add_inventory_args(p)
    p.add_argument("--job", help="YAML file with a job section, overriding the inventory's")
    p.add_argument("--full", action="store_true", help="always stream the whole image (compressed save|load)")
    p.set_defaults(func=main)


def main(args) -> int:
    inv = load(args)
    with Cluster(inv, args.accept_new_host_keys) as cl:
        arches: dict[str, str | None] = {}
        if any(n.arch is None for n in inv.nodes):
            arches = {k: p.arch for k, p in cl.each(lambda r: probe(r, inv.master.host)).items()}
        results = push_to_nodes(cl, arches, force_full=args.full)
    for r in results:
        print(f"{r.node:12s} {r.tag:28s} {r.action:8s} layers {r.layers_sent}/{r.layers_total}  "
              f"{r.bytes_sent / 1e6:9.1f} MB of {r.image_bytes / 1e6:.1f} MB  {r.seconds:.1f}s  id {r.image_id[7:19]}")
    return 0
