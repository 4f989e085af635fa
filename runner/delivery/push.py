"""`runner push`: bring every node the image for its arch, moving only the layers a node lacks.

In one direction: plan (which node has the image, what each lacks, who sends it what) ->
transfer -> verify (each node's image id against this host's). With two or more nodes of an arch
needing an image, they form a relay chain (runner/delivery/relay.py): this host sends the layers any of
them lacks once, to the first, and each node passes the stream on as it loads it, so the host's
uplink carries one copy whatever the node count. A node that cannot take part, or whose relay
fails, gets its own stream from this host (`job.push: direct` or `push --direct` for every node):
the missing layers, then a compressed full `docker save | docker load` if that fails.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from runner.core.errors import UserError
from runner.delivery import disk_room
from runner.delivery.images import (
    Exported,
    build_image,
    export,
    host_client,
    host_image,
    host_image_ids,
    missing_layers,
    node_chains,
    node_image_id,
    on_host_engine,
)
from runner.delivery.layer_sizes import host_layers
from runner.delivery.push_result import PushResult
from runner.delivery.registry import pull_to_nodes
from runner.inventory import BuildSpec, Inventory
from runner.transport.cluster import Cluster
from runner.transport.ssh import Remote
from runner.transport.stream import ssh_stream, transfer_progress

log = logging.getLogger("runner.push")


@dataclass
class Chain:
    """Nodes that get one tag through one stream: host -> nodes[0] -> nodes[1] ..."""
    tag: str
    nodes: list[str]
    missing: dict[str, list[int]]  # node -> indices of the layers it lacks (the stream carries their union)


@dataclass
class PushPlan:
    tags: dict[str, str]                                       # node -> tag
    current: set[str] = field(default_factory=set)             # nodes that already run the host's image
    direct: list[str] = field(default_factory=list)            # nodes that get their own stream
    chains: list[Chain] = field(default_factory=list)
    exports: dict[str, Exported] = field(default_factory=dict)
    host: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # tag -> host_image_facts
    innocent: set[str] = field(default_factory=set)            # cut off by a failure before them in a chain
    refused: dict[str, str] = field(default_factory=dict)      # node -> why nothing is sent to it (no room)


MAX_CHAIN = 32         # nodes per relay chain: one failure cuts off at most the rest of its chain
CHAINS_AT_ONCE = 4     # relay chains running at once (each holds one ssh process per node)
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
                     aes=exp.arch == "amd64", finish_s=LOAD_WAIT_S, size=sum(exp.sizes[i] for i in layers))
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
                     image_bytes=exp.total_bytes, source="host")
    if not force_full and node_image_id(remote, exp.tag) == exp.image_id:
        res.seconds = time.time() - t0
        return res
    if force_full:
        _push_full(remote, exp, res, progress)
    else:
        try:
            _push_layers(remote, exp, res, progress)
        except disk_room.NoRoom:
            raise
        except UserError as exc:
            if "no space left on device" in str(exc).lower():  # the whole image would not fit either
                raise
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
    disk_room.check_engine_room(remote, size, f"{exp.tag} ({len(missing)} of {len(exp.layers)} layers)")
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
    disk_room.check_engine_room(remote, exp.total_bytes, f"{exp.tag} (all {len(exp.layers)} layers)")
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
                  force_full: bool = False, build: bool = False, relay: bool | None = None) -> list[PushResult]:
    """Each node gets job.image for its arch; images are built first where job.build says how
    (when missing on this host, or always with build=True); exports happen once per tag.
    relay: None follows job.push; False gives every node its own stream."""
    tags = node_tags(cl.inv, arches)
    if cl.inv.job.registry:  # the nodes pull instead (runner/delivery/registry.py)
        return pull_to_nodes(cl, tags, on_host_engine(sorted(set(tags.values())), host_layers))
    specs = build_specs(cl.inv, tags, arches)
    if build and not any(specs.values()):
        raise UserError(f"{cl.inv.path}: push --build: the job has no build section saying how to build "
                        f"{', '.join(sorted(specs))} (job.build: {{context, dockerfile, args}})")
    for tag, spec in specs.items():
        ensure_built(tag, spec, build)
    use_relay = (cl.inv.job.push == "relay") if relay is None else relay
    plan = plan_push(cl, tags, force_full, use_relay and not force_full)
    try:
        with transfer_progress(quiet) as progress:
            results, failed = transfer(cl, plan, progress, force_full)
            results.update(verify(cl, plan, failed, progress))
    finally:
        for exp in plan.exports.values():
            exp.release()
    out, errors = [], []
    for n in cl.inv.nodes:
        val = results[n.name]
        if isinstance(val, Exception):
            errors.append(f"{n.name}: {str(val).removeprefix(f'node {n.name}: ')}")
        else:
            out.append(val)
            log.info("push %s: %s %s (%d/%d layers, %.1f MB, %.1fs)", val.node, val.tag, val.action,
                     val.layers_sent, val.layers_total, val.bytes_sent / 1e6, val.seconds)
    if errors:
        raise UserError("push failed: " + "; ".join(errors))
    return out


def plan_push(cl: Cluster, tags: dict[str, str], force_full: bool, relay: bool) -> PushPlan:
    """Who needs what, and from whom. Which nodes already run the host's image: an inspect each, no
    `docker save` (a full export costs ~11 s for this project's image, and `up` pushes on every
    launch). With relay, the nodes of each tag that need it are asked which layers they lack and
    whether they can run the relay agent (python3); those that can form that tag's chain."""
    plan = PushPlan(tags)
    host = plan.host = host_image_facts(sorted(set(tags.values())))
    remotes = [cl[n.name] for n in cl.inv.nodes]
    if not force_full:
        for r, same, err in cl.map(remotes, lambda r: node_image_id(r, tags[r.node.name]) == host[tags[r.node.name]][0]):
            if err is None and same:
                plan.current.add(r.node.name)
    need = [r for r in remotes if r.node.name not in plan.current]
    plan.exports = {t: export(t) for t in sorted({tags[r.node.name] for r in need})}
    if not relay:
        plan.direct = [r.node.name for r in need]
        return plan
    from runner.delivery.relay import not_relayable

    for tag, exp in plan.exports.items():
        group = [r for r in need if tags[r.node.name] == tag]
        if len(group) < 2:
            plan.direct += [r.node.name for r in group]
            continue
        why = not_relayable(exp)
        if why:
            log.warning("image %s is not relayed (%s); each node gets its own stream", tag, why)
            plan.direct += [r.node.name for r in group]
            continue
        facts = {r.node.name: (v, e) for r, v, e in cl.map(group, _relay_facts)}
        lacks: dict[str, list[int]] = {}
        for r in group:
            v, err = facts[r.node.name]
            have, why, room = v if err is None else (set(), None, None)  # a node that could not be asked: direct
            if err is not None or why:
                log.warning("node %s: not in the relay (%s); it gets its own stream from this host",
                            r.node.name, why or err)
                plan.direct.append(r.node.name)
            else:
                missing = missing_layers(exp, have)
                short = disk_room.engine_shortage(r.node.name, room, sum(exp.sizes[i] for i in missing),
                                                  f"{tag} ({len(missing)} of {len(exp.layers)} layers)")
                if short:
                    plan.refused[r.node.name] = short
                    continue
                lacks[r.node.name] = missing
        if len(lacks) >= 2:
            # Who lacks most first: the stream thins as it goes (each node passes on only what
            # the nodes after it lack), so a node that has most layers sits where it is thinnest.
            order = sorted(lacks, key=lambda n: -sum(exp.sizes[i] for i in lacks[n]))
            for i in range(0, len(order), MAX_CHAIN):
                part = order[i:i + MAX_CHAIN]
                if len(part) >= 2:
                    plan.chains.append(Chain(tag, part, {n: lacks[n] for n in part}))
                else:
                    plan.direct += part
        else:
            plan.direct += list(lacks)
    return plan


