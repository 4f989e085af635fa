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
from trainer.runtime import heartbeat


def _group_key(g: torch.Tensor) -> tuple:
    mesh = getattr(g, "device_mesh", None)
    return ("plain",) if mesh is None else ("dtensor", id(mesh))


def fp32_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of gradients on one mesh (DTensors, whole across their shards) or of plain local
    ones, of any float dtype, accumulated and returned in fp32: bf16 gradients are not rounded to a
    bf16 norm per tensor as torch.nn.utils.get_total_norm would."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def total_grad_norm(params: list[torch.Tensor], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[_group_key(g)].append(g)
    if len(groups) == 1 and pp_group is None:  # one mesh (or none): its norm as is, no square and root
        return fp32_norm(grads)
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for gs in groups.values():
        sq = sq + fp32_norm(gs) ** 2
    if pp_group is not None:
        with heartbeat.during("collective"):  # a wait for the other stages' backward, not compute
            sq = ordered_sum(sq, pp_group)  # rank order: the norm decides the clip, and it is logged
    return sq.sqrt()


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, pp_group: dist.ProcessGroup | None = None,
                   all_params: list[torch.Tensor] | None = None,
                   optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """Norm over `params` (tied copies excluded); clip every gradient in `all_params` (default
    params) by it (scale_for_clip). On the device, without reading the norm back (no host sync)."""
    norm = total_grad_norm(params, pp_group)
    scale_for_clip(optimizer, all_params if all_params is not None else params, norm, max_norm)
    return norm


def scale_for_clip(optimizer: torch.optim.Optimizer | None, params: list[torch.Tensor], norm: torch.Tensor,
                   max_norm: float) -> None:
    """Clip this step's gradients of `params`: times torch's clip_grad_norm_ factor
    min(max_norm / (norm + 1e-6), 1), or 1 when the norm is not finite; nothing when max_norm <= 0.

    With a fused AdamW `optimizer` the factor goes into its step as `grad_scale` (the kernel divides
    each gradient by it as it reads it and writes the result back, the AMP grad scaler's path), so
    the gradients are not rewritten by a pass of their own: 4 bytes per fp32 gradient less per step
    (the clip's read + write become the kernel's write-back). Else one foreach multiply. Either way
    the step sees the same clipped gradients (to rounding: x / (1/c) against x * c, equal where
    nothing is clipped)."""
    coef = None
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
    if optimizer is not None and optimizer.defaults.get("fused"):
        optimizer.grad_scale = None if coef is None else coef.float().reciprocal()
        return
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if coef is not None and grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))


def _local(g: torch.Tensor) -> torch.Tensor:
    # Scaling is elementwise: each rank scales its own shard of a DTensor gradient.
    return g._local_tensor if hasattr(g, "_local_tensor") else g
