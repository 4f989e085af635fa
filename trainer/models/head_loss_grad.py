"""The LM head + cross-entropy with the head's gradients computed in the forward, chunk by chunk.

The chunked loss in lm_loss.py keeps only the final hidden states for backward and recomputes each
chunk's logits there (activation checkpointing): one head matmul and one softmax pass more per step
than the model's own loss. Here each chunk's logits are used once: the forward computes the chunk's
summed cross-entropy and, from the same softmax, d(loss)/d(logits) = softmax - one_hot (rows with
target -100 are zero), then at once the two gradients the head's backward would compute from it:
d/d(hidden) = dlogits @ W into a [tokens, hidden] buffer and d/d(W) = dlogits^T @ hidden added into a
[vocab, hidden] buffer. The chunk's logits and dlogits are freed before the next chunk; backward only
scales the two saved gradients by the incoming scalar. Per step that is 3 head matmuls instead of 4,
and no logits of any chunk live past it (the same idea as Liger-Kernel's fused linear cross-entropy).

Where it applies (lm_loss.lm_loss_sum decides): training (grad enabled), a bias-free nn.Linear head
with a plain (not DTensor) weight, outside a pipeline stage. Not under tensor parallelism (the
vocab-parallel loss does its own thing) and not in pipeline stages: a GPipe stage runs every
microbatch's forward before any backward, and each would hold a [vocab, hidden] gradient.

Precision: as autograd would: logits and dlogits in the compute dtype (bf16 under autocast or FSDP2's
bf16 parameters), the softmax and loss in fp32, the matmuls accumulating in fp32 inside the GEMM.
The weight's gradient is accumulated over chunks in the weight's dtype, as autograd does: bf16 with
FSDP2's bf16 parameters (in place, inside the GEMM), fp32 for fp32 weights under autocast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def ce_sum_and_grad(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed fp32 cross-entropy, its gradient w.r.t. `logits` in their dtype) of [n, vocab] logits
    against [n] targets; rows with target -100 count 0 and get a zero gradient. The loss is
    F.cross_entropy's (log_softmax in fp32, then nll_loss); eager, one fp32 [n, vocab] buffer beside
    the logits holds the log-probabilities and then, in place, the gradient (compiled, the steps
    fuse and the fp32 buffer need not exist)."""
    logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    loss = F.nll_loss(logp, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    valid = (targets != IGNORE_INDEX).unsqueeze(-1)
    grad = logp.exp_()  # softmax, in place of the log-probabilities (not needed any more)
    grad.scatter_add_(-1, targets.clamp(min=0).unsqueeze(-1), -valid.to(grad.dtype))
    grad.masked_fill_(~valid, 0.0)
    return loss, grad.to(logits.dtype)


class _HeadLossSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int,
                ce: Callable) -> torch.Tensor:
        device_type = hidden.device.type
        autocast = torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type) if autocast else weight.dtype
        ctx.shape, ctx.dtypes = hidden.shape, (hidden.dtype, weight.dtype)
        with torch.autocast(device_type, enabled=False) if autocast else contextlib.nullcontext():
            h = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
            w = weight.to(dtype)
            grad_h = torch.empty_like(h)
            grad_w, total = None, None
            for hc, yc, gh in zip(h.tensor_split(chunks), targets.reshape(-1).tensor_split(chunks),
                                  grad_h.tensor_split(chunks), strict=True):
                loss, dlogits = ce(torch.mm(hc, w.t()), yc)
                torch.mm(dlogits, w, out=gh)
                if grad_w is None:  # in the weight's dtype: fp32 under autocast, as autograd accumulates it
                    grad_w = torch.mm(dlogits.t(), hc).to(weight.dtype)
                elif grad_w.dtype == dtype:
                    grad_w.addmm_(dlogits.t(), hc)
                else:
                    grad_w.add_(torch.mm(dlogits.t(), hc))
                total = loss if total is None else total + loss
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        # Scaled in place: the buffers are this function's own (a second backward through the same
        # graph fails in autograd's saved-tensor version check instead of scaling twice).
        dh = grad_h.to(h_dtype).mul_(g).reshape(ctx.shape) if ctx.needs_input_grad[0] else None
        dw = grad_w.to(w_dtype).mul_(g) if ctx.needs_input_grad[1] else None
        return dh, dw, None, None, None


def head_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int,
                  ce: Callable = ce_sum_and_grad) -> torch.Tensor:
    """Summed cross-entropy of hidden @ weight^T against targets (-100 ignored), `chunks` token groups
    at a time, the head's gradients computed on the way (module doc). `ce` is ce_sum_and_grad or a
    compiled copy of it."""
    return _HeadLossSum.apply(hidden, weight, targets, max(int(chunks), 1), ce)
