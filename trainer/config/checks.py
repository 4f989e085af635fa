"""Every config key checked for range and consistency before anything starts (one line, exit 2).

`check_ranges` needs nothing but the config (it runs inside config.validate, torch-free).
`check_model` also reads the model's transformers config (sequence length vs positions, a loss
split into more chunks than a microbatch has tokens); compose.check_supported runs it before the
process group, so a mistake never ends in a traceback after the config dump or a half-trained run.
Keys the chosen layout ignores are checked too: a typo there is still a typo.
"""

from __future__ import annotations

import math
from typing import Any

from contract.memory import auto_loss_chunks
from trainer.config.bounds import check_numbers
from trainer.config.schema import Config, ConfigError, get_key

OPTIMIZERS = ("adamw", "sgd")
DP_SYNC = ("allreduce", "diloco")
SYNC_DTYPES = ("fp32", "bf16", "int8")
COMPILE = {"auto": "auto", "true": "true", "false": "false", "try": "try", "on": "true", "off": "false",
           "yes": "true", "no": "false", "1": "true", "0": "false"}
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
PARAM_DTYPES = {"auto": "auto", "fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
AC_MODES = ("none", "selective", "full")

# key -> smallest accepted value (integers)
AT_LEAST = {
    "train.batch_size": 1, "train.microbatch_num": 1, "train.grad_acc_steps": 1, "train.eval_batches": 1,
    "train.eval_interval": 0, "train.exit_interval": 0, "train.seed": 0,
    "data.seq_len": 1, "data.num_workers": 0, "data.tokenizer_vocab_size": 260,
    "parallel.tp": 1, "parallel.pp": 1, "parallel.virtual_stages": 1,
    "schedule.warmup_steps": 0,
    "checkpoint.interval": 0, "checkpoint.keep_last": 0, "checkpoint.preempt_interval": 0, "checkpoint.replicas": 0,
    "profile.num_prof_steps": 0,
    "parallel.diloco.inner_steps": 1, "parallel.diloco.fragments": 1, "parallel.diloco.overlap_steps": 0,
}
# optional integers (None = default/derived) -> smallest accepted value when given
AT_LEAST_OPTIONAL = {
    "train.steps": 0, "parallel.dp": 1, "parallel.dp_shard": 1, "schedule.total_steps": 1,
    "model.num_hidden_layers": 1, "model.hidden_size": 1, "model.num_attention_heads": 1,
    "model.intermediate_size": 1, "model.vocab_size": 2,
}
WHY = {"data.tokenizer_vocab_size": " (byte-level BPE: 256 bytes + special tokens)"}


def _real(key: str, value: float, lo: float, hi: float | None = None, *, lo_open: bool = False,
          hi_open: bool = True) -> None:
    ok = math.isfinite(value) and (value > lo if lo_open else value >= lo)
    if hi is not None:
        ok = ok and (value < hi if hi_open else value <= hi)
    if not ok:
        left, right = "(" if lo_open else "[", ")" if hi_open else "]"
        span = f"in {left}{lo:g}, {hi:g}{right}" if hi is not None else (f"> {lo:g}" if lo_open else f">= {lo:g}")
        raise ConfigError(f"{key} must be {span}, got {value!r}")


def check_ranges(cfg: Config) -> None:
    from trainer.config.partition import check_partition_syntax
    from trainer.config.schedules import schedule_spec

    for key, lo in AT_LEAST.items():
        if get_key(cfg, key) < lo:
            raise ConfigError(f"{key} must be >= {lo}{WHY.get(key, '')}, got {get_key(cfg, key)}")
    for key, lo in AT_LEAST_OPTIONAL.items():
        value = get_key(cfg, key)
        if value is not None and value < lo:
            raise ConfigError(f"{key} must be >= {lo} (or unset), got {value}")
    check_numbers(cfg)  # and every number at most its bound (trainer/config/bounds.py)
    t, o, s, d, p = cfg.train, cfg.optim, cfg.schedule, cfg.data, cfg.parallel
    # Values torch.optim.AdamW would only reject once the model is built.
    if o.name.lower() not in OPTIMIZERS:
        raise ConfigError(f"optim.name: unknown optimizer '{o.name}' (choose one of {', '.join(OPTIMIZERS)})")
    o.name = o.name.lower()
    _real("optim.lr", o.lr, 0.0)
    _real("optim.beta1", o.beta1, 0.0, 1.0)
    _real("optim.beta2", o.beta2, 0.0, 1.0)
    _real("optim.eps", o.eps, 0.0, lo_open=True)
    _real("optim.weight_decay", o.weight_decay, 0.0)
    _real("train.grad_clip", t.grad_clip, 0.0)
    _real("schedule.warmup_ratio", s.warmup_ratio, 0.0, 1.0)
    _real("schedule.min_lr", s.min_lr, 0.0)
    if s.min_lr > o.lr:
        raise ConfigError(f"schedule.min_lr {s.min_lr:g} is above the peak optim.lr {o.lr:g}; lower it")
    _real("data.eval_fraction", d.eval_fraction, 0.0, 1.0)
    _real("data.mlm_probability", d.mlm_probability, 0.0, 1.0, lo_open=True, hi_open=False)
    if cfg.logging.peak_flops is not None:
        _real("logging.peak_flops", cfg.logging.peak_flops, 0.0, lo_open=True)
    if not d.text_field:
        raise ConfigError("data.text_field must name a column (default: text)")
    # The GPU-server knobs.
    mode = COMPILE.get(str(t.compile).strip().lower())
    if mode is None:
        raise ConfigError(f"train.compile: '{t.compile}' (auto, true, try or false)")
    t.compile = mode
    if t.compile_backend not in COMPILE_BACKENDS:
        raise ConfigError(f"train.compile_backend: '{t.compile_backend}' ({', '.join(COMPILE_BACKENDS)})")
    if str(t.param_dtype).lower() not in PARAM_DTYPES:
        raise ConfigError(f"train.param_dtype: '{t.param_dtype}' (auto, fp32 or bf16)")
    t.param_dtype = PARAM_DTYPES[str(t.param_dtype).lower()]
    if t.param_dtype == "bf16" and t.dtype == "fp32":
        raise ConfigError("train.param_dtype bf16 computes in bf16 but train.dtype is fp32; set train.dtype bf16 "
                          "(or auto) or train.param_dtype fp32")
    li = cfg.logging.log_interval
    if li != "auto" and (not isinstance(li, int) or li < 1):
        raise ConfigError(f"logging.log_interval must be auto or >= 1, got {li!r}")
    if t.gc_interval != "auto" and (not isinstance(t.gc_interval, int) or t.gc_interval < 0):
        raise ConfigError(f"train.gc_interval must be auto or >= 0 (0: Python's automatic collector), "
                          f"got {t.gc_interval!r}")
    if t.activation_checkpointing not in AC_MODES:
        raise ConfigError(f"train.activation_checkpointing: '{t.activation_checkpointing}' "
                          f"({', '.join(AC_MODES)})")
    if t.loss_chunks != "auto" and (not isinstance(t.loss_chunks, int) or t.loss_chunks < 1):
        raise ConfigError(f"train.loss_chunks must be auto or >= 1, got {t.loss_chunks!r}")
    # Layout keys, also when the layout does not use them.
    if p.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"parallel.device: '{p.device}' (auto, cpu or cuda)")
    if p.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"parallel.backend: '{p.backend}' (auto, gloo or nccl)")
    if p.backend == "nccl" and p.device == "cpu":
        raise ConfigError("parallel.backend: nccl needs CUDA devices but parallel.device is cpu; use gloo or auto")
    schedule_spec(p.pp_schedule)
    check_partition_syntax(p.partition)
    _check_diloco(cfg)
    _check_watch(cfg)


