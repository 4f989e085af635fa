"""Inputs a user gets wrong, refused in one line (ConfigError: exit 2, no traceback): files in
another encoding, format placeholders in names, output paths that are files, a launcher env whose
rank is not a rank of its world, a model whose sizes transformers cannot split; and the test hooks
(TRAINER_TEST_*) do nothing in a trainer the tests did not start.

Each was a traceback (or a hang) before: a UnicodeDecodeError from the YAML reader, an IndexError
from checkpoint.name's str.format at the first save, FileExistsError at the first mkdir, a
RANK=3 of WORLD_SIZE=2 waiting in the rendezvous for ranks that never come, a ZeroDivisionError
of a head 0 wide, TRAINER_TEST_HOLD holding every rank forever."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.trainer_run import REPO, trainer_env
from trainer.config import ConfigError, resolve
from trainer.config.argv import parse_train_args
from trainer.runtime.dist_env import from_environ

BASE = ("--data.source", "synthetic", "--train_steps", "2")


def _refused(*argv: str, environ: dict[str, str] | None = None) -> str:
    config, overrides = parse_train_args([*BASE, *argv])
    with pytest.raises(ConfigError) as e:
        resolve(config, overrides, environ=environ or {})
    assert "\n" not in str(e.value)
    return str(e.value)


# --- files in another encoding -----------------------------------------------------------------

@pytest.mark.parametrize("encoding", ["latin-1", "utf-16"])
def test_a_config_file_in_another_encoding_is_one_line(tmp_path, encoding):
    f = tmp_path / "c.yaml"
    f.write_bytes("train:\n  steps: 2\noutput_dir: caf\u00e9\n".encode(encoding))
    message = _refused("--config", str(f))
    assert str(f) in message and "not UTF-8" in message


def test_a_utf8_config_with_a_bom_is_read(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_bytes(b"\xef\xbb\xbftrain:\n  steps: 3\n")
    config, overrides = parse_train_args(["--config", str(f)])
    assert resolve(config, overrides, environ={}).train.steps == 3


def _hub_repo(tmp_path: Path, ref: bytes) -> Path:
    repo = tmp_path / "models--org--tiny"
    snap = repo / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_bytes(ref)
    (snap / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return repo


@pytest.mark.parametrize("ref", [b"\xff\xfeabc", b"a" * 5000])
def test_a_hub_caches_refs_main_in_another_encoding_or_huge_is_one_line(tmp_path, ref):
    repo = _hub_repo(tmp_path, ref)
    message = _refused("--model.path", str(repo), "--model.load_weights", "false")
    assert str(repo / "refs" / "main") in message


def test_a_tokenizer_file_that_is_not_one_is_one_line(tmp_path):
    from trainer.config import DataConfig
    from trainer.data.tokenizer import load_tokenizer

    f = tmp_path / "tokenizer.json"
    f.write_bytes("{\"model\": \"caf\u00e9\"".encode("latin-1"))
    with pytest.raises(ConfigError, match="tokenizer.json"):
        load_tokenizer(DataConfig(tokenizer=str(f)), [])


LATIN_1 = {
    "corpus.txt": "caf\u00e9 au lait\n\nune autre ligne\n",
    "corpus.jsonl": '{"text": "caf\u00e9 au lait"}\n{"text": "une autre ligne"}\n',
    "corpus.json": '[{"text": "caf\u00e9 au lait"}, {"text": "une autre ligne"}]',
}


@pytest.mark.parametrize("name", [*LATIN_1, "folder/train.jsonl"])
def test_text_data_in_another_encoding_is_one_line(tmp_path, name):
    """JSON lines read by pyarrow were taken as they were, and a UnicodeDecodeError traceback came when
    the rows were read (.txt was one line already). The file is named, a folder's file too."""
    from trainer.config import DataConfig
    from trainer.data.text_sources import load_texts

    f = tmp_path / name
    f.parent.mkdir(exist_ok=True)
    (f.parent / "a-good.jsonl").write_text('{"text": "fine"}\n') if name.startswith("folder") else None
    f.write_bytes(LATIN_1[Path(name).name.replace("train", "corpus")].encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        load_texts(DataConfig(source=str(f.parent if name.startswith("folder") else f)),
                   cache_dir=str(tmp_path / "cache"))
    assert str(f) in str(e.value) and "not UTF-8" in str(e.value) and "\n" not in str(e.value), str(e.value)


# --- names and paths ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["{0}{step}", "{step}{x}", "{step.__class__}", "{}", ".tmp-{step}", "a\n{step}"])
def test_checkpoint_names_never_reach_str_format(name):
    assert "checkpoint.name" in _refused("--checkpoint.name", name)


@pytest.mark.parametrize("value", ["{0}", "%s%s%d", "%(x)s", "{step.__init__.__globals__}"])
def test_placeholders_in_names_and_paths_are_plain_text(tmp_path, value):
    """A run name, output path or model name with a placeholder is taken as text (or refused as a
    name that does not exist), never formatted."""
    config, overrides = parse_train_args([*BASE, "--output-dir", str(tmp_path / value)])
    assert resolve(config, overrides, environ={}).output_dir.endswith(value)
    assert value in _refused("--model.preset", value)
    assert value in _refused("--data.source", str(tmp_path / value))


def test_output_paths_that_are_files_are_one_line(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert "output_dir" in _refused("--output-dir", str(f))
    assert "output_dir" in _refused("--output-dir", str(f / "below"))
    assert "checkpoint.dir" in _refused("--output-dir", str(tmp_path / "out"), "--checkpoint.dir", str(f))
    (tmp_path / "out2").mkdir()
    (tmp_path / "out2" / "logs").write_text("x")
    assert "logs" in _refused("--output-dir", str(tmp_path / "out2"))
    assert "name over 255 bytes" in _refused("--data.source", "x" * 300)


def test_a_key_with_a_newline_is_one_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text('train:\n  "ste\\nps\\u001b[2J": 2\n')
    assert "ste\\nps\\x1b[2J" in _refused("--config", str(f))


# --- the launcher's env -------------------------------------------------------------------------

@pytest.mark.parametrize(("env", "words"), [
    ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
    ({"RANK": "0", "WORLD_SIZE": "9" * 5000}, "WORLD_SIZE="),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4", "MASTER_ADDR": "n0"}, "SLURM_PROCID=4"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "1", "MASTER_ADDR": "n0"}, "OMPI_COMM_WORLD_RANK=1"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "a b"}, "MASTER_ADDR"),
])
def test_a_launcher_env_that_is_not_a_process_of_its_job_is_one_line(env, words):
    with pytest.raises(ConfigError) as e:
        from_environ(env)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_rank_past_the_world_exits_at_once_instead_of_waiting(tmp_path):
    """Before: init_process_group waited for ranks 0 and 1 (a hang until the test's timeout)."""
    env = trainer_env({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"})
    proc = subprocess.run([sys.executable, "-m", "trainer", *BASE, "--output-dir", str(tmp_path)], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: env RANK=3"), proc.stderr[-2000:]


# --- test hooks ------------------------------------------------------------------------------

def test_test_hooks_in_a_users_env_do_nothing(tmp_path):
    """A trainer started without the tests' hooks (tests/hooks/ not on PYTHONPATH, as in the image
    and under the runner) ignores TRAINER_TEST_HOLD: it ran to the end; before, every rank waited
    at step 1 for a file nobody writes."""
    env = {k: v for k, v in trainer_env().items() if not k.startswith("PYTHONPATH")}
    env.update({"PYTHONPATH": str(REPO), "TRAINER_TEST_HOLD": "step:1", "TRAINER_TEST_CLOCK_SKEW_NS": "0:x"})
    proc = subprocess.run([sys.executable, "-m", "trainer", *BASE, "--output-dir", str(tmp_path)], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (tmp_path / ".hold").exists()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_the_hooks_are_on_only_where_the_tests_switch_them_on():
    from trainer.runtime import hold

    assert hold.test_env("TRAINER_TEST_HOLD", {"TRAINER_TEST_HOLD": "step:1"}) == "step:1"
    was = sys.modules.pop(hold.SWITCH_MODULE, None)
    try:
        os.environ["TRAINER_TEST_HOLD"] = "step:1"
        assert not hold.enabled() and hold.held_points() == set()
        sys.modules[hold.SWITCH_MODULE] = sys  # what tests/hooks/sitecustomize.py's import does
        assert hold.held_points() == {("step", 1)}
    finally:
        os.environ.pop("TRAINER_TEST_HOLD", None)
        sys.modules.pop(hold.SWITCH_MODULE, None)
        if was is not None:
            sys.modules[hold.SWITCH_MODULE] = was


# --- model sizes transformers cannot split -----------------------------------------------------

@pytest.mark.parametrize(("argv", "words"), [
    (("--model.preset", "tiny-qwen3", "--model.hidden_size", "1"), "at least 1"),
    (("--model.preset", "tiny-llama", "--model.hf_overrides", "{head_dim: 3}"), "odd"),
    (("--model.preset", "tiny-gpt2", "--model.hf_overrides", "{n_embd: 10, n_head: 4}"), "not divisible"),
    (("--model.preset", "tiny-vitmae", "--model.hf_overrides", "{image_size: 30, patch_size: 8}"), "patch"),
])
def test_model_sizes_that_cannot_be_split_are_one_line_in_a_dry_run(argv, words):
    from trainer.tools.dry_run import make_plan

    config, overrides = parse_train_args([*BASE, *argv])
    with pytest.raises(ConfigError, match=words):
        make_plan(resolve(config, overrides, environ={}))


def test_a_dry_run_of_a_model_without_a_pipeline_layout():
    """ViT-MAE has none (it is never split): the dry run ended in layout.py's ValueError."""
    from trainer.tools.dry_run import make_plan

    config, overrides = parse_train_args([*BASE, "--model.preset", "tiny-vitmae"])
    plan = make_plan(resolve(config, overrides, environ={}))
    assert plan["family"] == "vitmae" and plan["units"] == 1 and plan["stages"][0]["params"] > 0


def test_a_run_file_the_os_refuses_is_one_line(tmp_path):
    """metrics.jsonl is a folder: an IsADirectoryError traceback before (trainer/cli.py now names the
    path and the OS's reason for any such error, exit 2)."""
    from tests.support.trainer_run import run_trainer

    (tmp_path / "metrics.jsonl").mkdir()
    proc = run_trainer(tmp_path, *BASE, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {tmp_path / 'metrics.jsonl'}: Is a directory")


@pytest.mark.parametrize(("argv", "words"), [
    (("--model_name", "x" * 300), "unknown preset"),                  # OSError: File name too long
    (("--model.path", "m" * 300), "name over 255 bytes"),              # the same, from pathlib's is_dir
    (("--optim.lr", "1" + "0" * 400), "past any number a float holds"),  # OverflowError
    (("--config", "c" * 300 + ".yaml"), "cannot be read"),             # OSError from is_file
])
def test_what_the_fuzzer_found(argv, words):
    """Each was a traceback that tests/unit/test_fuzz_trainer.py found."""
    assert words in _refused(*argv)
