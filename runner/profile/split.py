"""`parallel.partition: auto`: contiguous layer ranges per pipeline stage that minimise the slowest
stage, from what `runner profile` measured on each node. Pure (no I/O, no torch).

The model, as PipeEdge's: a stage's time per microbatch is its compute (forward + backward of the
embeddings on the first stage, of each of its layers, of the norm + head on the last, as measured on
its node) plus the transfers of its boundaries (the activation it sends on, the gradient it sends
back: latency + bytes / bandwidth of the measured link). In steady state a pipeline runs at its
slowest stage, so the split minimises max(stage time); a step then takes about
sum(stage times) + (microbatches - 1) x the slowest + the slowest optimizer step.

A stage must fit its node's memory: the runtime (the probe's own resident size once torch is in),
its parameters with their gradients and optimizer state (measured after one optimizer step), and
the activations saved for backward of every microbatch in flight on it (1F1B: min(p - s, m) on
stage s; GPipe: all m). The trainer also builds the whole model on every rank before cutting it,
so that must fit too.

The search is a dynamic programme over (stage, first layer) that is exact for this cost: the
tests compare it with brute force on random profiles. Among splits with the same slowest stage it
takes the one whose second slowest is fastest, and so on (less time filling and draining the
pipeline); what still ties goes to the smallest boundaries (earlier stages take fewer layers: they
hold more microbatches in flight under 1F1B). The same profile always gives the same split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from runner.core.errors import UserError

KINDS = ("embed", "block", "head")
INF = math.inf


@dataclass(frozen=True)
class StageNode:
    """What one stage's node measured (the slowest of its nodes where a stage spans several)."""

    name: str
    time_s: dict[str, float]            # forward + backward of one microbatch, per kind
    train_bytes: dict[str, float]       # parameters + gradients + optimizer state, per kind
    act_bytes: dict[str, float]         # saved for backward per microbatch, per kind
    memory_available: float = INF       # bytes this node's job container may use
    runtime_bytes: float = 0.0          # the trainer process before any model (torch, libraries)
    optim_s: dict[str, float] = field(default_factory=dict)  # one optimizer step, per kind


@dataclass(frozen=True)
class Link:
    """The measured link between two neighbouring stages (one direction's numbers for both)."""

    latency_s: float = 0.0
    bandwidth_Bps: float = INF

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + (nbytes / self.bandwidth_Bps if self.bandwidth_Bps > 0 else INF)


@dataclass(frozen=True)
class Problem:
    stages: list[StageNode]
    num_layers: int
    microbatches: int
    links: list[Link | None]            # links[s]: between stage s and s + 1 (None: same node)
    boundary_bytes: float = 0.0         # one microbatch's hidden states (= its gradient)
    schedule: str = "1f1b"              # 1f1b | gpipe (how many microbatches a stage holds)
    model_bytes: float = 0.0            # the full model's parameters, built on every rank first

    @property
    def p(self) -> int:
        return len(self.stages)


@dataclass(frozen=True)
class StagePlan:
    stage: int
    node: str
    start: int
    end: int
    compute_s: float
    comm_s: float
    optim_s: float
    memory_bytes: float
    memory_available: float

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Split:
    bounds: list[int]
    stages: list[StagePlan]

    @property
    def bottleneck_s(self) -> float:
        return max(s.time_s for s in self.stages)

    def step_s(self, microbatches: int) -> float:
        """Predicted optimizer step: fill and drain through every stage once, the other
        microbatches at the slowest stage's pace, then the slowest optimizer step."""
        return (sum(s.time_s for s in self.stages) + (microbatches - 1) * self.bottleneck_s
                + max(s.optim_s for s in self.stages))

    @property
    def spec(self) -> str:
        """What the trainer takes: `--parallel.partition custom:0,a,b,L`."""
        return "custom:" + ",".join(map(str, self.bounds))


# ------------------------------------------------------------------ cost of one stage


def in_flight(problem: Problem, s: int) -> int:
    """Microbatches whose activations stage s holds at once."""
    if problem.schedule == "gpipe":
        return problem.microbatches
    return min(problem.p - s, problem.microbatches)


