"""checkpoint.format: full — the FSDP stub's single-file state dicts next to the DCP shards.

    model_state_dict.pt   unsharded model state dict (full-model FQNs, CPU tensors)
    optim_state_dict.pt   unsharded optimizer state dict keyed by FQN ({"state", "param_groups"})
    lr_state_dict.pt      LR scheduler state dict
    iter_state_dict.pt    {epoch, seg, start_idx, end_idx, loss_min}

These are for tools that expect the stub's files (and for reading weights without DCP); resume
always reads the DCP shards. Gathering full tensors costs memory on rank 0: use for small models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)


def _merge_optim(parts: list[dict]) -> dict:
    """Per-stage optimizer state dicts -> one (state by FQN; param groups joined by position)."""
    out: dict[str, Any] = {"state": {}, "param_groups": []}
    for sd in parts:
        out["state"].update(sd["state"])
        for i, g in enumerate(sd["param_groups"]):
            if i < len(out["param_groups"]):
                out["param_groups"][i]["params"] += list(g["params"])
            else:
                out["param_groups"].append({**g, "params": list(g["params"])})
    return out


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def write_full(trainer: Any, model: nn.Module, tmp: Path, state: dict, rank: int) -> None:
    """Collective: every rank gathers its stage's full tensors; stage leaders send them to rank 0."""
    dims = trainer.dims
    # cpu_offload leaves the full tensors on global rank 0 only (every other rank gets {}): with a
    # pipeline, each stage leader must keep its own stage's, so they are gathered and then copied.
    opts = StateDictOptions(full_state_dict=True, cpu_offload=dims.pp == 1)
    model_sd = _to_cpu(get_model_state_dict(model, options=opts))
    optim_sd = _to_cpu(get_optimizer_state_dict(model, trainer.optimizer, options=opts))
    parts = [(model_sd, optim_sd)]
    if dims.pp > 1:  # each pipeline stage holds part of the model: collect the stage leaders' parts
        leader = dims.coord("dp") == 0 and dims.coord("tp") == 0
        gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object((model_sd, optim_sd) if leader else None, gathered, dst=0)
        parts = [p for p in gathered or [] if p is not None]
    if rank != 0:
        return
    full_model: dict[str, Any] = {}
    for m, _ in parts:
        full_model.update(m)
    torch.save(full_model, tmp / "model_state_dict.pt")
    torch.save(_merge_optim([o for _, o in parts]), tmp / "optim_state_dict.pt")
    torch.save(trainer.scheduler.state_dict(), tmp / "lr_state_dict.pt")
    data = state["data"]
    torch.save({"epoch": state["epoch"], "seg": 0, "start_idx": data["consumed"],
                "end_idx": trainer.total_steps * data["global_batch"],
                "loss_min": state["loss_min"] if state["loss_min"] is not None else float("inf")},
               tmp / "iter_state_dict.pt")
