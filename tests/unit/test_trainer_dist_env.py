"""Launcher env (torchrun / Slurm / Open MPI) and the parallel degrees (ParallelDims), no processes."""

from __future__ import annotations

import pytest

from tests.support.trainer_run import read_metrics, run_trainer
from trainer.config import ConfigError, ParallelConfig
from trainer.parallel.mesh import ParallelDims
from trainer.runtime.dist_env import from_environ


def test_single_process_default():
    e = from_environ({})
    assert (e.rank, e.world_size, e.launcher, e.distributed) == (0, 1, "single", False)


def test_torchrun_env():
    e = from_environ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                      "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.master_addr, e.master_port, e.launcher) == \
        (3, 4, 1, 2, "10.0.0.1", 29400, "torchrun")


def test_slurm_env():
    e = from_environ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "4(x2)",
                      "MASTER_ADDR": "node01"})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.master_addr, e.master_port, e.launcher) == \
        (5, 8, 1, 4, "node01", 29500, "slurm")


def test_mpi_env():
    e = from_environ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "10", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
                      "OMPI_COMM_WORLD_LOCAL_SIZE": "10", "MASTER_ADDR": "h"})
    assert (e.rank, e.world_size, e.local_rank, e.launcher) == (2, 10, 2, "mpi")


@pytest.mark.parametrize("env", [{"SLURM_PROCID": "0", "SLURM_NTASKS": "2"},
                                 {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}])
def test_master_addr_required_for_srun_and_mpirun(env):
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        from_environ(env)


@pytest.mark.parametrize("sharding,world,local,kw,expect", [
    ("ddp", 4, 4, {}, (1, 4, 1, 1)),
    ("zero0", 2, 2, {}, (1, 2, 1, 1)),
    ("zero3", 4, 4, {}, (1, 1, 4, 1)),
    ("zero2", 8, 8, {"tp": 2, "pp": 2}, (2, 1, 2, 2)),
    ("zero3_hybrid", 16, 8, {}, (1, 2, 8, 1)),                 # replicate across nodes, shard within
    ("zero2_hybrid", 4, 4, {"dp_shard": 2}, (1, 2, 2, 1)),
])
def test_parallel_dims(sharding, world, local, kw, expect):
    d = ParallelDims.from_config(ParallelConfig(sharding=sharding, **kw), world, local)
    assert (d.pp, d.dp_replicate, d.dp_shard, d.tp) == expect and d.dp * d.tp * d.pp == world


@pytest.mark.parametrize("kw,world,needle", [({"tp": 3}, 4, "parallel.tp"), ({"dp": 3}, 4, "parallel.dp"),
                                             ({"sharding": "zero3_hybrid", "dp_shard": 3}, 4, "dp_shard"),
                                             ({"sharding": "zero3", "dp_shard": 2}, 4, "dp_shard")])
def test_inconsistent_degrees(kw, world, needle):
    with pytest.raises(ConfigError, match=needle):
        ParallelDims.from_config(ParallelConfig(**kw), world, world)


def test_local_weights_dir_and_bf16(tmp_path):
    """A model saved with save_pretrained loads offline through --model_name DIR; bf16 trains too."""
    from trainer.config import ModelConfig
    from trainer.models import build_model, model_spec

    mc = ModelConfig(preset="tiny-llama")
    build_model(model_spec(mc), mc, 1234).save_pretrained(tmp_path / "weights")  # tiny.yaml's seed
    loaded, preset, bf16 = tmp_path / "loaded", tmp_path / "preset", tmp_path / "bf16"
    run_trainer(loaded, "--config", "configs/tiny.yaml", "--model_name", str(tmp_path / "weights"), "--train.steps", "1")
    run_trainer(preset, "--config", "configs/tiny.yaml", "--train.steps", "1")
    assert read_metrics(loaded)[0]["loss"] == read_metrics(preset)[0]["loss"]
    run_trainer(bf16, "--config", "configs/tiny.yaml", "--train.steps", "2", "--train.dtype", "bf16")
    m = read_metrics(bf16)
    assert len(m) == 2 and abs(m[0]["loss"] - read_metrics(preset)[0]["loss"]) < 0.05


def test_bf16_where_the_device_supports_it(monkeypatch):
    """The stub's bf16: fp32 (with one reason line) only on a CUDA device without native bf16."""
    import torch

    from trainer.runtime.dist_env import training_dtype

    dtype, why = training_dtype("bf16", "cuda", native_bf16=False)
    assert dtype == "fp32" and why.startswith("train.dtype bf16: ") and "\n" not in why
    assert training_dtype("bf16", "cuda", native_bf16=True) == ("bf16", None)
    assert training_dtype("bf16", "cpu") == ("bf16", None)          # CPU autocast runs bf16 anywhere
    assert training_dtype("fp32", "cuda", native_bf16=False) == ("fp32", None)
    # Without an answer given, torch is asked about NATIVE support (emulation is True on any GPU).
    asked = []
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: asked.append(including_emulation) or False)
    assert training_dtype("bf16", "cuda")[0] == "fp32" and asked == [False]
