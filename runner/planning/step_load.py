"""What one training step of the job sends over each link between its nodes, and how long it computes:
the figures `runner check --links` compares the measured links with, and `job.dp_sync: auto` decides
from (runner/planning/dp_sync.py). Pure: inventory + job in, numbers out; no connection.

Ranks fill nodes in rank order (master first), `slots` (or job.nproc_per_node) per node, and pipeline
rank k holds global ranks [k W/pp, (k+1) W/pp), as the trainer's mesh lays them out (the same
mapping runner/profile/auto.py uses); tp is taken to stay inside a node, so a stage's data-parallel
peers are its ranks with the same tp coordinate.

- Pipeline neighbours: per step each microbatch's activations go forward and their gradient back,
  `tokens x hidden x 4` bytes each way (fp32 on the wire, as the schedules send; the probe's
  boundary_bytes), for every microbatch of the step.
- Data-parallel peers: the stage's gradients all-reduced once per step over a ring: each rank sends
  2 (n-1)/n x the stage's parameter bytes (fp32) to its ring neighbour (gloo's and NCCL's ring).

Compute per step: from `runner profile`'s cached per-layer times (forward + backward of one
microbatch, the stage's slowest node) when every node has one, else the FLOPs estimate
6 N + 12 L d S per token (N the stage's parameters, L its blocks, d hidden, S seq_len) at an assumed
rate (ASSUMED_FLOPS), which the printed line names so a user knows to measure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from contract.model_size import ModelShape
from runner.inventory import Inventory
from runner.planning.job_settings import job_settings
from runner.planning.sizing import cached_profiles, model_of, stage_bounds

# Per rank, where nothing was measured: a core of a Pi 5 does ~10 GFLOP/s fp32, a server CPU rank with
# its threads a few tens; a datacenter GPU ~100 TFLOP/s bf16 at the MFU a small model reaches. The
# line that uses one says so (and that `runner profile` measures it).
ASSUMED_FLOPS = {"cpu": 20e9, "gpu": 100e12}
WIRE_BYTES = 4  # fp32 gradients and activations on the wire


@dataclass(frozen=True)
class Flow:
    """What one step sends from node `src` to node `dst` for one purpose."""

    src: str
    dst: str
    kind: str            # "pipeline" | "data-parallel"
    stage: int
    bytes: float         # per step, this direction
    messages: int        # per step (each pays the link's latency once)


@dataclass
class StepLoad:
    model: str
    pp: int
    dp: int
    tp: int
    microbatches: int
    stage_params: list[int]           # per pipeline stage
    compute_s: float                  # the slowest stage's compute per step
    compute_from: str                 # "runner profile" or the assumption used
    flows: list[Flow] = field(default_factory=list)
    rank_nodes: list[str] = field(default_factory=list)

    def dp_groups(self) -> list[list[str]]:
        """Per stage (tp coordinate 0): the nodes of its data-parallel replicas, in dp rank order."""
        per = len(self.rank_nodes) // self.pp
        if per < self.dp * self.tp:  # degrees the processes cannot hold: the trainer refuses them at start
            return []
        return [[self.rank_nodes[k * per + j * self.tp] for j in range(self.dp)] for k in range(self.pp)]

    def allreduce_bytes(self, stage: int) -> float:
        """What one rank sends per step in a ring all-reduce of the stage's fp32 gradients."""
        n = self.dp
        return 2 * (n - 1) / n * self.stage_params[stage] * WIRE_BYTES if n > 1 else 0.0


def _flops_per_token(shape: ModelShape, params: int, blocks: int, seq: int) -> float:
    return 6 * params + 12 * blocks * shape.hidden * seq


def step_load(inv: Inventory) -> StepLoad:
    """The job's per-step traffic and compute (module doc). NotSized (contract/model_size.py) for a
    job this arithmetic does not cover; UserError for a value out of its range."""
    s = job_settings(inv.job)
    name, shape = model_of(s, inv.job)
    pp, tp = int(s["parallel.pp"]), int(s["parallel.tp"])
    order = inv.ordered()
    nproc = [inv.job.nproc_per_node or n.slots for n in order]
    ranks = [n.name for n, k in zip(order, nproc, strict=True) for _ in range(k)]
    world = len(ranks)
    dp = int(s["parallel.dp"] or max(world // (pp * tp), 1))
    micro_num = int(s["train.microbatch_num"] or (4 if pp > 1 else 1))
    batch, seq = int(s["train.batch_size"]), int(s["data.seq_len"])
    micro, n_micro = max(batch // micro_num, 1), micro_num * int(s["train.grad_acc_steps"])
    partition = str(s["parallel.partition"])
    bounds = stage_bounds(partition, shape.layers, pp, shape) if pp > 1 else [0, shape.layers]
    params = [shape.stage_params(a, b, first=k == 0, last=k == pp - 1)
              for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]
    per = world // pp if world >= pp else 1
    load = StepLoad(name, pp, dp, tp, n_micro, params, 0.0, "", rank_nodes=ranks)
    load.compute_s, load.compute_from = _compute(inv, s, shape, bounds, params, ranks, per, micro, seq, n_micro)
    boundary = micro * seq * shape.hidden * WIRE_BYTES
    for g in range(min(world, per * (pp - 1))):  # each rank to its next stage's peer, and the gradient back
        a, b = ranks[g], ranks[g + per]
        if a != b:
            load.flows += [Flow(a, b, "pipeline", g // per, boundary * n_micro, n_micro),
                           Flow(b, a, "pipeline", g // per, boundary * n_micro, n_micro)]
    for k, group in enumerate(load.dp_groups()):
        ring = list(zip(group, group[1:] + group[:1], strict=True)) if dp > 2 else list(zip(group, group[1:], strict=False))
        for a, b in ring:
            if a != b:
                load.flows.append(Flow(a, b, "data-parallel", k, load.allreduce_bytes(k), 2 * (dp - 1)))
                if dp == 2:
                    load.flows.append(Flow(b, a, "data-parallel", k, load.allreduce_bytes(k), 2 * (dp - 1)))
    return load


def _compute(inv: Inventory, s: dict, shape: ModelShape, bounds: list[int], params: list[int], ranks: list[str],
             per: int, micro: int, seq: int, n_micro: int) -> tuple[float, str]:
    """(seconds the slowest stage computes per step, where that figure comes from)."""
    pp = len(params)
    profiles = cached_profiles(inv.ordered())
    stage_nodes = [sorted(set(ranks[k * per:(k + 1) * per])) for k in range(pp)]
    try:
        if all(n in profiles for group in stage_nodes for n in group):
            worst = 0.0
            for k, group in enumerate(stage_nodes):
                blocks = bounds[k + 1] - bounds[k]
                for n in group:
                    t = profiles[n]["time_s"]
                    one = blocks * t["block"] + (t["embed"] if k == 0 else 0) + (t["head"] if k == pp - 1 else 0)
                    worst = max(worst, one * n_micro)
            return worst, "runner profile's layer times"
    except (KeyError, TypeError):  # a profile of another shape: estimated instead
        pass
    gpu = any(n.gpus for n in inv.ordered()) and s["parallel.device"] != "cpu"
    rate = ASSUMED_FLOPS["gpu" if gpu else "cpu"]
    worst = max(_flops_per_token(shape, p, bounds[k + 1] - bounds[k], seq) * micro * seq * n_micro
                for k, p in enumerate(params)) / rate
    return worst, (f"FLOPs estimate at an assumed {rate / 1e9:g} GFLOP/s per rank ({'GPU' if gpu else 'CPU'}); "
                   "`runner profile` measures it")
