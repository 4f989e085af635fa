"""What goes into a checkpoint: model + optimizer (sharded, through DCP), and the small per-run
and per-rank state (step, tokens, LR schedule, data position, RNG) in plain files.

Model and optimizer go through `get_state_dict`/`set_state_dict`, which name every tensor by
the FULL model's fully-qualified name whatever the wrapping (DDP's `module.` dropped, FSDP2 and
TP DTensors kept sharded). Pipeline stages already use the full model's names (stages.py), and
the optimizer state is flattened to one key per parameter (`state.<fqn>.exp_avg`,
`param_groups.<fqn>.lr`), so a checkpoint written with pp=2 loads with pp=1 and vice versa.

Under parallel.dp_sync diloco the replicas' parameters differ between syncs, and a key written by
several ranks is kept from one of them (DCP deduplicates by name), so: `model` holds the anchors
(the global parameters, the same on every replica: what `trainer export` reads), `diloco` the outer
Nesterov momentum and, with overlap_steps, the average of a sync in flight; each replica's own
parameters and inner optimizer state go under `replica<k>` (k: its dp_replicate coordinate). Such
a checkpoint resumes with the same dp_replicate and parallel.diloco settings.
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
    set_optimizer_state_dict,
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
    """The DCP-visible state: model and optimizer, each keyed by full-model FQNs; with `diloco`
    (trainer/parallel/diloco.py) the layout of the module doc."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, diloco: Any = None):
        self.model, self.optimizer, self.diloco = model, optimizer, diloco
        # Set before a load (Checkpointer.load): the DiLoCo replicas the checkpoint holds, None for
        # a checkpoint without DiLoCo. A replica it lacks (an elastic run's rejoining one), or a run
        # now without DiLoCo, starts from the anchors with replica 0's inner optimizer state.
        self.saved_replicas: set[int] | None = None

    def _from_anchor(self) -> bool:
        return self.saved_replicas is not None and (self.diloco is None or self.diloco.replica not in self.saved_replicas)

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=OPTIONS)
        if self.diloco is None:
            if self._from_anchor():  # a DiLoCo checkpoint resumed as one replica: its anchors are the model
                return {"model": model_sd, "replica0": {"optim": optim_sd}}
            return {"model": model_sd, "optim": optim_sd}
        # The DiLoCo object's own tensors (DTensors over their shards where the parameters are):
        # DCP loads into them in place.
        fqn = _param_fqns(self.model)
        anchors, outer = dict(model_sd), {}  # buffers: this replica's (BatchNorm's are dp rank 0's anyway)
        for pid, entry in self.diloco.global_state().items():
            anchors[fqn[pid]] = entry.pop("anchor")
            for kind, t in entry.items():
                outer.setdefault(kind, {})[fqn[pid]] = t
        if self._from_anchor():  # this replica is not in the checkpoint: the anchors, replica 0's inner state
            return {"model": anchors, "diloco": outer, "replica0": {"optim": optim_sd}}
        return {"model": anchors, "diloco": outer,
                f"replica{self.diloco.replica}": {"model": model_sd, "optim": optim_sd}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._from_anchor():
            if self.diloco is None:
                set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                               optim_state_dict=state["replica0"]["optim"], options=OPTIONS)
            else:  # the anchors were loaded in place into the DiLoCo object's own tensors
                self.diloco.start_from_anchor()
                set_optimizer_state_dict(self.model, self.optimizer, state["replica0"]["optim"], options=OPTIONS)
            return
        own = state if self.diloco is None else state[f"replica{self.diloco.replica}"]
        set_state_dict(self.model, self.optimizer, model_state_dict=own["model"],
                       optim_state_dict=own["optim"], options=OPTIONS)


def saved_replicas(keys: Any) -> set[int] | None:
    """The DiLoCo replicas whose own state a checkpoint holds, from its metadata's keys
    (`app.replica<k>.…`); None when it holds none (no DiLoCo)."""
    found = {int(k.split(".")[1][len("replica"):]) for k in keys
             if k.startswith("app.replica") and k.split(".")[1][len("replica"):].isdigit()}
    return found or None


def _param_fqns(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in get_state_dict's keys (wrapper prefixes dropped as DCP drops them)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    return {id(p): next(iter(_get_fqns(model, name))) for name, p in model.named_parameters()}


def dp_sync_state(trainer: Any) -> dict[str, Any] | None:
    """This rank's data-parallel sync counters (trainer/parallel/sync_meter.py), for its rank file."""
    meter = getattr(trainer, "sync_meter", None)
    return None if meter is None else meter.state_dict()


def restore_dp_sync(trainer: Any, rank_file: dict[str, Any]) -> dict[str, Any]:
    """The counters of a rank file (same layout) back into the meter, so dp_sync_bytes goes on from
    the straight run's; returns the rank file."""
    meter, saved = getattr(trainer, "sync_meter", None), rank_file.get("dp_sync")
    if meter is not None and isinstance(saved, dict):
        meter.load_state_dict(saved)
    return rank_file


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
