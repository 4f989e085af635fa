"""The language-model loss inside the model's root forward, chunk by chunk of tokens.

`model(input_ids=x, targets=y)` returns the SUM of token cross-entropies (targets already shifted,
-100 ignored) instead of logits. With loss_chunks = N > 1 the final hidden states go through the
LM head and the cross-entropy N token chunks at a time, each chunk under activation checkpointing:
its [tokens/N, vocab] logits (and their fp32 copy) exist only while that chunk is computed, in the
forward and again in the backward, so the [batch, seq, vocab] fp32 logits never exist. (At seq 2048,
batch 8 and Qwen3's 151,936-token vocabulary they alone are 10 GB.)

Why inside the root forward: DDP prepares its gradient reduction and FSDP2 gathers the root's
parameters (embeddings, final norm, head) in hooks around the root module's forward; a head applied
outside it would miss both. The forward is added by swapping the model's class for a subclass (as
FSDP2's fully_shard does), so parameter names, state dicts and checkpoints are unchanged.

Under tensor parallelism the head leaves its logits sharded over the vocabulary (a DTensor) and
the cross-entropy runs vocab-parallel (torch's loss_parallel): no TP rank ever holds full logits.
The caller wraps forward and backward in `loss_context(tp)`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _plain(t: torch.Tensor) -> torch.Tensor:
    # A vocab-parallel loss is a replicated DTensor scalar; the trainer adds plain tensors.
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _head_loss_sum(head: nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(h)
    return _plain(F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX,
                                  reduction="sum"))


def lm_loss_sum(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunks: int = 1) -> torch.Tensor:
    """Sum of token cross-entropies of head(hidden) against targets, in fp32, `chunks` tokens groups at a time."""
    if chunks <= 1:
        return _head_loss_sum(head, hidden, targets)  # one call: the same numbers as the plain model's logits
    total = None
    for h, y in zip(hidden.flatten(0, -2).tensor_split(chunks), targets.flatten().tensor_split(chunks), strict=True):
        # Only h (and y) are kept for backward; the chunk's logits are recomputed there.
        part = checkpoint(_head_loss_sum, head, h, y, use_reentrant=False)
        total = part if total is None else total + part
    return total


def loss_context(tp: int) -> Any:
    """torch's loss_parallel around forward and backward when the head is vocab-parallel."""
    if tp <= 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


class LossForward:
    """Mixin in front of a transformers *ForCausalLM / *ForMaskedLM class (see module doc)."""

    loss_chunks: int = 1

    def forward(self, input_ids: torch.Tensor | None = None, targets: torch.Tensor | None = None, **kwargs: Any):
        if targets is None:
            return super().forward(input_ids=input_ids, **kwargs)
        base = getattr(self, self.base_model_prefix)  # model | transformer | bert: everything but the head
        if hasattr(self, "cls"):  # BERT: transform + decoder
            hidden, head = base(input_ids=input_ids).last_hidden_state, self.cls
        else:
            hidden, head = base(input_ids=input_ids, use_cache=False).last_hidden_state, self.lm_head
        return lm_loss_sum(head, hidden, targets, self.loss_chunks)


_CLASSES: dict[type, type] = {}


def install_loss_forward(model: nn.Module, chunks: int) -> nn.Module:
    """Give `model` the targets forward (in place) with `chunks` loss chunks; returns it."""
    cls = type(model)
    if not issubclass(cls, LossForward):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(cls.__name__, (LossForward, cls), {"__module__": __name__})
        model.__class__ = _CLASSES[cls]
    model.loss_chunks = max(int(chunks), 1)
    return model
