"""Data parallelism with torch's own wrappers: DDP, and FSDP2 `fully_shard` for ZeRO-2/3 and hybrid.

- ddp / zero0: DistributedDataParallel over the flat dp mesh.
- zero3: fully_shard per transformer block, then the root; params resharded after forward.
- zero2: the same with reshard_after_forward=False (params stay gathered until backward ends;
  grads and optimizer state sharded).
- *_hybrid: the same over a 2-D (dp_replicate, dp_shard) mesh: HSDP, replicate across nodes.
- train.param_dtype bf16: FSDP2's MixedPrecisionPolicy (bf16 weights in compute, fp32 master
  weights, fp32 gradient reduction) on every layout: ddp becomes FSDP2 over (replicate dp, shard 1)
  and one process computes with bf16 copies of fp32 master weights (master_weights.py), so
  activations are bf16 throughout instead of autocast's bf16 matmuls over an fp32 residual stream.

DDP reduces into its buckets' memory (gradient_as_bucket_view: no second copy of the gradients)
through one Python communication hook when the trainer meters the sync (metrics.jsonl's
dp_sync_bytes / dp_sync_s: sync_meter.py; a few microseconds per 25 MB bucket), for ordered sums
on gloo with >= 3 ranks, or for a profile that times each bucket; else with its own C++ all-reduce.
FSDP2's reduce-scatters (and HSDP's / replicate's all-reduces) are metered by MeteredReduceScatter.

Known trap: over gloo, ReduceOp.AVG has been a silent SUM (pytorch/pytorch#162338), so FSDP2
on gloo is told to reduce with SUM and divide itself (`set_force_sum_reduction_for_comms`).
tests/distributed/test_trainer_dp.py compares every strategy with a single process to catch regressions.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from trainer.parallel.sync_meter import SyncMeter, nbytes

log = logging.getLogger("trainer")


class GradReduceHook:
    """The one DDP communication hook of a run (DDP takes one): each gradient bucket's mean over the
    dp ranks, either as DDP itself computes it (bucket x 1/n, SUM all-reduce: the same bits as DDP
    without a hook) or added in rank order (ordered_reduce.py: gloo with >= 3 ranks, where DDP's
    first-iteration bucket layout would change the bits of a resumed run). `observer`, when set
    (the profiler, only while it records a batch), wraps the reduction: observer(bucket, reduce)."""

    def __init__(self, group: Any, ordered: bool, meter: SyncMeter | None = None):
        self.group, self.ordered, self.meter = group, ordered, meter
        self.observer: Any = None

    def reduce(self, bucket: Any) -> Any:
        from trainer.parallel.ordered_reduce import ordered_allreduce_hook

        if self.ordered:
            return ordered_allreduce_hook(self.group, bucket)
        buf = bucket.buffer()
        buf.mul_(1.0 / self.group.size())
        return dist.all_reduce(buf, group=self.group, async_op=True).get_future().then(lambda f: f.value()[0])

    # Unannotated on purpose: DDP inspects the signature and rejects any annotation of `bucket` or
    # of the result other than the real GradBucket / Future[Tensor] objects (strings included).
    def hook(self, _state, bucket):
        start = time.perf_counter()
        fut = self.reduce(bucket) if self.observer is None else self.observer(bucket, self.reduce)
        if self.meter is None:
            return fut
        self.meter.count(nbytes(bucket.buffer()))  # what this rank hands to the collective
        return self.meter.until_done(fut, start)


def apply_ddp(model: nn.Module, dp_mesh: Any, device: torch.device, backend: str, observe: bool = True,
              meter: SyncMeter | None = None) -> nn.Module:
    """DDP over `dp_mesh`; the comm hook (GradReduceHook, as `ddp.grad_reduce`) only when the sums must
    be ordered, `observe` (a profile will time the reduction) or `meter` counts them."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainer.parallel.ordered_reduce import needs_ordered_grads

    # Parameters are already identical on every rank (same seed), but DDP broadcasts rank 0's anyway.
    kwargs: dict[str, Any] = {"device_mesh": dp_mesh, "gradient_as_bucket_view": True}
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    ddp = DDP(model, **kwargs)
    ordered = needs_ordered_grads(backend, dp_mesh.size())
    if ordered or observe or meter is not None:
        ddp.grad_reduce = GradReduceHook(dp_mesh.get_group(), ordered, meter)
        ddp.register_comm_hook(None, ddp.grad_reduce.hook)
    return ddp


def one_rank_mesh(device: torch.device) -> Any:
    """A 1-D mesh of this process alone (FSDP2 needs a mesh, also on one device); starts a process
    group of one rank on an in-memory store (no network) when none is running."""
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.runtime.dist_env import init_one_rank_group

    init_one_rank_group(device)
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], mesh: Any, *, reshard_after_forward: bool,
               param_dtype: torch.dtype | None, backend: str, pipeline: bool = False) -> nn.Module:
    """fully_shard each block, then the root (which picks up embeddings, final norm and head).

    zero3 reshards a block's parameters after its forward, except where that only costs a second
    all-gather: the last block (its backward starts right after the forward ends) and every block
    of a pipeline stage (each microbatch's forward would gather them again)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else \
        MixedPrecisionPolicy()
    for i, block in enumerate(blocks):
        reshard = reshard_after_forward and not pipeline and i < len(blocks) - 1
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    # The root's params are used last in forward and first in backward: no point resharding them.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    if backend == "gloo":
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    return model


class MeteredReduceScatter(DefaultReduceScatter):
    """FSDP2's own reduce-scatter (set_custom_reduce_scatter), counted: each call's input into the
    meter, and the time the (blocking on gloo) call takes. HSDP's and replicate's all-reduce of the
    reduce-scatter's output follows inside FSDP2 with no hook of its own: its size is counted in
    `all_reduced` (FSDP2's all-reduce hook, which runs right after it), timed from the end of the
    reduce-scatter (or, on one shard rank, from the allocation of its output) to that hook."""

    def __init__(self, meter: SyncMeter):
        super().__init__()
        self.meter = meter
        self.mark = time.perf_counter()

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.mark = time.perf_counter()
        return super().allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        start = time.perf_counter()
        self.meter.count(nbytes(input_tensor))
        work = super().__call__(output_tensor, input_tensor, group, op, async_op=async_op)
        self.mark = time.perf_counter()
        self.meter.span(start, self.mark)
        return work

    def all_reduced(self, reduce_output: torch.Tensor) -> None:
        self.meter.count(nbytes(reduce_output))
        self.meter.span(self.mark, time.perf_counter())


def meter_fsdp(model: nn.Module, meter: SyncMeter, all_reduces: bool) -> None:
    """Count the gradient reductions of every FSDP2 / replicate module of `model`; `all_reduces`: the
    mesh has a replicate dim (HSDP, replicate), whose all-reduce FSDP2 runs after each reduce-scatter."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            comm = MeteredReduceScatter(meter)
            m.set_custom_reduce_scatter(comm)
            if all_reduces:
                m.set_all_reduce_hook(comm.all_reduced)


def set_grad_sync(model: nn.Module, enabled: bool) -> None:
    """Skip (False) or perform (True) the gradient reduction of the next backward (accumulation)."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
    elif hasattr(model, "require_backward_grad_sync"):  # DDP: what no_sync() toggles
        model.require_backward_grad_sync = enabled
