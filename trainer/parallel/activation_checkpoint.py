"""Activation checkpointing of transformer blocks: train.activation_checkpointing none | selective | full.

- full: a block keeps only its input for backward and recomputes its whole forward there
  (least memory, about one extra forward of compute).
- selective: a block keeps the outputs of its matmuls (q/k/v/o, gate/up/down projections) and of
  the attention kernel (with its log-sum-exp), and recomputes everything else in backward:
  norms, rotary embeddings, activations (SiLU/GELU and the gating product), residual adds and
  dtype casts. Those are cheap to recompute but many and large, so most of the memory of a
  block's pointwise intermediates goes for a few percent of extra time.

Each block is replaced in its container by a wrapper whose forward calls
`torch.utils.checkpoint.checkpoint` directly (no `functools.partial` forward, which would hide
the block from torch.compile), compiled afterwards as one region (compile.py). The wrapper is
torch's ActivationWrapper, whose state-dict hooks and DCP's name handling drop its
`_checkpoint_wrapped_module.` prefix: checkpoints keep the model's own parameter names.

Order (compose.py, torchtitan's): TP, then activation checkpointing, then compile, then FSDP/DDP.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from trainer.models.build import block_containers

MODES = ("none", "selective", "full")
# Every spelling of "keep this output" the selective policy recognises (missing ones are skipped).
_SAVE_OP_NAMES = ("mm", "addmm", "bmm", "baddbmm", "linear", "_scaled_mm",
                  "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
                  "_efficient_attention_forward")


def _save_ops() -> frozenset:
    ops = set()
    for name in _SAVE_OP_NAMES:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.add(packet.default)
    return frozenset(ops)


_SAVE = _save_ops()


# Plain module-level functions: torch.compile calls context_fn while tracing the block, and a
# bound method (or a closure over the module) does not survive that.
def _selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(_selective_policy)


class CheckpointedBlock(ActivationWrapper):
    """A block whose forward runs under non-reentrant activation checkpointing."""

    def __init__(self, block: nn.Module, selective: bool):
        super().__init__(block)
        self.selective = selective

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.selective:
            return checkpoint(self._checkpoint_wrapped_module, *args, use_reentrant=False,
                              context_fn=_selective_context, **kwargs)
        return checkpoint(self._checkpoint_wrapped_module, *args, use_reentrant=False, **kwargs)


def block_slots(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """(container, key) of every transformer block of a full model or a pipeline stage, in order."""
    return [(c, key) for c in block_containers(module) for key, _ in c.named_children()]


def blocks_of(module: nn.Module) -> list[nn.Module]:
    """The blocks as they are now in their containers (wrapped or not): the FSDP units."""
    return [container.get_submodule(key) for container, key in block_slots(module)]


def apply_activation_checkpointing(module: nn.Module, mode: str) -> int:
    """Wrap every block of `module` in place; returns how many were wrapped."""
    if mode == "none":
        return 0
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}")
    slots = block_slots(module)
    for container, key in slots:
        block = container.get_submodule(key)
        if not isinstance(block, CheckpointedBlock):
            container.register_module(key, CheckpointedBlock(block, selective=mode == "selective"))
    return len(slots)


def strip_wrapper_names(name: str) -> str:
    """A parameter's name in the unwrapped model (what checkpoints and the reference model use)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
