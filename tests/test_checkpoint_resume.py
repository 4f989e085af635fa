"""Exact resume for every layout: 6 steps straight (saving at step 3) vs resume from step 3 + 3.

The straight run's step-3 checkpoint is exactly what a run stopped at step 3 leaves (the LR
horizon is the 6-step run's either way); stopping a run for real is covered by the SIGTERM test.
Losses are compared with == (CPU, fp32, one thread per process).
"""

from __future__ import annotations

import json
from pathlib import Path

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


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """The 6-step 2-process run of a layout (checkpoints at steps 3 and 6), run once per module."""
    done: dict[str, Path] = {}

    def get(layout: str) -> Path:
        if layout not in done:
            done[layout] = tmp_path_factory.mktemp(f"straight-{layout}")
            run_trainer(done[layout], *TINY, *LAYOUTS[layout], nproc=2)
        return done[layout]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_is_bitwise_equal(tmp_path, straight_run, layout):
    straight, resumed = straight_run(layout), tmp_path / "resumed"
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


@pytest.mark.parametrize("layout, one_proc", [
    # zero3 on 2 ranks (4 samples each) -> 1 process with the same global batch of 8
    ("zero3", ("--parallel.sharding", "zero3", "--train.batch_size", "8")),
    # pp=2 -> pp=1: the stage shards carry the full model's parameter names
    ("pp2_1f1b", ("--train.microbatch_num", "2")),
])
def test_reshard_to_one_process(tmp_path, straight_run, layout, one_proc):
    straight = straight_run(layout)
    out = tmp_path / "one"
    proc = run_trainer(out, *TINY, *one_proc, "--resume", str(straight / "checkpoints" / "step-3"))
    assert "RNG states not restored" in proc.stdout + proc.stderr  # 2 ranks -> 1: said, not silent
    resumed, expected = losses(out), losses(straight)[3:]
    assert len(resumed) == 3
    assert resumed[0] == pytest.approx(expected[0], rel=1e-5)
    assert resumed == pytest.approx(expected, rel=1e-4)


def test_global_batch_that_cannot_continue_is_one_error(tmp_path, straight_run):
    """24 samples consumed (3 steps x 8) cannot be continued with a global batch of 5."""
    straight = straight_run("zero3")
    proc = run_trainer(tmp_path / "bad", *TINY, "--train.batch_size", "5", "--train.microbatch_num", "1",
                       "--resume", str(straight / "checkpoints" / "step-3"), check=False)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "not a multiple of this run's global batch 5" in lines[0], proc.stderr[-2000:]
