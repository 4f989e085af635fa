"""What `runner up --resume` needs before the relaunch: which run it means, and its run dirs made
the SSH user's again where an earlier runner's root containers wrote them."""

from __future__ import annotations

from runner.core import runs
from runner.core.errors import UserError
from runner.core.redact import printable
from runner.planning.paths import node_paths
from runner.planning.plan import NodePlan, Plan
from runner.transport.cluster import Cluster
from runner.transport.probe import Probe
from runner.transport.ssh import Remote


def resume_run(master: Remote, wanted: str) -> str:
    """The run dir on the master that `--resume` means: the latest run for "latest", else the one
    whose id is `wanted` or starts with it (runner/core/runs.py: the rule every command uses)."""
    from runner.backends.ssh.node_runs import node_run_dirs

    names = list(node_run_dirs(master))
    where = f"{node_paths(master.node, master.home).runs} on {master.node.name} (the master)"
    if not names:
        what = "--resume" if wanted == "latest" else f"--resume {wanted}: no such run:"
        raise UserError(f"{what} no previous run in {where}")
    try:
        return runs.resolve(names, wanted, where)
    except UserError as exc:
        raise UserError(f"--resume {exc}") from None


def hand_back_runs(cl: Cluster, plan: Plan, probes: dict[str, Probe]) -> None:
    """A run an earlier runner's root containers wrote is made the (non-root) SSH user's before it
    is resumed: the sync copies into it and the relaunched ranks, running as that user, write to it."""
    from runner.backends.ssh.run_owner import hand_back

    def one(np_: NodePlan) -> str | None:
        p = probes[np_.node]
        return hand_back(cl[np_.node], np_.run_dir, np_.image, p.uid, p.gid) if p.uid else None

    for np_, first, err in cl.map(plan.nodes, one):
        if err:
            raise err if isinstance(err, UserError) else UserError(f"node {np_.node}: {err}")
        if first:
            who = printable(probes[np_.node].user or str(probes[np_.node].uid))  # the node's `id -un`: its words
            print(f"run {plan.run_id}: {np_.node}: files not owned by {who} handed back to it "
                  f"(first: {printable(first[:300])})", flush=True)
