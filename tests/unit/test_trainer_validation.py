"""Hostile values on the trainer's side: every key is checked for name, range and consistency with
the model before anything starts, also keys the chosen layout ignores; one line naming the key and
what it accepts, exit 2, nothing trained. And a resume whose LR schedule differs from the
checkpoint's is refused the same way unless --checkpoint.override_schedule true."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.trainer_run import read_metrics, run_trainer
from trainer.config import ConfigError, resolve
from trainer.config.argv import parse_train_args

TINY = ("--config", "configs/tiny.yaml")

# case -> (extra argv, the key the one line must name)
BAD = {
    "unknown optimizer": (["--optim.name", "lion"], "optim.name"),
    "negative lr": (["--optim.lr", "-0.1"], "optim.lr"),
    "lr not a number": (["--optim.lr", "nan"], "optim.lr"),
    "beta1 of 1": (["--optim.beta1", "1.0"], "optim.beta1"),
    "beta2 above 1": (["--optim.beta2", "1.5"], "optim.beta2"),
    "eps of 0": (["--optim.eps", "0"], "optim.eps"),
    "negative weight decay": (["--optim.weight_decay", "-0.01"], "optim.weight_decay"),
    "min_lr above the peak": (["--schedule.min_lr", "0.5"], "schedule.min_lr"),
    "negative warmup": (["--schedule.warmup_steps", "-2"], "schedule.warmup_steps"),
    "zero cosine horizon": (["--schedule.total_steps", "0"], "schedule.total_steps"),
    "negative checkpoint interval": (["--checkpoint.interval", "-5"], "checkpoint.interval"),
    "negative preempt interval": (["--checkpoint.preempt_interval", "-1"], "checkpoint.preempt_interval"),
    "negative keep_last": (["--checkpoint.keep_last", "-1"], "checkpoint.keep_last"),
    "negative eval interval": (["--train.eval_interval", "-1"], "train.eval_interval"),
    "no eval batches": (["--train.eval_batches", "0"], "train.eval_batches"),
    "negative grad clip": (["--train.grad_clip", "-1"], "train.grad_clip"),
    "negative seed": (["--seed", "-3"], "train.seed"),
    "zero timeout": (["--parallel.timeout_s", "0"], "parallel.timeout_s"),
    "zero dp_shard": (["--parallel.dp_shard", "0"], "parallel.dp_shard"),
    "negative workers": (["--data.num_workers", "-1"], "data.num_workers"),
    "eval fraction of 1": (["--data.eval_fraction", "1.0"], "data.eval_fraction"),
    "mlm probability 0": (["--data.mlm_probability", "0"], "data.mlm_probability"),
    "tiny BPE vocabulary": (["--data.tokenizer_vocab_size", "100"], "data.tokenizer_vocab_size"),
    "zero layers": (["--model.num_hidden_layers", "0"], "model.num_hidden_layers"),
    "zero peak flops": (["--logging.peak_flops", "0"], "logging.peak_flops"),
    "nccl on cpu": (["--parallel.backend", "nccl", "--parallel.device", "cpu"], "parallel.backend"),
    "prefix with a slash": (["--checkpoint.prefix", "a/b"], "checkpoint.prefix"),
    "no batch size": (["--train.batch_size", "none"], "train.batch_size"),
    # keys the layout (pp=1) does not use: a typo there is still reported
    "schedule with pp=1": (["--parallel.pp_schedule", "one-f-one-b"], "parallel.pp_schedule"),
    "partition with pp=1": (["--parallel.partition", "balanced"], "parallel.partition"),
    "custom partition going down": (["--parallel.partition", "custom:0,3,2"], "parallel.partition"),
    "weighted partition with a zero": (["--parallel.partition", "weighted:1,0"], "parallel.partition"),
    # the GPU-server knobs
    "dtype": (["--train.dtype", "fp8"], "train.dtype"),
    "compile": (["--train.compile", "sometimes"], "train.compile"),
    "activation checkpointing": (["--train.activation_checkpointing", "partial"], "train.activation_checkpointing"),
    "zero loss chunks": (["--train.loss_chunks", "0"], "train.loss_chunks"),
    "loss chunks not a number": (["--train.loss_chunks", "many"], "train.loss_chunks"),
    "override_schedule not a bool": (["--checkpoint.override_schedule", "maybe"], "checkpoint.override_schedule"),
    # consistency with the model
    "sequence longer than the positions": (["--data.seq_len", "600"], "data.seq_len"),
    "gpt-2 sequence longer than n_positions": (["--model.preset", "tiny-gpt2", "--data.seq_len", "513"],
                                               "data.seq_len"),
    "more loss chunks than tokens": (["--train.batch_size", "1", "--data.seq_len", "4", "--train.loss_chunks",
                                      "5"], "train.loss_chunks"),
    "loss chunks for an image model": (["--model.preset", "tiny-vitmae", "--train.loss_chunks", "4"],
                                       "train.loss_chunks"),
    "misspelt transformers field": (["--model.hf_overrides", '{"rms_norm_epsilon": 1e-6}'],
                                    "model.hf_overrides.rms_norm_epsilon"),
}


def _check(argv: list[str]) -> None:
    from trainer.parallel.compose import check_supported

    path, overrides = parse_train_args([*TINY, *argv])
    check_supported(resolve(path, overrides, environ={}))


@pytest.mark.parametrize("case", list(BAD))
def test_bad_value_is_one_line_naming_the_key(case):
    argv, key = BAD[case]
    with pytest.raises(ConfigError) as err:
        _check(argv)
    msg = str(err.value)
    assert key in msg and "\n" not in msg, msg


def test_the_good_values_still_pass():
    _check([])
    _check(["--train.compile", "true", "--train.activation_checkpointing", "selective", "--train.loss_chunks", "4",
            "--parallel.pp_schedule", "interleaved", "--parallel.partition", "custom:0,1,2",
            "--optim.name", "AdamW", "--data.seq_len", "512", "--train.dtype", "auto"])
    _check(["--train.loss_chunks", "auto", "--model.preset", "tiny-vitmae"])


@pytest.mark.parametrize("argv, key", [
    (["--optim.beta1", "1.0"], "optim.beta1"),               # AdamW used to reject it after the model was built
    (["--data.seq_len", "600"], "data.seq_len"),             # used to end in a traceback after the config dump
    (["--optim.name", "lion"], "optim.name"),                # used to be ignored (AdamW ran); sgd is one now
    (["--parallel.pp_schedule", "bogus"], "parallel.pp_schedule"),  # used to be ignored with pp=1
], ids=["beta", "positions", "optimizer", "schedule"])
def test_cli_refuses_before_anything_starts(tmp_path, argv, key):
    out = tmp_path / "out"
    proc = run_trainer(out, *TINY, "--train.steps", "2", *argv, check=False, timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr and "resolved config" not in proc.stdout
    assert not (out / "metrics.jsonl").exists() and not (out / "config.yaml").exists()


# ------------------------------------------------------------------ resume with another LR horizon


def _files(out: Path) -> dict[str, bytes]:
    """Every result file of a run (logs are appended to, and heartbeat/ says what the latest start
    is doing, so they are left out)."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.relative_to(out).parts[0] not in ("logs", "heartbeat")}


