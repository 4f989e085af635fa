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

How many chunks (train.loss_chunks auto): as few as keep each chunk's logits at most 2^28
elements (config_checks.resolve_loss_chunks), so the memory they take does not grow with the batch.

Compiled (`compile_loss`, with train.compile): one chunk's head + cross-entropy is one graph
(fullgraph, static shapes; every chunk has the same shape), so the bf16 logits, their fp32 copy,
the log-softmax and its gradient fuse into a few kernels instead of materialising each.

Under tensor parallelism the head leaves its logits sharded over the vocabulary (a DTensor) and
the cross-entropy runs vocab-parallel (torch's loss_parallel): no TP rank ever holds full logits.
The caller wraps forward and backward in `loss_context(tp)`. With sequence parallelism the final
hidden states arrive sharded over the sequence and are gathered first. The vocab-parallel loss
runs eager: compiled (torch 2.13, CPU/gloo, aot_eager) it returns a DTensor where eager returns a
tensor, and the next add fails in DTensor's dispatch (an AssertionError): loss_parallel swaps
DTensor's cross-entropy handling at run time, which the traced graph does not follow.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.models.own_positions import own_positions

IGNORE_INDEX = -100


def _plain(t: torch.Tensor) -> torch.Tensor:
    # A vocab-parallel loss is a replicated DTensor scalar; the trainer adds plain tensors.
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _head_loss_sum(head: nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(h)
    return _plain(F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX,
                                  reduction="sum"))


_COMPILED: dict[str, Any] = {}
_COMPILE_ATTR = "_trainer_loss_backend"  # set on the head module by compile_loss


def compile_loss(head: nn.Module, backend: str = "inductor") -> None:
    """Run `head`'s chunks of head + cross-entropy compiled (one graph per chunk shape)."""
    setattr(head, _COMPILE_ATTR, backend)


def _chunk_fn(head: nn.Module) -> Any:
    backend = getattr(head, _COMPILE_ATTR, None)
    if backend is None:
        return _head_loss_sum
    if backend not in _COMPILED:
        _COMPILED[backend] = torch.compile(_head_loss_sum, fullgraph=True, dynamic=False, backend=backend)
    return _COMPILED[backend]


def lm_loss_sum(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunks: int = 1) -> torch.Tensor:
    """Sum of token cross-entropies of head(hidden) against targets, in fp32, `chunks` tokens groups at a time."""
    if hasattr(hidden, "full_tensor"):  # sequence-parallel hidden states: the head needs every token
        hidden = hidden.full_tensor()
    fn = _chunk_fn(head)
    if chunks <= 1:
        return fn(head, hidden, targets)  # one call: the same numbers as the plain model's logits
    total = None
    for h, y in zip(hidden.flatten(0, -2).tensor_split(chunks), targets.flatten().tensor_split(chunks), strict=True):
        # Only h (and y) are kept for backward; the chunk's logits are recomputed there.
        part = checkpoint(fn, head, h, y, use_reentrant=False)
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
        with own_positions():  # no position ids passed: no packed-sequence check (a host sync)
            if hasattr(self, "cls"):  # BERT: transform + decoder
                hidden, head = base(input_ids=input_ids).last_hidden_state, self.cls
            else:
                hidden, head = base(input_ids=input_ids, use_cache=False).last_hidden_state, self.lm_head
        return lm_loss_sum(head, hidden, targets, self.loss_chunks)


_CLASSES: dict[type, type] = {}


def loss_head(model: nn.Module) -> nn.Module | None:
    """The module the loss applies to the final hidden states: LM head, or BERT's `cls`."""
    for name in ("lm_head", "cls"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return head
    return None


def install_loss_forward(model: nn.Module, chunks: int) -> nn.Module:
    """Give `model` the targets forward (in place) with `chunks` loss chunks; returns it."""
    cls = type(model)
    if not issubclass(cls, LossForward):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(cls.__name__, (LossForward, cls), {"__module__": __name__})
        model.__class__ = _CLASSES[cls]
    model.loss_chunks = max(int(chunks), 1)
    return model
