"""The Perseus families at test size on gloo: T5 (encoder-decoder, tuples between stages), BLOOM
(ALiBi) and Wide-ResNet (4-D activations, BatchNorm) give one process's losses (1e-5, CPU fp32)
in every layout, resume bit for bit, and write the Perseus timing CSVs.

Per family, five layouts besides the single-process reference:
- pp=2 x dp=2 ZeRO-3, 1F1B, partition written in Merak's items, --export_timing_csv (4 ranks);
- pp=4 GPipe, one unit per stage, with an evaluation (4 ranks): for T5 every payload kind
  crosses a boundary (encoder hidden + bias, encoder output, decoder hidden + encoder output + bias);
- ZeRO-3 x 2 on the whole model (2 ranks);
- DDP x 2, checkpoints every 2 steps, with an evaluation (2 ranks);
- DDP x 2 resumed from that run's step-2 checkpoint: steps 3-4, evaluation included, bit for bit.
Every layout splits the global batch of 8 into microbatches of 2 samples, as the reference does:
BatchNorm normalises over a microbatch, so Wide-ResNet's numbers depend on that split.

A tiny run spends ~90% of its CPU starting Python, torch and transformers, so the runs of one
world size share processes (tests/support/trainer_run.py:run_trainers): the three references in one
process, every 4-rank run in one torchrun, every 2-rank run in another: 3 launches, not 18.
Each run is still the trainer's entry point with its own output directory; a run that inherited
anything from the one before it would leave one process's numbers.
"""

from __future__ import annotations

import csv
import math
from collections import Counter
from pathlib import Path

import pytest

from tests.support.parallel_equiv import assert_equivalent, layout_args, references
from tests.support.trainer_run import numeric_metrics, read_metrics, run_trainers

pytestmark = pytest.mark.multiproc

