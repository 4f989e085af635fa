"""Upper bounds of every number a trainer config holds: one table, checked where the config is
validated (checks.check_ranges), each bound named in its message. Chosen so that no real run
reaches one (docs/flags.md, "Bounds"); a value beyond used to reach an allocation or an arithmetic
error deep in torch or transformers: a profile range of 10^12 batch indices filled memory, a BPE of
10^11 tokens the same, a model of 10^8 layers was built for minutes, a hidden size of 0 ended in a
reshape error, an overflowing degree in a mesh of that many ranks.

- every integer key: at most AT_MOST[key] (or MODEL_SIZES for model.*), else MAX_COUNT, and at
  least -MAX_COUNT (the keys' own lower bounds are checks.AT_LEAST);
- every real key: finite (no nan, no inf), and at most FLOAT_AT_MOST[key] where one is named;
- model.hf_overrides (and model.path's config.json, trainer/models/build.py): the fields that size a
  model within MODEL_SIZES, other integers within +-MAX_OVERRIDE_INT, reals finite, text short;
- products: the ranks of a layout at most MAX_RANKS, a microbatch's tokens at most
  MAX_MICROBATCH_TOKENS.
Torch-free; imports only the schema.
"""

from __future__ import annotations

import math
from typing import Any

from trainer.config.schema import DICT_KEYS, Config, ConfigError, config_keys, get_key

MAX_COUNT = 1 << 30                  # steps, intervals, any count not named below (~10^9)
MAX_RANKS = 1 << 20                  # ranks of one job (checkpoint state and the runner count as many)
MAX_MICROBATCH_TOKENS = 1 << 24      # batch_size / microbatch_num x seq_len: 16M tokens at once
MAX_OVERRIDE_INT = 1 << 31           # an hf_overrides integer that sizes nothing (token ids, windows)
MAX_OVERRIDE_TEXT = 1024             # characters of an hf_overrides string
MAX_OVERRIDE_ITEMS = 4096            # entries of an hf_overrides list or mapping

AT_MOST: dict[str, int] = {
    "train.seed": (1 << 63) - 1,     # torch.manual_seed's range
    "train.batch_size": 1 << 16, "train.microbatch_num": 1 << 16, "train.grad_acc_steps": 1 << 16,
    "train.eval_batches": 1 << 16, "train.loss_chunks": 1 << 20,
    "data.seq_len": 1 << 20, "data.tokenizer_vocab_size": 1 << 20, "data.num_workers": 1024,
    "parallel.dp": MAX_RANKS, "parallel.dp_shard": MAX_RANKS, "parallel.tp": MAX_RANKS, "parallel.pp": MAX_RANKS,
    "parallel.virtual_stages": 1024, "checkpoint.replicas": MAX_RANKS, "checkpoint.keep_last": 1 << 20,
    "profile.num_prof_steps": 1 << 20,
}
WHY_MOST = {
    "train.batch_size": " samples a rank computes at once", "data.seq_len": " tokens a sample",
    "data.tokenizer_vocab_size": " tokens (the largest real vocabularies have ~262,000)",
    "parallel.dp": " ranks", "parallel.dp_shard": " ranks", "parallel.tp": " ranks", "parallel.pp": " stages",
}
FLOAT_AT_MOST: dict[str, float] = {
    "optim.lr": 1e3, "optim.weight_decay": 1e3, "optim.eps": 1.0, "schedule.min_lr": 1e3,
    "train.grad_clip": 1e12, "logging.peak_flops": 1e18,
}
# transformers config fields that size a model: (least, most). The largest real models have ~126
# layers, 128 heads, hidden size 25,600, MLPs of 53,248 and vocabularies of 262,144.
_HIDDEN, _MLP, _LAYERS, _HEADS = (1, 1 << 17), (1, 1 << 20), (1, 1 << 10), (1, 1 << 12)
MODEL_SIZES: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 24), "type_vocab_size": (1, 1 << 12),
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "decoder_hidden_size"), _HIDDEN),
    **dict.fromkeys(("intermediate_size", "d_ff", "n_inner", "decoder_intermediate_size"), _MLP),
    **dict.fromkeys(("num_hidden_layers", "num_layers", "num_decoder_layers", "n_layer",
                     "decoder_num_hidden_layers"), _LAYERS),
    **dict.fromkeys(("num_attention_heads", "num_key_value_heads", "num_heads", "n_head",
                     "decoder_num_attention_heads"), _HEADS),
    "head_dim": (1, 1 << 14), "d_kv": (1, 1 << 14),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx"), (1, 1 << 24)),
    "image_size": (1, 1 << 14), "patch_size": (1, 1 << 12), "num_channels": (1, 1 << 12),
    "num_classes": (1, 1 << 24), "base_planes": (1, 1 << 14), "stem_channels": (1, 1 << 14),
    "width_factor": (1, 1 << 10), "pretraining_tp": (1, 1 << 10), "max_window_layers": (0, 1 << 10),
    "relative_attention_num_buckets": (1, 1 << 12), "relative_attention_max_distance": (1, 1 << 24),
    "chunk_size_feed_forward": (0, 1 << 20),
}


def shown(value: Any) -> str:
    """A value in a message: never Python's 4300-digit limit's ValueError, never a long line."""
    if type(value) is int and value.bit_length() > 64:
        return f"{'-' if value < 0 else ''}an integer of {value.bit_length()} bits"
    return repr(value)[:60]


