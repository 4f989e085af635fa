"""`runner push`: bring every node the image for its arch, all nodes in parallel, moving only the
layers a node lacks; fall back to a compressed full `docker save | docker load`. The node's image
id is verified afterwards; nodes that already have it are skipped."""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass

from runner.errors import UserError
from runner.images import (
    Exported,
    build_image,
    export,
    host_client,
    host_image,
    host_image_ids,
    missing_layers,
    node_chains,
    node_image_id,
)
from runner.inventory import BuildSpec, Inventory
from runner.session import Cluster, add_inventory_args, load, probe
from runner.ssh import Remote
from runner.stream import ssh_stream, transfer_progress

log = logging.getLogger("runner.push")


@dataclass
class PushResult:
    node: str
    tag: str
    image_id: str
    action: str            # skipped | layers | full | pulled (job.registry)
    layers_sent: int = 0
    layers_total: int = 0
    bytes_sent: int = 0    # archive bytes streamed (before ssh compression)
    image_bytes: int = 0
    seconds: float = 0.0


STALL_S = 300.0        # no byte accepted (or produced) for this long: the node or the source is stuck
LOAD_WAIT_S = 1800.0   # docker load still busy this long after the last byte: give up on this node


def stream_to_load(remote: Remote, exp: Exported, layers: list[int], progress=None, task=None,
                   gzip_: bool = False, stall_s: float = STALL_S) -> int:
    """tar (manifest, config and the given layers of the cached export) | [gzip] | ssh node docker
    load. Returns bytes streamed.

    Every failure (load dying mid-stream, a stall, a timeout, a bad archive) ends as a UserError
    naming the node with no child process left behind, so push_one can fall back."""
    name = remote.node.name
    local = [exp.archive_cmd(layers)] + ([["gzip", "-1", "-c"]] if gzip_ else [])
    on_chunk = (lambda n: progress.update(task, advance=n)) if progress is not None else None
    res = ssh_stream(remote, "docker load -q", local, upload=True, on_chunk=on_chunk, stall_s=stall_s,
                     aes=exp.arch == "amd64", finish_s=LOAD_WAIT_S)
    if res.unfinished:
        raise UserError(f"node {name}: docker load still running {LOAD_WAIT_S:.0f}s after the last byte; gave up")
    if not res.broken and res.ssh_rc == 0 and None in res.local_rcs:
        raise UserError(f"node {name}: tar/gzip of the image export did not exit after the stream ended")
    if res.stalled:
        raise UserError(f"node {name}: image stream stalled (nothing moved for {stall_s:.0f}s); stopped it")
    if not res.broken and any(rc for rc in res.local_rcs):  # the root cause, if any
        raise UserError(f"node {name}: reading the image export {exp.dir} failed: {res.local_err or 'gzip failed'}")
    if res.ssh_rc != 0 or res.broken:
        raise UserError(f"node {name}: docker load failed (exit {res.ssh_rc}{', mid-stream' if res.broken else ''}): "
                        f"{res.ssh_err or 'no output'}")
    return res.moved


def push_one(remote: Remote, exp: Exported, progress=None, force_full: bool = False) -> PushResult:
    t0 = time.time()
    res = PushResult(remote.node.name, exp.tag, exp.image_id, "skipped", layers_total=len(exp.layers),
                     image_bytes=exp.total_bytes)
    if not force_full and node_image_id(remote, exp.tag) == exp.image_id:
        res.seconds = time.time() - t0
        return res
    if force_full:
        _push_full(remote, exp, res, progress)
    else:
        try:
            _push_layers(remote, exp, res, progress)
        except UserError as exc:
            log.warning("node %s: partial load failed (%s); falling back to a full compressed save|load",
                        remote.node.name, exc)
            _push_full(remote, exp, res, progress)
    got = node_image_id(remote, exp.tag)
    if got != exp.image_id:
        raise UserError(f"node {remote.node.name}: image id after load is {got}, expected {exp.image_id}")
    res.seconds = time.time() - t0
    return res


def _push_layers(remote: Remote, exp: Exported, res: PushResult, progress) -> None:
    missing = missing_layers(exp, node_chains(remote))
    size = sum(exp.sizes[i] for i in missing)
    task = None
    if progress is not None:
        task = progress.add_task(f"{remote.node.name}: {len(missing)}/{len(exp.layers)} layers", total=size or 1)
    try:
        res.bytes_sent = stream_to_load(remote, exp, missing, progress, task)
    finally:
        if task is not None:
            progress.remove_task(task)
    res.action, res.layers_sent = "layers", len(missing)


def _push_full(remote: Remote, exp: Exported, res: PushResult, progress) -> None:
    task = None
    if progress is not None:  # counts compressed bytes: the bar ends short of the image size
        task = progress.add_task(f"{remote.node.name}: full image (gzip)", total=exp.total_bytes)
    try:
        res.bytes_sent = stream_to_load(remote, exp, list(range(len(exp.layers))), progress, task,
                                        gzip_=True)
    finally:
        if task is not None:
            progress.remove_task(task)
    res.action, res.layers_sent = "full", len(exp.layers)


