"""`runner sync`: job.sync's files to every node (runner/delivery/sync.py), one table row per node and source."""

from __future__ import annotations

import argparse

from runner.delivery.sync import scan, sync_to_nodes
from runner.inventory.choice import add_inventory_args, load
from runner.transport.cluster import Cluster


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sync", help="copy job.sync's files to every node (only what a node lacks)")
    add_inventory_args(p)
    p.add_argument("--job", help="YAML file with a job section, overriding the inventory's")
    p.set_defaults(func=main)


def main(args) -> int:
    inv = load(args)
    if not inv.job.sync:
        print("job.sync is empty: nothing to copy")
        return 0
    trees = scan(inv.job.sync)
    with Cluster(inv, args.accept_new_host_keys, workers=args.parallel) as cl:
        homes = cl.each(lambda r: r.home)
        results = sync_to_nodes(cl, homes, trees)
    for s in results:
        print(f"{s.node:12s} {s.dst:28s} {'present' if s.reused else 'updated':8s} files {s.files_sent}/{s.files_total}  "
              f"{s.bytes_sent / 1e6:9.1f} MB of {s.bytes_total / 1e6:.1f} MB  {s.seconds:.1f}s")
    return 0
