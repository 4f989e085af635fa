"""`parallel.partition: auto` in `runner up`: profile the nodes (cached), choose the split
(runner/profile/split.py) and hand it to the trainer as `--parallel.partition custom:...`, which its
config.yaml then records. The runner also writes the split and the profile it came from to
`partition.json` in the run dir; `up --resume` reads it back there, so a resumed run keeps its split
even if the nodes measure differently today.

Stages map onto nodes as the trainer's mesh puts them: pipeline rank k holds global ranks
[k W/pp, (k+1) W/pp), and global ranks fill nodes in rank order (master first), `slots` (or
job.nproc_per_node) per node. A stage spread over several nodes runs at the slowest of them.
"""

from __future__ import annotations

import json
import logging

from contract.partition import uniform_bounds
from runner.core.errors import UserError
from runner.inventory import Inventory, Job
from runner.inventory.safe_yaml import CONFIG_MAX_BYTES
from runner.inventory.safe_yaml import load as load_yaml
from runner.planning.link_use import partition_line
from runner.profile import doc_check
from runner.profile.measure import profile_cluster
from runner.profile.split import (
    Link,
    Problem,
    Split,
    StageNode,
    best_split,
    format_split,
    make_split,
)

log = logging.getLogger("runner.profile")
PARTITION_FILE = "partition.json"
PARTITION_FLAGS = ("--parallel.partition", "--partition_method")
ONE_STAGE_SCHEDULES = {"1f1b": "1f1b", "gpipe": "gpipe", "afab": "gpipe"}


def job_partition(job: Job) -> str | None:
    """The job's parallel.partition as the trainer will read it: the last flag in job.args, else
    the config file's (None when neither sets it)."""
    value = None
    if job.config:
        doc = load_yaml(job.config, "job.config", CONFIG_MAX_BYTES) or {}  # the runner's one bounded loader
        par = doc.get("parallel") if isinstance(doc, dict) else None
        if isinstance(par, dict) and par.get("partition") is not None:
            value = str(par["partition"])
    args = list(job.args)
    for i, a in enumerate(args):
        name, eq, inline = a.partition("=")
        if name in PARTITION_FLAGS:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else value)
    return value.strip() if value else None


def _stage_nodes(inv: Inventory, pp: int) -> list[list[int]]:
    """Indices (rank order) of the nodes holding each pipeline stage's ranks."""
    order = inv.ordered()
    nproc = [inv.job.nproc_per_node or n.slots for n in order]
    world = sum(nproc)
    if world % pp:
        raise UserError(f"parallel.pp {pp} does not divide the {world} processes of {inv.path}")
    owner = [i for i, k in enumerate(nproc) for _ in range(k)]
    per = world // pp
    return [sorted(set(owner[k * per:(k + 1) * per])) for k in range(pp)]


def problem_from_profile(prof, inv: Inventory) -> Problem:
    """The planner's input from a ClusterProfile (runner/profile/measure.py) and the inventory."""
    m = prof.model
    pp = int(m["pp"])
    groups = _stage_nodes(inv, pp)
    stages = []
    for idx in groups:
        docs = [prof.nodes[i] for i in idx]
        worst = {k: max(d["time_s"][k] for d in docs) for k in ("embed", "block", "head")}
        stages.append(StageNode(
            name="+".join(d["node"] for d in docs), time_s=worst,
            train_bytes={k: max(d["train_bytes"][k] for d in docs) for k in worst},
            act_bytes={k: max(d["act_bytes"][k] for d in docs) for k in worst},
            memory_available=min(d["memory_available"] for d in docs),
            runtime_bytes=max(d["runtime_bytes"] for d in docs),
            optim_s={k: max(d["optim_s"][k] for d in docs) for k in worst}))
    links: list[Link | None] = []
    for a, b in zip(groups, groups[1:], strict=False):
        last, first = a[-1], b[0]
        lk = prof.links[last] if last != first else None  # links[i]: node i -> node i + 1
        links.append(None if lk is None else Link(lk["latency_s"], lk["bandwidth_Bps"]))
    schedule = ONE_STAGE_SCHEDULES.get(str(m["pp_schedule"]).lower(), str(m["pp_schedule"]))
    return Problem(stages, int(m["num_layers"]), int(m["microbatches"]), links,
                   float(prof.nodes[0]["boundary_bytes"]), schedule, float(prof.nodes[0]["model_bytes"]))