FAMILIES = ["t5", "bloom", "wide_resnet"]
MICRO = 4  # the reference's microbatches: 8 samples in microbatches of 2
EVAL = ("--train.eval_interval", "4", "--train.eval_batches", "1")
QUIET = ("--profile.batch", "none")  # no torch-profiler trace where none is checked
# family -> pp=2 partition in Merak's items (tiny-t5: 12 items, tiny-bloom 6, tiny-wide-resnet 5)
MERAK_PP2 = {
    "t5": ("custom:0,3,12", "stage 0 (pp rank 0): embedding + encoder 0 (1 blocks",
           "stage 1 (pp rank 1): encoder 1 + decoder 0-1 + norm + head (3 blocks"),
    "bloom": ("custom:0,3,6", "stage 0 (pp rank 0): embeddings + layers 0-1 (2 layers",
              "stage 1 (pp rank 1): layers 2-3 + norm + head (2 layers"),
    "wide_resnet": ("custom:0,3,5", "stage 0 (pp rank 0): stem + bottlenecks 0-2 (3 bottlenecks",
                    "stage 1 (pp rank 1): bottleneck 3 + pool + fc (1 bottlenecks"),
}
PP4_LINES = {
    "t5": ["embedding + encoder 0", "encoder 1", "decoder 0", "decoder 1 + norm + head"],
    "bloom": ["embeddings + layer 0", "layer 1", "layer 2", "layer 3 + norm + head"],
    "wide_resnet": ["stem + bottleneck 0", "bottleneck 1", "bottleneck 2", "bottleneck 3 + pool + fc"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every layout of every family, in the directory this returns (`<family>-<layout>`)."""
    base = tmp_path_factory.mktemp("perseus")
    references(FAMILIES, micro=MICRO)
    four = []
    for f in FAMILIES:
        four.append((base / f"{f}-pp2_zero3", layout_args(
            f, "--parallel.pp", "2", "--parallel.sharding", "zero3", "--parallel.partition", MERAK_PP2[f][0],
            "--export_timing_csv", "true", "--num_prof_steps", "2", "--profile.batch", "1", dp=2, micro=2)))
        four.append((base / f"{f}-pp4_gpipe", layout_args(
            f, "--parallel.pp", "4", "--parallel.pp_schedule", "gpipe", *EVAL, *QUIET, micro=4)))
    two = []
    for f in FAMILIES:
        two.append((base / f"{f}-zero3", layout_args(f, "--parallel.sharding", "zero3", *QUIET, dp=2, micro=2)))
        two.append((base / f"{f}-ddp", layout_args(f, "--parallel.sharding", "ddp", "--checkpoint.interval", "2",
                                                   *EVAL, *QUIET, dp=2, micro=2)))
    for f in FAMILIES:  # after the other runs in the same processes: a fresh start is all the checkpoint gives
        two.append((base / f"{f}-ddp_resumed", layout_args(
            f, "--parallel.sharding", "ddp", "--resume", str(base / f"{f}-ddp" / "checkpoints" / "step-2"),
            *EVAL, *QUIET, dp=2, micro=2)))
    run_trainers(four, nproc=4)
    run_trainers(two, nproc=2)
    return base


@pytest.mark.parametrize("family", FAMILIES)
def test_perseus_family_layouts_equal_one_process_and_resume_bitwise(runs, family):
    # pp=2 x dp=2 ZeRO-3, 1F1B, Merak-item partition, timing CSVs
    out = runs / f"{family}-pp2_zero3"
    assert_equivalent(read_metrics(out), family, micro=MICRO)
    log = (out / "logs" / "rank0.log").read_text()
    assert MERAK_PP2[family][1] in log and MERAK_PP2[family][2] in log, log
    assert "read as item boundaries" in log
    _check_timing_csvs(out, stages=2, ranks=4, microbatches=2, steps=2)

    # pp=4 GPipe, one unit per stage; an evaluation after the last step passes every payload too
    out = runs / f"{family}-pp4_gpipe"
    metrics = read_metrics(out)
    assert_equivalent(metrics, family, micro=MICRO)
    pp_eval = metrics[-1]["eval_loss"]
    assert math.isfinite(pp_eval) and pp_eval > 0
    log = (out / "logs" / "rank0.log").read_text()
    for s, holds in enumerate(PP4_LINES[family]):
        assert f"stage {s} (pp rank {s}): {holds} (1 " in log, log

    # ZeRO-3 x 2 on the whole model (FSDP2 units: T5 blocks of both stacks, BLOOM blocks, bottlenecks)
    assert_equivalent(read_metrics(runs / f"{family}-zero3"), family, micro=MICRO)

    # DDP x 2 with checkpoints, then resumed from step 2: bit for bit
    straight, resumed = runs / f"{family}-ddp", runs / f"{family}-ddp_resumed"
    metrics = read_metrics(straight)
    assert_equivalent(metrics, family, micro=MICRO)
    if family != "wide_resnet":  # BatchNorm evaluates with each layout's own running statistics
        assert abs(metrics[-1]["eval_loss"] - pp_eval) <= 1e-5 * pp_eval
    assert numeric_metrics(resumed) == numeric_metrics(straight)[2:]
    assert [r["step"] for r in numeric_metrics(resumed)] == [3, 4]
    assert "eval_loss" in numeric_metrics(resumed)[-1]


def _check_timing_csvs(out: Path, stages: int, ranks: int, microbatches: int, steps: int) -> None:
    """Perseus' files: per rank the instruction log (forward/backward of its stage, every microbatch
    of the profiled steps) and the energy file; profile.csv with forward and backward per stage."""
    for rank in range(ranks):
        with (out / f"instructions-{rank}.csv").open() as f:
            rows = list(csv.DictReader(f))
        kinds = Counter(r["instruction"] for r in rows)
        assert kinds["forward_microstep"] == kinds["backward_microstep"] == microbatches * steps, (rank, kinds)
        assert {int(r["stage"]) for r in rows if r["stage"]} == {rank // (ranks // stages)}
        assert (out / f"time-energy-{rank}.csv").is_file()
    with (out / "profile.csv").open() as f:
        prof = list(csv.DictReader(f))
    assert {(int(r["stage"]), r["instruction"]) for r in prof} >= {
        (s, k) for s in range(stages) for k in ("forward", "backward")}
    assert all(float(r["time"]) > 0 for r in prof)
