"""`runner profile`: measure every node for the job's pipeline, in the job's image, under the node's
limits; print a table (`--json` for tools) and the split `parallel.partition: auto` would use.

One probe container per node (`python -m trainer probe`, trainer/tools/probe.py), all started at once:
each serves the link probe of the node before it on a port picked free on its node, measures the
link to the node after it, then times the model's layer kinds at the job's microbatch shape. The
JSON each writes under the node's `<workdir>/profiles/<id>/` is read back over SFTP, cached
(runner/planning/profile_cache.py) and the node's files and container removed. A node whose probe fails
stops the others and is named with its last log line.
"""

from __future__ import annotations

import logging
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runner.core.errors import UserError
from runner.inventory import Inventory, Node
from runner.planning import profile_cache
from runner.planning.link_use import neighbour_docs
from runner.planning.paths import node_paths
from runner.planning.plan import (
    LABEL_NODE,
    LABEL_PREFIX,
    OUT,
    docker_limits,
    extra_hosts,
    hosts_of,
    own_host,
    user_env,
)
from runner.profile import doc_check
from runner.transport.cluster import Cluster
from runner.transport.container_logs import log_tail
from runner.transport.probe import Probe

if TYPE_CHECKING:
    from runner.transport.docker_answers import NodeContainer

log = logging.getLogger("runner.profile")
LABEL_PROFILE = f"{LABEL_PREFIX}.profile"
PROBE_VERSION = 2  # trainer/tools/probe.py VERSION: a cached profile of another version is measured again
LINK_PORT_BASE = 29900


@dataclass
class ClusterProfile:
    """Nodes in rank order (master first), each with what its probe measured; links[i] joins
    node i and node i + 1."""

    nodes: list[dict]
    links: list[dict | None]
    cached: dict[str, bool] = field(default_factory=dict)

    @property
    def model(self) -> dict:
        return self.nodes[0]["model"]

    def as_dict(self) -> dict:
        return {"nodes": self.nodes, "links": self.links, "cached": self.cached}


# ------------------------------------------------------------------ measuring


def profile_cluster(cl: Cluster, probes: dict[str, Probe], refresh: bool = False, min_seconds: float = 2.0,
                    timeout: float = 900.0) -> ClusterProfile:
    """Every node's compute profile and every link between rank neighbours, from the cache where
    it has them, else measured now (only the nodes and links that are missing)."""
    from runner.delivery.images import node_image_id

    inv = cl.inv
    order = inv.ordered()
    refuse_custom_command(inv)
    tags = {n.name: inv.job.image_for(n.arch or probes[n.name].arch) for n in order}
    ids = cl.each(lambda r: node_image_id(r, tags[r.node.name]))
    lacking = [n for n, i in ids.items() if i is None]
    if lacking:
        raise UserError(f"profile: node(s) {', '.join(lacking)} lack the job's image; run `runner push` first")
    keys = {n.name: profile_cache.node_key(n, inv.job, ids[n.name], PROBE_VERSION, min_seconds) for n in order}
    nodes = {n.name: None if refresh else profile_cache.load("node", n.name, keys[n.name]) for n in order}
    nodes = {k: d if doc_check.problem(d, compute=True, link=False) is None else None for k, d in nodes.items()}
    links: list[dict | None] = []
    # `runner check --links`' cached pairs first (runner/planning/link_use.py): no probe for those links
    checked: list[dict | None] = [None] * len(order) if refresh else neighbour_docs(order)
    for a, b, lk in zip(order, order[1:], checked, strict=False):
        if lk is None and not refresh:
            lk = profile_cache.load("link", f"{a.name}-{b.name}", profile_cache.link_key(keys[a.name], keys[b.name]))
        links.append(lk if doc_check.problem({"link": lk}, compute=False, link=True) is None else None)
    cached = {n.name: nodes[n.name] is not None for n in order}
    need_compute = {n.name for n in order if nodes[n.name] is None}
    need_link = {i for i, lk in enumerate(links) if lk is None}
    if need_compute or need_link:
        docs = run_probes(cl, order, probes, tags, need_compute, need_link, min_seconds, timeout)
        for i, n in enumerate(order):
            doc = docs.get(n.name) or {}
            if n.name in need_compute:
                # host: runner/planning/sizing.py finds this node's measured memory by name and address
                measured = {**{k: v for k, v in doc.items() if k != "link"}, "host": n.host}
                nodes[n.name] = measured
                profile_cache.save("node", n.name, keys[n.name], measured)
            if i in need_link:
                links[i] = link = doc["link"]
                nxt = order[i + 1].name
                profile_cache.save("link", f"{n.name}-{nxt}", profile_cache.link_key(keys[n.name], keys[nxt]), link)
    out = []
    for n in order:
        node_doc = nodes[n.name]
        assert node_doc is not None  # from the cache or measured above
        doc = dict(node_doc)
        doc.update(node=n.name, cpus_limit=n.cpus, memory_limit=n.memory)
        out.append(doc)
    return ClusterProfile(out, links, cached)


def refuse_custom_command(inv: Inventory) -> None:
    if inv.job.command:
        raise UserError(f"{inv.path}: job.command replaces the trainer; `runner profile` runs the trainer "
                        f"image's `python -m trainer probe` and cannot measure a custom program")


