"""In-memory replicas of pipeline neighbours (issue 58): after a node loss the new layout takes its
stages from the survivors' memory, not from the last checkpoint on disk.

Each pipeline rank keeps, as of the end of a step, (a) a snapshot of its own stage's state and (b) a
replica of the NEXT stage's (ring order: the last stage's replica lives on the first rank), so any
one lost rank's stage survives on the rank before it. State = every parameter (full-model name,
stages.py) and its optimizer state (`name@exp_avg`, `name@exp_avg_sq`, `name@step`), plus the run's
own (step, tokens, data position, LR schedule) beside the own snapshot.

Refreshed every `every` steps, off the training's path: the step's end copies the own state into a
preallocated flat buffer (one `_foreach_copy_`), a thread of its own sends it to the previous rank
and receives the next one's, over a gloo group of its own (not the pipeline's, which the next step
uses meanwhile). Two versions of each are kept, written alternately, so a whole one survives while
the next is in flight; a version counts only once its transfer has completed. Memory: 4 x the
stage's state (params + 2 Adam moments: 12 x its parameters in fp32).

After a regroup (trainer/runtime/regroup.py): `assemble` agrees on the step every old stage is whole
at (stage_moves.agree_step), plans who sends what (stage_moves.plan_moves) and moves the tensors
over the new group; `load_stage` puts them into the new layout's stage modules and optimizer.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger("trainer")
SEP = "@"  # "<parameter name>@<optimizer state key>"


def stage_tensors(parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) of this rank's stage state, in a fixed order: each parameter by its full-model
    name, then its optimizer state tensors."""
    out = []
    for part in parts:
        for name, p in getattr(part, "module", part).named_parameters():
            out.append((name, p.detach()))
            for k, v in sorted(optimizer.state.get(p, {}).items()):
                if torch.is_tensor(v):
                    out.append((f"{name}{SEP}{k}", v.detach()))
    return out


def name_of(key: str) -> str:
    return key.split(SEP, 1)[0]


@dataclass
class Catalogue:
    """The keys, shapes and dtypes of a flat state buffer (one uint8 buffer, tensors back to back)."""

    keys: list[str]
    shapes: list[list[int]]
    dtypes: list[str]
    offsets: list[int] = field(default_factory=list)
    nbytes: int = 0

    def __post_init__(self) -> None:
        self.offsets, off = [], 0
        for shape, dt in zip(self.shapes, self.dtypes, strict=True):
            self.offsets.append(off)
            off += _numel(shape) * _dtype(dt).itemsize
        self.nbytes = off

    @classmethod
    def of(cls, tensors: list[tuple[str, torch.Tensor]]) -> Catalogue:
        return cls([k for k, _ in tensors], [list(t.shape) for _, t in tensors], [str(t.dtype) for _, t in tensors])

    def to_bytes(self) -> bytes:
        return json.dumps({"keys": self.keys, "shapes": self.shapes, "dtypes": self.dtypes}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Catalogue:
        d = json.loads(data)
        return cls(list(d["keys"]), [list(s) for s in d["shapes"]], [str(t) for t in d["dtypes"]])

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for k, shape, dt, off in zip(self.keys, self.shapes, self.dtypes, self.offsets, strict=True):
            n = _numel(shape) * _dtype(dt).itemsize
            out[k] = flat[off:off + n].view(_dtype(dt)).view(shape)
        return out


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"stage replica: {name!r} is not a torch dtype")
    return dt


