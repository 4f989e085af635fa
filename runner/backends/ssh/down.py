"""cancel (`runner down [RUN]`): SIGTERM, a grace period for the trainer's preempt checkpoint, then stop and
remove the run's containers on every node. Found by label, so it works from any shell and is
idempotent (a second call finds nothing and says so).

`--keep-runs N` then removes old run dirs on every node (a Pi's SD card fills up with
checkpoints): all but the N newest runner-made runs, never one that still has a container on the
node, never a hand-named dir. Files an earlier runner's root containers left there are removed
through the node's engine (runner/backends/ssh/run_owner.py) when the SSH user cannot."""

from __future__ import annotations

import logging

from runner.backends.results import CancelReport
from runner.backends.ssh.node_runs import latest_run, prune_runs, stop_run
from runner.core import runs
from runner.core.errors import EXIT_PARTIAL
from runner.transport.cluster import Cluster

log = logging.getLogger("runner.down")


def prune_all(cl: Cluster, keep: int, said: list[str]) -> list[str]:
    """prune_runs on every reachable node: one line per node (into said); the errors ("node: reason")."""
    errors = []
    for r, gone, err in cl.map(list(cl.remotes.values()), lambda r: prune_runs(r, keep)):
        if err is not None:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            errors.append(first if first.startswith(f"node {r.node.name}") else f"node {r.node.name}: {first}")
        elif gone:
            said.append(f"{r.node.name}: removed {len(gone)} run dir(s): {', '.join(gone)}")
        else:
            said.append(f"{r.node.name}: no run dirs to remove (keeping the {keep} newest)")
    return errors


def cancel(backend, run: str | None, grace: float | None, keep_runs: int | None) -> CancelReport:
    """Stop the run (run id, or the latest with a container) on every node that answers; then, with
    keep_runs, prune old run dirs. A node not reached is an error line each (exit 3: run it again)."""
    rep = CancelReport(run_id=None)
    with backend.cluster() as cl:
        inv = cl.inv
        if run and not runs.is_run_name(run):
            runs.resolve([], run)  # the one-line error for a name that is no run id
        run_id = rep.run_id = run or latest_run(cl.remotes, cl.workers)
        if not run_id:
            rep.lines.append("nothing to stop: no runner containers on any " + ("reachable " if cl.unreachable else "")
                             + "node")
            errors: list[str] = []
        else:
            stopped, errors = stop_run(cl.remotes, run_id, grace, workers=cl.workers)
            rep.stopped = stopped
            rep.lines.append(f"run {run_id}: " + (f"stopped and removed on {', '.join(stopped)}" if stopped
                                                  else "nothing running (already down)")
                             + (f"; NOT reached: {', '.join(cl.unreachable)}" if cl.unreachable else ""))
            rep.errors += [f"run {run_id}: could not stop on {e}" for e in errors]
        if keep_runs is not None and not errors:
            for e in prune_all(cl, keep_runs, rep.lines):
                errors.append(e)
                rep.errors.append(f"removing old runs: {e}")
        again = f"runner down {run_id} -i {inv.path}" if run_id else f"runner down -i {inv.path}"
        # One line per node not reached; non-zero so a script knows to run it again.
        rep.errors += [f"{msg}; its containers were not stopped: `{again}` once it is reachable"
                       for msg in cl.unreachable.values()]
        rep.exit_code = EXIT_PARTIAL if rep.errors else 0
    return rep
