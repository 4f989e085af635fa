"""`runner down [RUN]`: SIGTERM, a grace period for the trainer's preempt checkpoint, then stop and
remove the run's containers on every node. Found by label, so it works from any shell and is
idempotent (a second call finds nothing and says so).

`--keep-runs N` then removes old run dirs on every node (a Pi's SD card fills up with
checkpoints): all but the N newest runner-made runs, never one that still has a container on the
node, never a hand-named dir. Files an earlier runner's root containers left there are removed
through the node's engine (runner/run_owner.py) when the SSH user cannot."""

from __future__ import annotations

import argparse
import logging
import sys

from runner import runs
from runner.errors import EXIT_PARTIAL
from runner.fanout import DEFAULT_PARALLEL, parallel
from runner.paths import node_paths
from runner.plan import LABEL_GRACE, LABEL_NODE, LABEL_RUN
from runner.redact import printable
from runner.session import Cluster, add_inventory_args, load
from runner.ssh import Remote

log = logging.getLogger("runner.down")


def run_containers(remote: Remote, run_id: str | None, all_: bool = True) -> list:
    """This node's containers of the run (of any run with run_id None). By node label too: an
    engine may serve more than one inventory node (light sandbox nodes share one)."""
    flt = {"label": [f"{LABEL_RUN}={run_id}" if run_id else LABEL_RUN, f"{LABEL_NODE}={remote.node.name}"]}
    return remote.docker().containers.list(all=all_, filters=flt)


def stop_node(remote: Remote, run_id: str, grace: float | None, remove: bool = True) -> list[str]:
    """Stop (SIGTERM, then SIGKILL after grace) and remove this node's containers of the run."""
    gone = []
    containers = run_containers(remote, run_id)
    for c in containers:
        g = grace if grace is not None else float(c.labels.get(LABEL_GRACE, "30"))
        try:
            if c.status in ("running", "restarting", "paused"):
                # docker stop = SIGTERM, wait g seconds, SIGKILL: the trainer checkpoints on SIGTERM.
                c.stop(timeout=max(0, int(round(g))))
            if remove:
                c.remove(force=True)
            gone.append(c.labels.get(LABEL_NODE, c.name))
        except Exception as exc:  # noqa: BLE001 - already gone is fine (idempotent)
            if "No such container" not in str(exc) and "404" not in str(exc):
                raise
    if remove:
        remove_secrets(remote, run_id)
    return gone


def remove_secrets(remote: Remote, run_id: str) -> None:
    """The run's secrets file has no use once its containers are gone (or never came to be)."""
    try:
        remote.sftp.remove(node_paths(remote.node, remote.home).secrets(run_id))
    except OSError:
        pass


def stop_run(remotes: dict[str, Remote], run_id: str, grace: float | None = None,
             remove: bool = True, workers: int = DEFAULT_PARALLEL) -> tuple[list[str], list[str]]:
    """Every node, `workers` at a time. Returns (nodes where containers were stopped, errors)."""
    res = parallel(list(remotes.values()), lambda r: stop_node(r, run_id, grace, remove), workers)
    stopped, errors = [], []
    for r, val, err in res:
        if err is not None:
            lines = str(err).strip().splitlines() or [type(err).__name__]
            errors.append(f"{r.node.name}: {lines[0]}")
        elif val:
            stopped.append(r.node.name)
    return stopped, errors


def latest_run(remotes: dict[str, Remote], workers: int = DEFAULT_PARALLEL) -> str | None:
    """The latest run (runner/runs.py) among the containers on any node."""
    ids: set[str] = set()
    for _, val, _ in parallel(list(remotes.values()), lambda r: run_containers(r, None), workers):
        for c in val or []:
            ids.add(c.labels.get(LABEL_RUN, ""))
    return runs.latest(ids)


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


def prune_runs(remote: Remote, keep: int) -> list[str]:
    """Remove this node's run dirs (with their secrets files and gate dirs) but the `keep` newest
    runner-made ones; the ids removed, oldest first."""
    from runner.run_owner import remove_dirs
    from runner.status import node_run_dirs, run_doc

    made = sorted(i for i in node_run_dirs(remote) if runs.RUN_ID_RE.fullmatch(i))
    busy = {c.labels.get(LABEL_RUN) for c in run_containers(remote, None)}
    doomed = [i for i in made[:max(0, len(made) - keep)] if i not in busy]
    if not doomed:
        return []
    paths = node_paths(remote.node, remote.home)

    def image_of(left: list[str]) -> str | None:
        """A run's own image can reach files a root container of it wrote (else: the node's trainer image)."""
        images = (run_doc(remote, i).get("image") for i in reversed(left))
        return next((i for i in images if isinstance(i, str)), None)

    remove_dirs(remote, paths.runs, doomed, image_of)
    remote.run(["rm", "-rf", "--", *(paths.secrets(i) for i in doomed), *(paths.gates(i) for i in doomed)])
    return doomed


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
    inv = load(args, with_job=False)
    with Cluster(inv, args.accept_new_host_keys, partial=True, workers=args.parallel) as cl:
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
