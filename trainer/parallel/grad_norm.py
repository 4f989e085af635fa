"""Global gradient norm and clipping across any mix of TP, FSDP and pipeline stages.

`torch.nn.utils.clip_grad_norm_` needs every gradient on one mesh; with TP (2-D DTensors),
FSDP-only parameters (1-D DTensors), plain replicated tensors and pipeline stages on other
ranks, the norm has to be assembled: per mesh group the DTensor norm (exact across its
shards), then the squares summed over pipeline ranks. Tied-weight copies on later pipeline
stages are left out so the tied gradient counts once, as in the single-process model.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from trainer.parallel.ordered_reduce import ordered_sum


def _group_key(g: torch.Tensor) -> tuple:
    mesh = getattr(g, "device_mesh", None)
    return ("plain",) if mesh is None else ("dtensor", id(mesh))


def total_grad_norm(params: list[torch.Tensor], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[_group_key(g)].append(g)
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for gs in groups.values():
        norm = torch.nn.utils.get_total_norm(gs, 2.0, foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        sq = sq + norm.float() ** 2
    if pp_group is not None:
        sq = ordered_sum(sq, pp_group)  # rank order: the norm decides the clip, and it is logged
    return sq.sqrt()


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, pp_group: dist.ProcessGroup | None = None,
                   all_params: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Norm over `params` (tied copies excluded); scale every gradient in `all_params` (default params).

    On the device, without reading the norm back (no host sync): the factor is torch's
    clip_grad_norm_ formula, min(max_norm / (norm + 1e-6), 1), and 1 when the norm is not finite."""
    norm = total_grad_norm(params, pp_group)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
        grads = [_local(p.grad) for p in (all_params if all_params is not None else params) if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm


def _local(g: torch.Tensor) -> torch.Tensor:
    # Scaling is elementwise: each rank scales its own shard of a DTensor gradient.
    return g._local_tensor if hasattr(g, "_local_tensor") else g
