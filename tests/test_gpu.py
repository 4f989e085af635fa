"""CUDA tests (one GPU): a bf16 step with the GPU defaults, FSDP2 on NCCL with one rank, the NVML
energy CSV in real Joules, and checkpoint/resume on CUDA. Each skips without a CUDA device; CI has
none. On a GPU host:

    pytest -m gpu tests/test_gpu.py            (or: PYTHONPATH=. python3 -m pytest -m gpu tests/test_gpu.py)
"""

from __future__ import annotations

import csv
import sys

import pytest
import yaml

from tests.trainer_run import REPO, read_metrics, run_trainer, trainer_env


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU (none visible)")]

TINY = ("--config", "configs/tiny.yaml", "--parallel.device", "cuda")


def test_bf16_step_with_the_gpu_defaults(tmp_path):
    """dtype auto -> bf16 on a GPU with native bf16, blocks compiled, loss in chunks; losses finite and falling."""
    import torch

    proc = run_trainer(tmp_path, *TINY, "--train.steps", "8", "--optim.lr", "0.003", "--train.loss_chunks", "4",
                       timeout=900)
    train = yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    assert train["dtype"] == ("bf16" if native else "fp32") and train["compile"] == "true"
    assert "torch.compile: 2 blocks compiled in place" in proc.stdout + proc.stderr
    m = read_metrics(tmp_path)
    assert len(m) == 8 and all(0 < r["loss"] < 10 for r in m) and m[-1]["loss"] < m[0]["loss"]
    assert all(r["memory_bytes"] > 0 and r["mfu"] > 0 for r in m)


def test_no_host_sync_between_log_steps(tmp_path):
    """Steps that are not log steps never wait for the GPU: torch's sync debug mode sees no
    synchronising call in `train_step` (data, forward/backward, clip, AdamW, schedule, prefetch)."""
    import warnings

    import torch

    from trainer.config import resolve
    from trainer.dist_env import DistEnv
    from trainer.parallel.mesh import ParallelDims
    from trainer.train import Trainer, setup_logging

    cfg = resolve("configs/tiny.yaml", [("train.steps", 6), ("train.loss_chunks", 2), ("profile.batch", "none"),
                                        ("output_dir", str(tmp_path))], environ={})
    setup_logging(0, tmp_path, console=False)
    trainer = Trainer(cfg, DistEnv(), ParallelDims.from_config(cfg.parallel, 1, 1), torch.device("cuda", 0), "nccl")
    trainer.par.train(True)
    for _ in range(2):  # warm-up: compilation, allocator growth
        trainer.train_step()
        trainer.step += 1
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(3):
                loss, norm = trainer.train_step()
                trainer.step += 1
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert not syncs, syncs[:3]
    assert torch.isfinite(loss) and torch.isfinite(norm)


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


def test_nvml_energy_csv_in_joules(tmp_path):
    # ~0.5 s of recorded batches: long enough for NVML's energy counter to move several times
    proc = run_trainer(tmp_path, *TINY, "--model.preset", "llama-20m", "--train.batch_size", "16", "--data.seq_len",
                       "1024", "--train.steps", "25", "--profile_batch", "1", "--export_timing_csv", "true",
                       "--num_prof_steps", "20", timeout=900)
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
            "--checkpoint.interval", "3")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_trainer(straight, *args, timeout=900)
    run_trainer(resumed, *args, "--train.exit_interval", "3", timeout=900)
    assert (resumed / "checkpoints" / "latest").read_text().strip() == "step-3"
    run_trainer(resumed, *args, "--train.exit_interval", "3", "--resume", "latest", timeout=900)
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
