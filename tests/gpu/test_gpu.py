"""CUDA tests, in the order they run (cheapest and most telling first, so that a run cut off by a
time limit still says most): compiled vs eager equality, the flash kernel in the trainer's
profiled step, chunked vs unchunked loss, the head gradient in the forward vs the recomputing
chunks, memory bounds, no host sync between log steps, the GPU
defaults end to end (compiled blocks and loss, bf16 parameters, log cadence, memory fields), FSDP2
on NCCL with one rank, the NVML energy CSV in real Joules, checkpoint/resume on CUDA, and with
>= 2 GPUs every layout compiled on NCCL against one GPU. Each skips without a CUDA device (the
multi-GPU ones below 2); CI has none. On a GPU host:

    pytest -m gpu tests/gpu/test_gpu.py            (or: PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_gpu.py)

bench/gpu_session.sh runs them with the GPU benchmark under one time budget.
"""

from __future__ import annotations

import csv
import sys

import pytest
import yaml

from tests.support.trainer_run import REPO, read_metrics, run_trainer, trainer_env


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if _cuda() else 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU (none visible)")]

TINY = ("--config", "configs/tiny.yaml", "--parallel.device", "cuda")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each in-process test compiles the same HF forward code with other shapes and dtypes: a
    clean dynamo cache per test keeps one test's graphs from counting against the next's
    recompile limit."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _tiny(preset: str = "tiny-llama", **overrides):
    from trainer.config import ModelConfig
    from trainer.models import build_model, model_spec

    mc = ModelConfig(preset=preset, **overrides)
    spec = model_spec(mc)
    return spec, lambda: build_model(spec, mc, 0)


def _loss_and_grads(model, x, y):
    loss = model(input_ids=x, targets=y)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_equals_eager_on_cuda():
    """Blocks and the chunked loss compiled by inductor (fp32, no TF32): the loss and every gradient
    of one step equal the eager model's."""
    import torch

    from trainer.models.lm_loss import compile_loss, install_loss_forward
    from trainer.parallel.compile import compile_blocks

    dev = torch.device("cuda", 0)
    spec, build = _tiny()
    x = torch.randint(0, 512, (4, 64), device=dev)
    y = torch.randint(0, 512, (4, 64), device=dev)
    eager = install_loss_forward(build(), 4).to(dev)
    compiled = install_loss_forward(build(), 4).to(dev)
    assert compile_blocks(compiled, mode="true", backend="inductor") == 2
    compile_loss(compiled.lm_head, "inductor")
    (l0, g0), (l1, g1) = _loss_and_grads(eager, x, y), _loss_and_grads(compiled, x, y)
    assert torch.allclose(l1, l0, rtol=1e-5), (float(l1), float(l0))
    for n in g0:
        assert torch.allclose(g1[n], g0[n], rtol=1e-3, atol=1e-5), n


