"""The new layout's stages from the survivors' memory (issue 58): agree on the step, move the
tensors over the new group, put them into the new stage modules and optimizer.

Collective over the NEW default group, after trainer/runtime/regroup.rejoin: every rank says what it
holds (stage_replicas.StageReplicas: its own stage and its successor's, per whole version) and what
its new stage needs (parameter names); stage_moves decides the step and the moves, the same on
every rank; the bytes go rank to rank, one message per (sender, receiver) pair. A rank that holds
nothing (a node coming back) simply receives everything it needs.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.parallel.stage_moves import Held, NoCopy, agree_step, holdings_at, pairs, plan_moves
from trainer.parallel.stage_replicas import SEP, StageReplicas, name_of, wait_all


@dataclass
class Assembled:
    step: int                       # the optimizer steps the state has done (the new layout resumes after it)
    state: dict[str, torch.Tensor]  # key -> tensor for this rank's new stage
    run_state: dict                 # step, tokens, data position, LR schedule as of `step`
    moves: int                      # tensors moved over the network, all ranks together
    bytes_in: int
    bytes_out: int
    seconds: float


def _report(rep: StageReplicas | None, old_pp: int | None, need: list[str]) -> dict:
    if rep is None:
        return {"old_pp": old_pp, "held": [], "names": {}, "sizes": {}, "need": need, "runs": {}}
    sizes: dict[str, int] = {}
    for stage, step in rep.held():
        for key, t in rep.tensors(stage, step).items():
            sizes[name_of(key)] = sizes.get(name_of(key), 0) + t.numel() * t.element_size()
    runs = {s: rep.run_state_at(s) for s in rep.own_step if s is not None}
    return {"old_pp": old_pp, "held": rep.held(), "names": rep.names(), "sizes": sizes, "need": need, "runs": runs}


def assemble(rep: StageReplicas | None, old_pp: int | None, need: list[str]) -> Assembled:
    """This rank's new stage state (keys of `need`'s names) from the survivors' memory. NoCopy when
    some old stage survived nowhere (resume from the disk checkpoint then): raised on every rank."""
    t0 = time.perf_counter()
    me, world = dist.get_rank(), dist.get_world_size()
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, _report(rep, old_pp, need))
    stages = {r["old_pp"] for r in reports if r["old_pp"] is not None}
    if len(stages) != 1:
        raise NoCopy(f"the survivors disagree on the old layout's stages ({sorted(stages)})")
    held = [Held(r, s, k) for r, rp in enumerate(reports) for s, k in rp["held"]]
    step = agree_step(held, stages.pop())
    if step is None:
        raise NoCopy("no step at which every old stage is whole in some survivor's memory")
    names: dict[int, set[str]] = {}
    sizes: dict[str, int] = {}
    for rp in reports:
        for s, ns in rp["names"].items():
            names.setdefault(s, set()).update(ns)
        sizes.update(rp["sizes"])
    moves = plan_moves({r: rp["need"] for r, rp in enumerate(reports)}, holdings_at(held, step, names), sizes)
    mine: dict[str, torch.Tensor] = {}
    if rep is not None:
        for s, k in rep.held():
            if k == step:
                for key, t in rep.tensors(s, k).items():
                    mine.setdefault(key, t)
    wanted = set(need)
    state = {k: t for k, t in mine.items() if name_of(k) in wanted}
    got, sent = _transfer(pairs(moves), me, mine, state)
    run = next(rp["runs"][step] for rp in reports if step in rp["runs"])
    return Assembled(step, state, copy.deepcopy(run), len(moves), got, sent, time.perf_counter() - t0)


def _pack(keys: list[str], tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    header = json.dumps([[k, list(tensors[k].shape), str(tensors[k].dtype)] for k in keys]).encode()
    flat = [tensors[k].detach().contiguous().reshape(-1).view(torch.uint8) for k in keys]
    payload = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(header), dtype=torch.uint8), payload


def _unpack(header: torch.Tensor, payload: torch.Tensor) -> dict[str, torch.Tensor]:
    out, off = {}, 0
    for key, shape, dt in json.loads(header.numpy().tobytes()):
        dtype = getattr(torch, dt.removeprefix("torch."))
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        out[key] = payload[off:off + n].view(dtype).view(shape)
        off += n
    return out


def _transfer(by_pair: dict[tuple[int, int], list[str]], me: int, mine: dict[str, torch.Tensor],
              into: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Send what this rank is the source of, receive what it is the destination of (all posted
    before any is waited on: no pair waits on another). Returns (bytes received, bytes sent)."""
    out_msgs = {}
    for (src, dst), names in by_pair.items():
        if src == me:
            wanted = set(names)
            out_msgs[dst] = _pack(sorted(k for k in mine if name_of(k) in wanted), mine)
    sources = [src for (src, dst) in by_pair if dst == me]
    sizes = {s: torch.zeros(2, dtype=torch.int64) for s in sources}
    works = [dist.isend(torch.tensor([h.numel(), p.numel()], dtype=torch.int64), dst)
             for dst, (h, p) in out_msgs.items()]
    works += [dist.irecv(sizes[s], s) for s in sources]
    wait_all(works)
    bufs = {s: (torch.empty(int(sizes[s][0]), dtype=torch.uint8), torch.empty(int(sizes[s][1]), dtype=torch.uint8))
            for s in sources}
    works = [dist.isend(t, dst) for dst, (h, p) in out_msgs.items() for t in (h, p) if t.numel()]
    works += [dist.irecv(t, s) for s, (h, p) in bufs.items() for t in (h, p) if t.numel()]
    wait_all(works)
    for h, p in bufs.values():
        into.update(_unpack(h, p))
    return sum(int(h.numel() + p.numel()) for h, p in bufs.values()), \
        sum(int(h.numel() + p.numel()) for h, p in out_msgs.values())


