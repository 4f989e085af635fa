"""Data parallelism with torch's own wrappers: DDP, and FSDP2 `fully_shard` for ZeRO-2/3 and hybrid.

- ddp / zero0: DistributedDataParallel over the flat dp mesh.
- zero3: fully_shard per transformer block, then the root; params resharded after forward.
- zero2: the same with reshard_after_forward=False (params stay gathered until backward ends;
  grads and optimizer state sharded).
- *_hybrid: the same over a 2-D (dp_replicate, dp_shard) mesh: HSDP, replicate across nodes.

Known trap: over gloo, ReduceOp.AVG has been a silent SUM (pytorch/pytorch#162338), so FSDP2
on gloo is told to reduce with SUM and divide itself (`set_force_sum_reduction_for_comms`).
tests/test_trainer_dp.py compares every strategy with a single process to catch regressions.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger("trainer")


def apply_ddp(model: nn.Module, dp_mesh: Any, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    # Parameters are already identical on every rank (same seed), but DDP broadcasts rank 0's anyway.
    kwargs: dict[str, Any] = {"device_mesh": dp_mesh}
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    return DDP(model, **kwargs)


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], mesh: Any, *, reshard_after_forward: bool,
               param_dtype: torch.dtype | None, backend: str) -> nn.Module:
    """fully_shard each block, then the root (which picks up embeddings, final norm and head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else \
        MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    # The root's params are used last in forward and first in backward: no point resharding them.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    if backend == "gloo":
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    return model


def set_grad_sync(model: nn.Module, enabled: bool) -> None:
    """Skip (False) or perform (True) the gradient reduction of the next backward (accumulation)."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
    elif hasattr(model, "require_backward_grad_sync"):  # DDP: what no_sync() toggles
        model.require_backward_grad_sync = enabled
