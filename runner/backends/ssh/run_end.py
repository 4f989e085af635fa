"""What a run leaves behind when it ends: runner-status.json in each node's run dir (how it
ended, for `status`/`ls`), and the newest metrics record a notification quotes."""

from __future__ import annotations

import json
import logging
import os
import shlex
from datetime import datetime, timezone

from runner.backends.ssh.watch import Watcher
from runner.planning.plan import NodePlan, Plan
from runner.transport.cluster import Cluster

log = logging.getLogger("runner.up")


def last_metrics(cl: Cluster, nodes: list[NodePlan]) -> str | None:
    """The run's newest metrics.jsonl record among the nodes' run dirs (the logging rank's node
    holds it; which one that is depends on the layout), as the node wrote it; None if none has one."""
    from runner.backends.ssh.node_runs import node_progress

    found = []
    for _, got, err in cl.map(nodes, lambda np: node_progress(cl[np.node], np.run_dir)[0]):
        if err is None and got:
            try:
                step = json.loads(got).get("step")
            except (ValueError, AttributeError):
                continue
            if isinstance(step, int):
                found.append((step, got))
    return max(found)[1] if found else None


def write_status(cl: Cluster, plan: Plan, watcher: Watcher | None, code: int, skip: set[str] = frozenset()) -> None:
    """runner-status.json in each node's run dir, so `status`/`ls` know how a finished run ended
    (not on nodes in skip: a lost node would block the write)."""
    def one(np: NodePlan) -> None:
        o = watcher.done.get(np.node) if watcher else None
        doc = {"run_id": plan.run_id, "node": np.node, "rank": np.rank, "result": code,
               "exit_code": o.exit_code if o else None, "error": o.error if o else None,
               "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "image": np.image, "command": shlex.join(np.command)}
        try:
            cl[np.node].put_bytes(f"{np.run_dir}/runner-status.json", json.dumps(doc, indent=1).encode())
            if np.go_file:  # served its purpose at start-up; it lives outside the run dir
                cl[np.node].run(["rm", "-rf", os.path.dirname(np.go_file)])
        except Exception as exc:  # noqa: BLE001 - an unreachable node just has no status file
            log.debug("status file on %s: %s", np.node, exc)

    cl.map([np for np in plan.nodes if np.node not in skip], one)
