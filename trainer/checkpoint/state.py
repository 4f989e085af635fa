"""What goes into a checkpoint: model + optimizer (sharded, through DCP), and the small per-run
and per-rank state (step, tokens, LR schedule, data position, RNG) in plain files.

Model and optimizer go through `get_state_dict`/`set_state_dict`, which name every tensor by
the FULL model's fully-qualified name whatever the wrapping (DDP's `module.` dropped, FSDP2 and
TP DTensors kept sharded). Pipeline stages already use the full model's names (stages.py), and
the optimizer state is flattened to one key per parameter (`state.<fqn>.exp_avg`,
`param_groups.<fqn>.lr`), so a checkpoint written with pp=2 loads with pp=1 and vice versa.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _unwrap(m: nn.Module) -> nn.Module:
    return m.module if hasattr(m, "module") and isinstance(m, nn.parallel.DistributedDataParallel) else m


def merged_model(parts: list[nn.Module]) -> nn.Module:
    """One module whose parameter names are the full model's, over this rank's model parts.

    One part (no PP, or one stage per rank) is used as is. Several stages on a rank
    (interleaved schedules) are grafted into one tree: their submodule names never collide
    below the shared containers (`model.layers.<global index>`)."""
    if len(parts) == 1:
        return parts[0]
    root = nn.Module()

    def graft(dst: nn.Module, src: nn.Module) -> None:
        for name, child in _unwrap(src).named_children():
            have = dst._modules.get(name)
            if have is None or have is child:
                dst._modules[name] = child
                continue
            if not isinstance(have, _Merged):
                merged = _Merged()
                graft(merged, have)
                dst._modules[name] = have = merged
            graft(have, child)

    for part in parts:
        graft(root, part)
    return root


class _Merged(nn.Module):
    """A container made by merged_model (holds children of several stages)."""


class ModelOptimState(Stateful):
    """The DCP-visible state: model and optimizer, each keyed by full-model FQNs."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=OPTIONS)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=OPTIONS)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def model_signature(spec: Any) -> dict[str, Any]:
    """The model fields a checkpoint must agree on to load (compared before any tensor is read)."""
    c = spec.hf_config
    sig: dict[str, Any] = {"family": spec.family, "model_type": getattr(c, "model_type", None),
                           "num_params": int(spec.num_params)}
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "tie_word_embeddings", "image_size", "patch_size"):
        if hasattr(c, key):
            v = getattr(c, key)
            sig[key] = v if isinstance(v, (int, float, bool, str, type(None))) else str(v)
    return sig