def load_stage(parts: list[nn.Module], optimizer: torch.optim.Optimizer, state: dict[str, torch.Tensor]) -> int:
    """Every parameter of `parts` and its optimizer state from `state` (keys as stage_tensors names
    them). Returns the tensors loaded; KeyError naming a parameter `state` lacks."""
    by_name: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        name, _, kind = key.partition(SEP)
        if kind:
            by_name.setdefault(name, {})[kind] = t
    n = 0
    with torch.no_grad():
        for part in parts:
            for name, p in getattr(part, "module", part).named_parameters():
                if name not in state:
                    raise KeyError(f"regroup: the new stage's parameter {name} came from no survivor")
                p.copy_(state[name])
                kinds = by_name.get(name, {})
                if kinds:
                    optimizer.state[p] = {k: v.detach().clone().to(p.device) for k, v in kinds.items()}
                n += 1 + len(kinds)
    return n


def run_state(trainer: Any) -> dict:
    """What the trainer must resume with besides the tensors (duck-typed: train.Trainer)."""
    return {"step": trainer.step, "tokens_seen": trainer.tokens_seen, "data": dict(trainer.data.state_dict()),
            "scheduler": copy.deepcopy(trainer.scheduler.state_dict())}


def restore_run_state(trainer: Any, state: dict) -> None:
    """The trainer's step, tokens, data position and LR schedule as of the assembled step. The LR of
    every param group is the one the old run's scheduler had set (one schedule for all groups; the
    new stage may have a different number of groups), as a checkpoint's param_groups carry it."""
    trainer.step = int(state["step"])
    trainer.tokens_seen = int(state["tokens_seen"])
    trainer.data.load_state_dict(state["data"])
    sched = dict(state["scheduler"])
    groups = trainer.optimizer.param_groups
    lr, base = sched["_last_lr"][0], sched["base_lrs"][0]
    sched["_last_lr"], sched["base_lrs"] = [lr] * len(groups), [base] * len(groups)
    trainer.scheduler.load_state_dict(sched)
    for g in groups:
        g["lr"] = lr


class ReplicaCallback:
    """The trainer callback that refreshes the replicas at each step's end (after the checkpointer's)."""

    def __init__(self, replicas: StageReplicas):
        self.replicas = replicas

    def on_step_end(self, trainer: Any, record: dict | None) -> None:
        self.replicas.refresh(trainer.step, trainer.par.model_parts, trainer.optimizer, run_state(trainer))