def _relay_facts(r: Remote) -> tuple[set[str], str | None, tuple[int, int] | None]:
    """(the chain ids the node holds, why it cannot relay or None, its engine's room)."""
    res = r.run(["sh", "-c", "command -v python3"], timeout=30)
    return node_chains(r), None if res.rc == 0 else "no python3 for the relay agent", disk_room.engine_room(r)


def transfer(cl: Cluster, plan: PushPlan, progress, force_full: bool
             ) -> tuple[dict[str, PushResult | Exception], dict[str, str]]:
    """Run the plan: every direct stream and every chain at once. Returns the results so far and
    {node: why its relay failed} for push.verify to mend."""
    results: dict[str, PushResult | Exception] = {}
    for name in plan.current:
        tag = plan.tags[name]
        image_id, n_layers, size = plan.host[tag]
        results[name] = PushResult(name, tag, image_id, "skipped", layers_total=n_layers, image_bytes=size)
    for name, why in plan.refused.items():
        results[name] = UserError(why)
    failed: dict[str, str] = {}
    chains_at_once = threading.BoundedSemaphore(CHAINS_AT_ONCE)

    def job(item):
        if isinstance(item, Chain):
            with chains_at_once:
                return _run_chain(cl, item, plan.exports[item.tag], progress, failed, plan.innocent)
        return {item: push_one(cl[item], plan.exports[plan.tags[item]], progress, force_full)}

    for item, val, err in cl.map([*plan.chains, *plan.direct], job):
        if err is None:
            results.update(val)
        elif isinstance(item, Chain):  # not a node's failure (relay_chain reports those): try each directly
            failed.update(dict.fromkeys(item.nodes, f"relay failed: {err}"))
        else:
            results[item] = err  # a direct push: its error names the node
    return results, failed


