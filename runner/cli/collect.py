"""`runner collect [RUN]`: the parser, and runner.api's collect said per node, then the run's summary;
files that did not arrive are one error line (exit 3: collect again)."""

from __future__ import annotations

import argparse

from runner.cli.common import add_inventory_args, open_backend


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("collect", help="mirror every node's run dir to artifacts/<run>/<node>/ (incremental, verified)")
    add_inventory_args(p)
    p.add_argument("run", nargs="?", help="run id or prefix (default: latest)")
    p.add_argument("--dest", default="artifacts", help="local root (default artifacts/)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--no-plots", action="store_true", help="do not merge timelines or render plots")
    p.set_defaults(func=main)


def main(args) -> int:
    from runner.core.errors import Partial
    from runner.delivery.collect_files import collect_error, node_line

    rep = open_backend(args, with_job=False).collect(args.run, args.dest, plots=not args.no_plots, quiet=args.quiet)
    for node in rep.nodes:
        print(node_line(node))
    for line in rep.summary:
        print(line)
    if rep.errors:
        raise Partial(collect_error(rep.run_id, rep.errors))
    return 0