def _check_diloco(cfg: Config) -> None:
    """parallel.dp_sync and parallel.diloco.* (checked also under allreduce: a typo is a typo). What
    needs the layout or the model (replicas, sharding, blocks per rank) is checked by
    trainer/parallel/diloco.py once the mesh exists."""
    p, d = cfg.parallel, cfg.parallel.diloco
    if p.dp_sync not in DP_SYNC:
        raise ConfigError(f"parallel.dp_sync: '{p.dp_sync}' (allreduce or diloco)")
    if d.sync_dtype not in SYNC_DTYPES:
        raise ConfigError(f"parallel.diloco.sync_dtype: '{d.sync_dtype}' ({', '.join(SYNC_DTYPES)})")
    _real("parallel.diloco.outer_lr", d.outer_lr, 0.0, lo_open=True)
    _real("parallel.diloco.outer_momentum", d.outer_momentum, 0.0, 1.0)
    _real("parallel.diloco.merge_alpha", d.merge_alpha, 0.0, 1.0, hi_open=False)
    if d.fragments > d.inner_steps or d.inner_steps % d.fragments:
        raise ConfigError(f"parallel.diloco.fragments {d.fragments} must divide parallel.diloco.inner_steps "
                          f"{d.inner_steps} (one fragment is synced every inner_steps / fragments steps)")
    if d.overlap_steps >= d.inner_steps // d.fragments:
        raise ConfigError(f"parallel.diloco.overlap_steps {d.overlap_steps} must be below inner_steps / fragments = "
                          f"{d.inner_steps // d.fragments} (a fragment's sync ends before the next one starts)")



