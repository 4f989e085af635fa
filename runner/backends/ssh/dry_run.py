"""The SSH backend's plan: what `up` would start where, reading no key and contacting nothing
(each node's arch from options.arch, else left to the probe). The plan is the one the launch
makes (runner/planning/plan.py), with the flags the launch would add (an elastic run's replicas, a
resume's `--resume latest`), then the Perseus server, the memory each node needs and the elastic
layouts: its render() is what `runner up --dry-run` prints."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from runner.backends.base import dry_run_id, sizing_text, up_job
from runner.backends.results import NodeLaunch, Plan
from runner.core.errors import UserError
from runner.core.node_output import visible_lines
from runner.inventory import ARCH_ALIASES, Inventory
from runner.planning import hang_budget
from runner.planning.elastic import check as check_elastic
from runner.planning.elastic import render as render_elastic
from runner.planning.elastic import replicas_args, spec_of
from runner.planning.plan import Facts, make_plan, masked

RESUME_ARGS = ["--resume", "latest"]


@dataclass
class Prepared:
    """What submit() takes from a plan: the inventory (its job copied: planning and launching
    change its args), the env_file's values, the notify spec, the elastic spec."""

    inv: Inventory
    secrets: dict[str, str]
    notify: Any
    elastic: Any
    dp_sync: Any = None  # runner/planning/dp_sync.py DpSyncChoice (job.dp_sync), its flags already in inv.job.args


def prepare(inv: Inventory, options, detach: bool = False) -> Prepared:
    """What a plan and a launch both do first: the job's secrets and notify spec, an elastic run's
    refusals, on a copy of the job (the loaded inventory is left as it was)."""
    inv = copy.copy(inv)
    inv.job = copy.deepcopy(inv.job)
    secret_vals, spec = up_job(options, detach, inv.job, inv.path)
    elastic = spec_of(inv, options.elastic)
    if elastic is not None:
        check_elastic(inv, elastic)  # a job that could never shrink: refused before anything is contacted
        if detach:  # nobody would be there to choose the layout again when a node is lost
            raise UserError("--detach: an elastic run needs `runner up` attached; drop --detach (or the elastic)")
    dp_sync = None
    if inv.job.dp_sync is not None:  # imported only then: the links and sizing it reads cost every dry-run 30-50 ms
        from runner.planning.dp_sync import choose as choose_dp_sync

        dp_sync = choose_dp_sync(inv)  # its flags join the job's: every elastic re-plan keeps them
    if dp_sync is not None:
        inv.job.args += dp_sync.args
    return Prepared(inv, secret_vals, spec, elastic, dp_sync)


def _dry_facts(inv: Inventory, arch_args: list[str]) -> dict[str, Facts]:
    given: dict[str, str] = {}
    for a in arch_args:
        node, sep, arch = a.rpartition("=")
        if arch not in ARCH_ALIASES:
            raise UserError(f"--arch {a}: unknown arch {arch!r} (amd64 or arm64)")
        if sep:
            try:
                inv.node(node)
            except UserError:
                raise UserError(f"--arch {a}: no node named {node!r} in {inv.path}") from None
        given[node if sep else "*"] = ARCH_ALIASES[arch]
    return {n.name: Facts(arch=given.get(n.name, given.get("*"))) for n in inv.nodes}


def make(backend, options) -> Plan:
    prepared = prepare(backend.inventory, options)
    inv = prepared.inv
    plan_inv = copy.copy(inv)  # the plan's args (replicas, --resume) are the launch's to add again
    plan_inv.job = copy.deepcopy(inv.job)
    run_id = dry_run_id(options)
    elastic_lines = render_elastic(plan_inv, prepared.elastic) if prepared.elastic is not None else None
    if prepared.elastic is not None:
        plan_inv.job.args += replicas_args(plan_inv)  # as the launch will pass them
    if options.resume:
        plan_inv.job.args += RESUME_ARGS
    trees = []
    if plan_inv.job.sync:  # the sources scanned here (their digests name the copies on the nodes)
        from runner.delivery.sync import scan

        trees = scan(plan_inv.job.sync)
    plan = make_plan(plan_inv, run_id, _dry_facts(plan_inv, options.arch), secret_keys=list(prepared.secrets),
                     trees=trees)
    parts = []
    perseus = plan_inv.job.perseus
    if perseus is not None:
        from runner.backends.ssh import perseus as perseus_server

        perseus_server.attach(plan, None)
        parts = [plan.render(), visible_lines(perseus_server.render(plan, perseus))]
    else:
        parts = [plan.render()]
    sizing, refused = sizing_text(plan_inv)
    if sizing is not None:
        parts.append(sizing)
    if hang := hang_budget.dry_run_line(plan_inv.job):
        parts.append(hang)
    if prepared.dp_sync is not None:
        parts.append("\n".join(prepared.dp_sync.lines))
    if elastic_lines:
        parts.append(visible_lines(elastic_lines))
    def launches() -> list[NodeLaunch]:
        return [NodeLaunch(node=n.node, rank=n.rank, host=n.host, arch=n.arch, image=n.image, command=list(n.command),
                           env=masked(n.env), secret_keys=list(n.secret_keys), run_dir=n.run_dir) for n in plan.nodes]

    return Plan(backend="ssh", inventory=str(inv.path), run_id=run_id, options=options, text="\n".join(parts) + "\n",
                master_addr=plan.master_addr, master_port=plan.master_port, refusal=refused, detail=plan,
                prepared=prepared, launches=launches)
