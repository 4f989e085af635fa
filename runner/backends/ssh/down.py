"""`runner down [RUN]`: SIGTERM, a grace period for the trainer's preempt checkpoint, then stop and
remove the run's containers on every node. Found by label, so it works from any shell and is
idempotent (a second call finds nothing and says so).

`--keep-runs N` then removes old run dirs on every node (a Pi's SD card fills up with
checkpoints): all but the N newest runner-made runs, never one that still has a container on the
node, never a hand-named dir. Files an earlier runner's root containers left there are removed
through the node's engine (runner/backends/ssh/run_owner.py) when the SSH user cannot."""

from __future__ import annotations

import argparse
import logging
import sys

from runner.backends.ssh.node_runs import latest_run, prune_runs, stop_run
from runner.core import runs
from runner.core.errors import EXIT_PARTIAL
from runner.core.redact import printable
from runner.inventory.choice import add_inventory_args
from runner.transport.cluster import Cluster, open_nodes

log = logging.getLogger("runner.down")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("down", help="stop a run on every node (SIGTERM, grace period, remove); idempotent")
    add_inventory_args(p)
    p.add_argument("run", nargs="?", help="run id (default: the latest run found on the nodes)")
    p.add_argument("--grace", type=float, default=None,
                   help="seconds between SIGTERM and SIGKILL (default: the run's job.grace_period)")
    p.add_argument("--keep-runs", type=_count, default=None, metavar="N",
                   help="then remove every node's run dirs but the N newest (runner-made ids only; never a run "
                        "with a container left; 0 removes the stopped run's too)")
    p.set_defaults(func=main)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a number of runs (0 or more), got {text!r}")
    return int(text)


def prune_all(cl: Cluster, keep: int) -> list[str]:
    """prune_runs on every reachable node: one line per node; the errors ("node: reason")."""
    errors = []
    for r, gone, err in cl.map(list(cl.remotes.values()), lambda r: prune_runs(r, keep)):
        if err is not None:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            errors.append(first if first.startswith(f"node {r.node.name}") else f"node {r.node.name}: {first}")
        elif gone:
            print(f"{r.node.name}: removed {len(gone)} run dir(s): {', '.join(gone)}")
        else:
            print(f"{r.node.name}: no run dirs to remove (keeping the {keep} newest)")
    return errors


def main(args) -> int:
    with open_nodes(args) as cl:
        inv = cl.inv
        if args.run and not runs.is_run_name(args.run):
            runs.resolve([], args.run)  # the one-line error for a name that is no run id
        run_id = args.run or latest_run(cl.remotes, cl.workers)
        if not run_id:
            print("nothing to stop: no runner containers on any " + ("reachable " if cl.unreachable else "") + "node")
            errors = []
        else:
            stopped, errors = stop_run(cl.remotes, run_id, args.grace, workers=cl.workers)
            print(f"run {run_id}: " + (f"stopped and removed on {', '.join(stopped)}" if stopped
                                       else "nothing running (already down)")
                  + (f"; NOT reached: {', '.join(cl.unreachable)}" if cl.unreachable else ""))
            for e in errors:
                sys.stderr.write(f"runner: error: run {run_id}: could not stop on {printable(e)}\n")
        if args.keep_runs is not None and not errors:
            for e in prune_all(cl, args.keep_runs):
                errors.append(e)
                sys.stderr.write(f"runner: error: removing old runs: {printable(str(e))}\n")
        code = _unreachable(cl, run_id, inv.path)
        return code or (EXIT_PARTIAL if errors else 0)


def _unreachable(cl: Cluster, run_id: str | None, inv_path: str) -> int:
    """One line per node `down` could not reach; non-zero so a script knows to run it again."""
    again = f"runner down {run_id} -i {inv_path}" if run_id else f"runner down -i {inv_path}"
    for msg in cl.unreachable.values():
        sys.stderr.write(f"runner: error: {printable(msg)}; its containers were not stopped: `{again}` once it is reachable\n")
    return EXIT_PARTIAL if cl.unreachable else 0
