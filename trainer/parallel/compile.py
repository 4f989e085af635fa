"""torch.compile of each transformer block, in place: train.compile auto | true | try | false.

auto = true on CUDA devices, false on CPU (on CPU the inductor's C++ kernels rarely pay for their
compile time at the sizes a CPU trains, and CPU runs stay bitwise comparable with eager ones).

Each block is compiled with `nn.Module.compile(fullgraph=True, dynamic=False)`, which keeps the
module and its parameter names (no `_orig_mod.` wrapper), so checkpoints, DCP, tied weights and
FSDP units are unchanged. Blocks share their code, so one graph serves every block of a shape.
It runs after activation checkpointing (a checkpointed block compiles as one region, the
recomputation included) and before FSDP/DDP (whose hooks stay outside the compiled regions), as
torchtitan orders it.

Nothing falls back to eager silently:
- `fullgraph=True`: a graph break is an error, not a block split into eager pieces;
- `dynamic=False`: another batch shape (eval, a pipeline's last microbatch) compiles its own static
  graph instead of a slower shape-generic one;
- the backward graph is compiled with the forward (where torch has the switch), so its errors
  surface in the block's first forward too;
- `true`: a block that does not compile ends the run with one line naming the block and the reason;
  `try`: it runs eager instead, with one warning naming the block and the reason (all blocks of
  the model share its code, so all of them then run eager).
After the first step the trainer logs how many graphs were compiled (`compile_report`): the proof
that compiled code runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from trainer.config import ConfigError
from trainer.parallel.activation_checkpoint import block_slots, blocks_of

log = logging.getLogger("trainer")

BACKENDS = ("inductor", "aot_eager", "eager")


class CompileError(ConfigError):
    """train.compile true and a block that does not compile: one line, what to do."""


def resolve_compile(setting: str, device_type: str) -> str:
    """train.compile (normalised by config_checks to auto|true|try|false) for this device: true|try|false."""
    if setting == "auto":
        return "true" if device_type == "cuda" else "false"
    return setting


def _reason(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


@dataclass
class CompileGroup:
    """The blocks of one model (or pipeline stage) compiled together; `try` falls back as one."""

    mode: str                                   # true | try
    names: list[str] = field(default_factory=list)
    failed: str | None = None                   # why the group runs eager (try), once it does


class _Guarded:
    """A block's compiled call: the compiled function, or (after a compile error) the block's eager
    call (`try`), or the error turned into one line (`true`)."""

    def __init__(self, block: nn.Module, compiled: Any, name: str, group: CompileGroup):
        self.block, self.compiled, self.name, self.group = block, compiled, name, group

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch._dynamo.exc

        if self.group.failed is not None:
            return self.block._call_impl(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:
            why = _reason(e)
            if self.group.mode != "try":
                raise CompileError(f"train.compile: block {self.name} does not compile ({why}); set "
                                   f"train.compile try to run such blocks eager, or false") from e
            self.group.failed = why
            log.warning("train.compile try: block %s does not compile (%s); all %d blocks of this model run "
                        "eager", self.name, why, len(self.group.names))
            return self.block._call_impl(*args, **kwargs)


def configure_dynamo(num_graphs_hint: int) -> None:
    """Process-wide dynamo settings of the trainer (idempotent)."""
    import torch._dynamo
    import torch._functorch.config as functorch_config

    # A graph break or a compile error raises (the default; a library may have changed it).
    torch._dynamo.config.suppress_errors = False
    # Pipeline stages see several microbatch shapes, evaluation another: room for their static graphs.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 * max(num_graphs_hint, 1))
    # Compile the backward with the forward, so a backward that cannot compile fails in forward (where
    # `try` can still run the block eager), not in the middle of loss.backward(). torch >= 2.9 has it.
    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        functorch_config.force_non_lazy_backward_lowering = True


def compile_blocks(module: nn.Module, *, mode: str = "true", backend: str = "inductor", prefix: str = "") -> int:
    """Compile every block of `module` in place (fullgraph, static shapes); returns how many."""
    import torch

    if mode not in ("true", "try"):
        raise ValueError(f"compile mode {mode!r}")
    slots = block_slots(module)
    configure_dynamo(len(slots))
    group = CompileGroup(mode)
    names = {id(c): n for n, c in module.named_modules()}
    for container, key in slots:
        block = container.get_submodule(key)
        name = ".".join(x for x in (prefix, names.get(id(container), ""), key) if x)
        group.names.append(name)
        compiled = torch.compile(block._call_impl, fullgraph=True, dynamic=False, backend=backend)
        # What nn.Module.compile() sets, guarded: Module.__call__ runs _compiled_call_impl when set.
        block._compiled_call_impl = _Guarded(block, compiled, name, group)
    return len(slots)


def compile_report() -> dict[str, int]:
    """Counts dynamo keeps for this process: graphs compiled (a recompilation adds one), graph breaks."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def blocks_running_eager(module: nn.Module) -> list[str]:
    """Names of the blocks of `module` whose compiled call fell back to eager (train.compile try)."""
    out = []
    for block in blocks_of(module):
        guarded = getattr(block, "_compiled_call_impl", None)
        if isinstance(guarded, _Guarded) and guarded.group.failed is not None:
            out.append(guarded.name)
    return out
