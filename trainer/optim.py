"""The inner optimizer (AdamW, or plain SGD) and the LR schedule: linear warmup (steps or ratio),
then cosine to min_lr, flat after."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainer.config import Config, ConfigError

if TYPE_CHECKING:
    from trainer.parallel.master_weights import MasterWeights


def build_optimizer(params: list[nn.Parameter], cfg: Config, master: MasterWeights | None = None) -> torch.optim.Optimizer:
    """AdamW (optim.name sgd: torch's SGD without momentum) over `params`; over the fp32 masters of
    bf16 compute copies (`master`, one process with train.param_dtype bf16) that compile, master_adamw.MasterAdamW, whose step also writes the copies
    (eager, its dozen passes per parameter lose to torch's fused kernel over cast gradients: that
    one then, bench/results/optimizer_step.json)."""
    o = cfg.optim
    # No weight decay on biases and norm weights (1-D tensors), as is usual for transformers.
    decay = [p for p in params if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in params if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # A fused/foreach step takes one tensor type: sequence-parallel norms are (replicated) DTensors
    # beside plain per-head norms (Qwen3's q_norm/k_norm), so each group splits by type.
    groups = [{**g, "params": [p for p in g["params"] if _is_dtensor(p) == dt]} for g in groups for dt in (False, True)]
    groups = [g for g in groups if g["params"]]
    if o.name == "sgd":
        # Plain SGD, no momentum: the one inner optimizer whose averaged updates are the update of the
        # averaged gradients (DiLoCo with H = 1 is then DDP: tests/distributed/test_diloco.py). Decay is L2 here.
        if master is not None and master.compile_backend is not None:
            raise ConfigError("optim.name sgd: compiled bf16 parameters in one process are stepped by MasterAdamW "
                              "only; use optim.name adamw, train.compile false or train.param_dtype fp32")
        return torch.optim.SGD(groups, lr=o.lr, momentum=0.0, foreach=True)
    kwargs = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    if master is not None and master.compile_backend is not None:
        from trainer.parallel.master_adamw import MasterAdamW

        return MasterAdamW(groups, master, compile_backend=master.compile_backend,
                           eager_on_error=master.compile_mode == "try", **kwargs)
    try:
        # The fused kernel is several times faster than foreach/for-loop on CPU too (one pass per tensor).
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, ValueError):  # a device/dtype/tensor type fused does not support
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


def _is_dtensor(p: torch.Tensor) -> bool:
    return hasattr(p, "device_mesh")


def warmup_steps(cfg: Config, total_steps: int) -> int:
    s = cfg.schedule
    return int(round(s.warmup_ratio * total_steps)) if s.warmup_ratio > 0 else s.warmup_steps


def lr_at(step: int, cfg: Config, total_steps: int) -> float:
    """LR for optimizer step `step` (0-based). Warmup reaches the peak at step `warmup`."""
    s, peak = cfg.schedule, cfg.optim.lr
    horizon = s.total_steps or total_steps
    warm = warmup_steps(cfg, horizon)
    if warm > 0 and step < warm:
        return peak * (step + 1) / warm
    if s.decay == "constant":
        return peak
    if step >= horizon:
        return s.min_lr
    span = max(horizon - warm, 1)
    progress = (step - warm) / span
    return s.min_lr + 0.5 * (peak - s.min_lr) * (1.0 + math.cos(math.pi * progress))


def schedule_signature(cfg: Config, total_steps: int) -> dict:
    """What fixes the LR of every step (saved in checkpoints; a resume must agree with it)."""
    s = cfg.schedule
    horizon = s.total_steps or total_steps
    return {"train_steps": total_steps, "total_steps": s.total_steps, "horizon": horizon,
            "warmup": warmup_steps(cfg, horizon), "decay": s.decay, "lr": cfg.optim.lr, "min_lr": s.min_lr}


SIGNATURE_KEYS = ("horizon", "warmup", "decay", "lr", "min_lr")  # the train_steps/total_steps explain horizon


def schedule_mismatch(saved: dict, now: dict) -> str | None:
    """One phrase naming both schedules when they give different LRs, else None."""
    if all(saved.get(k) == now.get(k) for k in SIGNATURE_KEYS):
        return None
    return (f"horizon {saved.get('horizon')} -> {now.get('horizon')} steps (train.steps {saved.get('train_steps')} -> "
            f"{now.get('train_steps')}, schedule.total_steps {saved.get('total_steps')} -> {now.get('total_steps')}), "
            f"warmup {saved.get('warmup')} -> {now.get('warmup')}, decay {saved.get('decay')} -> {now.get('decay')}, "
            f"lr {saved.get('lr')} -> {now.get('lr')}, min_lr {saved.get('min_lr')} -> {now.get('min_lr')}")


def restart_schedule_at(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                        cfg: Config, total_steps: int, step: int) -> float:
    """checkpoint.override_schedule: after loading an older schedule's state, take this run's LR
    at `step` (the restored step count) and this run's peak as the base of every later step."""
    lr = lr_at(step, cfg, total_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    scheduler.base_lrs = [cfg.optim.lr] * len(optimizer.param_groups)
    scheduler._last_lr = [lr] * len(optimizer.param_groups)
    return lr


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    peak = cfg.optim.lr
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, cfg, total_steps) / peak if peak > 0 else 0.0)
