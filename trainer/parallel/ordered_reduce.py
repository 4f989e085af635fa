"""Sums over ranks whose bits depend only on the values: gather every rank's copy, add in rank order.

A ring all-reduce adds the ranks' values in an order set by where an element sits in the reduced
buffer. DDP reduces its first iteration in one bucket holding every gradient and later
iterations in buckets rebuilt in the order gradients became ready, so with three or more ranks
the same gradient is summed in another order in a process's first step than in the steps after:
a run resumed from a checkpoint (whose first step is the uninterrupted run's step k+1) ends up a
few float32 ulps away from the uninterrupted run. (Two ranks are immune: a+b == b+a bit for bit.)
Gathering and adding in rank order costs (n-1) x the buffer in traffic instead of the ring's
2(n-1)/n x, so it is used for gradients only where it buys that exactness (gloo, >= 3 ranks); the
reported scalars always go through it (a scalar costs nothing).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _gather(t: torch.Tensor, group: Any, n: int, async_op: bool = False):
    flat = t.detach().reshape(-1).contiguous()
    out = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
    # all_gather_single is all_gather_into_tensor's new name (torch 2.13 warns on the old one)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(out, flat, group=group, async_op=async_op)
    return out.view(n, -1), work


def _add_in_rank_order(rows: torch.Tensor) -> torch.Tensor:
    total = rows[0].clone()
    for i in range(1, rows.shape[0]):
        total += rows[i]
    return total


def ordered_sum(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum of `t` over the ranks of `group`, added in rank order (same shape as t, a new tensor)."""
    n = dist.get_world_size(group)
    if n == 1:
        return t.detach().clone()
    rows, _ = _gather(t, group, n)
    return _add_in_rank_order(rows).view(t.shape)


def ordered_mean(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    return ordered_sum(t, group) / dist.get_world_size(group)


def needs_ordered_grads(backend: str, dp: int) -> bool:
    """Whether DDP's gradient all-reduce is replaced by the rank-ordered sum (see module doc).
    NCCL is not bitwise reproducible across layouts anyway; CPU runs promise exact resume."""
    return backend == "gloo" and dp >= 3


def ordered_allreduce_hook(group: Any, bucket: Any) -> torch.futures.Future:
    """A DDP bucket's mean over the ranks, added in rank order (independent of the bucket layout)."""
    n = dist.get_world_size(group)
    buf = bucket.buffer()
    rows, work = _gather(buf, group, n, async_op=True)

    def finish(_: torch.futures.Future) -> torch.Tensor:
        return _add_in_rank_order(rows).div_(n).view(buf.shape)

    return work.get_future().then(finish)
