"""What `runner check` asks of every node, in parallel: SSH + verified host key, docker engine,
arch, CPUs, memory, free disk, GPUs, clock offset, route to the master, master port, image, and
for a node that lacks the image, whether its engine's data root has room for what push would
load there (runner/delivery/layer_sizes.py); each node's answers and problems as a NodeCheck (the
table and the exit are runner/cli/check.py's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runner.core.errors import UserError
from runner.core.fanout import DEFAULT_PARALLEL, parallel
from runner.delivery.images import node_image_id, on_host_engine
from runner.delivery.layer_sizes import HostLayers, engine_room_for, host_layers
from runner.inventory import Inventory, Node
from runner.transport.probe import Probe, probe
from runner.transport.rendezvous import AUTO_PORT_BASE, AUTO_PORT_OFFSETS, AUTO_PORT_SPAN
from runner.transport.ssh import Remote

CLOCK_TOLERANCE_S = 2.0
MIN_DISK_GB = 5.0


@dataclass
class NodeCheck:
    node: str
    host: str
    ssh: str = "-"
    host_key: str = "-"
    probe: Probe | None = None
    image: str | None = None
    image_present: bool | None = None   # the node has the tag (and, when comparable, the host's id)
    image_state: str | None = None      # present | stale | absent | unverified (host lacks the tag)
    image_id: str | None = None         # on the node
    host_image_id: str | None = None    # on this host's engine, what push would bring
    master_port: str = "-"               # "<port> free", "<port> IN USE" or "auto"
    master_port_detail: str | None = None  # auto: where `up` will look and what is taken there
    engine_free: int | None = None       # bytes free in the node engine's data root (measured when push has work)
    image_lacking: int | None = None     # bytes of the host image's layers the node lacks (push's estimate)
    problems: list[str] = field(default_factory=list)


def check_node(inv: Inventory, node: Node, accept_new: bool, port: int | None,
               host: dict[str, HostLayers | None] | None = None) -> NodeCheck:
    nc = NodeCheck(node.name, f"{node.host}:{node.port}")
    try:
        remote = Remote(node, accept_new).connect()
    except UserError as exc:
        msg = str(exc).split(": ", 1)[-1]
        nc.ssh = "FAIL"
        nc.host_key = "REFUSED" if "host key" in msg.lower() else "-"
        nc.problems.append(msg)
        return nc
    with remote:
        nc.ssh = "ok"
        nc.host_key = ("pinned " if node.host_key else "known_hosts ") + (remote.host_key_fp or "")[:20] + "…"
        p = probe(remote, inv.master.rank_addr)
        nc.probe = p
        _node_problems(nc, node, p, inv.master.rank_addr)
        if node.is_master:
            _master_port(nc, port, p.listening or set())
        nc.image = inv.job.image_for(node.arch or p.arch)
        if nc.image and not p.docker_error:
            nc.image_id = node_image_id(remote, nc.image)
            hl = (host or {}).get(nc.image)
            nc.host_image_id = hl.image_id if hl else None
            nc.image_state = image_state(nc.image_id, nc.host_image_id)
            nc.image_present = nc.image_state in ("present", "unverified")
            if hl is not None and nc.image_state in ("absent", "stale"):
                _push_room(nc, remote, hl, pull=bool(inv.job.registry))
    return nc


def _push_room(nc: NodeCheck, remote: Remote, hl: HostLayers, pull: bool) -> None:
    """What push (or the registry pull, `pull`) would load into the node's engine, against its data
    root's room: the rule push and the pull apply before a byte moves, with the layers' sizes
    estimated (layer_sizes.py). A node whose images cannot be listed is left to push to report."""
    then = ("the pull would stop there before docker pull runs" if pull else "push would stop there before sending")
    try:
        _, nc.image_lacking, room, short = engine_room_for(
            remote, hl, nc.image, how="docker pull" if pull else "docker load",
            then=f"{then}: free space there (docker image prune, docker system df)")
    except UserError:
        return
    nc.engine_free = room[0] if room else None
    if short:
        nc.problems.append(short)


def _node_problems(nc: NodeCheck, node: Node, p: Probe, master_host: str) -> None:
    if p.docker_error:
        nc.problems.append(f"docker engine: {p.docker_error}")
    if not p.ifname:
        nc.problems.append(f"no route to master {master_host}")
    if node.arch and p.arch and node.arch != p.arch:
        nc.problems.append(f"inventory says {node.arch}, node is {p.arch}")
    if p.clock_offset_s is not None and abs(p.clock_offset_s) > CLOCK_TOLERANCE_S:
        nc.problems.append(f"clock off by {p.clock_offset_s:+.1f}s (timelines across nodes will not line up)")
    if p.disk_free_gb is not None and p.disk_free_gb < MIN_DISK_GB:
        nc.problems.append(f"only {p.disk_free_gb} GB free in workdir")
    if node.gpus and not p.gpus:
        nc.problems.append("inventory asks for GPUs, nvidia-smi sees none")
    elif node.gpus and p.gpu_runtime is False:
        nc.problems.append("inventory asks for GPUs, docker cannot give them to a container: install the NVIDIA "
                           "Container Toolkit (nvidia-ctk runtime configure --runtime=docker, then restart docker)")


def _master_port(nc: NodeCheck, port: int | None, listening: set[int]) -> None:
    if port is not None:
        nc.master_port = f"{port} IN USE" if port in listening else f"{port} free"
        if port in listening:
            nc.problems.append(f"master port {port} is in use")
        return
    # The exact port exists only once the run id does: show where `up` will start looking.
    nc.master_port = "auto"
    lo, hi = AUTO_PORT_BASE, AUTO_PORT_BASE + AUTO_PORT_OFFSETS - 1
    if any(all(q in listening for q in range(s, s + AUTO_PORT_SPAN)) for s in range(lo, hi + 1)):
        nc.problems.append(f"master_port auto: no free port near {lo}-{hi + AUTO_PORT_SPAN}; set job.master_port")
    busy = sorted(q for q in listening if lo <= q <= hi)
    nc.master_port_detail = f"{lo}-{hi}: " + ("all free" if not busy else f"{len(busy)} in use ({_ports(busy)}), up skips them")


def _ports(ports: list[int]) -> str:
    return ",".join(map(str, ports[:4])) + (f",+{len(ports) - 4}" if len(ports) > 4 else "")


def image_state(node_id: str | None, host_id: str | None) -> str:
    """present: same id as this host's image (push skips it); stale: the tag is there but another
    image (push replaces it); absent; unverified: node has it, this host has no such image."""
    if node_id is None:
        return "absent"
    if host_id is None:
        return "unverified"
    return "present" if node_id == host_id else "stale"


def run_checks(inv: Inventory, accept_new: bool, workers: int = DEFAULT_PARALLEL) -> list[NodeCheck]:
    port = inv.job.master_port if isinstance(inv.job.master_port, int) else None
    tags = {inv.job.image_for(n.arch or a) for n in inv.nodes for a in ("amd64", "arm64")} - {None}
    host = on_host_engine(sorted(tags), host_layers)
    res = parallel(inv.ordered(), lambda n: check_node(inv, n, accept_new, port, host), workers)
    out = []
    for n, val, err in res:
        if err is not None:
            val = NodeCheck(n.name, f"{n.host}:{n.port}", ssh="?", problems=[str(err)])
        out.append(val)
    return out
