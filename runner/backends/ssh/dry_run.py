"""`runner up --dry-run` on SSH nodes: what would run where, printed; reads no key and contacts
nothing (each node's arch from --arch, else left to the probe). The plan is the one the launch
makes (runner/planning/plan.py), with the flags the launch would add (an elastic run's replicas, a
resume's `--resume latest`), then the Perseus server, the memory each node needs and the elastic
layouts."""

from __future__ import annotations

from runner.backends.base import dry_run_id
from runner.backends.ssh import perseus
from runner.backends.ssh.launch import RESUME_ARGS, prepare
from runner.core.errors import UserError
from runner.core.node_output import visible_lines
from runner.inventory import ARCH_ALIASES, Inventory
from runner.planning.elastic import render as render_elastic
from runner.planning.elastic import replicas_args
from runner.planning.plan import Facts, make_plan
from runner.planning.sizing import check_sizing


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


def main(args) -> int:
    inv, secret_vals, _spec, elastic = prepare(args, dry=True)
    run_id = dry_run_id(args)
    elastic_lines = render_elastic(inv, elastic) if elastic is not None else None
    if elastic is not None:
        inv.job.args += replicas_args(inv)  # as the launch will pass them
    if args.resume:
        inv.job.args += RESUME_ARGS
    from runner.delivery.sync import scan

    plan = make_plan(inv, run_id, _dry_facts(inv, args.arch), secret_keys=list(secret_vals),
                     trees=scan(inv.job.sync))
    if inv.job.perseus is not None:
        perseus.attach(plan, None)
    print(plan.render())
    if inv.job.perseus is not None:
        print(visible_lines(perseus.render(plan, inv.job.perseus)))
    check_sizing(inv, show=True, ignore=args.ignore_sizing)
    if elastic_lines:
        print(visible_lines(elastic_lines))
    return 0
