"""The GPU-server defaults, checked on CPU: bf16 parameters (one process: bf16 copies of fp32
masters; DDP: FSDP2's mixed precision) against autocast, DDP's gradient buckets and hook, the log cadence, the CUDA
allocator setting, the device index of a local rank, memory in GiB, the largest over ranks, and
the garbage collector's schedule (a real loop in this process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml

from tests.support.trainer_run import REPO, checkpoint_tensors, read_metrics, run_trainer, trainer_env

# logging.peak_flops given: the CPU's bf16 matmul probe costs ~45 s of CPU per process here.
BF16 = ("--config", "configs/tiny.yaml", "--train.steps", "4", "--optim.lr", "0.01", "--train.dtype", "bf16",
        "--profile.batch", "none", "--logging.peak_flops", "1e9")
# As a CUDA run compiles (blocks, loss and master_adamw.py's update), with the eager-kernel backend.
COMPILED = ("--train.compile", "true", "--train.compile_backend", "aot_eager")
BF16_RTOL = 2e-2  # bf16 keeps 8 bits of mantissa: activations in bf16 vs fp32 residual stream and norms


@pytest.fixture(scope="module")
def autocast_losses(tmp_path_factory) -> list[float]:
    """One process, bf16 autocast over fp32 weights (train.param_dtype fp32)."""
    out = tmp_path_factory.mktemp("autocast")
    run_trainer(out, *BF16, "--train.param_dtype", "fp32")
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["param_dtype"] == "fp32"
    return [r["loss"] for r in read_metrics(out)]


def _close_not_equal(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == 4
    for step, (a, b) in enumerate(zip(got, want, strict=True), 1):
        assert abs(a - b) <= BF16_RTOL * abs(b), f"step {step}: {a} vs autocast {b}"
    assert got != want  # bf16 activations are not autocast's numbers: the setting took effect


def test_bf16_parameters_on_one_process_match_autocast(tmp_path, autocast_losses):
    """train.param_dtype bf16 in one process: bf16 compute weights over fp32 masters
    (master_weights.py) and the compiled AdamW that writes them (master_adamw.py); the master
    weights and AdamW state the checkpoint holds are fp32, and a run resumed from step 2 repeats
    steps 3 and 4 exactly."""
    proc = run_trainer(tmp_path, *BF16, *COMPILED, "--train.param_dtype", "bf16", "--checkpoint.interval", "2")
    assert "bf16 compute weights over fp32 master weights in one process; AdamW reads their bf16 gradients and " \
           "writes them (one compiled pass per parameter)" in proc.stdout
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["param_dtype"] == "bf16"
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    _close_not_equal(losses, autocast_losses)
    saved = checkpoint_tensors(tmp_path / "checkpoints" / "step-4")
    weights = {k: v for k, v in saved.items() if k.startswith("app.model.")}
    state = {k: v for k, v in saved.items() if k.startswith("app.optim.state.") and v.dim() > 0}
    assert weights and state
    assert {v.dtype for v in weights.values()} == {v.dtype for v in state.values()} == {torch.float32}
    resumed = tmp_path / "resumed"
    run_trainer(resumed, *BF16, *COMPILED, "--train.param_dtype", "bf16", "--resume",
                str(tmp_path / "checkpoints" / "step-2"))
    assert [r["loss"] for r in read_metrics(resumed)][-2:] == losses[2:]


@pytest.mark.multiproc
def test_bf16_parameters_with_ddp_match_autocast(tmp_path, autocast_losses):
    proc = run_trainer(tmp_path, *BF16, "--train.param_dtype", "bf16", "--parallel.sharding", "ddp",
                       "--train.batch_size", "2", nproc=2)
    assert "DDP as FSDP2 over (replicate 2, shard 1)" in proc.stdout
    _close_not_equal([r["loss"] for r in read_metrics(tmp_path)], autocast_losses)


def test_param_dtype_resolution_and_errors():
    from trainer.config import ConfigError, resolve
    from trainer.runtime.dist_env import resolve_param_dtype

    assert resolve_param_dtype("auto", "bf16", "cuda") == "bf16"
    assert resolve_param_dtype("auto", "bf16", "cpu") == "fp32"  # CPU runs keep autocast unless asked
    assert resolve_param_dtype("auto", "fp32", "cuda") == "fp32"
    assert resolve(None, [("train.steps", 1), ("train.param_dtype", "bfloat16")], environ={}).train.param_dtype == "bf16"
    with pytest.raises(ConfigError, match="train.param_dtype: 'fp16'"):
        resolve(None, [("train.steps", 1), ("train.param_dtype", "fp16")], environ={})
    with pytest.raises(ConfigError, match="train.param_dtype bf16 .* train.dtype is fp32"):
        resolve(None, [("train.steps", 1), ("train.param_dtype", "bf16"), ("train.dtype", "fp32")], environ={})


def test_ddp_reduces_in_its_buckets_with_a_python_hook_only_where_needed():
    import torch.distributed as dist

    from trainer.parallel.data_parallel import apply_ddp, one_rank_mesh

    try:
        mesh = one_rank_mesh(torch.device("cpu"))
        plain = apply_ddp(torch.nn.Linear(4, 4), mesh, torch.device("cpu"), "gloo", observe=False)
        assert plain.gradient_as_bucket_view and not hasattr(plain, "grad_reduce")
        plain(torch.randn(2, 4)).sum().backward()
        assert plain.module.weight.grad is not None
        timed = apply_ddp(torch.nn.Linear(4, 4), mesh, torch.device("cpu"), "gloo", observe=True)
        assert timed.grad_reduce.ordered is False  # the profiler's observer needs the hook; no ordering
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ log cadence, allocator, device index


def test_log_interval_auto_is_every_step_on_cpu_and_every_tenth_on_cuda():
    from trainer.config import ConfigError, resolve
    from trainer.config.checks import resolve_log_interval

    assert resolve_log_interval("auto", "cpu") == 1 and resolve_log_interval("auto", "cuda") == 10
    assert resolve_log_interval(3, "cuda") == 3
    assert resolve(None, [("train.steps", 1)], environ={}).logging.log_interval == "auto"
    assert resolve(None, [("train.steps", 1), ("logging.log_interval", "4")], environ={}).logging.log_interval == 4
    with pytest.raises(ConfigError, match="logging.log_interval must be auto or >= 1"):
        resolve(None, [("train.steps", 1), ("logging.log_interval", "0")], environ={})


def test_expandable_segments_unless_the_user_chose_an_allocator_config():
    from trainer.runtime.dist_env import configure_allocator

    env: dict[str, str] = {}
    assert configure_allocator(env) and env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        mine = {var: "max_split_size_mb:128"}
        assert configure_allocator(mine) is None and mine == {var: "max_split_size_mb:128"}


def test_local_rank_maps_onto_the_visible_devices():
    from trainer.runtime.dist_env import cuda_index

    assert cuda_index(3, 1) == 0    # Slurm --gpus-per-task=1: every task sees one device
    assert cuda_index(5, 4) == 1
    assert [cuda_index(r, 8) for r in range(8)] == list(range(8))


# ------------------------------------------------------------------ memory: GiB, max over ranks


def test_memory_record_and_line_in_gib():
    from trainer.metrics import StepStats, console_line

    gib = 2 ** 30
    r = StepStats(1, 2.0, 1e-3, 1.0, 4, 128, 0.5, 128, 1, 1e6, 1e12, 3 * gib // 2, 2 * gib).record()
    assert r["memory_gib"] == 1.5 and r["memory_reserved_gib"] == 2.0 and r["memory_bytes"] == 3 * gib // 2
    assert "| Memory usage:  1.50GiB (2.00GiB reserved) |" in console_line(r)
    cpu = StepStats(1, 2.0, 1e-3, 1.0, 4, 128, 0.5, 128, 1, 1e6, 1e12, gib).record()
    assert cpu["memory_reserved_gib"] is None and "| Memory usage:  1.00GiB | LR" in console_line(cpu)


MEMORY_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
import trainer.train as train
from types import SimpleNamespace

dist.init_process_group("gloo")
rank = dist.get_rank()
out = {}
for reserved in (None, 10):
    train.memory_bytes = lambda device, r=rank, res=reserved: (1000 * (r + 1), None if res is None else res * (2 - r))
    me = SimpleNamespace(env=SimpleNamespace(distributed=True), device=torch.device("cpu"), backend="gloo")
    slots = [float(rank + 1) if i == rank else 0.0 for i in range(2)]  # each rank fills its own (StepTimes)
    out[str(reserved)] = train.Trainer._memory(me, slots)
open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w").write(json.dumps(out))
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_memory_is_the_largest_over_ranks(tmp_path):
    """Every rank reports the largest allocated and the largest reserved figure of all ranks
    (here rank 1 allocates more, rank 0 reserves more), and the step-time slots each rank filled
    ride on the same all-reduce."""
    script = tmp_path / "memory.py"
    script.write_text(MEMORY_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=trainer_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"None": [[2000, None], [1.0, 2.0]], "10": [[2000, 20], [1.0, 2.0]]}


@pytest.mark.multiproc
def test_bf16_on_an_image_model_keeps_batchnorm_in_fp32(tmp_path):
    """Wide-ResNet under ZeRO-3 x 2 with train.dtype bf16: FSDP2's mixed precision would cast each
    BatchNorm's weight to bf16 beside its fp32 running statistics, which batch_norm refuses (seen on
    an H100: every Wide-ResNet row of bench/gpu_families failed so; CPU refuses the same mix). The
    run keeps fp32 weights and computes in bf16 by autocast, within bf16's tolerance of one
    autocast process; train.param_dtype bf16 for such a model is one line."""
    from trainer.config import ConfigError
    from trainer.runtime.dist_env import resolve_param_dtype

    args = ("--model.preset", "tiny-wide-resnet", "--train.steps", "4", "--train.dtype", "bf16",
            "--profile.batch", "none", "--logging.peak_flops", "1e9")
    # One process: 4 samples in microbatches of 2, as the two ranks' 2 each (BatchNorm normalises
    # over what one forward sees).
    run_trainer(tmp_path / "one", *args, "--train.batch_size", "4", "--train.microbatch_num", "2")
    run_trainer(tmp_path / "zero3", *args, "--train.batch_size", "2", "--parallel.sharding", "zero3", nproc=2)
    assert yaml.safe_load((tmp_path / "zero3" / "config.yaml").read_text())["train"]["param_dtype"] == "fp32"
    got, want = ([r["loss"] for r in read_metrics(tmp_path / d)] for d in ("zero3", "one"))
    assert len(got) == len(want) == 4
    for step, (a, b) in enumerate(zip(got, want, strict=True), 1):
        assert abs(a - b) <= BF16_RTOL * abs(b), f"step {step}: {a} vs one autocast process {b}"
    assert resolve_param_dtype("auto", "bf16", "cuda", "image") == "fp32"
    with pytest.raises(ConfigError, match="not for an image model"):
        resolve_param_dtype("bf16", "bf16", "cuda", "image")


# ------------------------------------------------------------------ host work per step


def _tiny_lm(preset: str):
    from trainer.config import ModelConfig
    from trainer.models import build_model, model_spec

    mc = ModelConfig(preset=preset)
    return build_model(model_spec(mc), mc, 0)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_the_trainers_forward_skips_the_packed_sequence_check(preset, monkeypatch):
    """transformers' packed-sequence check waits for the device every forward (a data-dependent
    `if` on the position ids; on an H100 the sync debug mode named it): the trainer's loss forward,
    whose positions are the model's own, never runs it; a plain forward still does, and the loss
    is the same bits either way."""
    from transformers import masking_utils

    from trainer.models.lm_loss import install_loss_forward

    calls = []

    def counting(position_ids):
        calls.append(tuple(position_ids.shape))
        return None

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counting)
    model = install_loss_forward(_tiny_lm(preset), 1)
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=x, targets=x)
    assert calls == []
    logits = model(input_ids=x).logits  # a user's own forward: the check runs as transformers wrote it
    assert calls == [(2, 16)]
    by_hand = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x.flatten(), reduction="sum")
    assert torch.equal(loss, by_hand)


def test_one_process_fsdp2_is_one_unit_with_the_same_numbers():
    """train.param_dtype bf16 on one process: FSDP2 over the whole model as one unit (per-block
    units only add host work where nothing is sharded); one bf16 step's loss and fp32 gradients
    equal the per-block wrapping's bit for bit."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from trainer.models.lm_loss import install_loss_forward
    from trainer.parallel.activation_checkpoint import blocks_of
    from trainer.parallel.data_parallel import apply_fsdp, one_rank_mesh

    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    results = []
    try:
        mesh = one_rank_mesh(torch.device("cpu"))
        for per_block in (True, False):
            model = install_loss_forward(_tiny_lm("tiny-llama"), 2)
            blocks = blocks_of(model) if per_block else []
            apply_fsdp(model, blocks, mesh, reshard_after_forward=False, param_dtype=torch.bfloat16, backend="gloo")
            assert [isinstance(b, FSDPModule) for b in blocks_of(model)] == [per_block] * len(blocks_of(model))
            loss = model(input_ids=x, targets=x)
            loss.backward()
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            assert {g.dtype for g in grads.values()} == {torch.float32}
            results.append((loss.detach(), grads))
    finally:
        dist.destroy_process_group()
    (l1, g1), (l2, g2) = results
    assert torch.equal(l1, l2)
    assert g1.keys() == g2.keys() and all(torch.equal(g1[n], g2[n]) for n in g1)



