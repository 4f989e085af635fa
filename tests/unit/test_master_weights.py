"""trainer/parallel/master_weights.py: bf16 compute weights over fp32 masters in one process, the
numbers of FSDP2's mixed precision on a one-rank mesh (which it replaces) bit for bit."""

from __future__ import annotations

import pytest
import torch

from trainer.models.lm_loss import install_loss_forward
from trainer.parallel.master_weights import MasterWeights, bf16_weights_suit


def _tiny_lm(preset: str = "tiny-llama", device: str = "cpu"):
    from trainer.config import ModelConfig
    from trainer.models import build_model, model_spec

    mc = ModelConfig(preset=preset)
    return install_loss_forward(build_model(model_spec(mc), mc, 0), 2).to(device)


def _batches(device: str = "cpu"):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 512, (4, 16), generator=g).to(device) for _ in range(3)]


def _train(model, wrap: str, checkpointing: bool, compile_backend: str | None = None):
    """Three AdamW steps with clipping (the second over two microbatches); the losses, then the
    fp32 weights and the last step's fp32 gradients by name. On the model's device (FSDP2 over
    gloo on CPU, NCCL on CUDA)."""
    from trainer.parallel.activation_checkpoint import apply_activation_checkpointing
    from trainer.parallel.compile import compile_blocks
    from trainer.parallel.grad_norm import scale_for_clip, total_grad_norm

    if checkpointing:
        apply_activation_checkpointing(model, "full")
    if compile_backend:
        compile_blocks(model, backend=compile_backend)
    device = next(model.parameters()).device
    if wrap == "fsdp2":
        from trainer.parallel.data_parallel import apply_fsdp, one_rank_mesh

        apply_fsdp(model, [], one_rank_mesh(device), reshard_after_forward=False,
                   param_dtype=torch.bfloat16, backend="gloo" if device.type == "cpu" else "nccl")
    else:
        MasterWeights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    losses = []
    for i, x in enumerate(_batches(device.type)):
        for micro in (x.tensor_split(2) if i == 1 else [x]):
            loss = model(input_ids=micro, targets=micro) / x.numel()
            loss.backward()
            losses.append(loss.detach())
        params = [p for p in model.parameters() if p.grad is not None]
        scale_for_clip(opt, params, total_grad_norm(params), 0.5)
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, {n: _full(p) for n, p in model.named_parameters()}, grads


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


@pytest.mark.parametrize(("preset", "checkpointing"), [("tiny-llama", False), ("tiny-qwen3", True), ("tiny-t5", False)])
def test_master_weights_equal_fsdp2_on_one_rank_bit_for_bit(preset, checkpointing):
    """tiny-llama, tiny-qwen3 and tiny-t5 (the last two tie embedding and head: one compute copy,
    gradients from both uses) three AdamW
    steps with clipping inside the fused step, one of them over two microbatches (fp32 gradient
    accumulation), with and without full activation checkpointing (the backward recomputes each
    block with the bf16 copies): losses and fp32 gradients equal FSDP2's bit for bit, the fp32 weights
    to one rounding of the optimizer.

    Each case in a process of its own: the reference is what moves with what ran before it. On an
    AVX2-only CPU (2026-12-01), after tiny-llama's two runs in the same process, FSDP2's last-step
    gradients of tiny-qwen3 with checkpointing differed from its own in a fresh process in 23 of 24
    tensors (up to 0.56% of the largest: one bf16 rounding), while the master weights' were the
    same bit for bit in both; in a fresh process the two agree bit for bit."""
    import subprocess
    import sys
    from pathlib import Path

    code = f"from tests.unit.test_master_weights import _equal_fsdp2; _equal_fsdp2({preset!r}, {checkpointing!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _equal_fsdp2(preset: str, checkpointing: bool) -> None:
    import torch.distributed as dist

    try:
        ref = _train(_tiny_lm(preset), "fsdp2", checkpointing)
    finally:
        dist.destroy_process_group()
    ours = _train(_tiny_lm(preset), "master", checkpointing)
    assert len(ref[0]) == len(ours[0]) == 4
    assert all(torch.equal(a, b) for a, b in zip(ref[0], ours[0], strict=True)), (ref[0], ours[0])
    for want, got in ((ref[2], ours[2]), (ref[1], ours[1])):
        assert want.keys() == got.keys()
        assert {t.dtype for t in got.values()} == {torch.float32}
    # The last step's gradients come from the weights of the steps before: bit for bit. The weights
    # after the last step to 1e-6 of the largest: FSDP2's own update moves by an ulp when another
    # FSDP2 model ran before it in the same process (seen on CPU; the cause is in FSDP2, not pinned).
    assert [n for n in ref[2] if not torch.equal(ref[2][n], ours[2][n])] == []
    assert [n for n in ref[1] if (ref[1][n] - ours[1][n]).abs().max() > 1e-6 * ref[1][n].abs().max()] == []
    assert ours[0][0] != ours[0][-1]  # it trained


