"""Flags and YAML keys of the five seed systems, mapped onto canonical config keys.

One table, used by the CLI parser, the YAML loader and docs/flags.md (kept in sync by a test).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.presets import HF_NAMES


def _same(v: Any) -> Any:
    return v


def model_name_key(value: Any) -> tuple[str, Any]:
    """picotron --model_name: a local model dir loads it, a known hub name picks a preset."""
    v = str(value)
    try:
        local = Path(v).is_dir()
    except (OSError, ValueError):  # a name the OS cannot take (too long, a NUL): not a local folder
        local = False
    if local:
        return "model.path", v
    return "model.preset", HF_NAMES.get(v, v)


@dataclass(frozen=True)
class Alias:
    canonical: str
    source: str                          # which seed system the spelling comes from
    convert: Callable[[Any], Any] = _same
    env: str | None = None               # env fallback (below the flag, above the YAML)
    is_switch: bool = False              # takes no value (store_true)


PI, M3D, PICO, STUB, MERAK, OURS = ("Pi pipeline guide", "minimal 3D pretrain", "picotron",
                                    "FSDP stub", "Perseus/Merak", "this trainer")

FLAGS: dict[str, Alias] = {
    # Pi pipeline guide (seed 000)
    "--train_steps": Alias("train.steps", PI),
    "--batch_size": Alias("train.batch_size", PI, env="BATCH_SIZE"),
    "--microbatch_num": Alias("train.microbatch_num", PI, env="MICROBATCH_NUM"),
    "--profile_batch": Alias("profile.batch", PI, env="PROFILE_BATCH"),
    # minimal 3D pretrain (seed 002)
    "--max-steps": Alias("train.steps", M3D),
    "--micro-batch-size": Alias("train.batch_size", M3D),
    "--learning-rate": Alias("optim.lr", M3D),
    "--warmup-ratio": Alias("schedule.warmup_ratio", M3D),
    "--log-interval": Alias("logging.log_interval", M3D),
    "--save-interval": Alias("checkpoint.interval", M3D),
    "--output-dir": Alias("output_dir", M3D, env="OUTPUT_DIR"),
    "--data-dir": Alias("data.source", M3D),
    "--hidden-size": Alias("model.hidden_size", M3D),
    "--num-layers": Alias("model.num_hidden_layers", M3D),
    "--num-attention-heads": Alias("model.num_attention_heads", M3D),
    "--tensor-parallel-size": Alias("parallel.tp", M3D),
    "--pipeline-parallel-size": Alias("parallel.pp", M3D),
    "--num-microbatches": Alias("train.microbatch_num", M3D),
    "--pipeline-schedule": Alias("parallel.pp_schedule", M3D),
    # picotron (seed 003; create_config.py flags)
    "--dp": Alias("parallel.dp", PICO),
    "--tp": Alias("parallel.tp", PICO),
    "--pp": Alias("parallel.pp", PICO),
    "--pp_engine": Alias("parallel.pp_schedule", PICO),
    "--grad_acc_steps": Alias("train.grad_acc_steps", PICO),
    "--mbs": Alias("train.batch_size", PICO),
    "--seq_len": Alias("data.seq_len", PICO),
    "--num_hidden_layers": Alias("model.num_hidden_layers", PICO),
    "--model_name": Alias("model.preset", PICO),          # or model.path for a local dir
    "--total_train_steps": Alias("train.steps", PICO),
    "--use_cpu": Alias("parallel.device", PICO, convert=lambda v: "cpu" if v in (True, "true", "True", "1") else "auto",
                       is_switch=True),
    # Perseus/Merak (seed 004)
    "--partition_method": Alias("parallel.partition", MERAK),
    "--export_timing_csv": Alias("profile.export_timing_csv", MERAK, is_switch=True),
    "--num_prof_steps": Alias("profile.num_prof_steps", MERAK),
    "--perseus_url": Alias("profile.perseus_url", MERAK, env="PERSEUS_URL"),
    # ours
    "--resume": Alias("checkpoint.resume", OURS),
    "--seed": Alias("train.seed", OURS),
}

# Env fallbacks: variable -> canonical key (below CLI flags, above YAML).
ENV_KEYS: dict[str, str] = {a.env: a.canonical for a in FLAGS.values() if a.env}

# FSDP stub YAML keys (seed 001) -> canonical keys.
YAML_ALIASES: dict[str, Alias] = {
    "dist.sharding_stage": Alias("parallel.sharding", STUB),
    "dist.dtype": Alias("train.dtype", STUB),
    "dist.backend": Alias("parallel.backend", STUB),
    "dist.cpu_only": Alias("parallel.device", STUB, convert=lambda v: "cpu" if v else "auto"),
    "dataset.batch_size": Alias("train.batch_size", STUB),
    "dataset.num_workers": Alias("data.num_workers", STUB),
    "lr_scheduler.total_iterations": Alias("schedule.total_steps", STUB),
    "lr_scheduler.warmup_iterations": Alias("schedule.warmup_steps", STUB),
    "lr_scheduler.min_lr": Alias("schedule.min_lr", STUB),
    "model.hf_config": Alias("model.hf_overrides", STUB),
    "checkpoint.chkpt_saving_iterations": Alias("checkpoint.interval", STUB),
    "checkpoint.preempt_chkpt_saving_iterations": Alias("checkpoint.preempt_interval", STUB),
    "checkpoint.directory": Alias("checkpoint.dir", STUB),
    "checkpoint.state_dict_type": Alias("checkpoint.format", STUB,
                                        convert=lambda v: "full" if v == "full" else "dcp"),
}

# Stub keys that describe its placeholder files; accepted and ignored (the stub ignored them too).
YAML_IGNORED = {"dataset.path_train", "dataset.path_eval"}


def flags_table_markdown() -> str:
    rows = ["| Flag / key | Origin | Canonical key | Env fallback |", "|---|---|---|---|"]
    for flag, a in FLAGS.items():
        rows.append(f"| `{flag}` | {a.source} | `{a.canonical}` | {('`' + a.env + '`') if a.env else ''} |")
    for key, a in YAML_ALIASES.items():
        rows.append(f"| YAML `{key}` | {a.source} | `{a.canonical}` | |")
    return "\n".join(rows)