def test_gc_interval_auto_is_python_s_own_collector_on_cpu_and_every_50th_step_on_cuda():
    from trainer.runtime.gc_schedule import resolve_gc_interval

    assert resolve_gc_interval("auto", "cpu") == 0 and resolve_gc_interval("auto", "cuda") == 50
    assert resolve_gc_interval(3, "cpu") == 3 and resolve_gc_interval(0, "cuda") == 0


@pytest.mark.parametrize("interval", [2, 0])
def test_gc_interval_collects_after_every_nth_step_with_the_automatic_collector_off(tmp_path, monkeypatch, interval):
    """A real training loop in this process: with an interval the automatic collector is off during
    every step (so nothing collects but the schedule), the young generations are collected after
    steps 2 and 4, and the collector is on again after the loop; with 0 it stays on (Python collects
    when it will) and the schedule collects nothing."""
    import gc

    from trainer.config import resolve
    from trainer.config.argv import parse_train_args
    from trainer.parallel.mesh import ParallelDims
    from trainer.runtime.dist_env import DistEnv
    from trainer.train import Trainer

    cfg = resolve(*parse_train_args(["--config", "configs/tiny.yaml", "--train.steps", "5", "--profile.batch", "none",
                                     "--logging.peak_flops", "1e9", "--train.gc_interval", str(interval),
                                     "--output-dir", str(tmp_path)]))
    trainer = Trainer(cfg, DistEnv(), ParallelDims.from_config(cfg.parallel, 1, 1), torch.device("cpu"), "gloo")
    seen: list[tuple] = []
    step = trainer.train_step

    def watched_step():
        seen.append(("step", trainer.step + 1, gc.isenabled()))
        return step()

    def collected(phase, info):  # collections while the automatic collector is off: the schedule's own
        if phase == "start" and not gc.isenabled():
            seen.append(("gc", trainer.step, info["generation"]))

    monkeypatch.setattr(trainer, "train_step", watched_step)
    assert gc.isenabled()
    gc.callbacks.append(collected)
    try:
        trainer.fit()
    finally:
        gc.callbacks.remove(collected)
        trainer.close()
    assert gc.isenabled()
    steps = [s for s in seen if s[0] == "step"]
    assert steps == [("step", n, interval == 0) for n in range(1, 6)]
    if interval:
        assert [s for s in seen if s[0] == "gc"] == [("gc", 2, 1), ("gc", 4, 1)]
        assert trainer.gc.collections == 2
    else:
        assert [s for s in seen if s[0] == "gc"] == [] and trainer.gc.collections == 0
