"""PP x DP and DP x TP x PP on one DeviceMesh through the real `trainer` equal a single process."""

from __future__ import annotations

import pytest

from tests.support.parallel_equiv import assert_equivalent, run_layout

pytestmark = pytest.mark.multiproc


# BERT: the two DP ranks (and the microbatches) hold different numbers of masked tokens, so the
# last stage must divide by the global count, not its own (Parallelized.loss_denominator).
# CI runs BERT x ZeRO-3 (the unequal counts and sharded stages at once); RUN_SLOW=1 the Llama ones.
@pytest.mark.parametrize("model,sharding", [pytest.param("llama", "zero3", marks=pytest.mark.slow),
                                            pytest.param("llama", "ddp", marks=pytest.mark.slow), ("bert", "zero3")])
def test_pp2_x_dp2(tmp_path, model, sharding):
    m = run_layout(tmp_path, model, 4, "--parallel.pp", "2", "--parallel.sharding", sharding, dp=2, micro=2)
    assert_equivalent(m, model)


def test_dp2_x_tp2_x_pp2_eight_processes(tmp_path):
    # Tied Qwen3: the tied-gradient sync runs per (dp, tp) coordinate over sharded DTensor grads.
    m = run_layout(tmp_path, "qwen3", 8, "--parallel.pp", "2", "--parallel.tp", "2",
                   "--parallel.sharding", "zero3", dp=2, micro=2)
    assert_equivalent(m, "qwen3")
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "world 8 = pp 2 x dp 2 (replicate 1 x shard 2) x tp 2" in log
