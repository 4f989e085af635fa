"""Exact resume for every layout: 6 steps straight (saving at step 3) vs resume from step 3 + 3.

The straight run's step-3 checkpoint is exactly what a run stopped at step 3 leaves (the LR
horizon is the 6-step run's either way); stopping a run for real is covered by the SIGTERM test.
Losses are compared with == (CPU, fp32, one thread per process).
"""

from __future__ import annotations

import json

import pytest

from tests.trainer_run import losses, run_trainer

pytestmark = pytest.mark.multiproc

TINY = ("configs/tiny.yaml", "--train.steps", "6", "--checkpoint.interval", "3")

LAYOUTS = {
    "ddp": ("--parallel.sharding", "ddp"),
    "zero3": ("--parallel.sharding", "zero3"),
    "pp2_1f1b": ("--parallel.pp", "2", "--parallel.pp_schedule", "1f1b", "--train.microbatch_num", "2"),
    "tp2": ("--parallel.tp", "2"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_is_bitwise_equal(tmp_path, layout):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_trainer(straight, *TINY, *LAYOUTS[layout], nproc=2)
    ckpts = straight / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-6"
    step3 = ckpts / "step-3"
    state = json.loads((step3 / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["data"]["consumed"] == 3 * state["data"]["global_batch"]
    # Every rank wrote its shard set and its RNG/data file.
    for r in range(2):
        assert (step3 / f"rank{r}.pt").is_file() and (step3 / f"manifest.rank{r}.json").is_file()
    assert len(list(step3.glob("__*_*.distcp"))) == 2

    run_trainer(resumed, *TINY, *LAYOUTS[layout], "--resume", str(step3), nproc=2)
    full = losses(straight)
    assert len(full) == 6
    assert losses(resumed) == full[3:]
    # The resumed run continues the step count and the token count.
    assert (resumed / "checkpoints" / "latest").read_text().strip() == "step-6"
    end = json.loads((resumed / "checkpoints" / "step-6" / "trainer_state.json").read_text())
    assert end["tokens_seen"] == json.loads((ckpts / "step-6" / "trainer_state.json").read_text())["tokens_seen"]