def _kinds(problem: Problem, s: int, a: int, b: int) -> dict[str, float]:
    return {"embed": 1.0 if s == 0 else 0.0, "block": float(b - a), "head": 1.0 if s == problem.p - 1 else 0.0}


def stage_compute(problem: Problem, s: int, a: int, b: int) -> float:
    node, n = problem.stages[s], _kinds(problem, s, a, b)
    return sum(n[k] * node.time_s.get(k, 0.0) for k in KINDS if n[k])


def stage_comm(problem: Problem, s: int) -> float:
    """Sends of stage s per microbatch: its activation forward, its input's gradient back."""
    t = 0.0
    out = problem.links[s] if s < problem.p - 1 else None  # to the next stage
    back = problem.links[s - 1] if s > 0 else None         # from the one before
    if out is not None:
        t += out.seconds(problem.boundary_bytes)
    if back is not None:
        t += back.seconds(problem.boundary_bytes)
    return t


def stage_memory(problem: Problem, s: int, a: int, b: int) -> float:
    node, n = problem.stages[s], _kinds(problem, s, a, b)
    held = sum(n[k] * node.train_bytes.get(k, 0.0) for k in KINDS if n[k])
    acts = sum(n[k] * node.act_bytes.get(k, 0.0) for k in KINDS if n[k])
    boundary = problem.boundary_bytes if s > 0 else 0.0  # received inputs, kept for backward
    return node.runtime_bytes + held + in_flight(problem, s) * (acts + boundary)


def stage_optim(problem: Problem, s: int, a: int, b: int) -> float:
    node, n = problem.stages[s], _kinds(problem, s, a, b)
    return sum(n[k] * node.optim_s.get(k, 0.0) for k in KINDS if n[k])


def stage_cost(problem: Problem, s: int, a: int, b: int) -> float:
    """Time per microbatch of stage s holding layers [a, b); INF where it does not fit."""
    if stage_memory(problem, s, a, b) > problem.stages[s].memory_available:
        return INF
    return stage_compute(problem, s, a, b) + stage_comm(problem, s)


def make_split(problem: Problem, bounds: list[int]) -> Split:
    plans = []
    for s in range(problem.p):
        a, b = bounds[s], bounds[s + 1]
        plans.append(StagePlan(s, problem.stages[s].name, a, b, stage_compute(problem, s, a, b),
                               stage_comm(problem, s), stage_optim(problem, s, a, b),
                               stage_memory(problem, s, a, b), problem.stages[s].memory_available))
    return Split(list(bounds), plans)


# ------------------------------------------------------------------ the search


def best_split(problem: Problem) -> Split:
    """The split minimising the slowest stage, then the second slowest, and so on; remaining ties
    go to the smallest boundaries. UserError, naming the node, when no split fits its memory."""
    p, n = problem.p, problem.num_layers
    _check_shape(problem)
    _check_init_memory(problem)
    # tail[s][j]: stage times (slowest first) of the best split of layers [j, n) over stages
    # s..p-1, each stage >= 1 layer; None where nothing fits. Comparing these vectors
    # lexicographically is compatible with adding the same stage to both, so the optimum of a
    # prefix extends an optimum of its tail: the programme is exact.
    tail: list[list[tuple[float, ...] | None]] = [[None] * (n + 1) for _ in range(p + 1)]
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    tail[p][n] = ()
    for s in range(p - 1, -1, -1):
        rest = p - 1 - s  # stages after s, each needing a layer
        for j in range(s, n - rest):
            best = None
            for b in range(j + 1, n - rest + 1):  # ascending: a tie keeps the smaller boundary
                after = tail[s + 1][b]
                if after is None:
                    continue
                c = stage_cost(problem, s, j, b)
                if c == INF:
                    continue
                cand = _merge(after, c)
                if best is None or cand < best:
                    best, cut[s][j] = cand, b
            tail[s][j] = best
    if tail[0][0] is None:
        raise UserError(_no_fit(problem))
    bounds = [0]
    for s in range(p):
        bounds.append(cut[s][bounds[-1]])
    return make_split(problem, bounds)


