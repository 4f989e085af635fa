"""THE one place where parallelisms are composed onto a model.

Order (torchtitan's): split for PP first, then TP on each part, then FSDP/DDP on each part.
This build implements the data-parallel path; PP and TP plug in here (see `check_supported`).

`parallelize()` returns a `Parallelized`: the model parts this rank holds plus
`forward_backward(inputs, labels, n_micro)`, which runs one batch split into n_micro
microbatches and returns the batch's mean loss (None on ranks that do not compute the loss,
e.g. non-last pipeline stages). Gradients equal those of the mean loss over the whole batch,
however it is split: each microbatch contributes loss_sum / total_weight.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainer.config import Config, ConfigError
from trainer.models.build import ModelSpec, Task, transformer_blocks
from trainer.parallel.data_parallel import apply_ddp, apply_fsdp, set_grad_sync
from trainer.parallel.mesh import ParallelDims

log = logging.getLogger("trainer")


def check_supported(cfg: Config) -> None:
    """Refuse, before any process group exists, what this build cannot run yet."""
    if cfg.parallel.pp > 1:
        raise ConfigError(f"parallel.pp={cfg.parallel.pp}: pipeline parallelism is not yet supported in this build")
    if cfg.parallel.tp > 1:
        raise ConfigError(f"parallel.tp={cfg.parallel.tp}: tensor parallelism is not yet supported in this build")


@dataclass
class Parallelized:
    model_parts: list[nn.Module]
    task: Task
    dims: ParallelDims
    device: torch.device
    dtype: str = "fp32"
    owns_loss: bool = True
    fsdp: bool = False
    sync_every_microbatch: bool = False   # zero3: reduce-scatter per microbatch keeps grads sharded
    extras: dict = field(default_factory=dict)

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.model_parts for p in m.parameters()]

    def train(self, mode: bool = True) -> None:
        for m in self.model_parts:
            m.train(mode)

    def _autocast(self) -> Any:
        # FSDP2 casts through its MixedPrecisionPolicy; DDP and single process use autocast.
        if self.dtype == "bf16" and not self.fsdp:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, n_micro: int) -> torch.Tensor | None:
        model = self.model_parts[0]
        inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
        total = self.task.weight(inputs, labels)
        chunks = list(zip(inputs.tensor_split(n_micro), labels.tensor_split(n_micro), strict=True))
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(chunks):
            last = i == len(chunks) - 1
            if self.dims.mesh is not None:
                set_grad_sync(model, last or self.sync_every_microbatch)
            with self._autocast():
                loss = self.task.loss_sum(model, x, y) / max(total, 1)
            loss.backward()
            loss_sum += loss.detach()
        return loss_sum

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        with self._autocast():
            return self.task.loss_sum(self.model_parts[0], inputs, labels) / max(self.task.weight(inputs, labels), 1)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Total grad norm over all ranks' shards (clipped when max_norm > 0)."""
        params = [p for p in self.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf, foreach=True)
        if hasattr(norm, "full_tensor"):  # DTensor under FSDP2: the norm of the whole gradient
            norm = norm.full_tensor()
        return float(norm)


def parallelize(model: nn.Module, spec: ModelSpec, dims: ParallelDims, cfg: Config, device: torch.device,
                backend: str) -> Parallelized:
    check_supported(cfg)
    model.to(device)
    task = Task(spec.task)
    par = Parallelized([model], task, dims, device, cfg.train.dtype)
    if dims.mesh is None or dims.dp == 1:
        return par
    if dims.fsdp:
        blocks = transformer_blocks(model)
        param_dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else None
        apply_fsdp(model, blocks, dims.fsdp_mesh, reshard_after_forward=dims.sharding.startswith("zero3"),
                   param_dtype=param_dtype, backend=backend)
        par.fsdp = True
        par.sync_every_microbatch = dims.sharding.startswith("zero3")
        log.info("FSDP2 %s over mesh %s: %d blocks + root", dims.sharding, dims.fsdp_mesh.mesh_dim_names, len(blocks))
    else:
        par.model_parts = [apply_ddp(model, dims.fsdp_mesh, device)]
        log.info("DDP over %d ranks", dims.dp)
    return par
