"""`runner check`: every node in parallel (SSH + verified host key, docker engine, arch, CPUs,
memory, free disk, GPUs, clock offset, route to the master, master port, image), one table, and a
non-zero exit naming every node that fails."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field

from rich.console import Console
from rich.table import Table

from runner.errors import UserError
from runner.images import node_image_id
from runner.inventory import Inventory, Node
from runner.session import Probe, add_inventory_args, load, parallel, probe
from runner.ssh import Remote

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
    image_present: bool | None = None
    master_port: str = "-"
    problems: list[str] = field(default_factory=list)


def check_node(inv: Inventory, node: Node, accept_new: bool, port: int | None) -> NodeCheck:
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
        p = probe(remote, inv.master.host)
        nc.probe = p
        if p.docker_error:
            nc.problems.append(f"docker engine: {p.docker_error}")
        if not p.ifname:
            nc.problems.append(f"no route to master {inv.master.host}")
        if node.arch and p.arch and node.arch != p.arch:
            nc.problems.append(f"inventory says {node.arch}, node is {p.arch}")
        if p.clock_offset_s is not None and abs(p.clock_offset_s) > CLOCK_TOLERANCE_S:
            nc.problems.append(f"clock off by {p.clock_offset_s:+.1f}s (timelines across nodes will not line up)")
        if p.disk_free_gb is not None and p.disk_free_gb < MIN_DISK_GB:
            nc.problems.append(f"only {p.disk_free_gb} GB free in workdir")
        if node.gpus and not p.gpus:
            nc.problems.append("inventory asks for GPUs, nvidia-smi sees none")
        if node.is_master:
            if port is None:
                nc.master_port = "auto"
            elif port in (p.listening or set()):
                nc.master_port = f"{port} IN USE"
                nc.problems.append(f"master port {port} is in use")
            else:
                nc.master_port = f"{port} free"
        nc.image = inv.job.image_for(node.arch or p.arch)
        if nc.image and not p.docker_error:
            nc.image_present = node_image_id(remote, nc.image) is not None
    return nc


def run_checks(inv: Inventory, accept_new: bool) -> list[NodeCheck]:
    port = inv.job.master_port if isinstance(inv.job.master_port, int) else None
    res = parallel(inv.ordered(), lambda n: check_node(inv, n, accept_new, port))
    out = []
    for n, val, err in res:
        if err is not None:
            val = NodeCheck(n.name, f"{n.host}:{n.port}", ssh="?", problems=[str(err)])
        out.append(val)
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="preflight every node in parallel and print a table")
    add_inventory_args(p)
    p.add_argument("--job", help="YAML file with a job section, overriding the inventory's")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def main(args) -> int:
    inv = load(args)
    checks = run_checks(inv, args.accept_new_host_keys)
    if args.json:
        print(json.dumps([{**asdict(c), "probe": {**asdict(c.probe), "listening": None} if c.probe else None}
                          for c in checks], indent=2))
    else:
        t = Table(title=f"check {inv.path}")
        for col in ("node", "ssh", "host key", "docker", "arch", "cpus", "mem GB", "disk GB", "gpus",
                    "clock", "ifname", "master port", "image"):
            t.add_column(col, overflow="fold")
        for c in checks:
            p = c.probe or Probe()
            t.add_row(c.node, c.ssh, c.host_key, p.docker or ("FAIL" if c.probe else "-"), p.arch or "-",
                      str(p.cpus or "-"), str(p.mem_gb or "-"), str(p.disk_free_gb if p.disk_free_gb is not None else "-"),
                      str(p.gpus), f"{p.clock_offset_s:+.2f}s" if p.clock_offset_s is not None else "-",
                      p.ifname or "-", c.master_port,
                      "-" if c.image_present is None else (f"{c.image} present" if c.image_present else f"{c.image} missing"))
        Console(width=200).print(t)
    failing = [c for c in checks if c.problems]
    if failing:
        raise UserError("check failed on " + "; ".join(f"{c.node}: {', '.join(c.problems)}" for c in failing),
                        exit_code=1)
    if not args.json:
        print(f"all {len(checks)} node(s) ok")
    return 0