def push_to_nodes(cl: Cluster, arches: dict[str, str | None], quiet: bool = False,
                  force_full: bool = False, build: bool = False) -> list[PushResult]:
    """Each node gets job.image for its arch; images are built first where job.build says how
    (when missing on this host, or always with build=True); exports happen once per tag."""
    tags = node_tags(cl.inv, arches)
    if cl.inv.job.registry:  # the nodes pull instead (runner/registry.py)
        from runner.registry import pull_to_nodes

        return pull_to_nodes(cl, tags, host_image_ids(sorted(set(tags.values()))))
    specs = build_specs(cl.inv, tags, arches)
    if build and not any(specs.values()):
        raise UserError(f"{cl.inv.path}: push --build: the job has no build section saying how to build "
                        f"{', '.join(sorted(specs))} (job.build: {{context, dockerfile, args}})")
    for tag, spec in specs.items():
        ensure_built(tag, spec, build)
    # Which nodes already run the host's image: an inspect each, no `docker save` (a full export
    # costs ~11 s for this project's image, and `up` pushes on every launch).
    host = host_image_facts(sorted(set(tags.values())))
    remotes = [cl[n.name] for n in cl.inv.nodes]
    current: dict[str, bool] = {}
    if not force_full:
        for r, same, err in cl.map(remotes, lambda r: node_image_id(r, tags[r.node.name]) == host[tags[r.node.name]][0]):
            current[r.node.name] = err is None and same
    exports = {t: export(t) for t in sorted({tags[n] for n in tags if not current.get(n)})}
    with transfer_progress(quiet) as progress:
        def one(r: Remote) -> PushResult:
            tag = tags[r.node.name]
            if current.get(r.node.name):
                image_id, n_layers, size = host[tag]
                return PushResult(r.node.name, tag, image_id, "skipped", layers_total=n_layers, image_bytes=size)
            return push_one(r, exports[tag], progress, force_full)

        res = cl.map(remotes, one)
    out, errors = [], []
    for r, val, err in res:
        if err is not None:
            errors.append(f"{r.node.name}: {str(err).removeprefix(f'node {r.node.name}: ')}")
        else:
            out.append(val)
            log.info("push %s: %s %s (%d/%d layers, %.1f MB, %.1fs)", val.node, val.tag, val.action,
                     val.layers_sent, val.layers_total, val.bytes_sent / 1e6, val.seconds)
    if errors:
        raise UserError("push failed: " + "; ".join(errors))
    return out


def host_image_facts(tags: list[str]) -> dict[str, tuple[str, int, int]]:
    """{tag: (image id, layer count, size in bytes)} from this host's engine; a tag it lacks is
    the export's one-line error (build it first, or fix job.image)."""
    client = host_client()
    out = {}
    for t in tags:
        a = host_image(client, t).attrs
        out[t] = (a["Id"], len(a["RootFS"]["Layers"]), int(a.get("Size") or 0))
    client.close()
    return out


def node_tags(inv: Inventory, arches: dict[str, str | None]) -> dict[str, str]:
    tags: dict[str, str] = {}
    for n in inv.nodes:
        arch = n.arch or arches.get(n.name)
        tag = inv.job.image_for(arch)
        if not tag:
            raise UserError(f"{inv.path}: job.image: no image for arch {arch} (node {n.name})")
        tags[n.name] = tag
    return tags


def build_specs(inv: Inventory, tags: dict[str, str], arches: dict[str, str | None]) -> dict[str, BuildSpec | None]:
    """{tag: how to build it, or None}; one tag asked of two different build specs is an error."""
    out: dict[str, BuildSpec | None] = {}
    for n in inv.nodes:
        tag, spec = tags[n.name], inv.job.build.get(n.arch or arches.get(n.name) or "")
        if tag in out and out[tag] != spec:
            raise UserError(f"{inv.path}: job.build: tag {tag} is built differently for the arches of its nodes; "
                            "give each arch its own tag in job.image")
        out[tag] = spec
    return out


def ensure_built(tag: str, spec: BuildSpec | None, force: bool) -> None:
    """Build when asked to, or when this host lacks the tag and the job says how; else take it."""
    if spec is None:
        if force:
            log.info("%s: no job.build for it; taking the image as it is", tag)
        return
    if force or host_image_ids([tag])[tag] is None:
        image_id = build_image(tag, spec)
        log.info("built %s: %s", tag, image_id[:19])


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("push", help="bring every node its image, moving only missing layers "
                       "(with job.registry: the nodes pull it)")
    add_inventory_args(p)
    p.add_argument("--job", help="YAML file with a job section, overriding the inventory's")
    p.add_argument("--full", action="store_true", help="always stream the whole image (compressed save|load)")
    p.add_argument("--build", action="store_true", help="build every image job.build describes, even if present")
    p.set_defaults(func=main)


def main(args) -> int:
    inv = load(args)
    with Cluster(inv, args.accept_new_host_keys, workers=args.parallel) as cl:
        arches: dict[str, str | None] = {}
        if any(n.arch is None for n in inv.nodes):
            arches = {k: p.arch for k, p in cl.each(lambda r: probe(r, inv.master.rank_addr)).items()}
        results = push_to_nodes(cl, arches, force_full=args.full, build=args.build)
    for r in results:
        print(f"{r.node:12s} {r.tag:28s} {r.action:8s} layers {r.layers_sent}/{r.layers_total}  "
              f"{r.bytes_sent / 1e6:9.1f} MB of {r.image_bytes / 1e6:.1f} MB  {r.seconds:.1f}s  id {r.image_id[7:19]}")
    return 0
