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
tensor's own mesh, which is that rank), and plain tensors (buffers, replicated weights) are
broadcast from it over the stage's ranks. Without a group (`materialize(..., group=None)`) every
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


def to_meta(module: nn.Module) -> dict[str, torch.Tensor]:
    """Move `module` to the meta device; returns its CPU values for `materialize`."""
    ref = cpu_reference(module)
    with _keep_parameter_objects():
        module.to("meta")
    return ref


@torch.no_grad()
def materialize(module: nn.Module, ref: dict[str, torch.Tensor], device: torch.device, group=None,
                source: bool = True) -> None:
    """Storage on `device` for this rank's part of every tensor of `module`, filled from `ref`:
    locally (group None), or from the `source` rank of `group` (the stage's ranks; `ref` is read
    only there)."""
    from torch.distributed.tensor import distribute_tensor

    with _keep_parameter_objects():
        module.to_empty(device=device)
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
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
        if dtensor:  # this rank's slice of the full tensor
            local = distribute_tensor(full, t.device_mesh, t.placements,
                                      src_data_rank=None if group is None else 0).to_local()
            t.to_local().copy_(local)
            continue
        if group is not None:
            import torch.distributed as dist

            dist.broadcast(full, group=group, group_src=0)
        t.copy_(full)
