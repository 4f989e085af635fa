"""`runner down [RUN]`: the parser, and runner.api's cancel said in lines (stdout) and errors
(stderr, one line each; exit 3 when a node or the job was not reached: run it again)."""

from __future__ import annotations

import argparse
import sys

from runner.cli.common import add_inventory_args, open_backend


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a number of runs (0 or more), got {text!r}")
    return int(text)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("down", help="stop a run on every node (SIGTERM, grace period, remove); idempotent")
    add_inventory_args(p)
    p.add_argument("run", nargs="?", help="run id (default: the latest run found on the nodes)")
    p.add_argument("--grace", type=float, default=None,
                   help="seconds between SIGTERM and SIGKILL (default: the run's job.grace_period)")
    p.add_argument("--keep-runs", type=_count, default=None, metavar="N",
                   help="(ssh) then remove every node's run dirs but the N newest (runner-made ids only; never a run "
                        "with a container left; 0 removes the stopped run's too)")
    p.set_defaults(func=main)


def main(args) -> int:
    from runner.core.redact import printable

    rep = open_backend(args, with_job=False).cancel(args.run, args.grace, keep_runs=args.keep_runs)
    for line in rep.lines:
        print(line)
    for e in rep.errors:
        sys.stderr.write(f"runner: error: {printable(e)}\n")
    return rep.exit_code
