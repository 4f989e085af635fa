"""The job's settings that size a stage, as the trainer will resolve them (default < the job.config
YAML < job.env < job.args), read by `runner up` before launch (runner/planning/sizing.py).

Read as an attacker could write them: the config through the runner's one bounded YAML loader
(runner/inventory/safe_yaml.py: size, depth, no aliases, UTF-8), and every integer checked against
its range where it is read (RANGES), so a zero, negative or 30-digit parallel degree or model
dimension is one line naming where it was given, never a ZeroDivisionError traceback or a model
of 10^20 parameters. A value that is not a number at all is left to the trainer, which names it.
"""

from __future__ import annotations

import re
from typing import Any

from contract.presets import HF_NAMES
from runner.core.errors import UserError
from runner.inventory import Job
from runner.inventory.safe_yaml import CONFIG_MAX_BYTES, compose, plain, read_text

# trainer/config/'s defaults for the keys that size a stage
DEFAULTS: dict[str, Any] = {
    "model.preset": "tiny-llama", "model.path": None, "model.load_weights": True, "model.num_hidden_layers": None,
    "model.hidden_size": None, "model.num_attention_heads": None, "model.intermediate_size": None,
    "model.vocab_size": None, "model.attn_implementation": "sdpa", "model.hf_overrides": {},
    "data.seq_len": 128, "train.batch_size": 16, "train.microbatch_num": None, "train.grad_acc_steps": 1,
    "train.dtype": "auto", "train.loss_chunks": "auto", "train.activation_checkpointing": "none",
    "parallel.dp": None, "parallel.tp": 1, "parallel.pp": 1, "parallel.pp_schedule": "1f1b",
    "parallel.partition": "uniform_transformer", "parallel.virtual_stages": 1, "parallel.sharding": "ddp",
    "parallel.device": "auto", "checkpoint.replicas": 0,
}
# trainer/config/flags.py's spellings of those keys: flags, switches (no value), env, YAML
FLAGS = {
    "--batch_size": "train.batch_size", "--micro-batch-size": "train.batch_size", "--mbs": "train.batch_size",
    "--microbatch_num": "train.microbatch_num", "--num-microbatches": "train.microbatch_num",
    "--grad_acc_steps": "train.grad_acc_steps", "--seq_len": "data.seq_len",
    "--hidden-size": "model.hidden_size", "--num-layers": "model.num_hidden_layers",
    "--num_hidden_layers": "model.num_hidden_layers", "--num-attention-heads": "model.num_attention_heads",
    "--model_name": "model.preset", "--tensor-parallel-size": "parallel.tp", "--tp": "parallel.tp",
    "--pipeline-parallel-size": "parallel.pp", "--pp": "parallel.pp", "--dp": "parallel.dp",
    "--pipeline-schedule": "parallel.pp_schedule", "--pp_engine": "parallel.pp_schedule",
    "--partition_method": "parallel.partition", "--use_cpu": "parallel.device",
}
SWITCHES = {"--use_cpu", "--export_timing_csv"}  # every switch of the trainer: they take no value
ENV = {"BATCH_SIZE": "train.batch_size", "MICROBATCH_NUM": "train.microbatch_num"}
YAML = {"dataset.batch_size": "train.batch_size", "dist.dtype": "train.dtype", "dist.sharding_stage": "parallel.sharding",
        "dist.cpu_only": "parallel.device", "model.hf_config": "model.hf_overrides"}
# The integer keys and the range each is read in. Outside it the job is refused in one line naming
# the key and the range (the trainer refuses such values too): before, a zero degree ended in a
# ZeroDivisionError traceback, a 23-digit hidden size sized a model of 10^20 parameters, and a
# negative one printed negative memory.
SIZE_MAX = 1 << 24        # a model dimension (trainer/models/build.py MAX_SIZE_FIELD)
DEGREE_MAX = 1 << 20      # a parallel degree or a count of microbatches
RANGES: dict[str, tuple[int, int]] = {
    "data.seq_len": (1, SIZE_MAX), "train.batch_size": (1, SIZE_MAX), "train.microbatch_num": (1, DEGREE_MAX),
    "train.grad_acc_steps": (1, DEGREE_MAX), "parallel.dp": (1, DEGREE_MAX), "parallel.tp": (1, DEGREE_MAX),
    "parallel.pp": (1, DEGREE_MAX), "parallel.virtual_stages": (1, 1024), "checkpoint.replicas": (0, DEGREE_MAX),
    "train.loss_chunks": (1, DEGREE_MAX),
    **{f"model.{k}": (1, SIZE_MAX) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                            "intermediate_size", "vocab_size")},
}
INTS = set(RANGES) - {"train.loss_chunks"}  # loss_chunks may also be "auto"
# A model's size fields wherever they are given (hf_overrides, a config.json): the trainer's list
# (within trainer/config/bounds.py MODEL_SIZES: tests/unit/test_inventory_numbers.py).
MODEL_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "num_layers", "num_decoder_layers", "num_heads", "d_model",
                     "d_ff", "d_kv", "n_head", "n_layer", "image_size", "patch_size", "num_channels", "num_classes")


