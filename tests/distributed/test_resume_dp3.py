"""Exact resume at dp=3: what an uninterrupted run logs and holds after each step, a run stopped
and resumed in a new process logs and holds too, bit for bit.

Three ranks, because with two a sum is the same in any order (a+b == b+a): with three, DDP's
first step in a process reduces its gradients in another bucket layout than later steps, and a
ring all-reduce then adds them in another order (found here: a resumed run drifted by 2 ulps in
the loss and in 58 of 84 tensors; trainer/parallel/ordered_reduce.py). Every logged metric but
the timings is compared with ==, and every model and optimizer tensor of the checkpoint written
after each resumed step with torch.equal.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.trainer_run import checkpoint_tensors, numeric_metrics, run_trainer

pytestmark = pytest.mark.multiproc

STEPS, STOP = 5, 2
JOB = ("--config", "configs/tiny.yaml", "--train.steps", str(STEPS), "--checkpoint.interval", "1",
       "--checkpoint.keep_last", str(STEPS + 1))
# layout -> (args, processes); all at dp=3
LAYOUTS = {
    "ddp": (("--parallel.sharding", "ddp"), 3),
    "zero2": (("--parallel.sharding", "zero2"), 3),
    "zero3": (("--parallel.sharding", "zero3"), 3),
    "pp2_dp3": (("--parallel.pp", "2", "--train.microbatch_num", "2"), 6),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resumed_run_equals_uninterrupted_bitwise(tmp_path, layout):
    args, nproc = LAYOUTS[layout]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_trainer(straight, *JOB, *args, nproc=nproc)
    run_trainer(resumed, *JOB, *args, "--train.exit_interval", str(STOP), nproc=nproc)
    assert (resumed / "checkpoints" / "latest").read_text().strip() == f"step-{STOP}"
    run_trainer(resumed, *JOB, *args, "--resume", "latest", nproc=nproc)

    want, got = numeric_metrics(straight), numeric_metrics(resumed)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(want, got, strict=True):
        assert a == b, f"step {a['step']}: uninterrupted {a} != resumed {b}"

    for step in range(STOP + 1, STEPS + 1):
        a = checkpoint_tensors(straight / "checkpoints" / f"step-{step}")
        b = checkpoint_tensors(resumed / "checkpoints" / f"step-{step}")
        assert a.keys() == b.keys() and len(a) > 10
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        assert not differ, f"after step {step}: {len(differ)} of {len(a)} tensors differ, e.g. {differ[:3]}"
