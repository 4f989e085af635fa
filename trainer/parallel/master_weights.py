"""bf16 compute weights over fp32 master weights in one process (train.param_dtype bf16, one rank).

What FSDP2's MixedPrecisionPolicy does on a mesh of one rank, without its per-parameter copies.
FSDP2 on one rank casts each fp32 parameter to a new bf16 tensor and then copies that into the
unsharded parameter before every forward (two kernels per parameter), and after the backward
copies the bf16 gradients into a flat fp32 buffer and out again. On one H100 at smollm-1.7b
batch 4 that was 14.4 ms (pre-forward) + 10.7 ms (post-backward) of a 204 ms step
(bench/results/gpu_step_profile-smollm-1.7b.txt), where one cast each way (~7 ms) is all the
arithmetic needs; with this module the step took 192.5 ms instead of 200.8.

Here, as in FSDP2, the model's registered parameters are the fp32 master weights whenever no
forward/backward is in flight: the optimizer, gradient clipping, checkpoints and exports see fp32
tensors and fp32 gradients. Around each forward (a pre-hook on the root module) the registered
parameters are swapped for bf16 compute parameters, refreshed from the masters by one cast per
parameter (also when the masters look unchanged: fused AdamW updates them in place without
bumping their version counters). The compute parameters are the same objects every step, so
compiled blocks keep their graphs. When the backward ends (a callback queued on the autograd
engine) each bf16 gradient is cast into its master's fp32 gradient, or added to it (accumulation
over microbatches, in fp32, as FSDP2 does), the masters are registered again and the copies'
memory is freed until the next forward (as FSDP2 reshards after the backward). Floating-point
inputs of the root forward are cast to bf16, as FSDP2's `cast_forward_inputs`. A forward without
a backward (evaluation, no_grad) registers the masters again when it returns.

FSDP2-on-one-rank's losses and gradients bit for bit (tests/unit/test_master_weights.py).

Where the run compiles (train.compile, the CUDA default) the optimizer is master_adamw.MasterAdamW,
which calls `keep_copies()`: then a single microbatch's gradients stay bf16 on the copies (no fp32
gradient exists), the optimizer reads them there and writes each copy as it updates its master, and
the copies keep their memory, so the next forward casts nothing; they are cast again only when a
master's version counter moved otherwise (a checkpoint loaded into the model). Gradients summed over
microbatches still go to fp32 on the masters (cast before the next microbatch's forward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only


class MasterWeights:
    """Attach to `model` (hooks on it; the model object is unchanged). `.masters` and `.computes`
    are parallel lists, one entry per distinct parameter (tied weights share one)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16, compile_mode: str = "false",
                 compile_backend: str = "inductor"):
        self.dtype = dtype
        # How master_adamw.MasterAdamW runs its update: as the run compiles its blocks (train.compile).
        self.compile_mode = compile_mode
        self.compile_backend = None if compile_mode == "false" else compile_backend
        self.slots: list[tuple[nn.Module, str, int]] = []  # (module, attribute, index into masters)
        self.masters: list[nn.Parameter] = []
        self.computes: list[nn.Parameter] = []
        index: dict[int, int] = {}
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is None:
                    continue
                if id(p) not in index:
                    index[id(p)] = len(self.masters)
                    self.masters.append(p)
                    compute = nn.Parameter(torch.empty_like(p, dtype=dtype), requires_grad=p.requires_grad)
                    self.computes.append(compute)
                self.slots.append((module, name, index[id(p)]))
        self._index = index
        self.active = False           # compute parameters registered (a forward/backward in flight)
        self.kept = False             # keep_copies(): the optimizer (master_adamw.py) writes the copies
        self._synced: list[int] | None = None  # the masters' version counters when the copies last equalled them
        self._backward_queued = False
        model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        model.register_forward_hook(self._post_forward)

    def _register(self, params: list[nn.Parameter]) -> None:
        for module, name, i in self.slots:
            module._parameters[name] = params[i]

    def _pre_forward(self, _module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not self.active:  # a second forward before the backward reuses the copies in place
            with torch.no_grad():
                if self.kept:  # a microbatch before this one left its gradients on the copies
                    self._fold_grads()
                if not self.copies_current():
                    for c in self.computes:
                        c.untyped_storage().resize_(c.numel() * c.element_size())
                    torch._foreach_copy_(self.computes, [m.detach() for m in self.masters])
                    if self.kept:
                        self._synced = self._versions()
            self._register(self.computes)
            self.active = True
        return tree_map_only(torch.Tensor, self._cast_input, (args, kwargs))

    def _cast_input(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype) if t.is_floating_point() else t

    def _post_forward(self, _module: nn.Module, _args: Any, output: Any) -> None:
        grads = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not grads:
            self._release()
            return
        self._backward_queued = False
        for t in grads:
            t.register_hook(self._on_backward)

    def _on_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._post_backward)
        return grad

    @torch.no_grad()
    def _post_backward(self) -> None:
        # Kept copies: a first microbatch's gradients stay bf16 on the copies (the optimizer reads
        # them there); a later one's are added to the fp32 sum.
        self._fold_grads(only_onto_sums=self.kept)
        self._release()

    def _fold_grads(self, only_onto_sums: bool = False) -> None:
        """Each copy's bf16 gradient cast into its master's fp32 gradient, or added to it (the
        fp32 sum over microbatches); with only_onto_sums, only where a sum exists."""
        for master, compute in zip(self.masters, self.computes, strict=True):
            g = compute.grad
            if g is None or (only_onto_sums and master.grad is None):
                continue
            if master.grad is None:
                master.grad = g.to(master.dtype)
            else:
                master.grad.add_(g)
            compute.grad = None

    def _release(self) -> None:
        """Register the fp32 masters again and free the bf16 copies' memory until the next forward
        (the tensors stay, with empty storage, as FSDP2's resharded parameters do): the optimizer
        step runs beside fp32 weights, gradients and state alone."""
        if self.active:
            self._register(self.masters)
            self.active = False
            if not self.kept:
                with torch.no_grad():
                    for c in self.computes:
                        c.untyped_storage().resize_(0)

    # What master_adamw.MasterAdamW uses: it reads the bf16 gradients and writes the copies itself.

    def keep_copies(self) -> None:
        """From now on the copies keep their memory between steps and a single microbatch's
        gradients stay on them in bf16: the optimizer reads those (grad_of) and writes the copies
        (copies_written), so the next forward casts nothing. The copies are cast again before a
        forward only when a master changed otherwise (a checkpoint loaded into it: its version
        counter moved)."""
        self.kept = True

    def _versions(self) -> list[int]:
        return [m._version for m in self.masters]

    def copies_current(self) -> bool:
        return self._synced is not None and self._synced == self._versions()

    def copies_written(self, current: bool) -> None:
        """The optimizer set the copies from the masters (`current`: all of them are now equal)."""
        self._synced = self._versions() if current else None

    def grad_of(self, master: torch.Tensor) -> torch.Tensor | None:
        """`master`'s gradient: bf16 on its copy (one microbatch), else the fp32 sum on it."""
        i = self._index[id(master)]
        g = self.computes[i].grad
        return g if g is not None else self.masters[i].grad

    def copy_of(self, master: torch.Tensor) -> nn.Parameter:
        return self.computes[self._index[id(master)]]

    def gradients(self) -> list[torch.Tensor]:
        return [g for m in self.masters if (g := self.grad_of(m)) is not None]

    def clear_grads(self, set_to_none: bool = True) -> None:
        for c in self.computes:
            if c.grad is not None:
                if set_to_none:
                    c.grad = None
                else:
                    c.grad.zero_()


def bf16_weights_suit(model: nn.Module) -> bool:
    """bf16 compute weights (here or FSDP2's) suit every model but one with BatchNorm (fp32 running
    statistics beside a bf16 weight: batch_norm refuses the mix); such a model keeps autocast."""
    return not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
