"""Build models (transformers families, and the trainer's own Wide-ResNet) from presets or a local
directory, and say how to compute their loss.

Random init happens on one seed before any sharding, so every rank and every parallel layout
starts from identical weights. Parameter counts of big presets are taken on the meta device
(no memory allocated).
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from contract.presets import PRESETS
from trainer.config import ConfigError, ModelConfig
from trainer.config.bounds import MODEL_SIZES, model_size_problem
from trainer.runtime import container_limits
from trainer.runtime.unpickling import why_not_data


@dataclass(frozen=True)
class Family:
    config_cls: str                      # a transformers name, or "module:Name" for the trainer's own
    model_cls: str
    task: str                            # causal_lm | masked_lm | mae | seq2seq | image


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM", "causal_lm"),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", "causal_lm"),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", "causal_lm"),
    "gpt2": Family("GPT2Config", "GPT2LMHeadModel", "causal_lm"),
    "bert": Family("BertConfig", "BertForMaskedLM", "masked_lm"),
    "vitmae": Family("ViTMAEConfig", "ViTMAEForPreTraining", "mae"),
    "bloom": Family("BloomConfig", "BloomForCausalLM", "causal_lm"),
    "t5": Family("T5Config", "trainer.models.t5:T5ForConditionalGeneration", "seq2seq"),
    "wide_resnet": Family("trainer.models.wide_resnet:WideResNetConfig", "trainer.models.wide_resnet:WideResNet",
                          "image"),
}
MODEL_TYPE_TO_FAMILY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2", "bert": "bert",
                        "vit_mae": "vitmae", "bloom": "bloom", "t5": "t5", "wide_resnet": "wide_resnet"}
# model.<key> overrides under each family's own name for the field (None: the family has no such knob).
_OVERRIDE_NAMES = {
    "gpt2": {"intermediate_size": "n_inner"},
    "t5": {"intermediate_size": "d_ff"},
    "bloom": {"intermediate_size": None},  # BLOOM's MLP is 4 x hidden, fixed
    "wide_resnet": dict.fromkeys(("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size")),
}

# Dropout draws random numbers per rank, which would make parallel layouts diverge; pretraining
# here runs without it (re-enable through model.hf_overrides).
_NO_DROPOUT = {
    "gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "vitmae": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "bloom": dict(hidden_dropout=0.0, attention_dropout=0.0),
    "t5": dict(dropout_rate=0.0),
}


def _transformers_attr(name: str) -> Any:
    """A transformers class by name, or one of the trainer's own as "module:Name"."""
    if ":" in name:
        import importlib

        module, _, attr = name.partition(":")
        return getattr(importlib.import_module(module), attr)
    import transformers

    return getattr(transformers, name)


