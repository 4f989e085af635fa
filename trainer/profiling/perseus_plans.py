"""`trainer perseus-plans RUN_DIR --frequency MHZ [...]`: Perseus plan files from a run's CSVs.

A plan lists, per rank, (instruction, MHz) pairs in the order the rank runs its forward and
backward instructions in one step. That order is in the instructions-{rank}.csv files of a run
with `--export_timing_csv` (forward_microstep / backward_microstep rows, with stage and
microbatch): the first step of each rank's rows is taken, and every later step must repeat it.
One file is written per frequency, every instruction at that frequency (the sweep that gives
profile.csv its per-frequency rows); `--stage-frequencies` writes one plan with a frequency per
stage instead. Serve them with job.perseus (scheduler PlanSequence for a list, PointSolution for
one) or `python -m runner.agents.perseus_server --plan ...`.
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

from trainer.config import ConfigError

NAMES = {"forward_microstep": "forward", "backward_microstep": "backward"}
SPLIT = ("backward_input_microstep", "backward_weight_microstep")


def rank_order(path: Path) -> list[tuple[str, int, int]]:
    """(instruction, stage, microbatch) of one step of this rank, from its instructions CSV."""
    rows, split = [], False
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
            name = row.get("instruction", "")
            split |= name in SPLIT
            if name in NAMES:
                try:
                    start, stage, mb = float(row["start"]), int(row["stage"]), int(row["microbatch"])
                    if not math.isfinite(start) or stage < 0 or mb < 0:
                        raise ValueError(f"start {start}, stage {stage}, microbatch {mb}")
                except (KeyError, TypeError, ValueError) as e:
                    raise ConfigError(f"{path}:{reader.line_num}: not a timing row ({' '.join(str(e).split())[:100]}); "
                                      "export it again with --export_timing_csv") from None
                rows.append((start, NAMES[name], stage, mb))
    if split:
        raise ConfigError(f"{path}: the schedule splits backward into input and weight parts; Perseus plans "
                          f"name forward and backward only")
    seq = [(n, s, m) for _, n, s, m in sorted(rows)]
    if not seq:
        raise ConfigError(f"{path}: no forward_microstep/backward_microstep rows (run with --export_timing_csv)")
    step = []
    for key in seq:
        if key in step:
            break
        step.append(key)
    for i in range(0, len(seq), len(step)):
        if seq[i:i + len(step)] != step[:len(seq) - i]:
            raise ConfigError(f"{path}: recorded steps differ in instruction order (row {i}); plans need one order")
    return step


def orders(run_dir: Path) -> list[list[tuple[str, int, int]]]:
    files = list(run_dir.glob("instructions-*.csv"))
    for p in files:
        if not (p.stem.rsplit("-", 1)[1].isascii() and p.stem.rsplit("-", 1)[1].isdigit()):
            raise ConfigError(f"{p}: not an instructions-<rank>.csv name; move it out of {run_dir}")
    files.sort(key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    if not files:
        raise ConfigError(f"{run_dir}: no instructions-{{rank}}.csv (run the job with --export_timing_csv)")
    ranks = [int(p.stem.rsplit("-", 1)[1]) for p in files]
    if ranks != list(range(len(ranks))):
        raise ConfigError(f"{run_dir}: instructions CSVs of ranks {ranks}; every rank 0..N-1 is needed "
                          f"(collect every node's files into one directory)")
    return [rank_order(p) for p in files]


def render(plan: list[list[tuple[str, int]]]) -> str:
    """The plan file: a Python literal, one line per rank."""
    return "[\n" + "".join(f"    {[tuple(p) for p in rank]!r},\n" for rank in plan) + "]\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="trainer perseus-plans", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path, help="a run's output dir holding instructions-{rank}.csv")
    p.add_argument("--frequency", type=int, action="append", default=[], metavar="MHZ",
                   help="one plan with every instruction at MHZ (repeat for a sweep)")
    p.add_argument("--stage-frequencies", metavar="MHZ,MHZ,...",
                   help="one plan with stage s at the s-th frequency")
    p.add_argument("--out", type=Path, default=None, help="directory for the plan files (default RUN_DIR/plans)")
    args = p.parse_args(argv)
    if not args.frequency and not args.stage_frequencies:
        p.error("give --frequency MHZ (repeatable) or --stage-frequencies")
    ords = orders(args.run_dir)
    out = args.out or args.run_dir / "plans"
    out.mkdir(parents=True, exist_ok=True)
    plans: dict[str, list[list[tuple[str, int]]]] = {}
    for mhz in args.frequency:
        plans[f"plan-{mhz}.py"] = [[(n, mhz) for n, _, _ in o] for o in ords]
    if args.stage_frequencies:
        per = [int(x) for x in args.stage_frequencies.split(",")]
        stages = {s for o in ords for _, s, _ in o}
        if len(per) <= max(stages):
            raise ConfigError(f"--stage-frequencies: {len(per)} given, the run has stages 0..{max(stages)}")
        plans["plan-stages.py"] = [[(n, per[s]) for n, s, _ in o] for o in ords]
    for name, plan in plans.items():
        (out / name).write_text(render(plan))
        print(out / name)
    return 0
