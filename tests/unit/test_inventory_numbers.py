"""Numbers, encodings and YAML the runner reads, written by someone who wants a traceback, a hang or
gigabytes of memory instead of a one-line refusal (issue 54, items 6 and 7, the runner's part).

- every numeric field of the inventory and the job is bounded where it is parsed, the bound in
  the message (memory, Slurm's mem and time, the count of nodes and of ranks);
- zero, negative and overflowing parallel degrees and model dimensions in job.args, job.env,
  hf_overrides and the job.config the runner sizes a job from are one line naming where they were
  given (a ZeroDivisionError traceback before, or a model of 10^20 parameters);
- the job.config goes through the inventory's one bounded YAML loader (runner/inventory/safe_yaml.py:
  size, depth, aliases; a RecursionError traceback before);
- an inventory, a job file or an env file in another encoding is one line (UnicodeDecodeError
  tracebacks before), as is a scalar the YAML constructor cannot build (an int of 5,000 digits);
- format placeholders in values never reach str.format or %-formatting.
Every refusal: a UserError of one line, nothing started, nothing written."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from runner.core.errors import UserError
from runner.inventory import load_inventory
from runner.inventory.slurm import load_slurm_inventory
from runner.planning.sizing import check_sizing

NODE = "nodes:\n  - {name: a, host: 10.9.0.1, arch: amd64}\n"


def _one_line(exc: pytest.ExceptionInfo, *parts: str) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and all(p in msg for p in parts), msg
    return msg


def _size(tmp_path: Path, job: str, config: str | None = None) -> None:
    """Load the inventory and size its job as `runner up --dry-run` does."""
    if config is not None:
        (tmp_path / "cfg.yaml").write_text(config)
        job += f"  config: {tmp_path / 'cfg.yaml'}\n"
    p = tmp_path / "inv.yaml"
    p.write_text(f"{NODE}job:\n  image: t:1\n{job}")
    check_sizing(load_inventory(p, check_files=False), show=False, ignore=True)


@pytest.mark.parametrize("args, parts", [
    ("[--tp, '0']", ("job.args --tp", "parallel.tp '0'", "1..1048576")),            # ZeroDivisionError before
    ("[--pp, '-2']", ("job.args --pp", "parallel.pp '-2'")),
    ("[--hidden-size, '99999999999999999999999']", ("job.args --hidden-size", "1..16777216")),
    ("[--num-layers, '0']", ("model.num_hidden_layers '0'",)),
    ("[--seq_len, '-5']", ("data.seq_len '-5'",)),                                  # negative memory before
    ("[--batch_size, '0']", ("train.batch_size '0'",)),
    ("['--model.vocab_size=" + "9" * 5000 + "']", ("model.vocab_size", "1..16777216")),
    ("['--parallel.virtual_stages=100000']", ("parallel.virtual_stages", "1..1024")),
])
def test_zero_negative_or_overflowing_numbers_in_job_args_are_one_line(tmp_path, args, parts):
    with pytest.raises(UserError) as exc:
        _size(tmp_path, f"  args: {args}\n")
    _one_line(exc, *parts)


def test_numbers_in_job_env_are_bounded_too(tmp_path):
    with pytest.raises(UserError) as exc:
        _size(tmp_path, "  env: {BATCH_SIZE: '-1'}\n")
    _one_line(exc, "job.env.BATCH_SIZE", "train.batch_size '-1'")


@pytest.mark.parametrize("config, parts", [
    ("parallel:\n  tp: 0\n", (":2: parallel.tp", "parallel.tp 0", "1..1048576")),
    ("model:\n  hf_config: {num_hidden_layers: -3}\n", (":2: model.hf_config", "num_hidden_layers -3")),
    ("model:\n  hf_config: {hidden_size: '4096'}\n", ("hidden_size '4096'", "1..16777216")),
    ("model:\n  hf_overrides: {vocab_size: 1.0e+300}\n", ("vocab_size 1e+300",)),
    ("train:\n  loss_chunks: 0\n", ("train.loss_chunks 0",)),
])
def test_bad_numbers_in_the_job_config_name_its_line(tmp_path, config, parts):
    with pytest.raises(UserError) as exc:
        _size(tmp_path, "", config)
    msg = _one_line(exc, *parts)
    assert str(tmp_path / "cfg.yaml") in msg


ALIAS_BOMB = "".join(f"{k}: &{k} [{', '.join([f'*{p}' if p else 'x'] * 9)}]\n"
                     for p, k in zip(["", *"abcdefgh"], "abcdefghi", strict=True))


@pytest.mark.parametrize("config, why", [
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", "YAML syntax error"),           # RecursionError traceback before
    ("a: " + "[" * 40 + "]" * 40 + "\n", "nested more than 32 levels"),
    (ALIAS_BOMB, "anchors and aliases"),                                       # expanded silently before
    ("parallel: {tp: 2}\n" + "#" * (2 << 20) + "\n", "over the 1048576 bytes"),
    ("model: {preset: caf\xe9}\n", "not UTF-8"),
])
def test_the_job_config_goes_through_the_inventorys_loader(tmp_path, config, why):
    (tmp_path / "cfg.yaml").write_bytes(config.encode("latin-1"))
    p = tmp_path / "inv.yaml"
    p.write_text(f"{NODE}job:\n  image: t:1\n  config: {tmp_path / 'cfg.yaml'}\n")
    inv = load_inventory(p, check_files=False)
    with pytest.raises(UserError) as exc:
        check_sizing(inv, show=False, ignore=True)
    _one_line(exc, str(tmp_path / "cfg.yaml"), why)


@pytest.mark.parametrize("node, parts", [
    (", memory: 99999999999999999999g", ("nodes[0].memory", "at most 65536g")),
    (", memory: 65t", ("nodes[0].memory",)),
    (", cpus: .nan", ("nodes[0].cpus", "0.01..1024")),
    (", port: " + "9" * 5000, ("nodes[0].port", "cannot be read")),     # a ValueError traceback before
    (", gpus: -1", ("nodes[0].gpus", "0..1024")),
])
def test_node_numbers_are_bounded_with_the_bound_in_the_message(tmp_path, node, parts):
    p = tmp_path / "inv.yaml"
    p.write_text(f"nodes:\n  - {{name: a, host: 10.9.0.1, arch: amd64{node}}}\n")
    with pytest.raises(UserError) as exc:
        load_inventory(p, check_files=False)
    _one_line(exc, f"{p}:2: ", *parts)


def test_the_count_of_ranks_is_bounded(tmp_path):
    p = tmp_path / "inv.yaml"
    nodes = "".join(f"  - {{name: n{i}, host: 10.9.{i // 250}.{i % 250 + 1}}}\n" for i in range(1100))
    p.write_text(f"defaults: {{slots: 1024, arch: amd64}}\nnodes:\n{nodes}")
    with pytest.raises(UserError) as exc:
        load_inventory(p, check_files=False)
    _one_line(exc, f"{p}:3: nodes: 1126400 ranks", "at most 1048576")


@pytest.mark.parametrize("field, value, parts", [
    ("mem", "99999999999999999999G", ("slurm.mem", "at most")),
    ("time", "99999999999-00:00:00", ("slurm.time", "at most 366 days")),
    ("time", "1:99:99", ("slurm.time",)),
])
def test_slurm_numbers_are_bounded(tmp_path, field, value, parts):
    p = tmp_path / "slurm.yaml"
    p.write_text(f"slurm:\n  nodes: 2\n  {field}: '{value}'\njob:\n  image: t:1\n")
    with pytest.raises(UserError) as exc:
        load_slurm_inventory(str(p), check_files=False)
    _one_line(exc, f"{p}:3: ", *parts)


@pytest.mark.parametrize("encoding", ["latin-1", "utf-16", "cp1252"])
@pytest.mark.parametrize("what", ["inventory", "job file", "env file"])
def test_a_file_in_another_encoding_is_one_line(tmp_path, encoding, what):
    """A UnicodeDecodeError traceback before, for each of the three."""
    inv, job, env = tmp_path / "inv.yaml", tmp_path / "job.yaml", tmp_path / "job.env"
    inv.write_text(f"nodes:\n  - {{name: a, host: 10.9.0.1, arch: amd64}}\njob:\n  image: t:1\n  env_file: {env}\n")
    job.write_text(f"image: t:1\nenv_file: {env}\n")
    env.write_text("TOKEN=abc\n")
    text = {"inventory": inv, "job file": job, "env file": env}[what]
    text.write_bytes(text.read_text().replace("1", "\xe9", 1).encode(encoding) if what != "env file"
                     else "TOKEN=caf\xe9\n".encode(encoding))
    with pytest.raises(UserError) as exc:
        load_inventory(inv, job_path=str(job) if what == "job file" else None, check_files=False)
    _one_line(exc, str(text), "UTF-8")


def test_a_fifo_or_a_device_is_not_read(tmp_path):
    """A FIFO named as an inventory hung the runner (open blocks for a writer); /dev/zero never ends."""
    fifo = tmp_path / "inv.yaml"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        with pytest.raises(UserError) as exc:
            load_inventory(path, check_files=False)
        _one_line(exc, str(path), "not a regular file")


@pytest.mark.parametrize("value", ["'{0}{1}%s%(x)s{}'", "'%n%n%n'", "'{__class__}'"])
def test_format_placeholders_stay_text(tmp_path, value, capsys):
    """In an env value, an arg, a mount's container path: refused or kept as written, never formatted."""
    p = tmp_path / "inv.yaml"
    p.write_text(f"{NODE}job:\n  image: t:1\n  args: [{value}]\n  env: {{X: {value}}}\n")
    job = load_inventory(p, check_files=False).job
    assert job.args == [ast.literal_eval(value)] and job.env["X"] == ast.literal_eval(value)
    p.write_text(f"{NODE}job:\n  image: t:1\n  mounts: {{/data: {value}}}\n")
    with pytest.raises(UserError) as exc:
        load_inventory(p, check_files=False)
    _one_line(exc, "job.mounts./data")


