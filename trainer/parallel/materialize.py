"""Meta-device init, then each rank materialises only its own shards on its device.

Sharded layouts (FSDP2, TP) are composed on a model whose parameters live on the meta device
(no memory), then `to_empty` gives every rank storage for its shards only, and the values are
copied in, one parameter at a time, from the seeded CPU model: a model larger than one GPU builds
on 8 of them, and every layout still starts from bit-identical weights (the single-process
run's). The device never holds more than one full parameter at a time (the one being sliced).

Shards are sliced locally (`distribute_tensor(..., src_data_rank=None)`: no communication), so
every rank must hold the same CPU values, which the shared seed guarantees.
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
    embedding and head; a plain `.to("meta")` would give each use its own copy)."""
    with _keep_parameter_objects():
        module.to(device)


def to_meta(module: nn.Module) -> dict[str, torch.Tensor]:
    """Move `module` to the meta device; returns its CPU values for `materialize`."""
    ref = cpu_reference(module)
    with _keep_parameter_objects():
        module.to("meta")
    return ref


@torch.no_grad()
def materialize(module: nn.Module, ref: dict[str, torch.Tensor], device: torch.device) -> None:
    """Storage on `device` for this rank's part of every tensor of `module`, filled from `ref`."""
    with _keep_parameter_objects():
        module.to_empty(device=device)
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        src = ref.get(strip_wrapper_names(name))
        if src is None:
            raise KeyError(f"materialize: no reference value for {name}")
        if hasattr(t, "device_mesh"):  # a DTensor: this rank's slice of the full tensor, no collective
            from torch.distributed.tensor import distribute_tensor

            local = distribute_tensor(src.to(device), t.device_mesh, t.placements, src_data_rank=None).to_local()
            t.to_local().copy_(local)
        else:
            t.copy_(src)
