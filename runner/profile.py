"""`runner profile`: measure every node for the job's pipeline, in the job's image, under the node's
limits; print a table (`--json` for tools) and the split `parallel.partition: auto` would use.

One probe container per node (`python -m trainer probe`, trainer/probe.py), all started at once:
each serves the link probe of the node before it on a port picked free on its node, measures the
link to the node after it, then times the model's layer kinds at the job's microbatch shape. The
JSON each writes under the node's `<workdir>/profiles/<id>/` is read back over SFTP, cached
(runner/profile_cache.py) and the node's files and container removed. A node whose probe fails
stops the others and is named with its last log line.
"""

from __future__ import annotations

import argparse
import json
import logging
import secrets
import sys
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from runner import profile_cache
from runner.errors import UserError
from runner.inventory import Inventory, Node
from runner.node_output import log_tail
from runner.paths import node_paths
from runner.plan import LABEL_NODE, LABEL_PREFIX, OUT, docker_limits, user_env
from runner.session import Cluster, Probe, add_inventory_args, load, probe

log = logging.getLogger("runner.profile")
LABEL_PROFILE = f"{LABEL_PREFIX}.profile"
PROBE_VERSION = 2  # trainer/probe.py VERSION: a cached profile of another version is measured again
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


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure every node for the job's pipeline (parallel.partition auto)",
                       description="Time the job's layer kinds, memory and links on every node, in the job's image "
                                   "under the node's limits; cached per node, image and model shape. Extra trainer "
                                   "args go after `--`.")
    add_inventory_args(p)
    p.add_argument("--job", help="YAML file with a job section, overriding the inventory's")
    p.add_argument("--json", action="store_true", help="print the profile and the auto split as JSON")
    p.add_argument("--refresh", action="store_true", help="measure again, ignoring the cache")
    p.add_argument("--no-push", action="store_true", help="do not push images (fail if a node lacks one)")
    p.add_argument("--min-seconds", type=float, default=2.0, help="timed seconds per layer kind (default 2.0)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds the probes may take (default 900)")
    p.add_argument("trainer_args", nargs="*", help="extra trainer arguments (after --)")
    p.set_defaults(func=main)


def main(args) -> int:
    from runner.profile_auto import plan_from_profile, render_plan

    inv = load(args)
    if args.trainer_args:
        inv.job.args = list(inv.job.args) + list(args.trainer_args)
    refuse_custom_command(inv)  # before any connection
    with Cluster(inv, args.accept_new_host_keys, workers=args.parallel) as cl:
        probes = cl.each(lambda r: probe(r, inv.master.rank_addr, clock=False))
        if not args.no_push:
            from runner.push import push_to_nodes

            push_to_nodes(cl, {n: p.arch for n, p in probes.items()}, quiet=args.json)
        prof = profile_cluster(cl, probes, refresh=args.refresh, min_seconds=args.min_seconds, timeout=args.timeout)
    split, uniform, problem = plan_from_profile(prof, inv)
    if args.json:
        doc = prof.as_dict()
        doc["split"] = None if split is None else {"spec": split.spec, "bounds": split.bounds,
                                                   "bottleneck_s": split.bottleneck_s,
                                                   "step_s": split.step_s(problem.microbatches)}
        doc["uniform"] = None if uniform is None else {"spec": uniform.spec, "bottleneck_s": uniform.bottleneck_s,
                                                       "step_s": uniform.step_s(problem.microbatches)}
        print(json.dumps(doc, indent=1))
        return 0
    print_table(prof, inv)
    if split is not None:
        print(render_plan(split, uniform, problem))
    return 0


# ------------------------------------------------------------------ measuring


