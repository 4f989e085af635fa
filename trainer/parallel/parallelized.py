"""`Parallelized`: a model as the training loop sees it once a layout is applied (its parts, the
task, the mesh), one step's forward/backward over microbatches, evaluation and gradient clipping.
A pipeline (trainer/parallel/pipeline.py) subclasses it; trainer/parallel/compose.py builds it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.models.build import Task
from trainer.models.lm_loss import loss_context
from trainer.parallel.data_parallel import set_grad_sync
from trainer.parallel.mesh import ParallelDims


@dataclass
class Parallelized:
    model_parts: list[nn.Module]
    task: Task
    dims: ParallelDims
    device: torch.device
    dtype: str = "fp32"
    owns_loss: bool = True
    bf16_weights: bool = False            # computes with bf16 weights (FSDP2's mixed precision or
                                          # master_weights.py), so no autocast
    sync_every_microbatch: bool = False   # zero3: reduce-scatter per microbatch keeps grads sharded
    extras: dict = field(default_factory=dict)

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.model_parts for p in m.parameters()]

    def train(self, mode: bool = True) -> None:
        for m in self.model_parts:
            m.train(mode)

    def _autocast(self) -> Any:
        # bf16 weights (FSDP2's MixedPrecisionPolicy, or master_weights.py in one process) need no
        # autocast; fp32 weights (train.param_dtype fp32, a model with BatchNorm) compute under it.
        if self.dtype == "bf16" and not self.bf16_weights:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def loss_denominator(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        """What this rank divides its summed loss by: (targets in the global batch) / dp.

        DDP/FSDP average gradients (and Trainer._dp_mean averages the reported loss) over the dp
        ranks, so dividing by global/dp yields sum over all ranks / global: the global-batch mean.
        With equal counts (causal LM on packed blocks, images) global/dp is exactly the local
        count: no all-reduce is needed, and the numbers are those of any other layout. Call with
        CPU tensors (no device sync); with unequal counts every rank of the DP group must call it
        (one scalar all-reduce per batch).
        """
        local = self.task.weight(inputs, labels)
        # DiLoCo (diloco.py): each replica's loss is its own batch's mean, counted over its shard ranks only.
        mesh, ranks = self.extras.get("replica_mesh", (self.dims.dp_mesh, self.dims.dp))
        if self.task.constant_weight or self.dims.mesh is None or ranks == 1:
            return float(max(local, 1))
        count = torch.tensor([local], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, group=mesh.get_group())  # SUM (gloo's AVG is unreliable)
        return max(int(count), 1) / ranks

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, n_micro: int) -> torch.Tensor | None:
        model = self.model_parts[0]
        total = self.loss_denominator(inputs, labels)
        inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
        chunks = list(zip(inputs.tensor_split(n_micro), labels.tensor_split(n_micro), strict=True))
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(chunks):
            last = i == len(chunks) - 1
            if self.dims.mesh is not None:
                set_grad_sync(model, last or self.sync_every_microbatch)
            with loss_context(self.dims.tp):  # vocab-parallel loss: forward and backward inside
                with self._autocast():
                    loss = self.task.loss_sum(model, x, y) / total
                loss.backward()
            loss_sum += loss.detach()
        return loss_sum

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        total = self.loss_denominator(inputs, labels)
        inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
        with loss_context(self.dims.tp), self._autocast():
            return self.task.loss_sum(self.model_parts[0], inputs, labels) / total

    def clip_grad_norm(self, max_norm: float, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
        """Total grad norm over all ranks' shards as a device tensor; the gradients clipped to
        max_norm when it is > 0, inside `optimizer`'s step where it is a fused AdamW (grad_norm.py)."""
        from trainer.parallel.grad_norm import clip_grad_norm, fp32_norm, scale_for_clip

        master = self.extras.get("master_weights")
        if master is not None and master.kept:  # bf16 gradients on the compute copies (master_adamw.py)
            if max_norm > 0 and not (optimizer is not None and optimizer.defaults.get("fused")):
                raise ValueError("clip_grad_norm: bf16 gradients are clipped inside MasterAdamW's step; pass it")
            norm = fp32_norm(master.gradients())
            scale_for_clip(optimizer, [], norm, max_norm)
            return norm
        # TP and FSDP-only params on different meshes: the norm is assembled there
        return clip_grad_norm([p for p in self.parameters() if p.grad is not None], max_norm, optimizer=optimizer)
