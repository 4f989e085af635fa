"""Gradient clipping inside the fused AdamW step (trainer/parallel/grad_norm.py `scale_for_clip`):
the same parameters after the step as torch's clip_grad_norm_ then the step, without a pass over the
gradients of its own; the foreach fallback multiplies as before."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.support.op_counts import OpCounter
from trainer.parallel.grad_norm import scale_for_clip


def _grad_muls() -> OpCounter:
    """Counts the multiplies that rewrite gradients in place (the clip's own pass)."""
    return OpCounter(torch.ops.aten._foreach_mul_, torch.ops.aten.mul_)


def _model_and_grads(scale: float, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    (model(torch.randn(5, 8)) ** 2).sum().mul(scale).backward()
    return model


def _norm(model) -> torch.Tensor:
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], foreach=True)


@pytest.mark.parametrize("scale, max_norm", [(100.0, 1.0), (1e-3, 1.0), (100.0, 0.0)],
                         ids=["clipped", "under the limit", "clipping off"])
def test_fused_step_with_the_clip_inside_equals_clip_then_step(scale, max_norm):
    """Three steps: the parameters equal torch's clip_grad_norm_ + fused AdamW within 1e-6 (rounding
    of x / (1/c) against x * c), bit for bit where nothing is clipped; no multiply touches the
    gradients; the norm returned is the pre-clip norm."""
    ref, ours = _model_and_grads(scale), _model_and_grads(scale)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, fused=True)
    for step in range(3):
        if step:
            for m in (ref, ours):
                m.zero_grad()
                (m(torch.randn(5, 8, generator=torch.Generator().manual_seed(step))) ** 2).sum().mul(scale).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm if max_norm > 0 else math.inf)
        ref_opt.step()
        norm = _norm(ours)
        with _grad_muls() as muls:
            scale_for_clip(opt, list(ours.parameters()), norm, max_norm)
        assert muls.count == 0
        assert torch.equal(norm, want)
        if max_norm == 0:
            assert opt.grad_scale is None
        opt.step()
        exact = max_norm == 0 or float(want) <= max_norm
        for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
            if exact:
                assert torch.equal(p, q)
            else:
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_foreach_optimizer_gets_one_multiply_and_the_same_step():
    ref, ours = _model_and_grads(100.0), _model_and_grads(100.0)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, foreach=True)
    with _grad_muls() as muls:
        scale_for_clip(opt, list(ours.parameters()), _norm(ours), 1.0)
    assert muls.count == 1 and getattr(opt, "grad_scale", None) is None
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fused", [True, False])
def test_a_non_finite_norm_leaves_the_gradients_unscaled(fused):
    model = _model_and_grads(1.0)
    before = [p.grad.clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    scale_for_clip(opt, list(model.parameters()), torch.tensor(math.inf), 1.0)
    if fused:
        assert float(opt.grad_scale) == 1.0
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))


def test_fsdp2_one_rank_dtensor_parameters_take_the_scale():
    """FSDP2 (here over one process): DTensor parameters and gradients, a plain scale tensor; the
    step equals clip_grad_norm_ + step within 1e-6."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from trainer.parallel.data_parallel import one_rank_mesh

    try:
        mesh = one_rank_mesh(torch.device("cpu"))
        ref, ours = _model_and_grads(0.0), _model_and_grads(0.0)
        for m in (ref, ours):
            fully_shard(m, mesh=mesh)
            m.zero_grad()
            (m(torch.randn(5, 8, generator=torch.Generator().manual_seed(7))) ** 2).sum().mul(100.0).backward()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, fused=True)
        want = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0).full_tensor()
        ref_opt.step()
        norm = _norm(ours).full_tensor()
        scale_for_clip(opt, list(ours.parameters()), norm, 1.0)
        opt.step()
        assert torch.equal(norm, want) and float(want) > 1.0
        for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=1e-6, atol=1e-7)
    finally:
        dist.destroy_process_group()


def test_the_trainer_clips_inside_its_fused_step(tmp_path):
    """A real Trainer step (tiny config, grad_clip 0.5): the optimizer is fused AdamW and its scale is
    the clip factor's inverse, (norm + 1e-6) / 0.5, for the norm the step reports."""
    from trainer.config import resolve
    from trainer.config.argv import parse_train_args
    from trainer.parallel.mesh import ParallelDims
    from trainer.runtime.dist_env import DistEnv
    from trainer.train import Trainer

    cfg = resolve(*parse_train_args(["--config", "configs/tiny.yaml", "--train.steps", "2", "--profile.batch", "none",
                                     "--train.grad_clip", "0.5", "--logging.peak_flops", "1e9",
                                     "--output-dir", str(tmp_path)]))
    trainer = Trainer(cfg, DistEnv(), ParallelDims.from_config(cfg.parallel, 1, 1), torch.device("cpu"), "gloo")
    assert trainer.optimizer.defaults["fused"]
    _, norm = trainer.train_step()
    assert float(norm) > 0.5
    torch.testing.assert_close(trainer.optimizer.grad_scale, (norm + 1e-6) / 0.5, rtol=1e-6, atol=0)
