"""Exact resume for every layout (losses compared with ==: CPU, fp32, one thread per process).

The issue's four layouts (ddp, zero3, pp=2 1f1b, tp=2): 6 steps straight vs a SEPARATE run that
ends after step 3 (train.exit_interval, same 6-step LR schedule) and is resumed with the same
command plus `--resume latest` for steps 4-6. The other layouts (zero2 with async saves,
zero3_hybrid 2x2, tp=2 x dp=2 zero3, pp=2 interleaved with 2 virtual stages per rank) resume
from the straight run's own step-3 checkpoint, one launch fewer each: that checkpoint is what
a run stopped at step 3 leaves, as the first group shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.trainer_run import losses, read_metrics, run_trainer

pytestmark = pytest.mark.multiproc

TINY = ("configs/tiny.yaml", "--train.steps", "6", "--checkpoint.interval", "3")

# layout -> (args, processes)
LAYOUTS = {
    "ddp": (("--parallel.sharding", "ddp"), 2),
    "zero3": (("--parallel.sharding", "zero3"), 2),
    "pp2_1f1b": (("--parallel.pp", "2", "--parallel.pp_schedule", "1f1b", "--train.microbatch_num", "2"), 2),
    "tp2": (("--parallel.tp", "2"), 2),
    # the straight run's periodic checkpoints are written in the background: resume from one
    "zero2_async": (("--parallel.sharding", "zero2", "--checkpoint.async_save", "true"), 2),
    "zero3_hybrid": (("--parallel.sharding", "zero3_hybrid", "--parallel.dp_shard", "2"), 4),
    "tp2_dp2_zero3": (("--parallel.tp", "2", "--parallel.sharding", "zero3"), 4),
    "pp2_interleaved": (("--parallel.pp", "2", "--parallel.pp_schedule", "interleaved1f1b",
                         "--parallel.virtual_stages", "2", "--train.microbatch_num", "2",
                         "--model.num_hidden_layers", "4"), 2),
}
REAL_STOP = ("ddp", "zero3", "pp2_1f1b", "tp2")


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """The 6-step run of a layout (checkpoints at steps 3 and 6), run once per module."""
    done: dict[str, Path] = {}

    def get(layout: str) -> Path:
        if layout not in done:
            args, nproc = LAYOUTS[layout]
            done[layout] = tmp_path_factory.mktemp(f"straight-{layout}")
            run_trainer(done[layout], *TINY, *args, nproc=nproc)
        return done[layout]

    return get


def _check_step3(ckpts: Path, nproc: int) -> None:
    step3 = ckpts / "step-3"
    state = json.loads((step3 / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["data"]["consumed"] == 3 * state["data"]["global_batch"]
    # Every rank wrote its shard set and its RNG/data file.
    for r in range(nproc):
        assert (step3 / f"rank{r}.pt").is_file() and (step3 / f"manifest.rank{r}.json").is_file()
    assert len(list(step3.glob("__*_*.distcp"))) == nproc


# CI: one layout per kind of checkpoint (DDP, FSDP2, async, a pipeline, TP x FSDP2 DTensors); the
# rest (tp2 alone, hybrid, interleaved stages) in the slow tier, RUN_SLOW=1.
SLOW_LAYOUTS = {"tp2", "zero3_hybrid", "pp2_interleaved"}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_LAYOUTS else k
                                    for k in LAYOUTS])
def test_resume_is_bitwise_equal(tmp_path, straight_run, layout):
    args, nproc = LAYOUTS[layout]
    straight, resumed = straight_run(layout), tmp_path / "resumed"
    full = losses(straight)
    assert len(full) == 6
    ckpts = straight / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-6"
    _check_step3(ckpts, nproc)

    if layout in REAL_STOP:
        stop = (*TINY, *args, "--train.exit_interval", "3")
        run_trainer(resumed, *stop, nproc=nproc)
        assert (resumed / "checkpoints" / "latest").read_text().strip() == "step-3"
        _check_step3(resumed / "checkpoints", nproc)
        assert losses(resumed) == full[:3]
        run_trainer(resumed, *stop, "--resume", "latest", nproc=nproc)
        assert [m["step"] for m in read_metrics(resumed)] == [1, 2, 3, 4, 5, 6]
        assert losses(resumed) == full
    else:
        run_trainer(resumed, *TINY, *args, "--resume", str(ckpts / "step-3"), nproc=nproc)
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