def test_the_runner_never_refuses_a_size_the_trainer_takes():
    """The runner's ranges hold the trainer's (trainer/config/bounds.py): a value the runner refuses
    the trainer refuses too, so sizing never stops a job the trainer would run."""
    bounds = pytest.importorskip("trainer.config.bounds")
    from runner.planning.job_settings import MODEL_SIZE_FIELDS, RANGES, SIZE_MAX

    for key, (lo, hi) in RANGES.items():
        field = key.removeprefix("model.")
        most = bounds.MODEL_SIZES[field][1] if key.startswith("model.") else bounds.AT_MOST.get(key)
        assert most is None or hi >= most, (key, hi, most)
        assert lo <= 1 or key == "checkpoint.replicas", key
    for field in MODEL_SIZE_FIELDS:
        lo, hi = bounds.MODEL_SIZES[field]
        assert lo >= 1 and hi <= SIZE_MAX, field


@pytest.mark.parametrize("node, job, config", [
    (", identity_file: " + "a" * 300, "", None),            # pathlib's exists(): File name too long (OSError)
    (", addr: \"10.0.0.1\\0\"", "", None),                  # inet_aton: embedded null character (ValueError)
    ("", "  args: [--pp]\n", None),                        # a flag with no value: int(None) (TypeError)
    ("", "", "dist: {dtype: 1}\n"),                         # a dtype that is not one: KeyError in the arithmetic
    ("", "  sync: [{src: DATA, dst: /d}]\n  args: [--model_name, '/d/" + "m" * 300 + "']\n", None),
])
def test_what_the_fuzzer_found(tmp_path, node, job, config):
    """Inputs tests/unit/test_fuzz_inventory.py found ending in a traceback: each now loads and sizes, or
    is refused in one line."""
    (tmp_path / "data").mkdir()
    p = tmp_path / "inv.yaml"
    cfg = ""
    if config is not None:
        (tmp_path / "cfg.yaml").write_text(config)
        cfg = f"  config: {tmp_path / 'cfg.yaml'}\n"
    p.write_text(f"nodes:\n  - {{name: a, host: 10.9.0.1, arch: amd64{node}}}\njob:\n  image: t:1\n{cfg}"
                 + job.replace("DATA", str(tmp_path / "data")))
    try:
        check_sizing(load_inventory(p, check_files=False), show=True, ignore=True)
    except UserError as exc:
        assert "\n" not in str(exc) and str(exc).startswith(f"{p}:"), exc
