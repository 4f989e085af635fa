"""`job.perseus` as the inventory states it: the plan files (read and checked here, so
`up --dry-run` refuses a bad one), the scheduler and the port. Starting the server is
runner/backends/ssh/perseus.py's."""

from __future__ import annotations

import os
from dataclasses import dataclass

from runner.agents.perseus_server import plan_bytes, read_plan
from runner.core.errors import UserError

FIELDS = {"plan", "scheduler", "port"}
SCHEDULERS = ("PointSolution", "PlanSequence")

@dataclass(frozen=True)
class PerseusSpec:
    plans: tuple[tuple[str, bytes], ...]   # (local path, the checked plan re-serialised: plan_bytes)
    scheduler: str
    port: int | str = "auto"
    where: str = ""                        # "inventory:line" of job.perseus.plan
    ranks: tuple[int, ...] = ()            # ranks each plan holds


def parse_perseus(c, v, expand) -> PerseusSpec:
    """c: the inventory's checker, v: the `job.perseus` value (line-numbered)."""
    m = c.mapping(v, "job.perseus", FIELDS)
    if "plan" not in m:
        c.fail(v.line, "job.perseus.plan", "missing: a plan file (or a list of them) with one list of "
               "(instruction, frequency) pairs per rank")
    pline, pv = m["plan"]
    items = pv.value if isinstance(pv.value, list) else [pv]
    if not items:
        c.fail(pv.line, "job.perseus.plan", "an empty list; give at least one plan file")
    plans, ranks = [], []
    for i, item in enumerate(items):
        w = f"job.perseus.plan[{i}]" if isinstance(pv.value, list) else "job.perseus.plan"
        path = expand(c.str_(item, w))
        if not os.path.isfile(path):
            c.fail(item.line, w, f"plan file not found: {path}")
        try:  # read once, bounded before reading, checked to plain data
            plan = read_plan(path)
        except ValueError as e:
            c.fail(item.line, w, str(e))
        ranks.append(len(plan))
        # What reaches the master is the checked value written out again, never a second read
        # of the file (it could be another file by then) nor anything of it but its value.
        plans.append((os.path.abspath(path), plan_bytes(plan)))
    scheduler = "PlanSequence" if isinstance(pv.value, list) else "PointSolution"
    if "scheduler" in m:
        sline, sv = m["scheduler"]
        scheduler = c.str_(sv, "job.perseus.scheduler")
        if scheduler not in SCHEDULERS:
            c.fail(sline, "job.perseus.scheduler", f"{scheduler!r}: one of {', '.join(SCHEDULERS)}")
        if scheduler == "PointSolution" and len(plans) != 1:
            c.fail(sline, "job.perseus.scheduler", f"PointSolution serves one plan file, got {len(plans)}; "
                   "use PlanSequence for a list")
    port: int | str = "auto"
    if "port" in m and m["port"][1].value != "auto":
        port = c.int_(m["port"][1], "job.perseus.port", 1024, 65535)
    return PerseusSpec(tuple(plans), scheduler, port, f"{c.path}:{pline}", tuple(ranks))


def check_world(spec: PerseusSpec, world: int) -> None:
    """Every plan file holds one list per rank of the job."""
    for (path, _), n in zip(spec.plans, spec.ranks, strict=True):
        if n != world:
            raise UserError(f"{spec.where}: job.perseus.plan: {path} holds {n} ranks' plans but the job has "
                            f"{world} ranks (the nodes' slots or job.nproc_per_node, summed)")
