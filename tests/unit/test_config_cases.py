"""Config and launcher behaviour through the real `trainer` CLI (single process): an unknown key in a
YAML file, Open MPI env without MASTER_ADDR, the resolved config on the console, and MFU against
a peak given in the config."""

from __future__ import annotations

import pytest
import yaml

from tests.support.trainer_run import read_metrics, run_trainer
from trainer.config import resolve
from trainer.metrics import flops_per_token
from trainer.models import model_spec


def _one_line_error(proc, needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and needle in err[0] and "Traceback" not in proc.stderr, proc.stderr


def test_unknown_key_inside_a_yaml_file_names_the_key(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"preset": "tiny-llama"}, "train": {"steps": 1, "stepz": 3}}))
    proc = run_trainer(tmp_path / "out", "--config", str(cfg), check=False)
    _one_line_error(proc, "train.stepz")


def test_open_mpi_launch_without_master_addr_is_one_line(tmp_path):
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    proc = run_trainer(tmp_path, "--config", "configs/tiny.yaml", "--train.steps", "1", env=env, check=False)
    _one_line_error(proc, "MASTER_ADDR")


@pytest.fixture(scope="module")
def peak_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("peak")
    proc = run_trainer(out, "--config", "configs/tiny.yaml", "--train.steps", "2", "--logging.peak_flops", "1e9")
    return out, proc


def test_resolved_config_is_printed_at_start_and_saved(peak_run):
    out, proc = peak_run
    console = proc.stdout + proc.stderr
    assert "resolved config:" in console
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["logging"]["peak_flops"] == 1e9 and saved["train"]["steps"] == 2
    # Every section of the saved config is on the console, before the first step line.
    first_step = console.index("Step:")
    for section in ("model:", "data:", "train:", "parallel:", "optim:", "schedule:", "checkpoint:", "profile:",
                    "logging:"):
        assert section in console[:first_step], section


def test_mfu_uses_the_configured_peak(peak_run):
    out, _ = peak_run
    cfg = resolve(str(out / "config.yaml"), [], environ={})
    spec = model_spec(cfg.model)
    fpt = flops_per_token(spec.num_params, spec.num_layers, spec.hidden_size, cfg.data.seq_len)
    for r in read_metrics(out):
        assert r["mfu"] == pytest.approx(r["tokens_per_s_per_device"] * fpt / 1e9, rel=1e-9)


def test_exponent_floats_without_a_dot_parse_in_yaml_and_on_the_command_line(tmp_path):
    # YAML 1.1 reads `3e-4` as a string; the config must still take it as the number users meant.
    cfg = tmp_path / "c.yaml"
    cfg.write_text("optim:\n  lr: 3e-4\ntrain:\n  steps: 1\n")
    c = resolve(str(cfg), [("logging.peak_flops", "1e9")], environ={})
    assert c.optim.lr == 3e-4 and c.logging.peak_flops == 1e9