def _pick_ports(cl: Cluster, order: list[Node], servers: set[int]) -> dict[int, int]:
    """A free port per serving node, distinct across nodes (sandbox nodes share one machine)."""
    listening = cl.each(lambda r: r.listening_ports())
    taken: set[int] = set()
    ports = {}
    for i in sorted(servers):
        busy = listening[order[i].name] | taken
        port = next(p for p in range(LINK_PORT_BASE, LINK_PORT_BASE + 1000) if p not in busy)
        ports[i] = port
        taken.add(port)
    return ports


def run_probes(cl: Cluster, order: list[Node], probes: dict[str, Probe], tags: dict[str, str],
               need_compute: set[str], need_link: set[int], min_seconds: float, timeout: float,
               link_bytes: int | None = None) -> dict[str, dict]:
    inv = cl.inv
    ident = secrets.token_hex(3)
    servers = {i + 1 for i in need_link}
    ports = _pick_ports(cl, order, servers)
    active = [i for i, n in enumerate(order) if n.name in need_compute or i in need_link or i in servers]
    dirs = {order[i].name: f"{node_paths(order[i], probes[order[i].name].home).workdir}/profiles/{ident}"
            for i in active}
    config = open(inv.job.config, "rb").read() if inv.job.config else None
    log.info("profile: measuring %s (%s)", ", ".join(order[i].name for i in active),
             "compute and links" if need_compute else "links")

    def command(i: int) -> list[str]:
        n = order[i]
        cmd = ["python", "-m", "trainer", "probe", "--out", f"{OUT}/profile.json", "--min-seconds", f"{min_seconds:g}",
               "--timeout", f"{timeout:g}"]
        if i in servers:
            cmd += ["--serve", str(ports[i])]
        if i in need_link:
            cmd += ["--peer", f"{order[i + 1].rank_addr}:{ports[i + 1]}"]
        if n.name not in need_compute:
            cmd += ["--no-compute"]
        if link_bytes is not None:  # `runner check --links`: a round sized to the link (runner/profile/links.py)
            cmd += ["--link-bytes", str(link_bytes)]
        return cmd + ["--"] + (["--config", f"{OUT}/config.yaml"] if config is not None else []) + list(inv.job.args)

    hosts = hosts_of(order, {k: p.facts() for k, p in probes.items()})  # plan.py: no lookup waits on DNS
    def start(i: int):
        n = order[i]
        r = cl[n.name]
        r.makedirs(dirs[n.name])
        if config is not None:
            r.put_bytes(f"{dirs[n.name]}/config.yaml", config)
        p = probes[n.name]
        env = {**user_env(p.facts()), **inv.job.env, **n.env, "NODE_NAME": n.name, "OUTPUT_DIR": OUT,
               "PYTHONUNBUFFERED": "1"}
        # As the job's containers: the SSH user's uid:gid, so the user can remove what the probe wrote.
        run_as = {"user": f"{p.uid}:{p.gid}"} if p.uid else {}
        c = r.docker().containers.create(
            tags[n.name], command(i), name=f"runner-profile-{ident}-{n.name}", environment=env,
            labels={LABEL_PROFILE: ident, LABEL_NODE: n.name}, network_mode="host", ipc_mode="host",
            volumes={dirs[n.name]: {"bind": OUT, "mode": "rw"}}, **docker_limits(n.cpus, n.memory), **run_as,
            extra_hosts=extra_hosts(hosts, own_host(n, p.facts())))
        c.start()
        return c

    containers: dict[str, NodeContainer] = {}
    try:
        started = cl.map(active, start)
        for i, c, err in started:
            if err is not None:
                raise UserError(f"profile: node {order[i].name}: starting the probe failed: {err}")
            containers[order[i].name] = c
        failed = _wait(containers, timeout)
        if failed:
            name, code = failed
            tail = [ln for ln in log_tail(containers[name], 20) if ln.strip()]
            for line in tail[-8:]:
                sys.stderr.write(f"  [{name}/probe] {line}\n")
            raise UserError(f"profile: node {name}: the probe {'exited ' + str(code) if code is not None else 'timed out'}"
                            f"{': ' + tail[-1][:300] if tail else ''}")
        docs = {}
        for i in active:
            n = order[i]
            text = cl[n.name].read_text(f"{dirs[n.name]}/profile.json")
            if text is None:
                raise UserError(f"profile: node {n.name}: the probe wrote no {dirs[n.name]}/profile.json")
            docs[n.name] = doc_check.node_doc(doc_check.loads(text), n.name, f"{dirs[n.name]}/profile.json",
                                                 compute=n.name in need_compute, link=i in need_link)
        return docs
    finally:
        def tidy(name: str) -> None:
            c = containers.get(name)
            if c is not None:
                c.remove(force=True)
            cl[name].run(["rm", "-rf", dirs[name]])

        cl.map(list(dirs), tidy)


def _wait(containers: dict[str, NodeContainer], timeout: float) -> tuple[str, int | None] | None:
    """Until every probe exited 0 (None), one exited non-zero, or the time is up: (node, code)."""
    deadline = time.time() + timeout
    pending = dict(containers)
    while pending:
        for name, c in list(pending.items()):
            c.reload()
            if c.status in ("exited", "dead"):
                code = c.exit_code
                if code != 0:
                    return name, code
                del pending[name]
        if time.time() > deadline:
            return next(iter(pending)), None
        time.sleep(0.5)
    return None
