"""torch.compile in the trainer, on CPU: every layout compiled equals one eager process, nothing
falls back to eager silently, and the chunked LM head + loss compiles too.

The layouts run dynamo + AOTAutograd (`aot_eager` backend: the graphs, the autograd split and the
DTensor/FSDP2/DDP/pipeline interplay, without inductor's C++ code generation, which costs ~30 s
of CPU per process here); test_trainer_speed.py::test_compile_true_keeps_the_losses runs the
inductor backend itself in one process, tests/gpu/test_gpu.py on CUDA.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn

from tests.support.parallel_equiv import assert_equivalent, run_layout

COMPILE = ("--train.compile", "true", "--train.compile_backend", "aot_eager", "--profile.batch", "none",
           "--logging.peak_flops", "1e9")  # no CPU matmul probe: MFU is not under test
# layout -> (processes, trainer args, microbatches per batch, dp). One run per claim (CI time): the
# pipeline with FSDP2 under it (ZeRO-3; DDP with bf16 parameters, the CUDA default, is FSDP2 too) and
# the compiled chunked loss; tensor parallelism with sequence parallelism. Checkpointing under
# compile: test_trainer_speed.py; DDP and the other layouts compiled on NCCL: tests/gpu/test_gpu.py.
LAYOUTS = {
    "pp2-1f1b-x-zero3x2-chunked-loss": (4, ("--parallel.pp", "2", "--parallel.pp_schedule", "1f1b",
                                            "--parallel.sharding", "zero3", "--train.loss_chunks", "2"), 2, 2),
    "tp2-sequence-parallel": (2, ("--parallel.tp", "2"), 1, 1),
}
GRAPHS = re.compile(r"torch\.compile: (\d+) graph\(s\) compiled in the first step, (\d+) graph break\(s\)")


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_layout_equals_one_eager_process(tmp_path, layout):
    nproc, args, micro, dp = LAYOUTS[layout]
    metrics = run_layout(tmp_path, "llama", nproc, *args, *COMPILE, micro=micro, dp=dp)
    assert_equivalent(metrics, "llama")  # losses within 1e-5 of the single eager process
    for rank in range(nproc):
        log = (tmp_path / "logs" / f"rank{rank}.log").read_text()
        assert "blocks compiled in place" in log, log[-2000:]
        m = GRAPHS.search(log)
        assert m and int(m[1]) >= 1 and int(m[2]) == 0, log[-2000:]  # compiled code ran, in whole graphs
    if layout.startswith("tp2"):
        assert "sequence parallel norms and residual stream" in (tmp_path / "logs" / "rank0.log").read_text()


# ------------------------------------------------------------------ no silent eager


class _Breaks(nn.Module):
    """A block dynamo cannot trace whole (an explicit graph break)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        torch._dynamo.graph_break()
        return x * 2


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([_Breaks(), _Breaks()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.model.layers:
            x = b(x)
        return x


def test_a_graph_break_ends_the_run_with_compile_true():
    from trainer.parallel.compile import CompileError, compile_blocks

    torch.manual_seed(0)
    model = _Model()
    assert compile_blocks(model, mode="true", backend="eager") == 2
    with pytest.raises(CompileError, match=r"block model\.layers\.0 does not compile .*train\.compile try"):
        model(torch.randn(2, 4))


def test_compile_try_runs_the_blocks_eager_with_one_warning(caplog):
    from trainer.parallel.compile import blocks_running_eager, compile_blocks

    torch.manual_seed(0)
    model, ref = _Model(), _Model()
    ref.load_state_dict(model.state_dict())
    compile_blocks(model, mode="try", backend="eager")
    x = torch.randn(2, 4)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        for _ in range(2):
            out = model(x)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "block model.layers.0 does not compile" in warnings[0], warnings
    assert "all 2 blocks of this model run eager" in warnings[0]
    assert torch.equal(out, ref(x))
    assert blocks_running_eager(model) == ["model.layers.0", "model.layers.1"]


def test_blocks_compile_whole_with_static_shapes():
    """fullgraph + dynamic=False: one graph serves both blocks; another batch shape (evaluation)
    adds a second static graph, never a shape-generic one."""
    from torch._dynamo.utils import counters

    from trainer.config import ModelConfig
    from trainer.models import build_model, model_spec
    from trainer.parallel.compile import compile_blocks, compile_report

    mc = ModelConfig(preset="tiny-llama")
    model = build_model(model_spec(mc), mc, 0)
    compile_blocks(model, backend="eager")
    torch._dynamo.reset()
    counters.clear()
    model(input_ids=torch.randint(0, 500, (2, 16)))
    assert compile_report() == {"graphs": 1, "graph_breaks": 0}
    model(input_ids=torch.randint(0, 500, (3, 16)))
    assert compile_report()["graphs"] == 2
    model(input_ids=torch.randint(0, 500, (3, 16)))
    assert compile_report()["graphs"] == 2


# ------------------------------------------------------------------ the chunked loss, compiled


def test_peak_memory_falls_as_loss_chunks_grow():
    """The compiled LM head + loss in 1 and 8 chunks on a 8192-token vocabulary: the same loss and
    gradients, and the allocator's peak over forward + backward falls by at least half the fp32
    logits and their gradient (the eager chunks: test_trainer_speed.py)."""
    from bench.lm_loss import peak_cpu_bytes
    from trainer.config import ModelConfig
    from trainer.models import build_model, model_spec
    from trainer.models.lm_loss import compile_loss, install_loss_forward

    mc = ModelConfig(preset="tiny-llama", vocab_size=8192, num_hidden_layers=1)
    spec = model_spec(mc)
    x = torch.randint(0, 8192, (4, 128))
    results = {}
    for chunks in (1, 8):
        model = install_loss_forward(build_model(spec, mc, 0), chunks)
        compile_loss(model.lm_head, "aot_eager")
        model(input_ids=x, targets=x).backward()  # compiles outside the measured step
        model.zero_grad(set_to_none=True)
        out = {}

        def step(model=model, out=out) -> None:
            loss = model(input_ids=x, targets=x)
            loss.backward()
            out["loss"] = loss.detach()

        peak = peak_cpu_bytes(step)
        results[chunks] = (peak, out["loss"], model.lm_head.weight.grad.clone())
    (p1, l1, g1), (p8, l8, g8) = results[1], results[8]
    assert p1 - p8 > 2 * 4 * 128 * 8192 * 4 * 0.5, (p1, p8)
    assert torch.allclose(l8, l1, rtol=1e-6)
    assert torch.allclose(g8, g1, rtol=1e-4, atol=1e-6)


def test_loss_chunks_auto_sizes_chunks_by_logits_elements():
    from contract.memory import LOSS_CHUNK_ELEMENTS
    from trainer.config.checks import resolve_loss_chunks

    assert LOSS_CHUNK_ELEMENTS == 2 ** 28
    # qwen3-0.6b, batch 8 x 2048: 16384 x 151936 logits = 9.3 x 2^28 -> 16 equal chunks of 1024 tokens
    assert resolve_loss_chunks("auto", "causal_lm", 151936, 8 * 2048) == 16
    assert resolve_loss_chunks("auto", "causal_lm", 151936, 32 * 2048) == 64   # grows with the batch
    assert resolve_loss_chunks("auto", "causal_lm", 49152, 4 * 2048) == 2      # smollm-1.7b, batch 4
    assert resolve_loss_chunks("auto", "causal_lm", 49152, 1 * 2048) == 1
    assert resolve_loss_chunks("auto", "causal_lm", 512, 128) == 1
    assert resolve_loss_chunks("auto", "causal_lm", 2 * 10 ** 6, 3 * 7 * 11) == 3  # 1.7 -> 2 -> first divisor: 3
    assert resolve_loss_chunks("auto", "mae", 0, 64) == 1
    assert resolve_loss_chunks(3, "causal_lm", 512, 128) == 3