def plan_from_profile(prof, inv: Inventory) -> tuple[Split | None, Split | None, Problem | None]:
    """(auto split, uniform_transformer split for comparison, the problem); Nones without a pipeline."""
    m = prof.model
    if int(m["pp"]) < 2:
        return None, None, None
    if int(m.get("virtual_stages", 1)) != 1 or str(m["pp_schedule"]).lower() not in ONE_STAGE_SCHEDULES:
        raise UserError(f"parallel.partition auto plans one stage per pipeline rank (gpipe, 1f1b); the job runs "
                        f"{m['pp_schedule']} with {m.get('virtual_stages', 1)} stages per rank: give "
                        f"custom:... or weighted:... instead")
    problem = problem_from_profile(prof, inv)
    split = best_split(problem)
    return split, make_split(problem, uniform_bounds(problem.num_layers, problem.p)), problem


def with_pp(prof, pp: int):
    """The profile planned for `pp` stages: layer times do not depend on pp (it is not in the
    cache key), so a profile measured for one pipeline plans another (an elastic run's new layout)."""
    prof.nodes[0] = {**prof.nodes[0], "model": {**prof.model, "pp": pp}}
    return prof


def render_plan(split: Split, uniform: Split | None, problem: Problem, prof=None) -> str:
    """The split as printed; with the profile, a last line naming the links it took from
    `runner check --links` (runner/planning/link_use.py), where it took any."""
    text = format_split(split, problem.microbatches)
    if uniform is not None:
        text += (f"\n  uniform_transformer ({uniform.spec}): slowest stage {uniform.bottleneck_s * 1e3:.2f} ms, "
                 f"step ~{uniform.step_s(problem.microbatches):.3f} s predicted "
                 f"({uniform.step_s(problem.microbatches) / split.step_s(problem.microbatches):.2f}x auto's)")
    line = None if prof is None else partition_line([d["node"] for d in prof.nodes], prof.links)
    return text + (f"\n{line}" if line else "")


def pin_auto_partition(cl, probes: dict, run_dir_of, resume: bool, refresh: bool = False,
                       pp: int | None = None) -> str | None:
    """For a job with parallel.partition auto: the split as `--parallel.partition custom:...`
    appended to job.args (None for any other partition). `run_dir_of(node)` is the node's run dir.
    On resume the split recorded in the run dir wins while it has `pp` stages (an elastic run's
    new layout: pp given, the split is planned again for it, from the cached profiles)."""
    inv: Inventory = cl.inv
    if job_partition(inv.job) != "auto":
        return None
    master = inv.master
    if resume:
        text = cl[master.name].read_text(f"{run_dir_of(master)}/{PARTITION_FILE}")
        spec = None
        if text:
            doc = doc_check.loads(text)
            where = f"{run_dir_of(master)}/{PARTITION_FILE}"
            spec = doc_check.split_spec(doc.get("spec") if isinstance(doc, dict) else None, master.name, where)
        if spec and pp is not None and spec.count(",") != pp:
            log.info("parallel.partition auto: the run's split %s is for another pipeline; planning for pp %d", spec, pp)
        elif spec:
            print(f"parallel.partition auto: the run's split {spec} (from its {PARTITION_FILE})", flush=True)
            inv.job.args = [*inv.job.args, "--parallel.partition", spec]
            return spec
        log.warning("parallel.partition auto: run dir has no %s; profiling the nodes again", PARTITION_FILE)
    prof = profile_cluster(cl, probes, refresh=refresh)
    if prof.nodes:
        from runner.planning.sizing import job_settings

        with_pp(prof, pp if pp is not None else int(job_settings(inv.job)["parallel.pp"]))
    split, uniform, problem = plan_from_profile(prof, inv)
    if split is None:
        return None
    print(render_plan(split, uniform, problem, prof), flush=True)
    doc = json.dumps({"spec": split.spec, "bounds": split.bounds,
                      "stages": [{"stage": s.stage, "node": s.node, "start": s.start, "end": s.end,
                                  "compute_s": s.compute_s, "comm_s": s.comm_s, "memory_bytes": s.memory_bytes}
                                 for s in split.stages],
                      "uniform": uniform.spec if uniform else None, "profile": prof.as_dict()}, indent=1).encode()

    def record(node) -> None:
        r = cl[node.name]
        r.makedirs(run_dir_of(node))
        r.put_bytes(f"{run_dir_of(node)}/{PARTITION_FILE}", doc)

    cl.each(lambda r: record(r.node))
    inv.job.args = [*inv.job.args, "--parallel.partition", split.spec]
    return split.spec