def test_flash_attention_runs_in_the_trainer_step(tmp_path):
    """The trainer's default CUDA step (compiled blocks, bf16): a profiled step launches a fused
    flash-attention kernel (PyTorch's own flash, or cuDNN's, which torch 2.11 picks first on an
    H100: `cudnn_generated_fort_native_sdpa_sm90_flash_fprop_...`), not the math path a full
    attention mask would force."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu_throughput import sdpa_kernels

    trainer = _trainer(tmp_path, [])
    trainer.train_step()  # compiles
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.train_step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    attn = sorted({n for n in names if any(m in n.lower() for m in ("attention", "attn", "flash", "fmha", "sdpa"))})
    kinds = sdpa_kernels(names)
    assert kinds in (["flash"], ["cudnn"]), (kinds, attn[:20])


def test_chunked_loss_equals_one_chunk_on_cuda():
    import torch

    from trainer.models.lm_loss import compile_loss, install_loss_forward

    dev = torch.device("cuda", 0)
    spec, build = _tiny(vocab_size=8192)
    x = torch.randint(0, 8192, (4, 128), device=dev)
    results = []
    for chunks in (1, 8):
        model = install_loss_forward(build(), chunks).to(dev)
        compile_loss(model.lm_head, "inductor")
        results.append(_loss_and_grads(model, x, x))
    (l1, g1), (l8, g8) = results
    assert torch.allclose(l8, l1, rtol=1e-5)
    assert all(torch.allclose(g8[n], g1[n], rtol=1e-3, atol=1e-5) for n in g1)


def test_head_gradient_in_forward_equals_the_recomputing_chunks_on_cuda():
    """The loss as the trainer runs it (head gradients in the forward, compiled by inductor) against
    the recomputing chunks a pipeline stage runs, fp32 and bf16 (autocast): the same loss (1e-5 /
    1e-3) and gradients of the hidden states and the head (1e-4 / 1% of the largest entry)."""
    import torch

    from trainer.models.lm_loss import compile_loss, lm_loss_sum

    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(0)
    w0, h0 = torch.randn(8192, 256, generator=g) * 0.05, torch.randn(4096, 256, generator=g)
    y = torch.randint(0, 8192, (4096,), generator=g).to(dev)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-3)):
        out = []
        for fuse in (True, False):
            head = torch.nn.Linear(256, 8192, bias=False).to(dev)
            with torch.no_grad():
                head.weight.copy_(w0)
            h = h0.to(dev).requires_grad_()
            compile_loss(head, "inductor")
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                loss = lm_loss_sum(head, h, y, 4, fuse=fuse)
            loss.backward()
            out.append((loss.detach(), h.grad, head.weight.grad))
        (fl, fh, fw), (cl, ch, cw) = out
        assert torch.allclose(fl, cl, rtol=tol), (dtype, float(fl), float(cl))
        for a, b in ((fh, ch), (fw, cw)):
            assert (a - b).abs().max() <= (1e-4 if dtype == torch.float32 else 1e-2) * b.abs().max(), dtype


def _peak_gib(model, x) -> float:
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=x, targets=x)
    loss.backward()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated() / 2 ** 30


def test_memory_bounds_of_checkpointing_and_loss_chunks():
    """Peak memory of one bf16 step (llama-20m, 8 x 1024 tokens, a 65,536-token vocabulary):
    full activation checkpointing below none, and 8 loss chunks below 1 by at least half the
    fp32 logits they never hold at once."""
    import torch

    from trainer.models.lm_loss import install_loss_forward
    from trainer.parallel.activation_checkpoint import apply_activation_checkpointing

    dev = torch.device("cuda", 0)
    spec, build = _tiny("llama-20m", vocab_size=65536)
    x = torch.randint(0, 65536, (8, 1024), device=dev)
    peaks = {}
    for ac, chunks in (("none", 1), ("full", 1), ("none", 8)):
        model = install_loss_forward(build(), chunks).to(dev)
        apply_activation_checkpointing(model, ac)
        _peak_gib(model, x)  # warm-up: kernels, allocator
        peaks[(ac, chunks)] = _peak_gib(model, x)
        del model
        torch.cuda.empty_cache()
    logits_gib = x.numel() * 65536 * 4 / 2 ** 30
    assert peaks[("full", 1)] < peaks[("none", 1)], peaks
    assert peaks[("none", 8)] < peaks[("none", 1)] - logits_gib / 2, (peaks, logits_gib)


def _trainer(tmp_path, overrides: list):
    import torch

    from trainer.config import resolve
    from trainer.parallel.mesh import ParallelDims
    from trainer.runtime.dist_env import DistEnv
    from trainer.train import Trainer, setup_logging

    cfg = resolve("configs/tiny.yaml", [("train.steps", 6), ("train.loss_chunks", 2), ("profile.batch", "none"),
                                        ("output_dir", str(tmp_path)), *overrides], environ={})
    setup_logging(0, tmp_path, console=False)
    trainer = Trainer(cfg, DistEnv(), ParallelDims.from_config(cfg.parallel, 1, 1), torch.device("cuda", 0), "nccl")
    trainer.par.train(True)
    return trainer


def test_no_host_sync_between_log_steps(tmp_path):
    """Steps that are not log steps never wait for the GPU: torch's sync debug mode sees no
    synchronising call in `train_step` (data, forward/backward, clip, AdamW, schedule, prefetch)."""
    import torch

    from bench.gpu_step_profile import host_syncs

    trainer = _trainer(tmp_path, [])
    for _ in range(2):  # warm-up: compilation, allocator growth
        trainer.train_step()
        trainer.step += 1
    torch.cuda.synchronize()
    results = []

    def three_steps():
        for _ in range(3):
            results.append(trainer.train_step())
            trainer.step += 1

    syncs = host_syncs(three_steps)  # each with the Python stack that made it
    assert not syncs, list(dict.fromkeys(syncs))[:4]
    loss, norm = results[-1]
    assert torch.isfinite(loss) and torch.isfinite(norm)


def test_bf16_step_with_the_gpu_defaults(tmp_path):
    """dtype auto -> bf16 on a GPU with native bf16, bf16 parameters (bf16 copies of fp32 masters,
    written by the compiled AdamW), blocks and loss compiled into whole graphs, a log line every
    10th step with memory in GiB (allocated and reserved); losses finite."""
    import torch

    proc = run_trainer(tmp_path, *TINY, "--train.steps", "12", "--optim.lr", "0.003", "--train.loss_chunks", "4",
                       timeout=900)
    cfg = yaml.safe_load((tmp_path / "config.yaml").read_text())
    train, log = cfg["train"], proc.stdout + proc.stderr
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    assert train["dtype"] == ("bf16" if native else "fp32") and train["compile"] == "true"
    assert train["param_dtype"] == ("bf16" if native else "fp32") and cfg["logging"]["log_interval"] == 10
    assert "torch.compile: 2 blocks compiled in place + LM head and loss (backend inductor" in log
    assert "0 graph break(s)" in log and "does not compile" not in log
    if native:
        assert "AdamW reads their bf16 gradients and writes them (one compiled pass per parameter)" in log
    assert "expandable_segments:True" in log
    assert train["gc_interval"] == 50 and "garbage collection: automatic off, generation 1 collected every 50 steps" in log
    m = read_metrics(tmp_path)
    assert [r["step"] for r in m] == [10, 12] and all(0 < r["loss"] < 10 for r in m)
    assert all(r["memory_gib"] > 0 and r["memory_reserved_gib"] >= r["memory_gib"] and r["mfu"] > 0 for r in m)


def test_fsdp2_on_nccl_with_one_rank(tmp_path):
    """fully_shard over a one-rank NCCL mesh, built on the meta device and materialised: the same
    loss as the plain model, and a training step that changes the weights."""
    script = tmp_path / "fsdp1.py"
    script.write_text('''
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from trainer.config import ModelConfig
from trainer.models import build_model, model_spec
from trainer.models.lm_loss import install_loss_forward
from trainer.parallel.activation_checkpoint import blocks_of
from trainer.parallel.data_parallel import apply_fsdp
from trainer.parallel.materialize import materialize, to_meta

dist.init_process_group("nccl")
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
mc = ModelConfig(preset="tiny-llama")
spec = model_spec(mc)
plain = install_loss_forward(build_model(spec, mc, 0), 2).to(dev)
model = install_loss_forward(build_model(spec, mc, 0), 2)
ref = to_meta(model)
apply_fsdp(model, blocks_of(model), mesh, reshard_after_forward=True, param_dtype=None, backend="nccl")
materialize(model, ref, dev)
x = torch.randint(0, 512, (4, 32), device=dev)
want, got = plain(input_ids=x, targets=x), model(input_ids=x, targets=x)
assert torch.allclose(got, want, rtol=1e-4), (float(got), float(want))
got.backward()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
before = model.lm_head.weight.full_tensor().clone()
opt.step()
assert not torch.equal(before, model.lm_head.weight.full_tensor())
dist.destroy_process_group()
print("FSDP1 OK")
''')
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                           str(script)], capture_output=True, text=True, timeout=600, env=trainer_env(), cwd=REPO)
    assert proc.returncode == 0 and "FSDP1 OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_master_weights_equal_fsdp2_on_one_cuda_rank():
    """The trainer's one-process bf16 weights (master_weights.py) against FSDP2 on a one-rank NCCL
    mesh, tiny-qwen3 (tied head), blocks compiled by inductor, three AdamW steps with the clip in
    the fused step: the same losses and fp32 gradients and weights (to 1e-5 of the largest entry:
    CUDA's reductions need not add in the same order twice)."""
    import torch
    import torch.distributed as dist

    from tests.unit.test_master_weights import _tiny_lm, _train

    torch.cuda.set_device(0)
    try:
        ref = _train(_tiny_lm("tiny-qwen3", "cuda"), "fsdp2", False, "inductor")
    finally:
        dist.destroy_process_group()
    ours = _train(_tiny_lm("tiny-qwen3", "cuda"), "master", False, "inductor")
    for a, b in zip(ref[0], ours[0], strict=True):
        assert torch.allclose(a, b, rtol=1e-5), (float(a), float(b))
    for want, got in ((ref[2], ours[2]), (ref[1], ours[1])):
        assert want.keys() == got.keys()
        assert [n for n in want if (want[n] - got[n]).abs().max() > 1e-5 * want[n].abs().max()] == []


def test_master_adamw_equals_fused_adamw_on_cuda():
    """master_adamw.py's update compiled by inductor (Triton) against torch's fused AdamW CUDA
    kernel: four steps of two groups, the clip's grad_scale on two; masters and moments to rounding,
    each bf16 copy its master cast, one graph for five shapes."""
    from tests.unit.test_master_adamw import check_update_equals_torch

    check_update_equals_torch("inductor", "cuda")


def test_nvml_energy_csv_in_joules(tmp_path):
    # ~0.5 s of recorded batches: long enough for NVML's energy counter to move several times
    proc = run_trainer(tmp_path, *TINY, "--model.preset", "llama-20m", "--train.batch_size", "16", "--data.seq_len",
                       "1024", "--train.steps", "25", "--profile_batch", "1", "--export_timing_csv", "true",
                       "--num_prof_steps", "20", "--train.compile", "false", timeout=900)
    path = tmp_path / "time-energy-0.csv"
    text = path.read_text()
    assert not text.startswith("#"), f"no sensor: {text.strip()}\n{proc.stdout[-2000:]}"
    rows = list(csv.DictReader(text.splitlines()))
    energy = [float(r["energy"]) for r in rows]
    times = [float(r["time"]) for r in rows]
    assert len(rows) >= 2 and energy == sorted(energy) and energy[-1] > energy[0] >= 0  # a cumulative counter
    watts = (energy[-1] - energy[0]) / (times[-1] - times[0])
    assert 1 < watts < 2000, watts  # what a GPU draws, in J/s


def test_checkpoint_resume_on_cuda(tmp_path):
    """6 steps straight vs 3 + resume: the same steps, the same losses (fp32, eager: deterministic
    enough for 1e-5; bf16 kernels are not bitwise reproducible run to run)."""
    args = (*TINY, "--train.steps", "6", "--train.dtype", "fp32", "--train.compile", "false",
            "--checkpoint.interval", "3", "--logging.log_interval", "1")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_trainer(straight, *args, timeout=900)
    run_trainer(resumed, *args, "--train.exit_interval", "3", timeout=900)
    assert (resumed / "checkpoints" / "latest").read_text().strip() == "step-3"
    run_trainer(resumed, *args, "--train.exit_interval", "3", "--resume", "latest", timeout=900)
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)