def job_settings(job: Job) -> dict[str, Any]:
    """The sizing keys as the trainer will resolve them: default < YAML < env < args. A value out
    of its range is one UserError naming where it was given (RANGES)."""
    out = dict(DEFAULTS)
    if job.config:
        # Through the one bounded loader (size, depth, no aliases, UTF-8): one line naming the file.
        doc = compose(job.config, read_text(job.config, "job.config", CONFIG_MAX_BYTES))
        for section, (_, body) in doc.value.items() if doc is not None and isinstance(doc.value, dict) else ():
            for key, (line, value) in body.value.items() if isinstance(body.value, dict) else ():
                name = f"{section}.{key}"
                _set(out, YAML.get(name, name), plain(value), f"{job.config}:{line}: {name}")
    for var, key in ENV.items():
        if job.env.get(var, "") != "":
            _set(out, key, job.env[var], f"job.env.{var}")
    args, i = list(job.args), 0
    while i < len(args):
        name, eq, inline = args[i].partition("=")
        if not name.startswith("--"):
            i += 1
            continue
        if eq:
            value, i = inline, i + 1
        elif name in SWITCHES and (i + 1 >= len(args) or args[i + 1].startswith("--")):
            value, i = True, i + 1
        else:
            value, i = (args[i + 1] if i + 1 < len(args) else None), i + 2
        key = name[2:] if "." in name else FLAGS.get(name)
        if key == "model.preset" and name == "--model_name":
            key, value = ("model.path", value) if str(value).startswith("/") else (key, HF_NAMES.get(value, value))
        if key is not None:
            _set(out, key, value, f"job.args {name}")
    return out


def _set(out: dict, key: str, value: Any, where: str) -> None:
    """out[key] = value as the trainer reads it; a number out of RANGES is refused naming `where`."""
    if key not in DEFAULTS or value is None:  # `--pp` with no value after it: the trainer refuses it, naming it
        return
    if key == "parallel.device" and not isinstance(value, str):
        value = "cpu" if value else "auto"  # --use_cpu, dist.cpu_only
    elif key in RANGES and value is not None and not (key == "train.loss_chunks" and value == "auto"):
        n = integer(value)
        if n is None:
            return  # not a number: the trainer refuses it at start, naming the key
        _check_range(key, n, value, where)
        value = n
    elif key == "model.hf_overrides":
        if not isinstance(value, dict):
            return
        for field in MODEL_SIZE_FIELDS:
            v = value.get(field)
            if v is not None and (type(v) is not int or not 1 <= v <= SIZE_MAX):
                raise UserError(f"{where}: {key}.{field} {shown(v)} is not an integer in 1..{SIZE_MAX} (the trainer "
                                "refuses it too); give the model's real size")
    out[key] = value


def integer(value: Any) -> int | None:
    """value as the trainer's int() reads it (a YAML int, a digit string, a whole float), or None;
    a digit string too long to be any size is read as one far out of every range, not parsed."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    text = str(value).strip()
    if not re.fullmatch(r"[+-]?\d+", text):
        return None
    return int(text) if len(text) <= 30 else (-1 if text.startswith("-") else 1) << 128


def _check_range(key: str, n: int, value: Any, where: str) -> None:
    lo, hi = RANGES[key]
    if not lo <= n <= hi:
        raise UserError(f"{where}: {key} {shown(value)} is not an integer in {lo}..{hi} (the trainer refuses it "
                        "too); give a value in that range")


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
