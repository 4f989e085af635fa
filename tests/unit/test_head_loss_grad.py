"""The LM loss that computes the head's gradients in its forward (trainer/models/head_loss_grad.py):
the same loss and gradients as the model's own head + cross-entropy, one head matmul fewer per chunk
than the checkpointed chunks, and no logits kept for the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.support.op_counts import OpCounter
from trainer.models.head_loss_grad import ce_sum_and_grad
from trainer.models.lm_loss import compile_loss, fuses_head_gradient, lm_loss_sum

TOKENS, HIDDEN, VOCAB = 48, 16, 97


def _tied(seed: int = 0):
    """Embedding and head sharing one weight (SmolLM's tie), a [2, 24] batch with ignored targets."""
    g = torch.Generator().manual_seed(seed)
    emb = nn.Embedding(VOCAB, HIDDEN)
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g))
    head.weight = emb.weight
    x = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=g)
    y = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=g)
    y[0, :7] = -100
    y[1, -3:] = -100
    return emb, head, x, y


def _by_hand(emb, head, x, y):
    h = torch.tanh(emb(x))
    loss = F.cross_entropy(head(h).float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
    loss.backward()
    return loss.detach(), emb.weight.grad.clone()


@pytest.mark.parametrize("chunks", [1, 2, 4, 5])
def test_the_fused_loss_has_the_models_own_loss_and_gradients(chunks):
    """fp32: the summed loss within 1e-6 (relative) and the tied weight's gradient (embedding and
    head paths together) within 1e-5 of autograd through the full logits; unequal chunks (5) too."""
    emb, head, x, y = _tied()
    assert fuses_head_gradient(head, torch.tanh(emb(x)))
    loss = lm_loss_sum(head, torch.tanh(emb(x)), y, chunks)
    loss.backward()
    grad = emb.weight.grad.clone()
    emb.weight.grad = None
    want, want_grad = _by_hand(emb, head, x, y)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.detach(), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)
    if chunks == 1:  # one chunk: the loss is F.cross_entropy's bits (same log_softmax + nll_loss)
        assert torch.equal(loss.detach(), want)


def test_ce_gradient_is_softmax_minus_one_hot_and_zero_on_ignored_rows():
    logits = torch.randn(6, VOCAB, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([3, -100, 0, VOCAB - 1, -100, 5])
    want = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    want.backward()
    loss, grad = ce_sum_and_grad(logits.detach(), targets)
    assert grad.dtype == torch.float64
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-6, atol=0)  # fp32 inside, as in training
    torch.testing.assert_close(grad, logits.grad, rtol=1e-6, atol=1e-7)
    assert torch.count_nonzero(grad[1]) == 0 and torch.count_nonzero(grad[4]) == 0


@pytest.mark.parametrize("chunks", [1, 4])
def test_three_head_matmuls_per_chunk_where_the_checkpointed_chunks_need_four(chunks):
    """Forward + backward of the loss alone (the hidden states are a leaf): the fused path runs the
    logits, d/d(hidden) and d/d(weight) matmuls once per chunk; the checkpointed path (pipeline
    stages: fuse=False) runs the logits matmul again in the backward. The fused path saves only the
    two gradients for the backward: no tensor with a vocabulary-sized row."""
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    y = torch.randint(0, VOCAB, (TOKENS,))
    counts, saved = {}, {}
    for fuse in (True, False):
        h = torch.randn(TOKENS, HIDDEN, requires_grad=True)
        shapes = []

        def pack(t, shapes=shapes):
            shapes.append(tuple(t.shape))
            return t

        aten = torch.ops.aten
        with OpCounter(aten.mm, aten.addmm, aten.addmm_, aten.bmm) as mm, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lm_loss_sum(head, h, y, chunks, fuse=fuse).backward()
        counts[fuse], saved[fuse] = mm.count, shapes
    recompute = 1 if chunks > 1 else 0  # one chunk is not checkpointed: autograd keeps its logits
    assert counts == {True: 3 * chunks, False: (3 + recompute) * chunks}
    assert sorted(saved[True]) == sorted([(TOKENS, HIDDEN), (VOCAB, HIDDEN)])
    assert all(VOCAB not in s[1:] for s in saved[True])