@dataclass
class ModelSpec:
    """What the rest of the trainer needs to know about a model, without holding it."""

    family: str
    task: str
    hf_config: Any
    num_params: int
    num_layers: int
    hidden_size: int
    attention_width: int = 0             # heads x head_dim (Qwen3-0.6B: 16 x 128 = 2048, hidden 1024)
    train_flops_per_sample: float | None = None  # where 6 N per token does not apply (convolutions)

    def tokens_per_sample(self, seq_len: int) -> int:
        if self.task == "mae":  # one token per image patch
            c = self.hf_config
            return (c.image_size // c.patch_size) ** 2
        if self.task == "image":  # throughput in images
            return 1
        return seq_len


# config.json fields that size tensors: integers within trainer/config/bounds.py MODEL_SIZES, the
# same bounds as model.hf_overrides (a hostile 10**12 would otherwise reach allocation or an
# arithmetic error).
SIZE_FIELDS = tuple(MODEL_SIZES)


def pretrained_config(mcfg: ModelConfig) -> Any:
    """model.path's config.json as a transformers config, its size fields checked (one ConfigError)."""
    where = f"model.path: {mcfg.path}/config.json"
    try:
        cfg = _transformers_attr("AutoConfig").from_pretrained(mcfg.path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers' parse and field validation errors of any kind: one line
        raise ConfigError(f"{where}: {' '.join(str(e).split())[:300]}") from None
    for key in SIZE_FIELDS:
        v = getattr(cfg, key, None)
        if v is not None and (why := model_size_problem(key, v)):
            raise ConfigError(f"{where}: {why}; the file is corrupt or not this model's")
    return cfg


def physical_memory() -> int | None:
    """This machine's RAM in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def memory_limit(cgroup: Path | None = None) -> tuple[int | None, str]:
    """(bytes this process may use, what sets them): the container's memory limit
    (trainer/runtime/container_limits.py) when it is below the machine's RAM, which sysconf reports inside
    a container too; else the RAM."""
    ram, limit = physical_memory(), container_limits.memory_limit(cgroup)
    if limit is not None and (ram is None or limit[0] < ram):
        return limit[0], "this container's memory limit"
    return ram, "this machine's memory"


def _family_of(mcfg: ModelConfig) -> str:
    if mcfg.path is not None:
        cfg = pretrained_config(mcfg)
        fam = MODEL_TYPE_TO_FAMILY.get(cfg.model_type)
        if fam is None:
            raise ConfigError(f"model.path: model_type '{cfg.model_type}' is not supported "
                              f"(supported: {', '.join(MODEL_TYPE_TO_FAMILY)})")
        return fam
    return PRESETS[mcfg.preset].family


def task_of(mcfg: ModelConfig) -> str:
    """The model's task (causal_lm | masked_lm | mae | seq2seq | image) from its preset or directory."""
    return FAMILIES[_family_of(mcfg)].task


def build_hf_config(mcfg: ModelConfig, vocab_size: int | None = None) -> tuple[str, Any]:
    """(family, transformers config) with preset, overrides and data vocab applied."""
    if mcfg.path is not None and mcfg.load_weights:
        vocab_size = None  # the weights fix the vocabulary; the tokenizer must fit it (Tokenizer.check_fits)
    family = _family_of(mcfg)
    fam = FAMILIES[family]
    if mcfg.path is not None:
        cfg = pretrained_config(mcfg)
    else:
        cfg = _transformers_attr(fam.config_cls)(**_NO_DROPOUT.get(family, {}), **PRESETS[mcfg.preset].config)
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size"):
        value = getattr(mcfg, key)
        if value is None:
            continue
        name = _OVERRIDE_NAMES.get(family, {}).get(key, key)
        if name is None:
            raise ConfigError(f"model.{key}: {family} has no such setting; use model.hf_overrides with a field of "
                              f"{type(cfg).__name__}")
        setattr(cfg, name, value)
        if family == "t5" and key == "num_hidden_layers":
            cfg.num_decoder_layers = value  # T5's depth is per stack: the decoder follows the encoder
    if family == "wide_resnet" and mcfg.vocab_size is not None:
        raise ConfigError("model.vocab_size: Wide-ResNet classifies images; set model.hf_overrides.num_classes")
    if vocab_size is not None and mcfg.vocab_size is None and fam.task not in ("mae", "image"):
        cfg.vocab_size = vocab_size
    if mcfg.vocab_size is not None:
        if vocab_size is not None and mcfg.vocab_size < vocab_size:
            raise ConfigError(f"model.vocab_size {mcfg.vocab_size} is smaller than the tokenizer's {vocab_size}")
        cfg.vocab_size = mcfg.vocab_size
    for key, value in mcfg.hf_overrides.items():
        if not hasattr(cfg, key):
            raise ConfigError(f"model.hf_overrides.{key}: not a field of {type(cfg).__name__} (a typo would be "
                              f"silently ignored); see the transformers docs of {type(cfg).__name__}")
        try:
            setattr(cfg, key, value)
        except Exception as e:  # noqa: BLE001 - transformers' field validation (a multi-line error): one line
            raise ConfigError(f"model.hf_overrides.{key}: {' '.join(str(e).split())[:200]}") from None
    # Configs that precompute a per-layer list (Qwen2/3 `layer_types`) must follow a depth override.
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, list) and types and len(types) != cfg.num_hidden_layers:
        cfg.layer_types = [types[i % len(types)] for i in range(cfg.num_hidden_layers)]
    heads = getattr(cfg, "num_attention_heads", None)
    if heads and cfg.hidden_size % heads and getattr(cfg, "head_dim", None) is None:
        raise ConfigError(f"model.hidden_size {cfg.hidden_size} is not divisible by num_attention_heads {heads}")
    kv = getattr(cfg, "num_key_value_heads", None)
    if kv is not None and heads and (kv > heads or heads % kv):
        cfg.num_key_value_heads = heads  # a head-count override must not leave an impossible GQA ratio
    if family in ("llama", "qwen2", "qwen3") and mcfg.hidden_size is not None and mcfg.path is None \
            and "head_dim" in PRESETS[mcfg.preset].config:
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = False
    # BLOOM (ALiBi) and Wide-ResNet have one attention code path (or none): no implementation to pick.
    if family not in ("bloom", "wide_resnet"):
        cfg._attn_implementation = mcfg.attn_implementation
    return family, cfg


def count_params(family: str, hf_config: Any) -> int:
    """Parameter count on the meta device: works for 175B without allocating it."""
    with torch.device("meta"):
        model = _transformers_attr(FAMILIES[family].model_cls)(hf_config)
    return sum(p.numel() for p in model.parameters())


def attention_width(hf_config: Any) -> int:
    """Query heads x head_dim: the width of the attention scores' matmuls (MFU's 12 L d S term).
    Not the hidden size where a family decouples them (Qwen3: head_dim 128 x 16 heads over hidden 1024)."""
    heads = getattr(hf_config, "num_attention_heads", None) or getattr(hf_config, "n_head", None)
    hidden = int(hf_config.hidden_size)
    head_dim = getattr(hf_config, "head_dim", None)
    if not heads:
        return hidden
    return int(heads) * int(head_dim if isinstance(head_dim, int) and head_dim > 0 else hidden // int(heads))


def num_units(family: str, hf_config: Any) -> int:
    """The repeated blocks a pipeline distributes: transformer layers, T5's encoder then decoder
    blocks, Wide-ResNet's bottlenecks."""
    if family == "t5":
        return int(hf_config.num_layers) + int(hf_config.num_decoder_layers)
    return int(hf_config.num_hidden_layers)


def model_spec(mcfg: ModelConfig, vocab_size: int | None = None) -> ModelSpec:
    family, cfg = build_hf_config(mcfg, vocab_size)
    flops = None
    if family == "wide_resnet":
        from trainer.models.wide_resnet import train_flops_per_image

        flops = train_flops_per_image(cfg)
    return ModelSpec(family, FAMILIES[family].task, cfg, count_params(family, cfg),
                     num_units(family, cfg), int(cfg.hidden_size), attention_width(cfg), flops)


def build_model(spec: ModelSpec, mcfg: ModelConfig, seed: int, meta: bool = False, copies: int = 1) -> nn.Module:
    """Full model on CPU in fp32, initialised from `seed` (or loaded from model.path); with `meta`,
    its structure only (no memory, no values: a rank that receives them, parallel/materialize.py).
    `copies`: how many ranks of this machine build it at once (parallel/compose.py
    `copies_built_here`), all of which must fit in its memory (or its container's limit)."""
    cls = _transformers_attr(FAMILIES[spec.family].model_cls)
    if meta:
        with torch.device("meta"):
            return cls(spec.hf_config).float()
    check_fits(spec, mcfg, copies)
    torch.manual_seed(seed)
    if mcfg.path is not None and mcfg.load_weights:
        _transformers_attr("utils").logging.disable_progress_bar()  # one bar per rank in the logs otherwise
        try:
            model, info = cls.from_pretrained(mcfg.path, config=spec.hf_config, local_files_only=True,
                                              dtype=torch.float32, output_loading_info=True)
        except pickle.UnpicklingError as e:  # pytorch_model.bin read weights_only (transformers' default)
            raise ConfigError(f"model.path: cannot load weights from '{mcfg.path}': its pickled weights "
                              f"(pytorch_model*.bin) are not plain tensors ({why_not_data(e)}); use the "
                              "repository's safetensors") from None
        except (OSError, RuntimeError, ValueError) as e:
            raise ConfigError(f"model.path: cannot load weights from '{mcfg.path}': "
                              f"{' '.join(str(e).split())[:300]}") from None
        # transformers initialises what the files lack at random and says so in a warning only: a
        # model.* override that changed the architecture would train half-random "pretrained" weights.
        missing = sorted(info.get("missing_keys") or []) + sorted(str(m) for m in info.get("mismatched_keys") or [])
        if missing:
            raise ConfigError(f"model.path: the weights in '{mcfg.path}' lack {len(missing)} tensor(s) of this model "
                              f"(first: {missing[0]}); drop the model.* overrides that change its architecture, or "
                              "set model.load_weights false")
    else:
        model = cls(spec.hf_config)
    return model.float()


def check_fits(spec: ModelSpec, mcfg: ModelConfig, copies: int = 1) -> None:
    """One line (ConfigError) before allocating when `copies` full fp32 models exceed the memory this
    process may use: a corrupt or mistyped size (vocab_size 10**7) or too many ranks on one machine,
    instead of the OOM killer's exit 137 without a word."""
    ram, what = memory_limit()
    one = 4 * spec.num_params  # the full model, fp32, on this machine's CPU
    if not ram or one * copies <= ram:
        return
    where = f"model.path: {mcfg.path}/config.json" if mcfg.path is not None else "model"
    each = (f", and the {copies} ranks on this machine each build one at once ({one * copies / 1e9:.1f} GB)"
            if copies > 1 else "")
    fix = ("fewer ranks per machine, or a sharded layout (parallel.sharding zero3: one rank of each stage builds it)"
           if copies > 1 and one <= ram else
           f"check its sizes (vocab_size {getattr(spec.hf_config, 'vocab_size', None)}, hidden_size "
           f"{getattr(spec.hf_config, 'hidden_size', None)})")
    raise ConfigError(f"{where}: {spec.num_params:,} parameters are {one / 1e9:.1f} GB in fp32{each}, more than "
                      f"{what} ({ram / 1e9:.1f} GB); {fix}")


BLOCK_PATHS = ("model.layers", "transformer.h", "bert.encoder.layer", "vit.encoder.layer", "vit.layers",
               "decoder.decoder_layers", "encoder.block", "decoder.block", "layer1", "layer2", "layer3", "layer4")


def block_containers(model: nn.Module) -> list[nn.ModuleList | nn.ModuleDict]:
    """The containers holding a model's (or a pipeline stage's) repeated blocks, at the known paths."""
    found: list[nn.ModuleList | nn.ModuleDict] = []
    for path in BLOCK_PATHS:
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, (nn.ModuleList, nn.ModuleDict)):
            found.append(obj)
    return found


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (FSDP units, TP targets, pipeline split points)."""
    return [b for c in block_containers(model) if isinstance(c, nn.ModuleList) for b in c]


# ---------------------------------------------------------------- losses


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies (labels already shifted; -100 ignored), in fp32."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=-100, reduction="sum")


class Task:
    """How a family computes its loss. `loss_sum` over a microbatch, `weight` normalises it:
    the batch loss is sum(loss_sum) / sum(weight), identical however the batch is split.

    `fused`: the model has the targets forward of trainer/models/lm_loss.py (the trainer's models
    do), which computes the loss inside the root forward, chunked; else logits, then the loss."""

    def __init__(self, kind: str, fused: bool = False):
        self.kind, self.fused = kind, fused

    @property
    def constant_weight(self) -> bool:
        """Every sample carries the same weight (causal LM on packed blocks: every token is a target;
        images: one per sample), so a rank's share of the global weight is known without asking."""
        return self.kind in ("causal_lm", "mae", "image")

    def weight(self, inputs: torch.Tensor, labels: torch.Tensor) -> int:
        if self.kind in ("mae", "image"):
            return int(inputs.shape[0])
        return int((labels != -100).sum())

    def loss_sum(self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.kind == "image":  # labels are class indices; the model sums the batch's cross entropy
            return model(pixel_values=inputs, targets=labels)
        if self.kind == "mae":
            # labels carry the masking noise so every layout masks the same patches
            out = model(pixel_values=inputs, noise=labels)
            return out.loss * inputs.shape[0]
        if self.fused:
            return model(input_ids=inputs, targets=labels)
        if self.kind == "masked_lm":
            logits = model(input_ids=inputs).logits
        else:
            logits = model(input_ids=inputs, use_cache=False).logits
        return lm_loss_sum(logits, labels)
