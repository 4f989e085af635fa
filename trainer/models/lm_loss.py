"""The language-model loss inside the model's root forward, chunk by chunk of tokens.

`model(input_ids=x, targets=y)` returns the SUM of token cross-entropies (targets already shifted,
-100 ignored) instead of logits. With loss_chunks = N > 1 the final hidden states go through the
LM head and the cross-entropy N token chunks at a time, each chunk under activation checkpointing:
its [tokens/N, vocab] logits (and their fp32 copy) exist only while that chunk is computed, so the
[batch, seq, vocab] fp32 logits never exist. (At seq 2048, batch 8 and Qwen3's 151,936-token
vocabulary they alone are 10 GB.) In training, with a plain bias-free linear head (no tensor or
pipeline parallelism), each chunk's head gradients are computed in the forward from the chunk's one
softmax (head_loss_grad.py): no logits are recomputed in the backward and none are kept. Elsewhere
(pipeline stages, evaluation, BERT's head) each chunk runs under activation checkpointing and its
logits are computed again in the backward.

Why inside the root forward: DDP prepares its gradient reduction and FSDP2 gathers the root's
parameters (embeddings, final norm, head) in hooks around the root module's forward; a head applied
outside it would miss both. The forward is added by swapping the model's class for a subclass (as
FSDP2's fully_shard does), so parameter names, state dicts and checkpoints are unchanged.

How many chunks (train.loss_chunks auto): as few as keep each chunk's logits at most 2^28
elements (config_checks.resolve_loss_chunks), so the memory they take does not grow with the batch.

Compiled (`compile_loss`, with train.compile): one chunk's cross-entropy and its gradient (or, on
the checkpointed path, head + cross-entropy) is one graph (fullgraph, static shapes; every chunk has
the same shape), so the fp32 copy of the logits, the log-softmax and its gradient fuse into a few
kernels instead of materialising each.

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

from trainer.models.head_loss_grad import IGNORE_INDEX, ce_sum_and_grad, head_loss_sum
from trainer.models.own_positions import own_positions


def _plain(t: torch.Tensor) -> torch.Tensor:
    # A vocab-parallel loss is a replicated DTensor scalar; the trainer adds plain tensors.
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _head_loss_sum(head: nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(h)
    return _plain(F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX,
                                  reduction="sum"))


_COMPILED: dict[tuple[str, str], Any] = {}
_COMPILE_ATTR = "_trainer_loss_backend"  # set on the head module by compile_loss


def compile_loss(head: nn.Module, backend: str = "inductor") -> None:
    """Run `head`'s chunks of head + cross-entropy compiled (one graph per chunk shape)."""
    setattr(head, _COMPILE_ATTR, backend)


def _compiled(head: nn.Module, fn: Any) -> Any:
    """`fn` as `head` runs it: compiled when compile_loss named a backend for it (one compiled copy
    per function and backend, shared by every head)."""
    backend = getattr(head, _COMPILE_ATTR, None)
    if backend is None:
        return fn
    key = (fn.__name__, backend)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)
    return _COMPILED[key]


def fuses_head_gradient(head: nn.Module, hidden: torch.Tensor) -> bool:
    """Whether the loss computes the head's gradients in its forward (head_loss_grad.py): in
    training, for a bias-free linear head whose weight is a plain tensor (not vocab-parallel)."""
    weight = getattr(head, "weight", None)
    return (type(head) is nn.Linear and head.bias is None and not hasattr(weight, "device_mesh")
            and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad))


def lm_loss_sum(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunks: int = 1,
                fuse: bool = True) -> torch.Tensor:
    """Sum of token cross-entropies of head(hidden) against targets, in fp32, `chunks` token groups
    at a time; `fuse` False (pipeline stages) always takes the recomputing path."""
    if hasattr(hidden, "full_tensor"):  # sequence-parallel hidden states: the head needs every token
        hidden = hidden.full_tensor()
    if fuse and fuses_head_gradient(head, hidden):
        return head_loss_sum(hidden, head.weight, targets, chunks, _compiled(head, ce_sum_and_grad))
    fn = _compiled(head, _head_loss_sum)
    if chunks <= 1:
        return fn(head, hidden, targets)  # one call: the same numbers as the plain model's logits
    total = None
    for h, y in zip(hidden.flatten(0, -2).tensor_split(chunks), targets.flatten().tensor_split(chunks), strict=True):
        # Only h (and y) are kept for backward; the chunk's logits are recomputed there.
        part = checkpoint(fn, head, h, y, use_reentrant=False) if torch.is_grad_enabled() else fn(head, h, y)
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