def test_under_autocast_the_fused_loss_matches_the_checkpointed_one_in_bf16():
    """fp32 weights under bf16 autocast (one process with train.param_dtype fp32, DDP): the logits and
    their gradient in bf16 on both paths, the weight's gradient summed over chunks in fp32; the loss
    within 1e-6 and the gradient within 1% of its largest entry (measured: 0.28%), both fp32."""
    results = []
    for fuse in (True, False):
        emb, head, x, y = _tied(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss_sum(head, torch.tanh(emb(x)), y, 4, fuse=fuse)
        loss.backward()
        results.append((loss.detach(), emb.weight.grad.clone()))
    (fl, fg), (cl, cg) = results
    assert fl.dtype == cl.dtype == fg.dtype == cg.dtype == torch.float32
    torch.testing.assert_close(fl, cl, rtol=1e-6, atol=0)  # the same bf16 logits, the loss in fp32
    # The gradient: bf16 rounding of d(logits) before (here) or after (autograd) the 1/total scale.
    assert (fg - cg).abs().max() < 0.01 * cg.abs().max()


def test_evaluation_takes_the_plain_path_with_the_same_loss():
    emb, head, x, y = _tied(2)
    h = torch.tanh(emb(x))
    train = lm_loss_sum(head, h, y, 4)
    with torch.no_grad():
        assert not fuses_head_gradient(head, h)
        evaluated = lm_loss_sum(head, h, y, 4)
    torch.testing.assert_close(evaluated, train.detach(), rtol=1e-6, atol=0)


def test_heads_it_does_not_apply_to():
    h = torch.randn(4, HIDDEN, requires_grad=True)
    assert not fuses_head_gradient(nn.Linear(HIDDEN, VOCAB, bias=True), h)  # a bias: the checkpointed path
    assert not fuses_head_gradient(nn.Sequential(nn.Linear(HIDDEN, VOCAB, bias=False)), h)  # BERT's cls-like head


def test_compiled_fused_loss_equals_eager():
    """train.compile: the chunk's cross-entropy and gradient as one graph (aot_eager on CPU: the
    traced graph, no code generation), the same loss and gradient as eager within 1e-6."""
    out = []
    for backend in (None, "aot_eager"):
        emb, head, x, y = _tied(3)
        if backend:
            compile_loss(head, backend)
        lm_loss_sum(head, torch.tanh(emb(x)), y, 2).backward()
        out.append(emb.weight.grad.clone())
    torch.testing.assert_close(out[1], out[0], rtol=1e-6, atol=1e-7)


def test_eager_peak_memory_one_chunk_no_more_than_full_logits_and_falls_with_chunks():
    """Eager fp32 (the CPU default: no compile) over forward + backward, 1024 tokens x a 8192-token
    vocabulary (32 MiB of fp32 logits): one fused chunk peaks no higher than autograd through the full
    logits (log-probabilities and gradient share one buffer), and 8 chunks below a quarter of it."""
    from bench.lm_loss import peak_cpu_bytes

    tokens, hidden, vocab = 1024, 32, 8192
    head = nn.Linear(hidden, vocab, bias=False)
    y = torch.randint(0, vocab, (tokens,))
    h = torch.randn(tokens, hidden, requires_grad=True)

    def full():
        F.cross_entropy(head(h).float(), y, reduction="sum").backward()

    peaks = {"full": peak_cpu_bytes(full)}
    for chunks in (1, 8):
        peaks[chunks] = peak_cpu_bytes(lambda chunks=chunks: lm_loss_sum(head, h, y, chunks).backward())
    logits = tokens * vocab * 4
    assert peaks[1] <= peaks["full"], peaks
    assert peaks[8] < peaks["full"] / 4 and peaks["full"] >= 2 * logits, (peaks, logits)