def profile_cluster(cl: Cluster, probes: dict[str, Probe], refresh: bool = False, min_seconds: float = 2.0,
                    timeout: float = 900.0) -> ClusterProfile:
    """Every node's compute profile and every link between rank neighbours, from the cache where
    it has them, else measured now (only the nodes and links that are missing)."""
    from runner.images import node_image_id

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
    links: list[dict | None] = []
    for a, b in zip(order, order[1:], strict=False):
        links.append(None if refresh else profile_cache.load("link", f"{a.name}-{b.name}",
                                                             profile_cache.link_key(keys[a.name], keys[b.name])))
    cached = {n.name: nodes[n.name] is not None for n in order}
    need_compute = {n.name for n in order if nodes[n.name] is None}
    need_link = {i for i, lk in enumerate(links) if lk is None}
    if need_compute or need_link:
        docs = run_probes(cl, order, probes, tags, need_compute, need_link, min_seconds, timeout)
        for i, n in enumerate(order):
            doc = docs.get(n.name) or {}
            if n.name in need_compute:
                # host: runner/sizing.py finds this node's measured memory by name and address
                nodes[n.name] = {**{k: v for k, v in doc.items() if k != "link"}, "host": n.host}
                profile_cache.save("node", n.name, keys[n.name], nodes[n.name])
            if i in need_link:
                links[i] = doc["link"]
                b = order[i + 1].name
                profile_cache.save("link", f"{n.name}-{b}", profile_cache.link_key(keys[n.name], keys[b]), links[i])
    out = []
    for n in order:
        doc = dict(nodes[n.name])
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
               need_compute: set[str], need_link: set[int], min_seconds: float, timeout: float) -> dict[str, dict]:
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
        return cmd + ["--"] + (["--config", f"{OUT}/config.yaml"] if config is not None else []) + list(inv.job.args)

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
            volumes={dirs[n.name]: {"bind": OUT, "mode": "rw"}}, **docker_limits(n.cpus, n.memory), **run_as)
        c.start()
        return c

    containers: dict[str, object] = {}
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
            docs[n.name] = json.loads(text)
        return docs
    finally:
        def tidy(name: str) -> None:
            c = containers.get(name)
            if c is not None:
                c.remove(force=True)
            cl[name].run(["rm", "-rf", dirs[name]])

        cl.map(list(dirs), tidy)


def _wait(containers: dict[str, object], timeout: float) -> tuple[str, int | None] | None:
    """Until every probe exited 0 (None), one exited non-zero, or the time is up: (node, code)."""
    deadline = time.time() + timeout
    pending = dict(containers)
    while pending:
        for name, c in list(pending.items()):
            c.reload()
            if c.status in ("exited", "dead"):
                code = c.attrs["State"].get("ExitCode")
                if code != 0:
                    return name, code
                del pending[name]
        if time.time() > deadline:
            return next(iter(pending)), None
        time.sleep(0.5)
    return None


# ------------------------------------------------------------------ display


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:.2f} GiB"


def print_table(prof: ClusterProfile, inv: Inventory) -> None:
    m = prof.model
    t = Table("node", "limits", "embed ms", "layer ms", "head ms", "optim ms (layer)", "memory avail.", "link to next",
              "source", title=f"{m['family']} {m['num_layers']} layers, hidden {m['hidden_size']}, microbatch "
                              f"{m['microbatch']} x {m['seq_len']} ({m['dtype']}); forward + backward per microbatch")
    for i, n in enumerate(prof.nodes):
        lk = prof.links[i] if i < len(prof.links) else None
        link = "-" if lk is None else f"{lk['latency_s'] * 1e6:.0f} us, {lk['bandwidth_Bps'] / 1e6:.0f} MB/s"
        limits = " ".join(x for x in (f"cpus {n['cpus_limit']:g}" if n.get("cpus_limit") else "",
                                      f"mem {n['memory_limit']}" if n.get("memory_limit") else "") if x) or "none"
        ts = n["time_s"]
        t.add_row(n["node"], limits, _ms(ts["embed"]), _ms(ts["block"]), _ms(ts["head"]), _ms(n["optim_s"]["block"]),
                  _gib(n["memory_available"]), link, "cached" if prof.cached.get(n["node"]) else "measured")
    # Piped (a log, a test): wide enough that no cell wraps.
    Console(width=None if sys.stdout.isatty() else 160).print(t)
