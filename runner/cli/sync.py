"""`runner sync`: job.sync's files to every node (runner.api's sync), one row per node and source."""

from __future__ import annotations

import argparse

from runner.cli.common import add_inventory_args, open_backend


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sync", help="copy job.sync's files to every node (only what a node lacks)")
    add_inventory_args(p)
    p.add_argument("--job", help="YAML file with a job section, overriding the inventory's")
    p.set_defaults(func=main)


def main(args) -> int:
    results = open_backend(args).sync()
    if not results:
        print("job.sync is empty: nothing to copy")
        return 0
    for s in results:
        print(f"{s.node:12s} {s.dst:28s} {'present' if s.reused else 'updated':8s} files {s.files_sent}/{s.files_total}  "
              f"{s.bytes_sent / 1e6:9.1f} MB of {s.bytes_total / 1e6:.1f} MB  {s.seconds:.1f}s")
    return 0