def model_size_problem(key: str, value: Any) -> str | None:
    """Why `value` cannot be the model field `key` (MODEL_SIZES), or None."""
    lo, hi = MODEL_SIZES[key]
    if type(value) is not int or not lo <= value <= hi:
        return f"{key} must be an integer in {lo}..{hi}, got {shown(value)}"
    return None


def _override_problem(key: Any, value: Any) -> str | None:
    if not isinstance(key, str) or not key.isidentifier() or len(key) > 100:
        return f"{shown(key)} is not a config field name"
    if key in MODEL_SIZES:
        return model_size_problem(key, value)
    if isinstance(value, float) and not math.isfinite(value):
        return f"{key} must be a finite number, got {value!r}"
    if type(value) is int and abs(value) > MAX_OVERRIDE_INT:
        return f"{key} must be within +-{MAX_OVERRIDE_INT}, got {shown(value)}"
    if isinstance(value, str) and len(value) > MAX_OVERRIDE_TEXT:
        return f"{key} is {len(value)} characters; at most {MAX_OVERRIDE_TEXT}"
    if isinstance(value, (list, dict)) and len(value) > MAX_OVERRIDE_ITEMS:
        return f"{key} holds {len(value)} entries; at most {MAX_OVERRIDE_ITEMS}"
    if isinstance(value, list):
        return next((p for p in (_override_problem(key, v) for v in value if not isinstance(v, (list, dict))) if p), None)
    return None


def check_overrides(overrides: dict) -> None:
    for key, value in overrides.items():
        if why := _override_problem(key, value):
            raise ConfigError(f"model.hf_overrides: {why}")


def _most(key: str) -> int:
    field = key.removeprefix("model.")
    if key.startswith("model.") and field in MODEL_SIZES:
        return MODEL_SIZES[field][1]
    return AT_MOST.get(key, MAX_COUNT)


def check_numbers(cfg: Config) -> None:
    """Every number of the config within its bound (module doc); one line naming key and bound."""
    for key in config_keys():
        value = get_key(cfg, key)
        if key in DICT_KEYS or isinstance(value, bool) or value is None or isinstance(value, str):
            continue
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ConfigError(f"{key} must be a finite number, got {value!r}")
            hi = FLOAT_AT_MOST.get(key)
            if hi is not None and value > hi:
                raise ConfigError(f"{key} must be at most {hi:g}, got {value:g}")
        elif isinstance(value, int):
            hi = _most(key)
            if value > hi:
                raise ConfigError(f"{key} must be at most {hi}{WHY_MOST.get(key, '')}, got {shown(value)}")
            if value < -MAX_COUNT:
                raise ConfigError(f"{key} must be at least {-MAX_COUNT}, got {shown(value)}")
    check_overrides(cfg.model.hf_overrides)
    p, t = cfg.parallel, cfg.train
    ranks = p.tp * p.pp * (p.dp or 1)
    if ranks > MAX_RANKS:
        raise ConfigError(f"parallel.dp x tp x pp = {ranks}: at most {MAX_RANKS} ranks")
    if t.microbatch_num >= 1 and t.batch_size // t.microbatch_num * cfg.data.seq_len > MAX_MICROBATCH_TOKENS:
        raise ConfigError(f"train.batch_size / train.microbatch_num x data.seq_len = "
                          f"{t.batch_size // t.microbatch_num * cfg.data.seq_len} tokens a microbatch: at most "
                          f"{MAX_MICROBATCH_TOKENS}; use more microbatches or a smaller batch")


# (width, heads, head dim) field names of one attention, as transformers' configs spell them.
ATTENTION_FIELDS = (("hidden_size", "num_attention_heads", "head_dim"), ("n_embd", "n_head", None),
                    ("decoder_hidden_size", "decoder_num_attention_heads", None))


def check_model_shape(hf: Any) -> None:
    """What transformers assumes of a built config's sizes and never says in one line (a reshape
    error, a ZeroDivisionError of a head dim of 0, a broadcast error of an odd rotary dim): each
    width split evenly into its heads, a head at least 1 wide (even where positions are rotary), an
    image cut into whole patches."""
    for width_key, heads_key, dim_key in ATTENTION_FIELDS:
        width, heads = getattr(hf, width_key, None), getattr(hf, heads_key, None)
        if type(width) is not int or type(heads) is not int or heads < 1:
            continue
        dim = getattr(hf, dim_key, None) if dim_key else None
        if dim is None:
            if width % heads:
                raise ConfigError(f"model: {width_key} {width} is not divisible by {heads_key} {heads}")
            dim = width // heads
        if type(dim) is int and dim < 1:
            raise ConfigError(f"model: {width_key} {width} / {heads_key} {heads} leaves heads {dim} wide; "
                              "give each head at least 1 (2 with rotary positions)")
        rotary = getattr(hf, "rope_parameters", None) is not None or getattr(hf, "rope_theta", None) is not None
        if type(dim) is int and dim % 2 and rotary:
            raise ConfigError(f"model: a head of {dim} (hidden_size / num_attention_heads or head_dim) is odd; "
                              "rotary positions turn pairs of dimensions: make it even")
    image, patch = getattr(hf, "image_size", None), getattr(hf, "patch_size", None)
    if type(image) is int and type(patch) is int and (patch > image or image % patch):
        raise ConfigError(f"model: image_size {image} is not a whole number of patch_size {patch} patches")