def _merge(desc: tuple[float, ...], c: float) -> tuple[float, ...]:
    """desc (sorted slowest first) with c inserted."""
    i = 0
    while i < len(desc) and desc[i] >= c:
        i += 1
    return desc[:i] + (c,) + desc[i:]


def brute_force(problem: Problem) -> Split | None:
    """Every contiguous split (each stage >= 1 layer) under the same order: for the tests and the
    benchmark's model-side check. None when nothing fits."""
    from itertools import combinations

    best: tuple[tuple[float, ...], list[int]] | None = None
    for cuts in combinations(range(1, problem.num_layers), problem.p - 1):
        bounds = [0, *cuts, problem.num_layers]
        times = tuple(sorted((stage_cost(problem, s, bounds[s], bounds[s + 1]) for s in range(problem.p)),
                             reverse=True))
        if times[0] == INF:
            continue
        if best is None or (times, bounds) < best:
            best = (times, bounds)
    return None if best is None else make_split(problem, best[1])


# ------------------------------------------------------------------ errors a user can act on


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def _check_shape(problem: Problem) -> None:
    if problem.p < 1:
        raise UserError("parallel.partition auto: no pipeline stages")
    if problem.num_layers < problem.p:
        raise UserError(f"parallel.partition auto: {problem.num_layers} layers cannot fill {problem.p} stages "
                        f"(each needs at least one); use fewer stages")
    if len(problem.links) != problem.p - 1:
        raise ValueError(f"{problem.p} stages need {problem.p - 1} links, got {len(problem.links)}")


def _check_init_memory(problem: Problem) -> None:
    for s, node in enumerate(problem.stages):
        need = node.runtime_bytes + problem.model_bytes
        if need > node.memory_available:
            raise UserError(f"parallel.partition auto: node {node.name} (stage {s}) cannot build the model: every "
                            f"rank builds the whole model ({_gib(problem.model_bytes)}) before cutting its stage, "
                            f"{_gib(need)} with the runtime, and the node has {_gib(node.memory_available)}; "
                            f"give it more memory (inventory `memory:`) or use a smaller model")


def max_layers(problem: Problem, s: int) -> int:
    """The most layers stage s fits in its node's memory (0: not even one)."""
    k = 0
    for count in range(1, problem.num_layers + 1):
        if stage_memory(problem, s, 0, count) > problem.stages[s].memory_available:
            break
        k = count
    return k


def _no_fit(problem: Problem) -> str:
    caps = [max_layers(problem, s) for s in range(problem.p)]
    for s, cap in enumerate(caps):
        if cap == 0:
            node = problem.stages[s]
            need = stage_memory(problem, s, 0, 1)
            return (f"parallel.partition auto: node {node.name} (stage {s}) cannot hold even one layer"
                    f"{' with the embeddings' if s == 0 else ''}{' with the head' if s == problem.p - 1 else ''}: "
                    f"needs {_gib(need)}, has {_gib(node.memory_available)}; give it more memory (inventory "
                    f"`memory:`), fewer microbatches in flight, or leave it out of the pipeline")
    held = ", ".join(f"{problem.stages[s].name} {caps[s]}" for s in range(problem.p))
    return (f"parallel.partition auto: no split of {problem.num_layers} layers fits the nodes' memory (the most "
            f"layers each node holds: {held}); add memory or nodes")


# ------------------------------------------------------------------ display


def format_split(split: Split, microbatches: int, title: str = "auto") -> str:
    """One line per stage, as printed at start."""
    lines = [f"parallel.partition {title}: {split.spec}  (slowest stage {split.bottleneck_s * 1e3:.2f} ms per "
             f"microbatch, step ~{split.step_s(microbatches):.3f} s predicted)"]
    for st in split.stages:
        mem = "" if st.memory_available == INF else f", memory {_gib(st.memory_bytes)} of {_gib(st.memory_available)}"
        lines.append(f"  stage {st.stage} on {st.node}: layers {st.start}-{st.end - 1} ({st.num_layers}), "
                     f"{st.compute_s * 1e3:.2f} ms compute + {st.comm_s * 1e3:.2f} ms transfer{mem}")
    return "\n".join(lines)
