"""The training loop's in-place regroup (issue 58, `elastic.in_place`): what train.run does when a
step fails because a node is gone, or when the runner moves the job to a new layout at a step boundary.

Why in the process: a restart stops every container, imports torch again, meets again and reads the
last checkpoint (tens of seconds, up to checkpoint.interval steps redone). Here the survivors keep
their processes and their weights:

1. before the first group, `InPlace.start` sets up the connection cut and the regroup.json watcher
   (trainer/runtime/regroup.py); `attach` gives each pipeline rank in-memory replicas of its
   successor's stage (stage_replicas.py), refreshed every `elastic.replica_every` steps;
2. the runner writes regroup.json (contract/regroup.py): the watcher cuts the old group's
   connections, the step in flight raises, `recover` catches it (or `BoundaryCallback` stops the
   loop at `at_step` for a planned switch), waits up to `elastic.wait_s` for the file, leaves the old
   group and joins the new one (runner's address and port, its epoch's store prefix);
3. the new layout's Trainer is built (`build`, train.py's), its stages assembled from the survivors'
   memory (stage_assembly.py: the step every old stage is whole at), the run state restored, and the
   loop goes on; every step writes regroup-status.local<L>.json so the runner knows.

A node coming back: the runner starts one process there with JOIN_ENV (`join`): no group, no weights.
The running ranks get regroup.json with `at_step` and stop after the same step (BoundaryCallback: the
pending epoch rides the step-end preemption vote), regroup as in 2-3, and the newcomer receives its
stages over the new group (stage_assembly.assemble: a rank holding nothing receives all it needs).

What it cannot do falls back to the restart path by ending the process with the error: no
regroup.json within wait_s, this node left out of the new layout, or some old stage surviving in no
memory (NoCopy: the restart then resumes from the disk checkpoint).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contract.regroup import Regroup
from trainer.parallel.pipeline import pp_lines
from trainer.parallel.stage_assembly import ReplicaCallback, assemble, load_stage, restore_run_state
from trainer.parallel.stage_moves import NoCopy
from trainer.parallel.stage_replicas import StageReplicas, make_groups
from trainer.runtime import heartbeat
from trainer.runtime.dist_env import process_started
from trainer.runtime.regroup import ConnectionCut, Watcher, rejoin, write_status

log = logging.getLogger("trainer")
# Set by the runner in the container it starts on a node coming back: the regroup epoch that process
# joins (it has no group and no weights until then; InPlace.join).
JOIN_ENV = "ELASTIC_JOIN_EPOCH"


class RegroupNow(Exception):
    """Raised at a step boundary when the runner asked for a switch after this step (`at_step`)."""


class BoundaryCallback:
    """Ends the loop, on every rank after the same step, once a planned regroup (a node back: no step
    abandoned) is pending and its `at_step` reached. Ranks see the file at different moments, so a rank
    acting on its own file would leave the others waiting in the next step: the pending epoch rides the
    checkpointer's step-end preemption vote (one all_reduce(MAX) that runs anyway; trainer/checkpoint/
    preempt.py), or, with no vote (checkpoint.on_signal false), a one-number all_reduce of its own.
    Only at steps whose stage replicas are whole (`every`): the survivors' stages are taken as of it."""

    def __init__(self, watcher: Watcher, every: int = 1):
        self.watcher, self.every = watcher, max(1, every)
        self.vote: Any = None
        self.slot = -1

    def bind(self, trainer: Any) -> None:
        """Ride the trainer's preemption vote where it has one."""
        for cb in trainer.callbacks:
            vote = getattr(cb, "preemption", None)
            if vote is not None and hasattr(vote, "riders"):
                self.vote, self.slot = vote, len(vote.riders)
                vote.riders.append(lambda: self.mine(trainer))
                return

    def mine(self, trainer: Any) -> int:
        """This rank's word: the epoch of a planned regroup due at this step, else 0."""
        spec = self.watcher.pending
        due = spec is not None and spec.at_step is not None and trainer.step >= spec.at_step
        return spec.epoch if due and spec is not None else 0

    def agreed(self, trainer: Any) -> int:
        if self.vote is not None:
            return self.vote.rode[self.slot] if len(self.vote.rode) > self.slot else 0
        word = self.mine(trainer)
        if getattr(trainer, "env", None) is None or not trainer.env.distributed:
            return word
        import torch
        import torch.distributed as dist

        flag = torch.tensor([word], dtype=torch.int64, device=trainer.device if trainer.backend == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def on_step_end(self, trainer: Any, record: dict | None) -> None:
        epoch = self.agreed(trainer)  # every step where it is a collective of its own: all ranks call it
        if trainer.stop_requested or trainer.step % self.every:
            return  # a preemption goes first; replicas not whole at this step: the next such step
        if epoch > self.watcher.epoch:
            raise RegroupNow(f"regroup epoch {epoch} after step {trainer.step}")


def _parts_names(trainer: Any) -> list[str]:
    return [n for part in trainer.par.model_parts for n, _ in getattr(part, "module", part).named_parameters()]


def new_config(cfg: Any, spec: Regroup) -> Any:
    """The run's config in the new layout: degrees, batch and partition from the file; never a disk
    resume (the stages come from memory: a checkpointer told to resume would overwrite them)."""
    lay = spec.layout
    out = copy.deepcopy(cfg)
    out.parallel.pp, out.parallel.dp, out.parallel.tp = lay.pp, lay.dp, lay.tp
    out.parallel.partition = lay.partition
    out.train.batch_size = lay.batch_size
    out.checkpoint.resume = None
    return out


class InPlace:
    """One rank's in-place regroup machinery (module doc). Made before the first process group."""

    def __init__(self, cfg: Any, env: Any, join_epoch: int | None = None):
        self.cfg, self.env = cfg, env
        self.node = os.environ.get("NODE_NAME") or os.uname().nodename
        self.run_dir = Path(cfg.output_dir)
        self.cut = ConnectionCut()  # before any group: what it spares is not a group's
        self.join_epoch = join_epoch  # a node coming back: the epoch whose group it joins (JOIN_ENV)
        self.watcher = Watcher(self.run_dir, self.node, env.local_rank, self.cut,
                               baseline=None if join_epoch is None else join_epoch - 1).start()
        self.replicas: StageReplicas | None = None
        self.history: list[dict[str, Any]] = []
        self.cost = {"refreshes": 0, "copy_s": 0.0, "exchange_cpu_s": 0.0}  # every layout's replicas together
        self.backend = "gloo"
        # The trainer after a recover: False = no recover yet (the caller's own), None = ended in one.
        self.current: Any = False

    def attach(self, trainer: Any) -> None:
        """Replicas for a pipelined layout (pp > 1, tp 1), and the step-boundary check. Collective."""
        self.backend = trainer.backend
        if trainer.dims.pp > 1 and trainer.dims.tp == 1 and trainer.dims.mesh is not None:
            group, line, pp_rank = make_groups(pp_lines(trainer.dims.mesh), self.env.rank)
            self.replicas = StageReplicas(line, pp_rank, group, every=self.cfg.elastic.replica_every)
            # First: the snapshot is taken, and its exchange runs on its thread, while the checkpointer
            # (and anything after it that may hold the step's end) does its work.
            trainer.callbacks.insert(0, ReplicaCallback(self.replicas))
        # after the refresh and the checkpointer's vote: that step's replicas count, the vote carries the bit
        boundary = BoundaryCallback(self.watcher, self.cfg.elastic.replica_every if self.replicas else 1)
        boundary.bind(trainer)
        trainer.callbacks.append(boundary)

    def _retire(self) -> None:
        rep, self.replicas = self.replicas, None
        if rep is not None:
            rep.close()
            self.cost["refreshes"] += rep._n
            self.cost["copy_s"] += rep.copy_s
            self.cost["exchange_cpu_s"] += rep.exchange_cpu_s

    def close(self) -> None:
        """The watcher and the replicas' thread stopped; their cost in one line (bench/elastic.py reads it)."""
        self.watcher.stop()
        self._retire()
        c = self.cost
        if c["refreshes"]:
            log.info("stage replicas: %d refresh(es), %.4f s on the training thread, %.4f s CPU on the exchange "
                     "thread", c["refreshes"], c["copy_s"], c["exchange_cpu_s"])

    def recover(self, error: BaseException, trainer: Any, build: Callable[[Any, Any], Any]) -> Any | None:
        """After `trainer.fit` raised: the new layout's trainer, ready to fit on, or None when this
        error is not a regroup's (the caller re-raises: the restart path). `build(cfg, env)` makes a
        Trainer for a layout (train.py's)."""
        planned = isinstance(error, RegroupNow)
        # planned: the watcher set `pending` and sets its event right after
        # planned: the vote may carry another rank's word before this rank's watcher read its own file
        spec = self.watcher.wait(float(self.cfg.elastic.wait_s))
        if spec is None:
            log.warning("regroup: no regroup.json within elastic.wait_s %.0f s after %s: the restart path takes "
                        "over", self.cfg.elastic.wait_s, type(error).__name__)
            return None
        times = dict(self.watcher.times)
        if spec.at_step is not None and not planned:
            return None  # a failure while a planned switch was pending: not a regroup of ours
        rank = spec.rank_of(self.node, self.env.local_rank)
        if rank is None:
            log.warning("regroup: epoch %d leaves node %s out: this process ends", spec.epoch, self.node)
            return None
        try:
            return self._regroup(spec, rank, times, trainer, build)
        except NoCopy as e:
            log.warning("regroup: %s: the restart path resumes from the disk checkpoint", e)
            write_status(self.run_dir, self.env.local_rank, spec.epoch, "failed", times, rank=rank, error=str(e)[:200])
            return None
        except Exception as e:  # the runner stops waiting now, not at its timeout; the error goes on
            write_status(self.run_dir, self.env.local_rank, spec.epoch, "failed", times, rank=rank,
                         error=f"{type(e).__name__}: {str(e)[:200]}")
            raise

    def join(self, backend: str, build: Callable[[Any, Any], Any]) -> Any | None:
        """A node coming back (started with JOIN_ENV): no group, no weights. Waits up to elastic.wait_s for
        its epoch's regroup.json, joins the running ranks' new group and receives its stages from them
        (the running ranks switch at a step boundary: BoundaryCallback). None: no file, or this node is
        not in it (the process ends; the runner's restart path goes on)."""
        self.backend = backend
        # The runner writes the file only once every newcomer says this: the running ranks train on
        # meanwhile (their pause is the switch, not this process's start-up).
        ready = {"ready": time.time()}
        if (started := process_started()) is not None:  # its start-up, split: the launcher's part, then its own
            ready["started"] = started
        write_status(self.run_dir, self.env.local_rank, int(self.join_epoch or 0), "ready", ready)
        spec = self.watcher.wait(float(self.cfg.elastic.wait_s))
        rank = None if spec is None else spec.rank_of(self.node, self.env.local_rank)
        if spec is None or rank is None or spec.epoch != self.join_epoch:
            log.warning("regroup: started to join epoch %s, got %s: this process ends", self.join_epoch,
                        "no regroup.json within elastic.wait_s" if spec is None else f"epoch {spec.epoch} without it")
            return None
        times = {**ready, **self.watcher.times}
        try:
            return self._regroup(spec, rank, times, None, build)
        except Exception as e:
            write_status(self.run_dir, self.env.local_rank, spec.epoch, "failed", times, rank=rank,
                         error=f"{type(e).__name__}: {str(e)[:200]}")
            raise

    def _regroup(self, spec: Regroup, rank: int, times: dict[str, float], trainer: Any,  # long: the steps, in order
                 build: Callable[[Any, Any], Any]) -> Any:
        heartbeat.mark("build")
        write_status(self.run_dir, self.env.local_rank, spec.epoch, "left", times, rank=rank)
        rep, old_pp = self.replicas, (trainer.dims.pp if trainer is not None else None)
        if rep is not None:
            rep.settle(10)  # the exchange in flight has ended (its connections were cut too)
        if trainer is not None:
            trainer.close()
            self.current = None  # closed: the caller must not close it again
            del trainer
            gc.collect()  # the old stages, schedule and groups go before the new ones come
        rejoin_s = rejoin(spec, rank, self.backend, nnodes=len(spec.ranks))
        times["joined"] = time.time()
        self.watcher.done(spec)
        write_status(self.run_dir, self.env.local_rank, spec.epoch, "joined", times, rank=rank)
        self.env = dataclasses.replace(self.env, rank=rank, world_size=spec.world_size,
                                       local_world_size=len(spec.ranks.get(self.node, [rank])),
                                       master_addr=spec.master_addr, master_port=spec.master_port)
        self.cfg = new_config(self.cfg, spec)
        t0 = time.perf_counter()
        new = build(self.cfg, self.env)
        build_s = time.perf_counter() - t0
        asm = assemble(rep, old_pp if rep is not None else None, _parts_names(new))
        load_stage(new.par.model_parts, new.optimizer, asm.state)
        restore_run_state(new, asm.run_state)
        self._retire()
        self.attach(new)
        times["resumed"] = time.time()
        write_status(self.run_dir, self.env.local_rank, spec.epoch, "resumed", times, rank=rank, step=asm.step)
        self.history.append({"epoch": spec.epoch, "from_step": asm.step, "rejoin_s": rejoin_s, "build_s": build_s,
                             "assemble_s": asm.seconds, "moves": asm.moves, "bytes_in": asm.bytes_in,
                             "bytes_out": asm.bytes_out, "times": times})
        log.warning("regroup: epoch %d (%s): rank %d of %d, pp %d dp %d, resumed after step %d from memory "
                    "(%d tensor(s) moved; rejoin %.2f s, build %.2f s, assemble %.2f s)", spec.epoch,
                    spec.why or "no reason given", rank, spec.world_size, spec.layout.pp, spec.layout.dp, asm.step,
                    asm.moves, rejoin_s, build_s, asm.seconds)
        return new
