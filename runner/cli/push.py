"""`runner push`: every node gets its image (runner.api's push: only the layers it lacks), one row
per node."""

from __future__ import annotations

import argparse

from runner.cli.common import add_inventory_args, open_backend


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
    for r in open_backend(args).push(full=args.full, build=args.build, direct=args.direct):
        print(f"{r.node:12s} {r.tag:28s} {r.action:8s} layers {r.layers_sent}/{r.layers_total}  "
              f"{r.bytes_sent / 1e6:9.1f} MB of {r.image_bytes / 1e6:.1f} MB  {r.seconds:.1f}s  id {r.image_id[7:19]}"
              + (f"  from {r.source}" if r.source else ""))
    return 0
