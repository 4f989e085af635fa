"""Numbers from flags and config files are bounded where the config is validated
(trainer/config/bounds.py, trainer/config/batches.py): each is accepted or refused in one line
naming its bound; none reaches an allocation or an arithmetic error deep in torch or transformers.

Written as an attacker (or a slip of the finger) writes them: a profile range of 10^12 batches
and a BPE of 10^11 tokens (each filled memory until the kernel killed the trainer: run here under
an address-space limit), zero, negative, overflowing and absurd degrees and model dimensions
(as flags and in model.hf_overrides), nan and inf."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from tests.support.trainer_run import REPO, trainer_env
from trainer.config import ConfigError, resolve
from trainer.config.argv import parse_train_args

BASE = ("--data.source", "synthetic", "--train_steps", "2")


def _limited(gib: int):
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (gib << 30, gib << 30))
    return limit


def _trainer(tmp_path, *args: str, gib: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", *args, "--output-dir", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=REPO, env=trainer_env(), timeout=300,
                          preexec_fn=_limited(gib))


def _one_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("error: ") and all(w in err for w in words), err


def test_a_profile_range_of_a_trillion_batches_is_refused_before_it_is_made(tmp_path):
    """Before: a set of 10^12 indices (MemoryError under the limit, the kernel's OOM killer without)."""
    proc = _trainer(tmp_path, *BASE, "--profile_batch", "0-999999999999", gib=2)
    _one_line(proc, "profile.batch", "1073741824")
    proc = _trainer(tmp_path, *BASE, "--profile_batch", "0-5000", gib=2)
    _one_line(proc, "profile.batch", "more than 1024 batches")


def test_a_tokenizer_vocabulary_of_a_hundred_billion_is_refused(tmp_path):
    """Before: the BPE trainer asked for 4.5 TB at once and the process aborted (exit 134)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world, a small corpus.\n\nanother paragraph here.\n" * 50)
    proc = _trainer(tmp_path, "--data.source", str(corpus), "--train_steps", "1",
                    "--data.tokenizer_vocab_size", "99999999999", gib=8)
    _one_line(proc, "data.tokenizer_vocab_size", "1048576")


def _refused(*argv: str) -> str:
    config, overrides = parse_train_args([*BASE, *argv])
    with pytest.raises(ConfigError) as e:
        resolve(config, overrides, environ={})
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize(("argv", "bound"), [
    (("--tp", "0"), "parallel.tp must be >= 1"),                      # zero and negative degrees and sizes
    (("--pp", "-1"), "parallel.pp must be >= 1"),
    (("--dp", "0"), "parallel.dp must be >= 1"),
    (("--parallel.dp_shard", "-2"), "parallel.dp_shard must be >= 1"),
    (("--model.hidden_size", "0"), "model.hidden_size must be >= 1"),
    (("--model.num_attention_heads", "-4"), "model.num_attention_heads must be >= 1"),
    (("--tp", "99999999999999999999"), "1048576"),
    (("--pp", "2000000"), "1048576"),
    (("--dp", "1024", "--tp", "1024", "--pp", "2"), "1048576"),
    (("--model.num_hidden_layers", "100000000"), "1024"),
    (("--model.hidden_size", "99999999999999"), "131072"),
    (("--model.vocab_size", "1000000000"), "16777216"),
    (("--train.batch_size", "99999999999999"), "65536"),
    (("--train.grad_acc_steps", "99999999999999"), "65536"),
    (("--train.eval_batches", "99999999999"), "65536"),
    (("--data.seq_len", "99999999"), "1048576"),
    (("--train.batch_size", "4096", "--data.seq_len", "65536"), "16777216"),
    (("--train_steps", "99999999999999"), "1073741824"),
    (("--checkpoint.interval", "99999999999999"), "1073741824"),
    (("--train.seed", "99999999999999999999999"), "9223372036854775807"),
    (("--model.hf_overrides", "{hidden_size: 0}"), "1..131072"),
    (("--model.hf_overrides", "{num_attention_heads: 0}"), "1..4096"),
    (("--model.hf_overrides", "{num_hidden_layers: -1}"), "1..1024"),
    (("--model.hf_overrides", "{intermediate_size: 99999999999999}"), "1..1048576"),
    (("--model.hf_overrides", "{max_position_embeddings: 99999999999999}"), "1..16777216"),
    (("--model.hf_overrides", "{vocab_size: 1.0e30}"), "1..16777216"),
    (("--model.hf_overrides", "{hidden_size: abc}"), "1..131072"),
    (("--model.hf_overrides", "{rms_norm_eps: .nan}"), "finite"),
    (("--optim.lr", "1e300"), "1000"),
    (("--logging.peak_flops", "1e300"), "1e+18"),
])
def test_an_absurd_number_is_refused_naming_its_bound(argv, bound):
    message = _refused(*argv)
    assert bound in message, message


def test_an_integer_of_five_thousand_digits_is_one_line(tmp_path):
    """Python refuses to read an integer of over 4300 digits (a ValueError from inside YAML)."""
    assert "cannot parse" in _refused("--train_steps", "9" * 5000)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  steps: " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError, match="c.yaml"):
        resolve(str(cfg), [], environ={})


def test_the_bounds_are_not_in_the_way_of_real_runs():
    """What real runs use passes: a 128-layer, 16k-wide, 128k-vocabulary model, 131k positions,
    a 1,024-rank layout, a seed of 2^63 - 1."""
    config, overrides = parse_train_args([*BASE, "--model.hf_overrides", "{num_hidden_layers: 128, hidden_size: "
                                          "16384, num_attention_heads: 128, num_key_value_heads: 8, intermediate_size:"
                                          " 53248, vocab_size: 128256, max_position_embeddings: 131072}",
                                          "--dp", "8", "--tp", "8", "--pp", "16", "--train.seed", str((1 << 63) - 1),
                                          "--data.seq_len", "8192", "--train.batch_size", "4"])
    cfg = resolve(config, overrides, environ={})
    assert cfg.model.hf_overrides["num_hidden_layers"] == 128 and cfg.parallel.pp == 16