def _run_chain(cl: Cluster, chain: Chain, exp: Exported, progress, failed: dict[str, str],
               innocent: set[str] | None = None) -> dict[str, PushResult]:
    """One relay chain; nodes that did not load go to `failed` (with why), and those that failed
    only because a node before them did also to `innocent`."""
    from runner.delivery.relay import relay_chain

    res = relay_chain([cl[n] for n in chain.nodes], exp, [chain.missing[n] for n in chain.nodes], progress)
    out: dict[str, PushResult] = {}
    log.info("relay %s: %s, this host sent %.1f MB in %.1fs", exp.tag, " -> ".join(chain.nodes),
             res.host_bytes / 1e6, res.seconds)
    for h in res.hops:
        if h.loaded:
            out[h.node] = PushResult(h.node, exp.tag, exp.image_id, "relay", len(chain.missing[h.node]),
                                     len(exp.layers), h.received if h.source != "host" else res.host_bytes,
                                     exp.total_bytes, res.seconds, h.source)
        else:
            failed[h.node] = h.error or "relay failed"
            if h.cut_off and innocent is not None:
                innocent.add(h.node)
    return out


def verify(cl: Cluster, plan: PushPlan, failed: dict[str, str], progress) -> dict[str, PushResult | Exception]:
    """Every relayed node's image id against the host's. Nodes cut off by a failure before them in
    a chain form one more chain (one more copy from this host, not one per node); a node whose
    relay failed, or whose id is wrong, then gets its own stream (push_one verifies itself)."""
    _check_ids(cl, plan, [n for c in plan.chains for n in c.nodes if n not in failed], failed)
    out: dict[str, PushResult | Exception] = {}
    again: dict[str, dict[str, list[int]]] = {}
    for c in plan.chains:
        for n in c.nodes:
            if n in plan.innocent and n in failed:
                again.setdefault(c.tag, {})[n] = c.missing[n]
    for tag, lacks in again.items():
        if len(lacks) < 2:
            continue
        log.warning("relay %s: %s cut off by a failure before them (%s); relaying to them again",
                    tag, ", ".join(lacks), failed[next(iter(lacks))])
        for n in lacks:
            del failed[n]
        retry = Chain(tag, list(lacks), lacks)
        plan.chains.append(retry)
        got = _run_chain(cl, retry, plan.exports[tag], progress, failed)
        _check_ids(cl, plan, list(got), failed)
        out.update({n: r for n, r in got.items() if n not in failed})
    for name, why in failed.items():
        log.warning("node %s: relay push failed (%s); sending it the image directly", name, why)
    for r, val, err in cl.map([cl[n] for n in failed],
                              lambda r: push_one(r, plan.exports[plan.tags[r.node.name]], progress)):
        out[r.node.name] = err if err is not None else val
    return out


def _check_ids(cl: Cluster, plan: PushPlan, nodes: list[str], failed: dict[str, str]) -> None:
    """Each node's image id for its tag against the host's; a mismatch goes to `failed`."""
    for r, got, err in cl.map([cl[n] for n in nodes], lambda r: node_image_id(r, plan.tags[r.node.name])):
        want = plan.exports[plan.tags[r.node.name]].image_id
        if err is not None or got != want:
            failed[r.node.name] = f"image id after the relay is {got}, expected {want}" if err is None else str(err)


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
