"""metrics.jsonl fields and values, the console lines, the MFU formula and the LR schedule."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import numpy as np
import pytest

from tests.support.trainer_run import read_metrics, run_trainer
from trainer.config import Config
from trainer.metrics import console_line, flops_per_token
from trainer.optim import lr_at
from trainer.runtime.tracking import SCALARS, scalars

RUN_ID = "20261126-120000-abcd"
FIELDS = {"step", "loss", "lr", "grad_norm", "global_batch_samples", "global_batch_tokens", "tokens_per_s",
          "tokens_per_s_per_device", "samples_per_s", "mfu", "memory_bytes", "memory_gib", "memory_reserved_gib",
          "step_time_s"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run for every check here, with both trackers on (W&B offline, as on a node without
    internet; its config and cache dirs kept out of the home directory)."""
    out = tmp_path_factory.mktemp("metrics")
    home = tmp_path_factory.mktemp("wandb-home")
    env = {"RUN_ID": RUN_ID, "WANDB_CONFIG_DIR": str(home / "config"), "WANDB_CACHE_DIR": str(home / "cache"),
           "WANDB_DATA_DIR": str(home / "data"), "WANDB_SILENT": "true"}
    proc = run_trainer(out, "--config", "configs/tiny.yaml", "--train.steps", "4", "--batch_size", "4",
                       "--microbatch_num", "2", "--log-interval", "1", "--logging.tensorboard", "true",
                       "--logging.wandb", "tiny-project", env=env)
    return proc, read_metrics(out), out


def test_metrics_jsonl_fields_and_sane_values(run):
    _, m, _ = run
    assert [r["step"] for r in m] == [1, 2, 3, 4]
    for r in m:
        assert FIELDS <= set(r)
        assert r["global_batch_samples"] == 4 and r["global_batch_tokens"] == 4 * 32
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_per_device"] == r["tokens_per_s"]
        assert math.isclose(r["samples_per_s"] * 32, r["tokens_per_s"], rel_tol=1e-9)
        assert 0 < r["mfu"] < 1 and r["memory_bytes"] > 10 * 2**20 and r["step_time_s"] > 0
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["lr"] > 0
    assert [r["tokens"] for r in m] == [128, 256, 384, 512]
    # The first record of a start names its layout (an elastic run's metrics show where each began).
    assert m[0]["layout"] == {"world": 1, "nnodes": 1, "pp": 1, "dp": 1, "tp": 1, "batch_size": 4, "partition": None}
    assert all("layout" not in r for r in m[1:])


def test_console_lines(run):
    proc, m, _ = run
    lines = proc.stdout.splitlines()
    assert any(ln.startswith("[rank0] Step: 1 ") and "| Loss: " in ln and "| Global batch size: " in ln
               and "| Tokens/s/GPU: " in ln and "| MFU: " in ln and "| Memory usage: " in ln and "| LR: " in ln
               for ln in lines)
    assert f"[rank0] step 4 loss {m[-1]['loss']:.4f}" in lines
    assert any("Number of parameters: 0.14M" in ln for ln in lines)
    assert console_line(m[0]).startswith("Step: 1 ")


def test_tensorboard_events_hold_the_metrics_jsonl_records(run):
    """logging.tensorboard: every metrics.jsonl record, read back with TensorBoard's own reader, as
    float32 scalars at its step and wall time (memory_reserved_gib is null on CPU: no scalar)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, m, out = run
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted(set(SCALARS.values()) - {"train/eval_loss", "memory/reserved_gib"})
    for key, tag in SCALARS.items():
        if tag in acc.Tags()["scalars"]:
            got = [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)]
            assert got == [(r["step"], float(np.float32(r[key])), pytest.approx(r["time"], abs=1e-6)) for r in m], tag


def test_wandb_offline_run_holds_the_metrics_jsonl_records(run):
    """logging.wandb: an offline W&B run under OUTPUT_DIR/wandb/ (what `runner collect` brings back
    for `wandb sync`), named and identified by the runner's RUN_ID, the trainer's config in it, and
    every metrics.jsonl record at its step, read back from the run file."""
    from tests.support.wandb_log import history, run_record

    _, m, out = run
    files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [f.name for f in files] == [f"run-{RUN_ID}.wandb"]
    rec = run_record(files[0])
    assert (rec.run_id, rec.display_name, rec.project) == (RUN_ID, RUN_ID, "tiny-project")
    config = {i.key: json.loads(i.value_json) for i in rec.config.update}
    assert config["train"]["steps"] == 4 and config["logging"]["wandb"] == "tiny-project"
    rows = history(files[0])
    assert [r["_step"] for r in rows] == [1, 2, 3, 4]
    for row, r in zip(rows, m, strict=True):
        assert {k: v for k, v in row.items() if not k.startswith("_")} == scalars(r)


def test_trackers_without_their_package_are_one_line(tmp_path, monkeypatch, capsys):
    """Nothing starts: one line naming the key, exit 2, no file in the output dir. Both packages
    are in the test environment and hidden here as Python hides a blocked module."""
    from trainer.cli import main

    args = ["--config", "configs/tiny.yaml", "--train.steps", "1", "--output-dir", str(tmp_path / "out")]
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert main([*args, "--logging.tensorboard", "true"]) == 2
    assert capsys.readouterr().err == (
        "error: logging.tensorboard: the tensorboard package is not installed in this environment; pip install "
        "'runner-trainer[tracking]' (or tensorboard) in the image/venv, or set it false\n")
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert importlib.util.find_spec("wandb") is None
    assert main([*args, "--logging.wandb", "my-project"]) == 2
    assert capsys.readouterr().err == ("error: logging.wandb: the wandb package is not installed in this environment; "
                                       "pip install wandb in the image/venv, or drop logging.wandb\n")
    assert main([*args, "--logging.wandb_mode", "cloud"]) == 2
    assert capsys.readouterr().err == "error: logging.wandb_mode: 'cloud' (offline or online)\n"
    assert not (tmp_path / "out").exists()


def test_mfu_formula():
    assert flops_per_token(1000, 2, 64, 32) == 6 * 1000 + 12 * 2 * 64 * 32


def test_lr_warmup_then_cosine_to_min():
    cfg = Config()
    cfg.optim.lr, cfg.schedule.warmup_steps, cfg.schedule.min_lr = 1.0, 4, 0.1
    lrs = [lr_at(s, cfg, 14) for s in range(16)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))
    assert math.isclose(lrs[9], 0.1 + 0.9 * 0.5, rel_tol=1e-9)  # halfway through the cosine
    assert lrs[14] == lrs[15] == 0.1
    cfg.schedule.warmup_ratio = 0.5  # ratio beats steps: 7 of 14
    assert math.isclose(lr_at(0, cfg, 14), 1 / 7)
