"""torch.compile of each transformer block, in place: train.compile auto | true | false.

auto = on for CUDA devices, off on CPU (on CPU the inductor's C++ kernels rarely pay for their
compile time at the sizes a CPU trains, and CPU runs stay bitwise comparable with eager ones).

Each block is compiled with `nn.Module.compile()`, which keeps the module and its parameter names
(no `_orig_mod.` wrapper), so checkpoints, DCP, tied weights and FSDP units are unchanged. Blocks
share their code, so the compiled graph is reused from block to block. It runs after activation
checkpointing (a checkpointed block compiles as one region, the recomputation included) and before
FSDP/DDP (whose hooks stay outside the compiled regions), as torchtitan orders it.

What does not compile yet runs eager, said in one log line, never a failure: blocks holding
DTensor tensor-parallel weights (their backward fails under compile in current torch), and any
compile error at run time (dynamo falls back to eager for that frame and logs it).
"""

from __future__ import annotations

import logging

from torch import nn

from trainer.parallel.activation_checkpoint import blocks_of

log = logging.getLogger("trainer")


def resolve_compile(setting: str, device_type: str) -> bool:
    """train.compile (normalised by config_checks to auto|true|false) for this device."""
    if setting == "auto":
        return device_type == "cuda"
    return setting == "true"


def compile_blocks(module: nn.Module, *, tp: int, announce: bool = True) -> int:
    """Compile every block of `module` in place; returns how many (0 when the layout cannot)."""
    if tp > 1:
        if announce:
            log.info("train.compile: blocks with DTensor tensor-parallel weights run eager (their backward "
                     "fails under torch.compile in this torch); everything else is unchanged")
        return 0
    import torch._dynamo

    # A frame the compiler cannot handle runs eager with a warning instead of ending the run.
    torch._dynamo.config.suppress_errors = True
    blocks = blocks_of(module)
    # Pipeline stages see several microbatch shapes, accumulation more: leave room for them.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 * max(len(blocks), 1))
    for block in blocks:
        block.compile()
    return len(blocks)
