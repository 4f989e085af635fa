"""`runner check`: every node in parallel (runner/backends/ssh/check.py), one table, and a non-zero exit
naming every node that fails."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from contract.memory import size_text
from runner.backends.ssh.check import NodeCheck, run_checks
from runner.core.errors import EXIT_NOT_READY, UserError
from runner.core.node_output import cells
from runner.inventory.choice import add_inventory_args, load
from runner.transport.probe import Probe


def _image_cell(c: NodeCheck) -> str:
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


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="preflight every node in parallel and print a table")
    add_inventory_args(p)
    p.add_argument("--job", help="YAML file with a job section, overriding the inventory's")
    p.add_argument("--json", action="store_true", help="print each node's checks as JSON")
    p.set_defaults(func=main)


def main(args) -> int:
    inv = load(args)
    checks = run_checks(inv, args.accept_new_host_keys, args.parallel)
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
            # What the node answered, as text (runner/core/node_output.py): no markup, controls visible.
            t.add_row(*cells(c.node, c.ssh, c.host_key, p.docker or ("FAIL" if c.probe else "-"), p.arch or "-",
                             p.cpus or "-", p.mem_gb or "-", p.disk_free_gb if p.disk_free_gb is not None else "-",
                             p.gpus, f"{p.clock_offset_s:+.2f}s" if p.clock_offset_s is not None else "-",
                             p.ifname or "-", " ".join(filter(None, (c.master_port, c.master_port_detail))),
                             _image_cell(c)))
        Console(width=200).print(t)
    failing = [c for c in checks if c.problems]
    if failing:
        raise UserError("check failed on " + "; ".join(f"{c.node}: {', '.join(c.problems)}" for c in failing),
                        exit_code=EXIT_NOT_READY)
    if not args.json:
        print(f"all {len(checks)} node(s) ok")
    return 0
