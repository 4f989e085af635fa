"""Resolving a config: YAML, env fallbacks and CLI overrides applied in order of precedence, then
every key validated (torch-free; one line naming the key on any error).

Precedence, lowest to highest: dataclass default < YAML file < environment variable < CLI flag.
(The Pi guide's `--batch_size` beats `BATCH_SIZE`, which beats the YAML; the runner's
`OUTPUT_DIR=/out` beats a YAML `output_dir`, while an explicit `--output-dir` beats both.)

Seed-compatible flags (`--train_steps`, `--max-steps`, `--mbs`, ...) and the FSDP stub's YAML keys
(`dist.sharding_stage`, ...) are aliases of canonical dotted keys; the table is
trainer/config/flags.py and docs/flags.md.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any

from trainer.config.schema import (
    DTYPES,
    LOG_LINES,
    SHARDING,
    Config,
    ConfigError,
    apply_yaml,
    get_key,
    set_key,
)

# ---------------------------------------------------------------- validation


def validate(cfg: Config) -> None:
    """Checks that need no torch and no process group; each error names its key and what it accepts.

    Every key is checked, also those the chosen layout does not use (a pipeline schedule with
    pp=1 is still a typo to report). Checks that need the model's config (sequence length vs
    positions, head divisibility) are in trainer/config/checks.py:check_model, run before start."""
    from contract.presets import PRESETS, unknown_preset_message
    from trainer.config.checks import check_ranges

    p, t = cfg.parallel, cfg.train
    if p.sharding not in SHARDING:
        raise ConfigError(f"parallel.sharding: unknown strategy '{p.sharding}' (choose one of {', '.join(SHARDING)})")
    p.pp_schedule = {"afab": "gpipe", "1F1B": "1f1b"}.get(p.pp_schedule, p.pp_schedule)
    if t.dtype not in DTYPES:
        raise ConfigError(f"train.dtype: unknown dtype '{t.dtype}' (auto, fp32 or bf16)")
    t.dtype = DTYPES[t.dtype]
    if cfg.model.path is None and cfg.model.preset not in PRESETS:
        raise ConfigError(unknown_preset_message(cfg.model.preset))
    check_output_paths(cfg)
    if cfg.model.path is not None and not Path(cfg.model.path).is_dir():
        raise ConfigError(f"model.path: '{cfg.model.path}' is not a local model directory")
    if t.microbatch_num is None:
        # The Pi guide's 4 microbatches feed a pipeline; without one they only slow a batch down.
        t.microbatch_num = 4 if p.pp > 1 else 1
    check_ranges(cfg)
    if t.batch_size % t.microbatch_num != 0:
        raise ConfigError(f"train.batch_size {t.batch_size} is not divisible by train.microbatch_num "
                          f"{t.microbatch_num} (--batch_size % --microbatch_num must be 0)")
    if cfg.data.source == "synthetic" and t.steps is None:
        raise ConfigError("train.steps: required with synthetic data (set --train.steps N or --train_steps N)")
    if cfg.schedule.decay not in ("cosine", "constant"):
        raise ConfigError(f"schedule.decay: '{cfg.schedule.decay}' (cosine or constant)")
    if cfg.logging.line not in LOG_LINES:
        raise ConfigError(f"logging.line: '{cfg.logging.line}' ({' or '.join(LOG_LINES)})")
    if cfg.logging.wandb_mode not in ("offline", "online"):
        raise ConfigError(f"logging.wandb_mode: '{cfg.logging.wandb_mode}' (offline or online)")
    if cfg.logging.wandb is not None and not cfg.logging.wandb.strip():
        raise ConfigError("logging.wandb: a W&B project name, or leave it unset")
    if cfg.model.attn_implementation not in ("sdpa", "eager"):
        raise ConfigError(f"model.attn_implementation: '{cfg.model.attn_implementation}' (sdpa or eager)")
    if cfg.checkpoint.format not in ("dcp", "full"):
        raise ConfigError(f"checkpoint.format: '{cfg.checkpoint.format}' (dcp or full)")
    check_checkpoint_name(cfg.checkpoint.name, cfg.checkpoint.prefix)
    from trainer.config.batches import parse_batches

    parse_batches(cfg.profile.batch)  # "1" | "1,3" | "2-4" | "none": one-line error otherwise
    if cfg.profile.format not in ("chrome", "seed"):
        raise ConfigError(f"profile.format: '{cfg.profile.format}' (chrome or seed)")
    check_perseus(cfg)
    if cfg.data.source != "synthetic" and not Path(cfg.data.source).exists():
        raise ConfigError(f"data.source: '{cfg.data.source}' does not exist (a file or directory, or 'synthetic')")
    if cfg.model.path is not None:
        from trainer.config.hub_layout import model_dir

        # A Hub cache repo folder means its snapshot; config.yaml records the folder that was read.
        cfg.model.path = str(model_dir(cfg.model.path, cfg.model.load_weights))


def check_checkpoint_name(name: str, prefix: str = "") -> None:
    """checkpoint.name: a directory name holding `{step}`, and no other braces: the trainer puts the
    step in with str.replace, so `{0}` or `{step.__class__}` never reach str.format (an IndexError
    traceback, or a name made of an object's attributes, before). Neither it nor checkpoint.prefix
    may start with '.': `.tmp-` names are the trainer's unfinished saves, never listed."""
    rest = name.replace("{step}", "")
    if ("{step}" not in name or "/" in name or "{" in rest or "}" in rest or len(name) > 200
            or not name.isprintable() or name.startswith(".")):
        raise ConfigError(f"checkpoint.name: {name[:100]!r} must hold {{step}}, no other brace, no '/', and not start "
                          "with '.' (e.g. step-{step})")
    if prefix and ("/" in prefix or len(prefix) > 200 or not prefix.isprintable() or prefix.startswith(".")):
        raise ConfigError(f"checkpoint.prefix: {prefix[:100]!r} must not contain '/' (it names a directory) nor "
                          "control characters, nor start with '.'")


# What the trainer makes under OUTPUT_DIR as directories (trainer/train.py, trainer/runtime/tracking.py).
RUN_DIRS = ("logs", "tensorboard", "wandb")


def _not_a_directory(path: Path) -> Path | None:
    """The first of path and its parents that exists and is not a directory (mkdir would fail there)."""
    for p in (path, *path.parents):
        if os.path.lexists(p):
            return None if p.is_dir() else p
    return None


def path_problem(value: str) -> str | None:
    """Why the OS cannot take `value` as a path (pathlib's checks raise on these instead of saying
    False), or None: a NUL byte, over 4096 bytes, a name over 255 bytes."""
    if "\0" in value:
        return "a NUL byte"
    if len(value.encode(errors="surrogateescape")) > 4096:
        return "over 4096 bytes"
    if any(len(part.encode(errors="surrogateescape")) > 255 for part in value.split("/")):
        return "a name over 255 bytes"
    return None


PATH_KEYS = ("output_dir", "checkpoint.dir", "checkpoint.resume", "data.source", "data.tokenizer", "model.path")


def check_output_paths(cfg: Config) -> None:
    """Paths the OS can take (no NUL, at most 4096 bytes), and OUTPUT_DIR, the checkpoint directory
    and the run's own subdirectories directories where they exist (a file there ended the run in a
    FileExistsError or NotADirectoryError traceback)."""
    for key in PATH_KEYS:
        value = get_key(cfg, key)
        if isinstance(value, str) and (why := path_problem(value)):
            raise ConfigError(f"{key}: {value[:60]!r} is not a path ({why})")
    out = Path(cfg.output_dir)
    d = cfg.checkpoint.dir
    ckpt = out / "checkpoints" if not d else (Path(d) if Path(d).is_absolute() else out / d)
    for key, path in (("output_dir", out), ("checkpoint.dir", ckpt), *((f"output_dir ({sub}/)", out / sub)
                                                                       for sub in RUN_DIRS)):
        if (blocker := _not_a_directory(path)) is not None:
            raise ConfigError(f"{key}: '{blocker}' exists and is not a directory; move it, or choose another "
                              f"{key.split()[0]}")


def check_perseus(cfg: Config) -> None:
    """profile.perseus_url and profile.gpu_clocks, before anything starts (docs/profiling.md)."""
    from urllib.parse import urlsplit

    prof = cfg.profile
    if prof.gpu_clocks not in ("off", "auto", "on"):
        raise ConfigError(f"profile.gpu_clocks: '{prof.gpu_clocks}' (off, auto or on)")
    if prof.perseus_url is None:
        return
    u = urlsplit(prof.perseus_url)
    try:
        ok = u.scheme in ("http", "https") and bool(u.hostname) and (u.port is None or u.port > 0)
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"profile.perseus_url: {prof.perseus_url!r} is not an http:// URL (e.g. http://10.0.0.1:7787)")
    if prof.num_prof_steps < 1:
        raise ConfigError("profile.perseus_url needs --num_prof_steps N (N >= 1): the steps measured under each plan")
    from trainer.config.schedules import schedule_spec

    if cfg.parallel.pp > 1 and schedule_spec(cfg.parallel.pp_schedule).name in ("interleaved_zb", "zbv", "dualpipev"):
        raise ConfigError(f"profile.perseus_url: {cfg.parallel.pp_schedule} splits the backward into input and weight "
                          f"parts; Perseus plans name forward and backward only: use 1f1b, gpipe or interleaved1f1b")


# ---------------------------------------------------------------- resolution


def resolve(config_path: str | None, overrides: list[tuple[str, Any]],
            environ: typing.Mapping[str, str] | None = None, check: bool = True) -> Config:
    """default < YAML < env < CLI; `overrides` are canonical (key, raw value) pairs from the CLI.
    check=False leaves out validate() (`--print-config` shows a partial config as it stands)."""
    from trainer.config.flags import ENV_KEYS

    environ = os.environ if environ is None else environ
    cfg = Config()
    if config_path:
        apply_yaml(cfg, config_path)
    for var, key in ENV_KEYS.items():
        if environ.get(var, "") != "":
            try:
                set_key(cfg, key, environ[var])
            except ConfigError as e:
                raise ConfigError(f"env {var}: {e}") from None
    for key, value in overrides:
        set_key(cfg, key, value)
    if check:
        validate(cfg)
    return cfg