def _auto_seconds(key: str, value: Any) -> None:
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{key} must be auto or a number of seconds >= 1, got {value!r}")


def _check_watch(cfg: Config) -> None:
    """parallel.timeout_s and watch.* (the hang watch: contract/hang.py)."""
    w = cfg.watch
    _auto_seconds("parallel.timeout_s", cfg.parallel.timeout_s)
    _auto_seconds("watch.hang_timeout_s", w.hang_timeout_s)
    _auto_seconds("watch.startup_timeout_s", w.startup_timeout_s)
    _real("watch.heartbeat_s", w.heartbeat_s, 0.0, 3600.0)
    if 0 < w.heartbeat_s < 0.05:
        raise ConfigError(f"watch.heartbeat_s {w.heartbeat_s:g}: at least 0.05 s (or 0: off)")
    _real("watch.straggler_factor", w.straggler_factor, 1.0, lo_open=True)
    if w.straggler_steps < 0:
        raise ConfigError(f"watch.straggler_steps must be >= 0, got {w.straggler_steps}")

def max_positions(hf: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(hf, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def resolve_loss_chunks(value: int | str, task: str, vocab_size: int, tokens: int) -> int:
    """train.loss_chunks: auto -> contract.memory.auto_loss_chunks (chunks of at most
    LOSS_CHUNK_ELEMENTS logits); 1 for ViT-MAE (no LM head)."""
    if value != "auto":
        return int(value)
    if task == "mae":
        return 1
    return auto_loss_chunks(tokens, vocab_size)


def resolve_log_interval(value: int | str, device_type: str) -> int:
    """logging.log_interval: auto -> 1 on CPU, 10 on CUDA, where every log step waits for the device
    (reading the loss and the step time), a wait that leaves the GPU idle while the host catches up."""
    if value != "auto":
        return int(value)
    return 10 if device_type == "cuda" else 1


def microbatch_tokens(cfg: Config) -> int:
    """Tokens of one microbatch (what one loss call sees): batch_size / microbatch_num x seq_len."""
    return cfg.train.batch_size // cfg.train.microbatch_num * cfg.data.seq_len


def check_model(cfg: Config, hf: Any, task: str) -> None:
    """Consistency of the config with the model's transformers config (`hf`)."""
    from trainer.config.bounds import check_model_shape

    check_model_shape(hf)
    t, seq = cfg.train, cfg.data.seq_len
    if task != "mae":
        limit = max_positions(hf)
        if limit is not None and seq > limit:
            raise ConfigError(f"data.seq_len {seq} is longer than the model's {limit} positions; use "
                              f"--data.seq_len <= {limit} or raise model.hf_overrides.max_position_embeddings")
    if t.loss_chunks != "auto":
        if task in ("mae", "image") and t.loss_chunks > 1:
            raise ConfigError(f"train.loss_chunks {t.loss_chunks}: {'ViT-MAE' if task == 'mae' else 'an image model'} "
                              f"has no LM head to chunk; use auto or 1")
        tokens = microbatch_tokens(cfg)
        if t.loss_chunks > tokens:
            raise ConfigError(f"train.loss_chunks {t.loss_chunks} is more than the {tokens} tokens of a microbatch "
                              f"(batch_size / microbatch_num x seq_len); use at most {tokens}")
