"""`runner check`: runner.api's check of the inventory's backend (SSH: every node in parallel, one
table; Slurm: the login node, Slurm's client tools and the partition), and a non-zero exit (1)
naming every problem."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from runner.cli.common import add_inventory_args, console, open_backend


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="preflight every node in parallel and print a table")
    add_inventory_args(p)
    p.add_argument("--job", help="YAML file with a job section, overriding the inventory's")
    p.add_argument("--json", action="store_true", help="print each node's checks as JSON")
    p.add_argument("--links", action="store_true",
                   help="then measure bandwidth and latency between every two nodes (cached for job.dp_sync auto)")
    p.set_defaults(func=main)


def _image_cell(c) -> str:
    from contract.memory import size_text

    if c.image_state is None:
        return "-"
    if c.image_state == "stale":
        cell = f"{c.image} stale (node {c.image_id[7:19]}, host {c.host_image_id[7:19]})"
    else:
        cell = f"{c.image} {c.image_state}"
    if c.image_lacking is not None:  # what push would load, beside the room the engine has
        free = f", engine {size_text(c.engine_free)} free" if c.engine_free is not None else ""
        cell += f"; lacks {size_text(c.image_lacking)}{free}"
    return cell


def main(args) -> int:
    from runner.core.errors import NotReady

    rep = open_backend(args).check()
    if args.json:
        if rep.backend == "ssh":
            print(json.dumps([{**asdict(c), "probe": {**asdict(c.probe), "listening": None} if c.probe else None}
                              for c in rep.items], indent=2))
        else:
            print(json.dumps([asdict(c) for c in rep.items], indent=2))
    elif rep.backend == "ssh":
        _node_table(rep)
    else:
        _slurm_lines(rep)
    if not rep.ok:
        on = " on " if rep.backend == "ssh" else ": "
        raise NotReady(f"check failed{on}" + "; ".join(rep.problems))
    if not args.json:
        print(f"all {len(rep.items)} node(s) ok" if rep.backend == "ssh" else
              f"ready: partition {rep.items[0].partition} has the {rep.items[0].nodes_wanted} node(s) the job asks for")
    if getattr(args, "links", False):
        _links(args)
    return 0


def _links(args) -> None:
    """`--links`: runner/profile/links.py's matrix and its warnings (SSH inventories)."""
    from runner.core.errors import UserError
    from runner.planning.links import render
    from runner.profile.links import check_links

    backend = open_backend(args)
    if not hasattr(backend, "cluster"):
        raise UserError("check --links: measures between SSH nodes; a Slurm job's links are the cluster's")
    matrix, lines = check_links(backend)
    print(render(matrix))
    print("\n".join(lines))


def _node_table(rep) -> None:
    from rich.table import Table

    from runner.core.node_output import cells
    from runner.transport.probe import Probe

    t = Table(title=f"check {rep.inventory}")
    for col in ("node", "ssh", "host key", "docker", "arch", "cpus", "mem GB", "disk GB", "gpus",
                "clock", "ifname", "master port", "image"):
        t.add_column(col, overflow="fold")
    for c in rep.items:
        p = c.probe or Probe()
        # What the node answered, as text (runner/core/node_output.py): no markup, controls visible.
        t.add_row(*cells(c.node, c.ssh, c.host_key, p.docker or ("FAIL" if c.probe else "-"), p.arch or "-",
                         p.cpus or "-", p.mem_gb or "-", p.disk_free_gb if p.disk_free_gb is not None else "-",
                         p.gpus, f"{p.clock_offset_s:+.2f}s" if p.clock_offset_s is not None else "-",
                         p.ifname or "-", " ".join(filter(None, (c.master_port, c.master_port_detail))),
                         _image_cell(c)))
    console(width=200).print(t)


def _slurm_lines(rep) -> None:
    from runner.core.node_output import visible

    c = rep.items[0]
    print(f"check {rep.inventory} (Slurm, from {c.where})")
    if c.login != "-":
        print(f"  login      {c.login}")
    if c.login != "FAIL":
        print("  tools      " + (f"missing: {', '.join(c.tools_missing)}" if c.tools_missing else
                                 "sbatch, squeue, scancel, scontrol, sinfo found"))
    if c.partition:
        print(visible(f"  partition  {c.partition}: {c.partition_nodes} node(s), {c.partition_state} "
                      f"(the job asks for {c.nodes_wanted})"))
