"""DiLoCo data parallelism (parallel.dp_sync diloco): replicas that step alone and average their change.

Each data-parallel replica trains on its own batches with its own inner optimizer (AdamW, or SGD)
and no gradient all-reduce. Every H = parallel.diloco.inner_steps steps the replicas average their
pseudo-gradient, anchor - local (the anchor: the global parameters at the previous sync, the same on
every replica), and an outer optimizer, torch's SGD with Nesterov momentum over the anchors, steps
the anchor with that average; every replica then continues from the new anchor (Douillard et al.
2023). The inner optimizer's state is kept across syncs, as in the paper.

Streaming DiLoCo (parallel.diloco.fragments N): the transformer blocks of this rank are cut into N
contiguous fragments (the embeddings go with the first, the final norm and head with the last,
weights tied across pipeline stages with the first on every stage, so their copies stay one), and
one fragment is synced every H/N steps, in turn: each fragment still every H steps, the peak
traffic 1/N of a full sync. With parallel.diloco.overlap_steps T the fragment's pseudo-gradient is
sent T steps before its outer step, by an asynchronous collective (async_op: gloo runs it on its
own threads, NCCL on its stream) that the next T inner steps overlap; at the outer step the local
fragment becomes merge_alpha x local + (1 - merge_alpha) x the new anchor (torchft's
fragment_update_alpha, the paper's mixing), so what the replica learnt during those T steps is not
all lost.

On the wire (sync_dtype): fp32 or bf16 pseudo-gradients are all-reduced (SUM, then / n); int8 ones
are quantised per tensor (scale = max |x| / 127, round to nearest) and all-gathered with their
scales, and every rank adds the n dequantised copies in rank order in fp32: one rounding (not a
second one after a quantised reduce-scatter), and the same bits on every replica. An all-gather's
input is 1/4 of the fp32 all-reduce's, but a ring moves (n-1) x it per rank where an all-reduce
moves 2 (n-1)/n x its buffer, so int8 saves 4x on the wire at n = 2, 2.7x at n = 3, nothing at n = 8
(a quantised reduce-scatter + all-gather, as torchft has, would keep 4x: not done here).

Where it sits: compose.py leaves the dp_replicate dim unwrapped (no DDP, no replicate) and shards
with FSDP2 over dp_shard only (*_hybrid: sharded within a node, DiLoCo across nodes, as
INTELLECT-1); this module syncs over the dp_replicate group of each pipeline stage, on local
shards (each shard rank with its peers of the same shard index). The trainer calls
`after_inner_step` after every optimizer step. Checkpoints (trainer/checkpoint/state.py) hold
the anchors as the model (what `trainer export` reads), the outer momentum and any in-flight
average, and each replica's own parameters and inner optimizer state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.config import ConfigError
from trainer.config.schema import DiLoCoConfig
from trainer.parallel.sync_meter import SyncMeter, nbytes

log = logging.getLogger("trainer")


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (a DTensor's shard), sharing its storage."""
    return p._local_tensor if hasattr(p, "_local_tensor") else p.detach()


@dataclass
class _Flight:
    """One bucket's collectives in flight and what decodes them."""
    works: list[Any]
    sent: list[torch.Tensor]         # kept alive until the works end
    out: list[torch.Tensor]          # what they write
    sizes: list[int]


@dataclass
class Fragment:
    """Parameters synced together; `buckets` are index lists, one collective (set) each."""
    params: list[nn.Parameter]
    buckets: list[list[int]]
    anchor: list[torch.Tensor] = field(default_factory=list)
    outer: torch.optim.SGD | None = None
    flights: list[_Flight] | None = None     # in flight: sent, not yet decoded
    average: list[torch.Tensor] | None = None  # decoded mean pseudo-gradient, waiting for its outer step

    @property
    def local(self) -> list[torch.Tensor]:
        return [local_tensor(p) for p in self.params]


