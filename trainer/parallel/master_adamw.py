"""AdamW for master_weights.py: one pass per parameter that reads its fp32 master, its bf16
gradient and the two fp32 moments, and writes the master, the moments and the bf16 compute copy
the next forward uses.

With torch's fused AdamW beside bf16 compute copies a step moves, per parameter, 52 bytes: the
bf16 gradient cast into an fp32 one (2 read + 4 written), the clip norm over it (4), the fused
kernel (master, moments read and written, the fp32 gradient read and, with the clip factor
inside the step, written back: 36) and the next forward's cast of the master into its copy
(4 + 2). Here it is 30: the norm over the bf16 gradient (2) and this update (master 8, moments 16,
gradient 2, copy 2), all of them memory-bound. At smollm-1.7b (1.71 B parameters) that is
89 GB against 51 GB a step.

The arithmetic is that of torch's fused AdamW kernel (aten/src/ATen/native/cuda/fused_adam_utils.cuh,
ADAMW mode): decoupled weight decay, then the moments, bias corrections from the step count, the
gradient divided by the clip's `grad_scale` as it is read. Its state (`step` as a 0-d fp32 tensor
on the parameter's device, `exp_avg`, `exp_avg_sq`) and param groups are the fused AdamW's own, so
checkpoints move between the two. The update is compiled (inductor: one kernel per parameter,
dynamic shapes, so one graph for every size) where the run compiles its blocks, and runs as the
same torch operations otherwise; equal to torch's fused AdamW to rounding (tests/unit/test_master_adamw.py).

A parameter whose gradient was accumulated over microbatches has an fp32 gradient (master_weights.py
keeps the sum in fp32): the same update reads it (a second graph).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from trainer.parallel.master_weights import MasterWeights

log = logging.getLogger("trainer")


def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 copy: torch.Tensor, bias_correction1: torch.Tensor, bias_correction2_sqrt: torch.Tensor,
                 grad_scale: torch.Tensor, hyper: torch.Tensor) -> None:
    """One AdamW update of `param` (fp32) in place, and `copy` (its bf16 compute copy) set to it.
    The bias corrections are this update's (1 - beta1^step, sqrt(1 - beta2^step): bias_corrections,
    outside the kernel, whose every block would compute the powers again); `grad` is divided by
    `grad_scale` (the clip, 1 for none); `hyper` holds lr, beta1, beta2, eps, weight_decay (fp32, on
    the device: one graph for every value; as Python floats, torch 2.13's compile gave some graphs
    wrong numbers)."""
    lr, beta1, beta2, eps, weight_decay = hyper.unbind()
    g = grad.float() / grad_scale
    param.sub_(param * (lr * weight_decay))
    exp_avg.mul_(beta1).add_(g * (1 - beta1))
    exp_avg_sq.mul_(beta2).add_(g * g * (1 - beta2))
    denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
    param.sub_((lr / bias_correction1) * exp_avg / denom)
    copy.copy_(param)


def bias_corrections(steps: list[torch.Tensor], beta1: float, beta2: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per step count (0-d tensors, on the device: no host sync), 1 - beta1^step and sqrt(1 - beta2^step)."""
    bc1 = torch._foreach_pow(beta1, steps)
    torch._foreach_neg_(bc1)
    torch._foreach_add_(bc1, 1.0)
    bc2 = torch._foreach_pow(beta2, steps)
    torch._foreach_neg_(bc2)
    torch._foreach_add_(bc2, 1.0)
    torch._foreach_sqrt_(bc2)
    return bc1, bc2


class MasterAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (fused: its state and param groups) over the fp32 masters of `master`,
    whose step reads the bf16 gradients and writes the bf16 copies (master_weights.py keeps both
    between steps once this optimizer is attached). `compile_backend` None: the update runs eagerly."""

    def __init__(self, params: Any, master: MasterWeights, compile_backend: str | None = None,
                 eager_on_error: bool = False, **kwargs: Any):
        super().__init__(params, fused=True, **kwargs)
        self.master = master
        master.keep_copies()
        self.compiled = compile_backend is not None
        self.eager_on_error = eager_on_error  # train.compile try: a compile error -> one warning, eager
        self._update = (torch.compile(adamw_update, dynamic=True, fullgraph=True, backend=compile_backend)
                        if compile_backend is not None else adamw_update)
        self._one: dict[torch.device, torch.Tensor] = {}

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:  # as torch's fused AdamW lays it out (its _init_group)
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _scalars(self, group: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's hyperparameters as one fp32 tensor on `device` (one copy per step: the LR
        moves), and the clip's grad_scale there (1 for none)."""
        beta1, beta2 = group["betas"]
        hyper = torch.tensor([group["lr"], beta1, beta2, group["eps"], group["weight_decay"]], dtype=torch.float32)
        scale = getattr(self, "grad_scale", None)  # grad_norm.scale_for_clip puts the clip here
        if scale is None:
            if device not in self._one:
                self._one[device] = torch.ones((), dtype=torch.float32, device=device)
            scale = self._one[device]
        return hyper.to(device, non_blocking=True), scale.to(device)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("MasterAdamW.step takes no closure")
        current, written = self.master.copies_current(), 0
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or group["capturable"]:
                raise ValueError("MasterAdamW: amsgrad, maximize and capturable are not supported")
            beta1, beta2 = group["betas"]
            scalars: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
            items = [(p, g) for p in group["params"] if (g := self.master.grad_of(p)) is not None]
            if not items:
                continue
            states = [self._state(p) for p, _ in items]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1.0)
            bc1, bc2 = bias_corrections(steps, beta1, beta2)
            for (p, g), s, c1, c2 in zip(items, states, bc1, bc2, strict=True):
                copy = self.master.copy_of(p)
                tensors = (p.detach(), g, s["exp_avg"], s["exp_avg_sq"], copy.detach())
                if all(t.is_contiguous() for t in tensors):  # flat: one graph for every shape (detached
                    tensors = tuple(t.view(-1).detach() for t in tensors)  # again: not views, no guards on a base)
                if p.device not in scalars:
                    scalars[p.device] = self._scalars(group, p.device)
                hyper, scale = scalars[p.device]
                self._run(*tensors, c1, c2, scale, hyper)
            written += len(items)
        # The copies of parameters without a gradient are as current as they were before the step.
        self.master.copies_written(current or written == len(self.master.masters))

    def _run(self, *args: Any) -> None:
        try:
            self._update(*args)
        except Exception as e:  # a compile error (raised before anything is written)
            if not (self.compiled and self.eager_on_error):
                raise
            log.warning("train.compile try: the AdamW update runs eagerly (%s)", str(e).strip().splitlines()[0][:300])
            self._update, self.compiled = adamw_update, False
            self._update(*args)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.master.clear_grads(set_to_none)