def test_resume_with_another_lr_horizon_is_refused_unless_overridden(tmp_path):
    from trainer.optim import lr_at

    out = tmp_path / "run"
    run_trainer(out, *TINY, "--train_steps", "3", "--checkpoint.enabled", "true")
    before = _files(out)
    assert "checkpoints/step-3/trainer_state.json" in before

    proc = run_trainer(out, *TINY, "--train_steps", "6", "--checkpoint.enabled", "true", "--resume", "latest",
                       check=False)
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: "), proc.stderr[-3000:]
    assert "horizon 3 -> 6 steps (train.steps 3 -> 6" in errors[0] and "--checkpoint.override_schedule true" in errors[0]
    assert "Traceback" not in proc.stderr
    assert _files(out) == before  # nothing overwritten: metrics, config.yaml, checkpoints

    run_trainer(out, *TINY, "--train_steps", "6", "--checkpoint.enabled", "true", "--resume", "latest",
                "--checkpoint.override_schedule", "true")
    m = read_metrics(out)
    assert [r["step"] for r in m] == [1, 2, 3, 4, 5, 6]
    new = resolve("configs/tiny.yaml", [("train.steps", 6)], environ={})
    for r in m[3:]:  # steps 4-6 follow the 6-step schedule from its step 4 on (0-based index 3)
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, new, 6), rel=1e-12)
    assert m[3]["lr"] > new.schedule.min_lr  # not the 3-step schedule's end value


def test_resume_with_the_same_schedule_is_accepted(tmp_path):
    """A longer run whose cosine horizon is fixed by schedule.total_steps keeps its LR schedule: fine."""
    out = tmp_path / "run"
    fixed = ("--schedule.total_steps", "10", "--checkpoint.enabled", "true")
    run_trainer(out, *TINY, "--train_steps", "2", *fixed)
    run_trainer(out, *TINY, "--train_steps", "4", *fixed, "--resume", "latest")
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