class DiLoCo:
    """The outer loop of one rank (see module doc). `fragments`: from split_fragments."""

    def __init__(self, fragments: list[Fragment], group: Any, cfg: DiLoCoConfig, meter: SyncMeter,
                 replica: int):
        self.fragments, self.group, self.cfg, self.meter, self.replica = fragments, group, cfg, meter, replica
        self.n = dist.get_world_size(group)
        self.every = cfg.inner_steps // cfg.fragments   # steps between two fragment syncs
        self._started = False
        momentum = cfg.outer_momentum
        with torch.no_grad():
            for f in fragments:
                f.anchor = [t.clone() for t in f.local]
                f.outer = torch.optim.SGD(f.anchor, lr=cfg.outer_lr, momentum=momentum, nesterov=momentum > 0,
                                          foreach=True)
                for a in f.anchor:
                    if momentum > 0:  # zeros behave as SGD's first-step clone; the checkpoint then always has them
                        f.outer.state[a]["momentum_buffer"] = torch.zeros_like(a)
                    if cfg.overlap_steps > 0:  # the in-flight average a checkpoint may need to hold
                        a.grad = torch.zeros_like(a)

    # ------------------------------------------------------------------ schedule
    def _fragment_at(self, step: int) -> int:
        """The fragment whose outer step falls at `step` (a multiple of `every`)."""
        return (step // self.every - 1) % len(self.fragments)

    def after_inner_step(self, step: int, last: bool = False) -> None:
        """After optimizer step `step` (1-based). Sync j (j = 1, 2, ...) steps fragment (j-1) mod N at
        step j x H/N, its pseudo-gradient sent overlap_steps before. `last`: the run's final step,
        where a sync still in flight is completed (a run stopped early keeps it for its checkpoint)."""
        tau = self.cfg.overlap_steps
        if not self._started:  # the first step of this process: a resumed run's pending sync
            self._started = True
            self.restored(step - 1)
        if step % self.every == 0:
            if tau == 0:
                self._send(self.fragments[self._fragment_at(step)])
            self._outer_step(self.fragments[self._fragment_at(step)])
        if tau > 0 and (step + tau) % self.every == 0:
            self._send(self.fragments[self._fragment_at(step + tau)])
        if last:
            for f in self.fragments:
                if f.flights is not None or f.average is not None:
                    self._outer_step(f)

    def drain(self) -> None:
        """Wait for what is in flight (the process group is about to go); nothing is applied."""
        for f in self.fragments:
            for flight in f.flights or []:
                for w in flight.works:
                    w.wait()

    # ------------------------------------------------------------------ sync
    @torch.no_grad()
    def _send(self, f: Fragment) -> None:
        deltas = torch._foreach_sub(f.anchor, f.local)  # the pseudo-gradient: anchor - local
        f.flights = [self._send_bucket([deltas[i] for i in b]) for b in f.buckets]

    def _send_bucket(self, ds: list[torch.Tensor]) -> _Flight:
        sizes = [d.numel() for d in ds]
        flat = torch.cat([d.reshape(-1) for d in ds])
        start = time.perf_counter()
        if self.cfg.sync_dtype == "int8":
            q, scales = quantize_int8(flat, ds, sizes)
            out_q = torch.empty(self.n * q.numel(), dtype=torch.int8, device=q.device)
            out_s = torch.empty(self.n * scales.numel(), dtype=scales.dtype, device=q.device)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # 2.13's new name
            works = [gather(out_q, q, group=self.group, async_op=True),
                     gather(out_s, scales, group=self.group, async_op=True)]
            self.meter.count(nbytes(q) + nbytes(scales))
            self.meter.until_done(torch.futures.collect_all([w.get_future() for w in works]), start)
            return _Flight(works, [q, scales], [out_q, out_s], sizes)
        if self.cfg.sync_dtype == "bf16":
            flat = flat.to(torch.bfloat16)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.meter.count(nbytes(flat))
        self.meter.until_done(work.get_future(), start)
        return _Flight([work], [], [flat], sizes)

    def _decode(self, flight: _Flight) -> torch.Tensor:
        """The mean pseudo-gradient of one bucket, flat, fp32."""
        for w in flight.works:
            w.wait()
        if self.cfg.sync_dtype == "int8":
            out_q, out_s = flight.out
            rows, scales = out_q.view(self.n, -1), out_s.view(self.n, -1)
            per = torch.tensor(flight.sizes, device=rows.device)
            total = rows[0].float() * scales[0].repeat_interleave(per)
            for r in range(1, self.n):  # rank order: the same bits on every replica
                total += rows[r].float() * scales[r].repeat_interleave(per)
            return total.div_(self.n)
        return flight.out[0].float().div_(self.n)

    @torch.no_grad()
    def _resolve(self, f: Fragment) -> None:
        """In flight -> decoded into f.average (per-parameter fp32 tensors shaped like the anchors)."""
        if f.flights is None:
            return
        average: list[torch.Tensor | None] = [None] * len(f.params)
        for b, flight in zip(f.buckets, f.flights, strict=True):
            for i, v in zip(b, self._decode(flight).split(flight.sizes), strict=True):
                average[i] = v.view_as(f.anchor[i])
        f.flights = None
        if self.cfg.overlap_steps > 0:  # kept in the anchors' grads: a checkpoint may save them
            torch._foreach_copy_([a.grad for a in f.anchor], average)
            f.average = [a.grad for a in f.anchor]
        else:
            f.average = average

    @torch.no_grad()
    def _outer_step(self, f: Fragment) -> None:
        self._resolve(f)
        if f.average is None:
            raise RuntimeError("DiLoCo: an outer step with no pseudo-gradient sent (schedule out of step)")
        keep = [a.grad for a in f.anchor]
        for a, g in zip(f.anchor, f.average, strict=True):
            a.grad = g
        f.outer.step()
        for a, g in zip(f.anchor, keep, strict=True):
            a.grad = g
        f.average = None
        if self.cfg.overlap_steps == 0:
            torch._foreach_copy_(f.local, f.anchor)
        else:  # local progress of the overlapped steps partly kept (merge_alpha)
            torch._foreach_lerp_(f.local, f.anchor, 1.0 - self.cfg.merge_alpha)
            torch._foreach_zero_(keep)  # "pending" in a checkpoint: zeros while nothing is in flight

    # ------------------------------------------------------------------ checkpoint
    def global_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """id(parameter) -> {"anchor", "momentum"?, "pending"?}: tensors shaped like the parameter (a
        DTensor over its mesh where it is one), the same on every replica. A sync in flight is waited
        for and decoded here, so "pending" holds its average (zeros where none is pending)."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for f in self.fragments:
            self._resolve(f)
            for i, (p, a) in enumerate(zip(f.params, f.anchor, strict=True)):
                entry = {"anchor": a}
                if self.cfg.outer_momentum > 0:
                    entry["momentum"] = f.outer.state[a]["momentum_buffer"]
                if self.cfg.overlap_steps > 0:
                    entry["pending"] = f.anchor[i].grad
                out[id(p)] = {k: like_param(p, v) for k, v in entry.items()}
        return out

    @torch.no_grad()
    def start_from_anchor(self) -> None:
        """A replica the checkpoint does not hold (an elastic run's rejoining one): its parameters become
        the anchors just loaded, the global parameters every replica agrees on; a lost replica's own
        change since the last sync is simply not in any average (trainer/checkpoint/state.py)."""
        for f in self.fragments:
            torch._foreach_copy_(f.local, f.anchor)

    def restored(self, step: int) -> None:
        """Before the first step of a run resumed at `step` (the checkpoint's tensors loaded in place):
        a fragment whose sync was in flight then finds its average in its anchors' grads."""
        tau = self.cfg.overlap_steps
        if tau == 0 or step < 1:
            return
        for s in range(step + 1, step + tau + 1):  # outer steps due within tau steps were sent by `step`
            if s % self.every == 0 and s - tau <= step:
                f = self.fragments[self._fragment_at(s)]
                f.flights, f.average = None, [a.grad for a in f.anchor]


def like_param(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's part) as the parameter is: a DTensor on its mesh, sharing storage."""
    if not hasattr(p, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)


def quantize_int8(flat: torch.Tensor, ds: list[torch.Tensor], sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor symmetric int8: scale = max |x| / 127 (fp32, one per tensor), q = round(x / scale)."""
    scales = torch.stack(torch._foreach_norm(ds, float("inf"))).float() / 127.0
    per = torch.tensor(sizes, device=flat.device)
    q = torch.round(flat / scales.clamp_min(torch.finfo(torch.float32).tiny).repeat_interleave(per))
    return q.clamp_(-127, 127).to(torch.int8), scales


def split_fragments(parts: list[nn.Module], blocks: list[nn.Module], n: int,
                    tied: list[nn.Parameter]) -> tuple[list[Fragment], str | None]:
    """This rank's parameters in `n` fragments of len(blocks) / n contiguous blocks each, or the
    reason they cannot be split. Parameters outside the blocks follow module order (embeddings
    with the first fragment, norm and head with the last); `tied` (copies of one weight on several
    pipeline stages) go to the first fragment, each in a collective of its own, so that every copy
    is averaged from the same buffer and they stay one weight bit for bit."""
    if n > 1 and (not blocks or len(blocks) % n):
        return [], (f"parallel.diloco.fragments {n} does not divide the {len(blocks)} transformer blocks this rank "
                    f"holds; use a divisor of {len(blocks)}" if blocks else
                    f"parallel.diloco.fragments {n}: this model has no transformer blocks to split; use 1")
    per = max(len(blocks) // n, 1)
    owner = {id(p): i // per for i, b in enumerate(blocks) for p in b.parameters()}
    tied_ids = {id(p) for p in tied}
    members: list[list[nn.Parameter]] = [[] for _ in range(n)]
    seen: set[int] = set()
    current = 0
    for part in parts:
        for p in part.parameters():
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            if id(p) in tied_ids:
                continue
            current = owner.get(id(p), current)
            members[current].append(p)
    members[0] += [p for p in tied if p.requires_grad]
    frags = []
    for ps in members:
        regular = [j for j, p in enumerate(ps) if id(p) not in tied_ids]
        buckets = ([regular] if regular else []) + [[j] for j, p in enumerate(ps) if id(p) in tied_ids]
        frags.append(Fragment(ps, buckets))
    return frags, None


def check_layout(cfg: Any, dims: Any) -> bool:
    """parallel.dp_sync diloco against the layout, the same answer on every rank (before anything is
    built); whether DiLoCo runs. One replica: a warning, and the run trains as one replica would."""
    p = cfg.parallel
    if p.dp_sync != "diloco":
        return False
    if dims.sharding in ("zero2", "zero3"):
        raise ConfigError(f"parallel.dp_sync diloco: parallel.sharding {dims.sharding} shards over every dp rank, "
                          f"which leaves no replicas to average; use {dims.sharding}_hybrid (sharded within a node, "
                          f"DiLoCo across nodes) or ddp")
    if dims.tp > 1:
        raise ConfigError("parallel.dp_sync diloco with parallel.tp > 1 is not supported yet; use tp 1")
    if dims.dp_replicate == 1:
        log.warning("parallel.dp_sync diloco: this layout has one replica (dp_replicate 1 of dp %d), nothing to "
                    "average: training as that one replica, without DiLoCo", dims.dp)
        return False
    return True


def agree(problem: str | None) -> None:
    """Raise `problem` (a ConfigError) on every rank if any rank has one (pipeline stages differ)."""
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    first = next((e for e in problems if e), None)
    if first:
        raise ConfigError(problem or first)


def describe(frags: list[Fragment], cfg: DiLoCoConfig, n: int) -> str:
    numel = sum(local_tensor(p).numel() for f in frags for p in f.params)
    per = {"fp32": 4, "bf16": 2, "int8": 1}[cfg.sync_dtype]
    return (f"DiLoCo over {n} replicas: no gradient all-reduce; every {cfg.inner_steps} steps the pseudo-gradient "
            f"({numel / 1e6:.2f}M values here, {numel * per / 2**20:.1f} MiB in {cfg.sync_dtype}) averaged, outer "
            f"SGD lr {cfg.outer_lr:g} Nesterov momentum {cfg.outer_momentum:g}; {cfg.fragments} fragment(s), one "
            f"every {cfg.inner_steps // cfg.fragments} steps, sent {cfg.overlap_steps} step(s) ahead")
