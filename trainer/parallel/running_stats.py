"""BatchNorm's running statistics across data-parallel replicas: dp rank 0's, on every replica,
after every optimizer step.

Each replica updates its running mean and variance from its own microbatches. DDP overwrites them
with rank 0's at the next forward (broadcast_buffers); FSDP2 and the pipelines' replicate never do.
Left alone, replicas would evaluate with different statistics and a checkpoint would keep whichever
replica's copy its planner picked, so a resumed run would not evaluate like the uninterrupted one.
Broadcasting rank 0's after each step is what DDP does anyway, a step earlier: training numbers are
unchanged (BatchNorm normalises with batch statistics while training). Models without BatchNorm
(every transformer) send nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def sync_running_stats(parts: list[nn.Module], dims: Any) -> None:
    """Replace every replica's BatchNorm buffers with dp rank 0's (one broadcast per dtype)."""
    if dims.mesh is None or dims.dp == 1:
        return
    buffers = [b for part in parts for m in part.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
               for b in m.buffers()]
    if not buffers:
        return
    group = dims.dp_mesh.get_group()
    for dtype in sorted({b.dtype for b in buffers}, key=str):
        same = [b for b in buffers if b.dtype == dtype]
        flat = torch.cat([b.detach().reshape(-1) for b in same])
        dist.broadcast(flat, group=group, group_src=0)
        with torch.no_grad():
            for b, value in zip(same, flat.split([b.numel() for b in same]), strict=True):
                b.copy_(value.view_as(b))
