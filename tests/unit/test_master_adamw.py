"""trainer/parallel/master_adamw.py: AdamW over fp32 masters that reads bf16 gradients and writes the
bf16 compute copies in the same pass; torch's fused AdamW's numbers (to rounding) and its state."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_master_weights import _batches, _tiny_lm
from trainer.parallel.grad_norm import fp32_norm, scale_for_clip, total_grad_norm
from trainer.parallel.master_adamw import MasterAdamW
from trainer.parallel.master_weights import MasterWeights

# A step moves a weight by about lr = 1e-2; the two kernels round differently (fused multiply-adds,
# the bias corrections in double there): after 4 steps they differ by ~1e-6 (measured 1.4e-6).
WEIGHT_ATOL = 1e-5


def _groups(params):
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


@pytest.mark.parametrize("backend", [None, "inductor"])
def test_the_update_equals_torch_fused_adamw_and_writes_the_copies(backend):
    """Four steps of two groups (weight decay 0.1 and 0), the clip's grad_scale on two of them:
    masters and moments equal torch's fused AdamW over the same (bf16-valued) gradients to
    rounding; each bf16 copy is its master cast; the state is laid out as torch's (a checkpoint of
    one loads into the other). Inductor (CPU here) compiles one graph for every shape."""
    check_update_equals_torch(backend, "cpu")


def check_update_equals_torch(backend: str | None, device: str) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    shapes = [(24, 16), (16,), (8, 24), (8,), (5, 3, 2)]
    init = [torch.randn(s, generator=g).to(device) for s in shapes]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    module = torch.nn.Module()
    for i, t in enumerate(init):
        module.register_parameter(f"p{i}", torch.nn.Parameter(t.clone()))
    ours = list(module.parameters())
    mw = MasterWeights(module, compile_mode="false" if backend is None else "true")
    mw.keep_copies()
    opt_ref = torch.optim.AdamW(_groups(ref), lr=1e-2, betas=(0.9, 0.95), fused=True)
    opt = MasterAdamW(_groups(ours), mw, compile_backend=backend, lr=1e-2, betas=(0.9, 0.95))
    for step in range(4):
        grads = [torch.randn(s, generator=g).bfloat16().to(device) for s in shapes]
        for p, c, gr in zip(ref, mw.computes, grads, strict=True):
            p.grad = gr.float()
            c.grad = gr.clone()
        scale = torch.tensor(2.5, device=device) if step % 2 else None
        opt_ref.grad_scale = opt.grad_scale = scale
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        assert all(c.grad is None for c in mw.computes)
        for a, b, c in zip(ref, ours, mw.computes, strict=True):
            torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=WEIGHT_ATOL,
                                       msg=lambda m, step=step, shape=tuple(b.shape): f"step {step} {shape}: {m}")
            assert torch.equal(c, b.detach().bfloat16())
        for a, b in zip(ref, ours, strict=True):
            for k in ("exp_avg", "exp_avg_sq"):
                want = opt_ref.state[a][k]
                torch.testing.assert_close(opt.state[b][k], want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
            assert torch.equal(opt.state[b]["step"], opt_ref.state[a]["step"])
    assert mw.copies_current()

    def layout(sd):
        return ([{k: v for k, v in grp.items() if k != "params"} for grp in sd["param_groups"]],
                {i: {k: (v.dtype, v.shape, v.device) for k, v in s.items()} for i, s in sd["state"].items()})

    assert layout(opt.state_dict()) == layout(opt_ref.state_dict())
    opt.load_state_dict(opt_ref.state_dict())  # torch's checkpoint into ours, moments included
    assert torch.equal(opt.state[ours[0]]["exp_avg"], opt_ref.state[ref[0]]["exp_avg"])
    if backend is not None:
        assert int(counters["stats"]["unique_graphs"]) == 1  # flat views: one graph for five shapes
        assert opt.compiled


def test_a_step_without_some_gradients_leaves_those_parameters_and_their_copies():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    mw = MasterWeights(module)
    opt = MasterAdamW(module.parameters(), mw, lr=1e-2)
    before = [p.detach().clone() for p in module.parameters()]
    module(torch.randn(2, 4))[:, :2].float().sum().backward()
    module[1].bias.grad = None  # as if unused
    mw.copy_of(module[1].bias).grad = None
    opt.step()
    assert torch.equal(module[1].bias.detach(), before[3])
    assert not torch.equal(module[0].weight.detach(), before[0])
    assert all(torch.equal(c, p.detach().bfloat16()) for p, c in zip(module.parameters(), mw.computes, strict=True))
    assert mw.copies_current()


def _train(model, optimizer: str, compile_backend: str | None = None):
    """Three steps with clipping, the first over two microbatches; losses and the first step's fp32
    gradients by name."""
    if optimizer == "master":
        mw = MasterWeights(model)
        opt = MasterAdamW(model.parameters(), mw, compile_backend=compile_backend, lr=1e-2)
    else:
        MasterWeights(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    losses, first = [], None
    for i, x in enumerate(_batches()):
        for micro in (x.tensor_split(2) if i == 0 else [x]):
            loss = model(input_ids=micro, targets=micro) / x.numel()
            loss.backward()
            losses.append(loss.detach())
        if optimizer == "master":
            grads = dict(zip([n for n, _ in model.named_parameters()], [mw.grad_of(p) for p in model.parameters()],
                             strict=True))
            norm = fp32_norm(mw.gradients())
        else:
            grads = {n: p.grad for n, p in model.named_parameters()}
            norm = total_grad_norm([p for p in model.parameters() if p.grad is not None])
        first = first or {n: g.float().clone() for n, g in grads.items()}
        scale_for_clip(opt, [p for p in model.parameters() if p.grad is not None], norm, 0.5)
        opt.step()
        opt.zero_grad()
    return losses, first


def test_training_equals_the_cast_gradient_path():
    """tiny-qwen3 (tied embedding and head), bf16 copies of fp32 masters, three steps: with
    MasterAdamW against torch's fused AdamW over fp32 gradients cast from the same bf16 ones. The
    first step (two microbatches: their gradients summed in fp32 on the masters) is the same bit
    for bit; later losses agree to 1e-3 (the weights differ by rounding, and bf16 copies of them
    can round apart)."""
    ref = _train(_tiny_lm("tiny-qwen3"), "torch")
    ours = _train(_tiny_lm("tiny-qwen3"), "master")
    assert len(ours[0]) == 4
    assert all(torch.equal(a, b) for a, b in zip(ref[0][:2], ours[0][:2], strict=True))
    assert ref[1].keys() == ours[1].keys()
    assert [n for n in ref[1] if not torch.equal(ref[1][n], ours[1][n])] == []
    for a, b in zip(ref[0][2:], ours[0][2:], strict=True):
        assert abs(float(a) - float(b)) <= 1e-3 * abs(float(a)), (float(a), float(b))
    assert ours[0][0] + ours[0][1] != ours[0][-1]  # it trained


def test_one_microbatch_gradients_stay_bf16_and_copies_are_cast_only_when_a_master_changes():
    """After a backward of one microbatch each gradient stays on its bf16 copy (no fp32 gradient
    exists); after the step the copies hold the new weights and keep their memory, so the next
    forward casts nothing (a copy overwritten here stays so); a master changed in place (a
    checkpoint loaded into the model) is cast again before the forward that follows."""
    model = _tiny_lm()
    mw = MasterWeights(model)
    opt = MasterAdamW(model.parameters(), mw, lr=1e-2)
    x = _batches()[0]
    model(input_ids=x, targets=x).backward()
    assert all(p.grad is None for p in model.parameters())
    assert {c.grad.dtype for c in mw.computes} == {torch.bfloat16}
    opt.step()
    opt.zero_grad()
    assert all(c.untyped_storage().size() == c.numel() * 2 for c in mw.computes)
    marker = mw.computes[0]
    with torch.no_grad():
        marker.fill_(3.0)
        model(input_ids=x, targets=x)
    assert bool((marker == 3.0).all())  # not cast again: the optimizer wrote the copies
    state = {k: v.clone() + 0.5 for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    with torch.no_grad():
        model(input_ids=x, targets=x)
    assert all(torch.equal(c, m.detach().bfloat16()) for m, c in zip(mw.masters, mw.computes, strict=True))


def test_the_trainer_clip_needs_the_fused_step():
    """Parallelized.clip_grad_norm over bf16 gradients on the copies: the norm in fp32 (as over
    their fp32 casts, to rounding), the clip handed to MasterAdamW; without it, one clear error."""
    from trainer.parallel.mesh import ParallelDims
    from trainer.parallel.parallelized import Parallelized

    model = _tiny_lm()
    mw = MasterWeights(model)
    opt = MasterAdamW(model.parameters(), mw, lr=1e-2)
    par = Parallelized([model], None, ParallelDims.from_config(_parallel(), 1, 1), torch.device("cpu"), "bf16",
                       bf16_weights=True, extras={"master_weights": mw})
    x = _batches()[0]
    model(input_ids=x, targets=x).backward()
    norm = par.clip_grad_norm(1e-3, opt)
    want = torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in mw.gradients()]))
    torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(opt.grad_scale, want / 1e-3, rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="inside MasterAdamW's step"):
        par.clip_grad_norm(1.0, None)


def _parallel():
    from trainer.config import ParallelConfig

    return ParallelConfig()


def test_a_compile_error_ends_the_run_or_with_compile_try_warns_once_and_runs_eagerly(caplog):
    """train.compile true: an update that cannot compile raises; `try`: one warning naming the
    reason, then the same step eagerly (the weights as an eager optimizer's), compiled no more."""
    def broken(*args):
        raise RuntimeError("inductor: no kernel for this\nsecond line")

    results = []
    for eager_on_error in (False, True, None):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 4)
        mw = MasterWeights(lin)
        opt = MasterAdamW(lin.parameters(), mw, compile_backend=None if eager_on_error is None else "inductor",
                          eager_on_error=bool(eager_on_error), lr=1e-2)
        if eager_on_error is not None:
            opt._update = broken
        lin(torch.ones(2, 4)).float().sum().backward()
        if eager_on_error is False:
            with pytest.raises(RuntimeError, match="no kernel for this"):
                opt.step()
            continue
        with caplog.at_level("WARNING", logger="trainer"):
            opt.step()
        results.append([p.detach().clone() for p in lin.parameters()])
        if eager_on_error:
            assert not opt.compiled
            assert [r.getMessage() for r in caplog.records] == [
                "train.compile try: the AdamW update runs eagerly (inductor: no kernel for this)"]
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