# ------------------------------------------------------------------ >= 2 GPUs: NCCL layouts, compiled

LAYOUTS = {
    "ddp": ("--parallel.sharding", "ddp", "--train.batch_size", "2"),
    "zero3": ("--parallel.sharding", "zero3", "--train.batch_size", "2"),
    "tp2": ("--parallel.tp", "2"),
    "pp2": ("--parallel.pp", "2", "--parallel.pp_schedule", "1f1b", "--train.microbatch_num", "2"),
}
NCCL_RTOL = 1e-3  # fp32 on TF32 tensor cores: the layouts split matmuls and sums differently


@pytest.fixture(scope="module")
def one_gpu_losses(tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("one-gpu")
    run_trainer(out, *TINY, "--train.steps", "4", "--train.dtype", "fp32", "--logging.log_interval", "1",
                timeout=900)
    return [r["loss"] for r in read_metrics(out)]


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_gpu_layouts_compiled_equal_one_gpu(tmp_path, one_gpu_losses, layout):
    """DDP / ZeRO-3 / TP (sequence parallel) / PP 1F1B on 2 GPUs over NCCL, blocks and loss compiled
    (the CUDA default): the losses of one GPU, step by step."""
    proc = run_trainer(tmp_path, *TINY, "--train.steps", "4", "--train.dtype", "fp32", "--logging.log_interval", "1",
                       *LAYOUTS[layout], nproc=2, timeout=900)
    assert "backend nccl" in proc.stdout and "blocks compiled in place" in proc.stdout
    got = [r["loss"] for r in read_metrics(tmp_path)]
    assert len(got) == len(one_gpu_losses) == 4
    for step, (a, b) in enumerate(zip(got, one_gpu_losses, strict=True), 1):
        assert abs(a - b) <= NCCL_RTOL * abs(b), f"{layout} step {step}: {a} vs one GPU {b}"
