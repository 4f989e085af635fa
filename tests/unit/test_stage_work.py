"""The work a rank's busy time is divided by before the straggler rule compares ranks (issue 57,
trainer/runtime/progress.py compute_work): each pipeline stage's forward + backward FLOPs per token,
so a stage's work follows what it really computes. Checked on the reduced Pi pipeline
(configs/pi-qwen3-3stage-tiny.yaml: Qwen3, 7 layers, hidden 64, 4 heads x 16, vocabulary 512, tied
LM head) as the straggler sandbox test runs it (uniform_transformer: layers 0-2 | 3-4 | 5-6 + norm +
head, seq_len 256), against torch's own FLOP count."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from contract import hang as rule
from trainer.config.schema import ModelConfig
from trainer.models.build import build_model, model_spec
from trainer.parallel.pipeline import plan_ranges
from trainer.parallel.stages import split_model
from trainer.runtime.progress import attention_layers, compute_work, matmul_params

SEQ = 256
LAYER = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64 + 2 * 16  # q, o | k, v (2 KV heads) | MLP | norms
HEAD = 512 * 64                     # the last stage's own copy of the tied embedding, as a Linear
ATTN = 12 * 64 * SEQ                # per attention layer per token: scores and weighted sum, fwd + bwd


@pytest.fixture(scope="module")
def stages():
    mc = ModelConfig(preset="tiny-qwen3", num_hidden_layers=7)
    spec = model_spec(mc, 512)
    full = build_model(spec, mc, 0)
    full.config._attn_implementation = "eager"  # attention as matmuls: FlopCounterMode counts them
    parts, _ = split_model(full, plan_ranges(full, "uniform_transformer", 3))
    return spec, [parts[s] for s in range(3)]


def test_each_stage_s_work_is_its_forward_and_backward_flops_per_token(stages):
    spec, parts = stages
    assert LAYER == 37024 and spec.attention_width == 64
    assert [matmul_params([p]) for p in parts] == [3 * LAYER, 2 * LAYER, 2 * LAYER + 64 + HEAD]
    assert [attention_layers([p]) for p in parts] == [3, 2, 2]
    work = [compute_work([p], spec.attention_width, SEQ) for p in parts]
    assert work == [6 * 3 * LAYER + 3 * ATTN, 6 * 2 * LAYER + 2 * ATTN, 6 * (2 * LAYER + 64 + HEAD) + 2 * ATTN]
    assert work == [1256256, 837504, 1034496]
    # The LM head stage against a plain 2-layer one: 1.235x by FLOPs; the parameter count (the old
    # measure) said 1.443x, so a last stage on a third of a CPU looked 1.17x faster than it was.
    assert work[2] / work[1] == pytest.approx(1.2352, abs=1e-4)
    assert matmul_params([parts[2]]) / matmul_params([parts[1]]) == pytest.approx(1.4434, abs=1e-4)


def test_the_work_agrees_with_torch_s_flop_count(stages):
    """torch counts every matmul of a forward + backward of one sample; the estimate misses only the
    norms' elementwise work: within 0.3% on each stage, where the parameter count's ratios between
    stages were up to 17% off."""
    spec, parts = stages
    ids = torch.randint(0, 512, (1, SEQ), generator=torch.Generator().manual_seed(0))
    x: torch.Tensor = ids
    counted = []
    for s, part in enumerate(parts):
        inp = x.detach().requires_grad_() if s else x
        fc = FlopCounterMode(display=False)
        with fc:
            out = part(inp, targets=ids) if s == 2 else part(inp)
            (out if s == 2 else out.sum()).backward()
        counted.append(fc.get_total_flops() / SEQ)
        x = out
    work = [compute_work([p], spec.attention_width, SEQ) for p in parts]
    for w, c in zip(work, counted, strict=True):
        assert abs(w - c) / c < 0.003, (work, counted)
    # Per unit of work, equal speed is slowness 1.0 for every stage; the parameter count put the
    # head stage at 0.86x of the others' median although it ran no faster.
    assert rule.slowness(counted, [float(w) for w in work]) == pytest.approx([1.0, 1.0, 1.0], abs=0.01)
    old = rule.slowness(counted, [float(matmul_params([p])) for p in parts])
    assert old[2] == pytest.approx(0.856, abs=0.005)


def test_attention_blocks_are_counted_once_per_block():
    """BERT's attention wraps its self-attention (one block, not two); T5's decoder blocks hold
    self and cross attention (two each); the pipeline's other families one per layer."""
    for preset, want in (("tiny-bert", 2), ("tiny-t5", 2 + 2 * 2), ("tiny-gpt2", 2), ("tiny-llama", 2)):
        mc = ModelConfig(preset=preset)
        assert attention_layers([build_model(model_spec(mc, 512), mc, 0)]) == want, preset


def test_a_third_of_a_cpu_on_the_head_stage_is_flagged_with_flops_not_with_parameters():
    """The sandbox's measured case, stage by stage: busy time in proportion to each stage's FLOPs,
    the other two at the speed a busy 2-core machine leaves them (0.55 CPU), node-2 at a third: per
    FLOP it is 1.65x the others' median, a straggler; per parameter it was 1.41x, under the rule
    (the parameter count scales every slowness of the head stage by 0.856)."""
    work = [1256256.0, 837504.0, 1034496.0]
    params = [3.0 * LAYER, 2.0 * LAYER, 2.0 * LAYER + 64 + HEAD]
    busy = [w / s for w, s in zip(work, (0.55, 0.55, 1 / 3), strict=True)]
    s = rule.Stragglers(rule.STRAGGLER_FACTOR, 1)
    assert s.update(busy, work) == [(2, pytest.approx(1.65))]
    old = rule.slowness(busy, params)
    assert old[2] == pytest.approx(1.412, abs=0.005) and old[2] < rule.STRAGGLER_FACTOR
