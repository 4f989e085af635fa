"""Meta-device init, then each rank materialises only its own shards on its device.

Sharded layouts (FSDP2, TP) are composed on a model whose parameters live on the meta device
(no memory), then `to_empty` gives every rank storage for its shards only, and the values are
filled in, one parameter at a time: a model larger than one GPU builds on 8 of them, and every
layout still starts from bit-identical weights (the single-process run's). The device never
holds more than one full parameter at a time (the one being sliced).

Only one rank per pipeline stage builds the seeded model on the CPU (`ParallelDims.builds_weights`: the
rank at coordinate 0 of every dp and tp dim); the others build it on the meta device, so a node of 8
GPUs holds one full fp32 copy in host memory during set-up, not 8. Each DTensor shard is then
scattered from that rank (`distribute_tensor(..., src_data_rank=0)`: coordinate 0 of the
tensor's own mesh, which is that rank when the mesh spans the stage), and the other tensors
(buffers, replicated weights, DTensors on a mesh smaller than the stage) are broadcast from it
over the stage's ranks, DTensors then sliced locally. Without a group (`materialize(..., group=None)`) every
rank slices its shard from its own copy, with no communication.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from trainer.parallel.activation_checkpoint import strip_wrapper_names


def cpu_reference(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `module` by name (tied weights under each of their names),
    detached: the values survive `module.to("meta")`."""
    ref = {n: p.detach() for n, p in module.named_parameters(remove_duplicate=False)}
    ref.update({n: b.detach() for n, b in module.named_buffers(remove_duplicate=False)})
    return ref


@contextlib.contextmanager
def _keep_parameter_objects() -> Iterator[None]:
    """Device moves that swap each parameter's contents in place instead of registering a new
    Parameter per attribute: a weight tied between two modules (embeddings and LM head, BERT's
    decoder bias) stays ONE parameter through `to("meta")` and `to_empty()`."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def move(module: nn.Module, device: torch.device | str) -> None:
    """`module.to(device)` keeping weights tied inside it one parameter (a T5 stage's decoder
    embedding and head, BERT's decoder bias). A plain `.to("meta")` gives each use its own new
    Parameter (CPU -> meta is no in-place conversion), so a CPU-built stage would lose ties that a
    meta-built one keeps: their `named_parameters()` would differ in length, and so would the
    collectives of `materialize` on the ranks of one stage (a hang)."""
    with _keep_parameter_objects():
        module.to(device)


def to_meta(module: nn.Module) -> dict[str, torch.Tensor]:
    """Move `module` to the meta device; returns its CPU values for `materialize`."""
    ref = cpu_reference(module)
    move(module, "meta")
    return ref


@torch.no_grad()
def materialize(module: nn.Module, ref: dict[str, torch.Tensor], device: torch.device, group=None,
                source: bool = True) -> None:
    """Storage on `device` for this rank's part of every tensor of `module`, filled from `ref`:
    locally (group None), or from the `source` rank of `group` (the stage's ranks; `ref` is read
    only there)."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    with _keep_parameter_objects():
        module.to_empty(device=device)
    tensors = [*module.named_parameters(), *module.named_buffers()]
    stage_size = 1 if group is None else dist.get_world_size(group)
    if group is not None:
        _check_same_tensors(tensors, group, device)
    for name, t in tensors:
        src = ref.get(strip_wrapper_names(name))
        if src is None or (group is not None and source and src.is_meta):
            raise KeyError(f"materialize: no reference value for {name}")
        dtensor = hasattr(t, "device_mesh")
        if group is None:
            full = src.to(device)
        elif source:
            full = src.to(device, copy=True)
        else:  # what arrives from the source rank (the full shape: a DTensor's global shape)
            full = torch.empty(t.shape, dtype=t.dtype, device=device)
        # Scatter only from a mesh that spans the stage, whose coordinate 0 is the source rank; a
        # DTensor on a smaller mesh (a norm weight sharded over dp only, beside tp) has other
        # coordinate-0 ranks, which hold no values: it gets the full tensor and slices it here.
        scatter = dtensor and group is not None and t.device_mesh.size() == stage_size
        if group is not None and not scatter:
            dist.broadcast(full, group=group, group_src=0)
        if dtensor:  # this rank's slice of the full tensor
            local = distribute_tensor(full, t.device_mesh, t.placements,
                                      src_data_rank=0 if scatter else None).to_local()
            t.to_local().copy_(local)
        else:
            t.copy_(full)


def _check_same_tensors(tensors: list[tuple[str, torch.Tensor]], group, device: torch.device) -> None:
    """Every rank of the stage is about to run one collective per tensor: check first that they
    hold the same number, so that a difference is an error on every rank, not a hang."""
    import torch.distributed as dist

    counts = torch.tensor([len(tensors), -len(tensors)], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
    if int(counts[0]) != -int(counts[1]):
        raise RuntimeError(f"materialize: the ranks of this stage hold between {-int(counts[1])} and "
                           f"{int(counts[0])} tensors (this rank {len(tensors)}): a tied weight kept on "
                           f"some ranks only; move modules with materialize.move")
