"""Config resolution: seed flags, precedence (flag > env > YAML > default), stub YAML keys, errors."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.trainer_run import REPO, run_trainer, trainer_env
from trainer.config import Config, ConfigError, get_key, resolve
from trainer.config.argv import parse_train_args
from trainer.config.flags import FLAGS, YAML_ALIASES


def cfg_from(argv: list[str], env: dict[str, str] | None = None) -> Config:
    path, overrides = parse_train_args(argv)
    return resolve(path, overrides, environ=env or {})


def test_defaults_are_the_pi_guide_defaults():
    c = cfg_from(["--train.steps", "1"])
    # The Pi guide's 4 microbatches are the default of pipelines; without one a batch is not split.
    assert (c.train.batch_size, c.train.microbatch_num, c.profile.batch) == (16, 1, "0")
    assert cfg_from(["--train.steps", "1", "--pp", "2"]).train.microbatch_num == 4
    assert c.parallel.sharding == "ddp" and c.output_dir == "outputs"


@pytest.mark.parametrize("flag,env_var,key,yaml_value,env_value,flag_value", [
    ("--batch_size", "BATCH_SIZE", "train.batch_size", 8, "12", "4"),
    ("--microbatch_num", "MICROBATCH_NUM", "train.microbatch_num", 2, "3", "1"),
    ("--profile_batch", "PROFILE_BATCH", "profile.batch", "5", "2", "1"),
    ("--output-dir", "OUTPUT_DIR", "output_dir", "from-yaml", "/from-env", "/from-flag"),
])
def test_precedence_flag_over_env_over_yaml(tmp_path, flag, env_var, key, yaml_value, env_value, flag_value):
    section, _, name = key.rpartition(".")
    doc: dict = {"train": {"steps": 1, "batch_size": 12}}
    if section:
        doc.setdefault(section, {})[name] = yaml_value
    else:
        doc[name] = yaml_value
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    base = ["--config", str(path)]
    assert str(get_key(cfg_from(base), key)) == str(yaml_value)
    assert str(get_key(cfg_from(base, {env_var: env_value}), key)) == env_value
    assert str(get_key(cfg_from(base + [flag, flag_value], {env_var: env_value}), key)) == flag_value


SAMPLE = {  # a valid value for each canonical key a seed flag maps to
    "train.steps": "5", "train.batch_size": "8", "train.microbatch_num": "2", "profile.batch": "1",
    "optim.lr": "0.0002", "schedule.warmup_ratio": "0.1", "logging.log_interval": "3",
    "checkpoint.interval": "100", "output_dir": "/tmp/x", "model.hidden_size": "128",
    "model.num_hidden_layers": "3", "model.num_attention_heads": "4", "parallel.tp": "2", "parallel.pp": "2",
    "parallel.pp_schedule": "gpipe", "parallel.dp": "2", "train.grad_acc_steps": "2", "data.seq_len": "64",
    "model.preset": "HuggingFaceTB/SmolLM-1.7B", "parallel.partition": "custom:0,1,3",
    "profile.export_timing_csv": "true", "profile.num_prof_steps": "4", "checkpoint.resume": "latest",
    "train.seed": "7", "profile.perseus_url": "http://127.0.0.1:7787",
}
NEEDS = {"profile.perseus_url": ["--num_prof_steps", "2"]}  # a plan window for the Perseus server
EXPECTED = {"model.preset": "smollm-1.7b", "profile.export_timing_csv": True}


@pytest.mark.parametrize("flag", [f for f in FLAGS if not FLAGS[f].is_switch])
def test_every_seed_flag_parses(tmp_path, flag):
    alias = FLAGS[flag]
    value = str(tmp_path) if alias.canonical == "data.source" else SAMPLE[alias.canonical]
    c = cfg_from(["--train.steps", "1", *NEEDS.get(alias.canonical, []), flag, value])
    expected = EXPECTED.get(alias.canonical, value)
    assert str(get_key(c, alias.canonical)) == str(expected)


def test_switch_and_alias_values():
    assert cfg_from(["--train.steps", "1", "--use_cpu"]).parallel.device == "cpu"
    c = cfg_from(["--train.steps", "1", "--pp_engine", "afab", "--train.microbatch_num=2", "--mbs", "4"])
    assert c.parallel.pp_schedule == "gpipe" and c.train.microbatch_num == 2 and c.train.batch_size == 4


def test_fsdp_stub_yaml_keys(tmp_path):
    path = tmp_path / "stub.yaml"
    path.write_text(yaml.safe_dump({
        "dist": {"cpu_only": True, "backend": "gloo", "dtype": "bfloat16", "sharding_stage": "zero3_hybrid"},
        "dataset": {"batch_size": 8, "num_workers": 1, "path_train": "x.csv"},
        "optim": {"lr": 0.0003, "weight_decay": 0.05},
        "lr_scheduler": {"total_iterations": 1000, "warmup_iterations": 10},
        "model": {"preset": "tiny-vitmae", "hf_config": {"hidden_size": 64}},
        "train": {"steps": 2, "microbatch_num": 1},
    }))
    c = cfg_from([str(path)])  # the stub's positional `train_stub.py cfg.yaml` form
    assert (c.parallel.device, c.parallel.backend, c.train.dtype, c.parallel.sharding) == \
        ("cpu", "gloo", "bf16", "zero3_hybrid")
    assert (c.train.batch_size, c.optim.weight_decay, c.schedule.total_steps, c.schedule.warmup_steps) == (8, 0.05, 1000, 10)
    assert c.model.hf_overrides == {"hidden_size": 64}


def test_flags_doc_lists_every_flag():
    doc = (REPO / "docs" / "flags.md").read_text()
    for flag in FLAGS:
        assert f"`{flag}`" in doc, flag
    for key in YAML_ALIASES:
        assert f"`{key}`" in doc, key


@pytest.mark.parametrize("argv,needle", [
    (["--train.stepz", "3"], "train.stepz"),
    (["--parallel.sharding", "zero4"], "parallel.sharding"),
    (["--model.preset", "gpt5"], "model.preset"),
    (["--batch_size", "10", "--microbatch_num", "4"], "train.batch_size"),
    (["--bogus_flag", "1"], "--bogus_flag"),
    (["--train.steps", "many"], "train.steps"),
])
def test_bad_config_is_one_line_error(argv, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        cfg_from(["--train.steps", "1", *argv])


BAD_CASES = {
    "unknown key": (["--train.stepz", "3"], {}, "train.stepz"),
    "unknown strategy": (["--parallel.sharding", "zero4"], {}, "parallel.sharding"),
    "unknown preset": (["--model.preset", "gpt5"], {}, "model.preset"),
    "indivisible batch": (["--batch_size", "10", "--microbatch_num", "4"], {}, "train.batch_size"),
    "slurm without MASTER_ADDR": ([], {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, "MASTER_ADDR"),
    "tp larger than the world": (["--tensor-parallel-size", "2"], {}, "parallel.tp"),
    "negative gc interval": (["--train.gc_interval", "-1"], {}, "train.gc_interval"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_config_cli_exit(tmp_path, case):
    argv, env, needle = BAD_CASES[case]
    proc = run_trainer(tmp_path, "--config", "configs/tiny.yaml", *argv, env=env, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_help_lists_commands():
    proc = subprocess.run([sys.executable, "-m", "trainer", "--help"], capture_output=True, text=True,
                          env=trainer_env(), cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: trainer [train] [--config X.yaml")
    from trainer.cli import COMMANDS

    assert proc.stdout.rstrip().splitlines()[-1] == "commands: " + ", ".join(sorted(COMMANDS))
    assert {"export", "plot", "train"} <= set(COMMANDS)
    # every section a --section.key flag can name is listed
    sections = [f.name for f in dataclasses.fields(Config) if f.name != "output_dir"]
    listed = re.search(r"\(sections ([^;]+);", " ".join(proc.stdout.split()))[1]
    assert [x.strip() for x in listed.replace(" and ", ", ").split(",")] == sections


def test_resolved_config_saved(tmp_path):
    run_trainer(tmp_path, "--config", "configs/tiny.yaml", "--train_steps", "1", "--mbs", "2", "--microbatch_num", "2")
    saved = yaml.safe_load((Path(tmp_path) / "config.yaml").read_text())
    assert saved["train"]["steps"] == 1 and saved["train"]["batch_size"] == 2 and saved["output_dir"] == str(tmp_path)


@pytest.mark.parametrize("path", sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.yaml")))
def test_shipped_configs_resolve(path):
    from trainer.models import model_spec
    from trainer.parallel.compose import check_supported

    c = resolve(str(REPO / path), [], environ={})
    check_supported(c)
    assert model_spec(c.model).num_params > 0


def test_seed_configs_match_their_systems():
    from trainer.models import model_spec

    stub = resolve(str(REPO / "configs/stub-zero3.yaml"), [], environ={})
    assert (stub.parallel.sharding, stub.train.dtype, stub.model.preset) == ("zero3", "bf16", "vitmae-stub")
    smol = resolve(str(REPO / "configs/smollm-3d.yaml"), [], environ={})
    assert (smol.parallel.dp, smol.parallel.tp, smol.parallel.pp, smol.train.batch_size, smol.train.grad_acc_steps,
            smol.data.seq_len) == (2, 2, 2, 4, 2, 128)
    # picotron's log for this run: "Number of parameters: 536.90M"
    assert abs(model_spec(smol.model).num_params / 1e6 - 536.90) < 0.05


@pytest.mark.multiproc
def test_stub_config_zero3_two_processes_match_one(tmp_path):
    """The stub's own YAML (dist.* keys, positional path) with the tiny ViT-MAE swapped in: ZeRO-3 on
    two ranks equals one process with the same global batch in fp32 (1e-5), and its own bf16 run
    stays within bf16's precision of that."""
    from tests.support.trainer_run import read_metrics

    stub = ("configs/stub-zero3.yaml", "--model.preset", "tiny-vitmae", "--train.steps", "3")
    runs = {"fp32x2": (2, ("--train.dtype", "fp32")), "fp32x1": (1, ("--train.dtype", "fp32", "--train.batch_size", "8")),
            "bf16x2": (2, ())}
    got = {}
    for name, (nproc, extra) in runs.items():
        run_trainer(tmp_path / name, *stub, *extra, nproc=nproc)
        got[name] = read_metrics(tmp_path / name)
        assert [r["global_batch_samples"] for r in got[name]] == [8, 8, 8], name
    for a, b, bf in zip(got["fp32x2"], got["fp32x1"], got["bf16x2"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(b["grad_norm"]), (a["step"], a["grad_norm"], b["grad_norm"])
        assert abs(bf["loss"] - b["loss"]) <= 2e-2 * abs(b["loss"]), (bf["step"], bf["loss"], b["loss"])


class _Writes:
    """A stderr that records each write() call: the ranks of one job share a pipe, and a line
    written in two calls (text, then "\\n") can be cut by another rank's line (seen in CI)."""

    def __init__(self):
        self.calls: list[str] = []

    def write(self, text):
        self.calls.append(text)
        return len(text)

    def flush(self):
        pass


def test_an_error_line_reaches_stderr_in_one_write(monkeypatch):
    from trainer.cli import main

    writes = _Writes()
    monkeypatch.setattr(sys, "stderr", writes)
    assert main(["--config", "configs/tiny.yaml", "--batch_size", "10", "--microbatch_num", "4"]) == 2
    assert main(["exprot"]) == 2  # the did-you-mean path
    assert len(writes.calls) == 2 and all(c.startswith("error: ") and c.endswith("\n") and c.count("\n") == 1
                                          for c in writes.calls), writes.calls