def test_the_registered_parameters_are_the_fp32_masters_outside_a_step():
    """Between steps (and after an evaluation forward under no_grad) the model's parameters, its
    state dict and its gradients are the fp32 masters; during the forward they are the bf16 copies,
    one per distinct parameter (the tied embedding and head share one)."""
    model = _tiny_lm("tiny-qwen3")
    masters = list(model.parameters())
    mw = MasterWeights(model)
    assert len(mw.computes) == len(masters)
    assert model.model.embed_tokens.weight is model.lm_head.weight  # tiny-qwen3 ties them
    seen = {}
    model.model.norm.register_forward_hook(lambda m, a, o: seen.update(dtype=m.weight.dtype, out=o.dtype))
    x = _batches()[0]
    with torch.no_grad():
        model(input_ids=x, targets=x)
    assert seen == {"dtype": torch.bfloat16, "out": torch.bfloat16}
    assert list(model.parameters()) == masters and not mw.active
    model(input_ids=x, targets=x).backward()
    assert list(model.parameters()) == masters and not mw.active
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in masters)
    assert all(c.grad is None for c in mw.computes)
    # Between steps the bf16 copies hold no memory (FSDP2 frees its unsharded parameters likewise).
    assert all(c.untyped_storage().size() == 0 for c in mw.computes)
    assert {t.dtype for t in model.state_dict().values() if t.is_floating_point()} == {torch.float32}


def test_compiled_blocks_keep_their_graphs_across_steps():
    """The bf16 copies are the same objects every step: compiled blocks (aot_eager here) compile
    once, not once per step, and no block falls back to eager."""
    from torch._dynamo.utils import counters

    from trainer.parallel.compile import blocks_running_eager, compile_blocks

    torch._dynamo.reset()
    counters.clear()
    model = _tiny_lm()
    n = compile_blocks(model, backend="aot_eager")
    MasterWeights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    graphs = []
    for x in _batches():
        model(input_ids=x, targets=x).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model(input_ids=x, targets=x)
        graphs.append(int(counters["stats"]["unique_graphs"]))
    assert graphs == [n] * 3, graphs
    assert blocks_running_eager(model) == []


def test_float_inputs_are_cast_and_batchnorm_models_keep_autocast():
    """Floating-point inputs reach the model in bf16 (as FSDP2's cast_forward_inputs), integer
    inputs as they are; a model with BatchNorm is not given bf16 weights."""
    lin = torch.nn.Sequential(torch.nn.Linear(4, 3))
    MasterWeights(lin)
    got = {}
    lin[0].register_forward_pre_hook(lambda m, a: got.update(x=a[0].dtype, w=m.weight.dtype))
    out = lin(torch.randn(2, 4))
    assert got == {"x": torch.bfloat16, "w": torch.bfloat16} and out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert lin[0].weight.dtype == torch.float32 and lin[0].weight.grad.dtype == torch.float32
    assert bf16_weights_suit(lin) and not bf16_weights_suit(torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1), torch.nn.BatchNorm2d(3)))
