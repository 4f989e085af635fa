"""`runner push`: every node gets its image (runner/delivery/push.py), one table row per node."""

from __future__ import annotations

import argparse

from runner.delivery.push import push_to_nodes
from runner.inventory.choice import add_inventory_args, load
from runner.transport.cluster import Cluster
from runner.transport.probe import probe


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("push", help="bring every node its image, moving only missing layers "
                       "(with job.registry: the nodes pull it)")
    add_inventory_args(p)
    p.add_argument("--job", help="YAML file with a job section, overriding the inventory's")
    p.add_argument("--full", action="store_true", help="always stream the whole image (compressed save|load)")
    p.add_argument("--build", action="store_true", help="build every image job.build describes, even if present")
    p.add_argument("--direct", action="store_true", help="one stream from this host to each node, no relay "
                   "(job.push: direct)")
    p.set_defaults(func=main)


def main(args) -> int:
    inv = load(args)
    with Cluster(inv, args.accept_new_host_keys, workers=args.parallel) as cl:
        arches: dict[str, str | None] = {}
        if any(n.arch is None for n in inv.nodes):
            arches = {k: p.arch for k, p in cl.each(lambda r: probe(r, inv.master.rank_addr)).items()}
        results = push_to_nodes(cl, arches, force_full=args.full, build=args.build,
                                 relay=False if args.direct else None)
    for r in results:
        print(f"{r.node:12s} {r.tag:28s} {r.action:8s} layers {r.layers_sent}/{r.layers_total}  "
              f"{r.bytes_sent / 1e6:9.1f} MB of {r.image_bytes / 1e6:.1f} MB  {r.seconds:.1f}s  id {r.image_id[7:19]}"
              + (f"  from {r.source}" if r.source else ""))
    return 0