class StageReplicas:
    """This rank's own-stage snapshots and its successor's replicas, two versions each (module doc).

    `line`: the global ranks of this rank's pipeline, by pp rank; `group`: a gloo group over them
    that nothing else uses (made by every rank: see `make_groups`)."""

    def __init__(self, line: list[int], pp_rank: int, group: Any, every: int = 1):
        self.pp, self.pp_rank, self.group, self.every = len(line), pp_rank, group, max(1, every)
        self.own_stage, self.next_stage = pp_rank, (pp_rank + 1) % len(line)
        self.pred, self.succ = line[(pp_rank - 1) % self.pp], line[(pp_rank + 1) % self.pp]
        self.own_cat: Catalogue | None = None
        self.next_cat: Catalogue | None = None
        self.own: list[torch.Tensor] = []
        self.rep: list[torch.Tensor] = []
        self.own_step: list[int | None] = [None, None]
        self.rep_step: list[int | None] = [None, None]
        self.run_state: list[dict | None] = [None, None]
        self._refs: list[torch.Tensor] = []
        self._views: list[list[torch.Tensor]] = []
        self._n = 0
        self.error: BaseException | None = None
        self.copy_s = 0.0      # main-thread seconds spent in refresh (copy + waiting for the last exchange)
        self.exchange_s = 0.0  # the exchange thread's seconds (off the main thread), wall
        self.exchange_cpu_s = 0.0  # ... and its CPU time: what it takes from the training's cores
        self._idle = threading.Event()
        self._idle.set()
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="stage-replicas", daemon=True)
        self._thread.start()

    # -- the training side ------------------------------------------------------------------------
    def refresh(self, step: int, parts: list[nn.Module], optimizer: torch.optim.Optimizer,
                run_state: dict) -> None:
        """At the end of `step` (after the optimizer step): snapshot, and hand the exchange to the thread."""
        if step % self.every:
            return
        t0 = time.perf_counter()
        self._idle.wait()  # the previous exchange has finished (it ran during this step)
        if self.own_cat is None:
            tensors = stage_tensors(parts, optimizer)
            self.own_cat = Catalogue.of(tensors)
            self.own = [torch.empty(self.own_cat.nbytes, dtype=torch.uint8) for _ in range(2)]
            self._refs = [t for _, t in tensors]
            self._views = [list(self.own_cat.views(f).values()) for f in self.own]
        slot = self._n % 2
        self._n += 1
        with torch.no_grad():
            torch._foreach_copy_(self._views[slot], self._refs)
        self.own_step[slot], self.run_state[slot] = step, run_state
        self.rep_step[slot] = None  # being overwritten from now on
        self._idle.clear()
        self._jobs.put((slot, step))
        self.copy_s += time.perf_counter() - t0

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            slot, step = job
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                if self.next_cat is None:
                    assert self.own_cat is not None  # made by refresh before the first job
                    self.next_cat = Catalogue.from_bytes(self._swap_bytes(self.own_cat.to_bytes()))
                    self.rep = [torch.empty(self.next_cat.nbytes, dtype=torch.uint8) for _ in range(2)]
                wait_all([dist.isend(self.own[slot], self.pred, group=self.group),
                          dist.irecv(self.rep[slot], self.succ, group=self.group)])
                self.rep_step[slot] = step
            except Exception as e:  # noqa: BLE001 - a peer gone, or the group cut for a regroup
                self.error = e
            finally:
                self.exchange_s += time.perf_counter() - t0
                self.exchange_cpu_s += time.thread_time() - c0
                self._idle.set()

    def _swap_bytes(self, data: bytes) -> bytes:
        n = torch.tensor([len(data)], dtype=torch.int64)
        got = torch.empty(1, dtype=torch.int64)
        wait_all([dist.isend(n, self.pred, group=self.group), dist.irecv(got, self.succ, group=self.group)])
        buf = torch.empty(int(got), dtype=torch.uint8)
        out = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        wait_all([dist.isend(out, self.pred, group=self.group), dist.irecv(buf, self.succ, group=self.group)])
        return buf.numpy().tobytes()

    def settle(self, timeout: float = 10.0) -> bool:
        """After a cut: wait for the exchange in flight to end (it raises on a cut connection)."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)

    # -- what survives ----------------------------------------------------------------------------
    def held(self) -> list[tuple[int, int]]:
        """(old stage, step) of every whole version this rank holds."""
        own = [(self.own_stage, s) for s in self.own_step if s is not None]
        rep = [(self.next_stage, s) for s in self.rep_step if s is not None] if self.pp > 1 else []
        return sorted(set(own + rep))

    def names(self) -> dict[int, list[str]]:
        """Old stage -> its parameter names (those this rank knows the catalogue of)."""
        out = {}
        for stage, cat in ((self.own_stage, self.own_cat), (self.next_stage, self.next_cat)):
            if cat is not None:
                out[stage] = sorted({name_of(k) for k in cat.keys})
        return out

    def tensors(self, stage: int, step: int) -> dict[str, torch.Tensor]:
        """Every key of old `stage`'s state as of `step`: views into the buffer that holds it."""
        for cat, flats, steps, s in ((self.own_cat, self.own, self.own_step, self.own_stage),
                                     (self.next_cat, self.rep, self.rep_step, self.next_stage)):
            if s == stage and step in steps and cat is not None:
                return cat.views(flats[steps.index(step)])
        raise KeyError(f"stage {stage} at step {step} is not held here")

    def run_state_at(self, step: int) -> dict | None:
        return self.run_state[self.own_step.index(step)] if step in self.own_step else None


def wait_all(works: list[Any]) -> None:
    """Wait for every posted op (all posted first: a ring of sends and receives never waits on itself)."""
    for w in works:
        if w is not None:
            w.wait()


def make_groups(lines: list[list[int]], rank: int) -> tuple[Any, list[int], int]:
    """A gloo group per pipeline line (collective: every rank calls it, in the same order); this
    rank's group, its line and its pp rank."""
    mine = None
    for line in lines:
        g = dist.new_group(line, backend="gloo")
        if rank in line:
            mine = (g, line, line.index(rank))
    if mine is None:
        raise ValueError(f"rank {rank} is in no pipeline line {lines}")
    return mine
