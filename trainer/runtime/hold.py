"""Test support, not a user feature: hold every rank at a known point of a run until a test says go.

    TRAINER_TEST_HOLD="POINT:STEP[,POINT:STEP...]"

POINT is `step` (step STEP has ended, its periodic checkpoint is written, the next step has not
begun; a preemption signal that arrives now stops the run after step STEP+1) or `save`
(checkpoint STEP is written by every rank but not yet renamed into place: a kill now leaves a
half-made checkpoint). At a held point each rank writes OUTPUT_DIR/.hold/POINT-STEP.held.rank<R>
and waits for OUTPUT_DIR/.hold/POINT-STEP.go; while it waits, once a preemption signal has reached
it, it writes POINT-STEP.signalled.rank<R>, so a test knows the signal landed before it says go.

This replaces sleeps a test had to hit ("send the signal within these 10 s"): a test waits on
files instead of time. Shipped in the image so the sandbox tests can hold a containerized run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

ENV = "TRAINER_TEST_HOLD"
POINTS = ("step", "save")
POLL_S = 0.05


def held_points(environ: dict[str, str] | None = None) -> set[tuple[str, int]]:
    spec = (os.environ if environ is None else environ).get(ENV, "")
    out = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, step = item.partition(":")
        if point not in POINTS or not step.isdigit():
            raise ValueError(f"{ENV}: '{item}' is not POINT:STEP with POINT one of {', '.join(POINTS)}")
        out.add((point, int(step)))
    return out


def hold(point: str, step: int, output_dir: str | Path, rank: int,
         signalled: Callable[[], bool] = lambda: False) -> None:
    """Wait here if the environment asks for (point, step); return at once otherwise."""
    if (point, step) not in held_points():
        return
    d = Path(output_dir) / ".hold"
    d.mkdir(parents=True, exist_ok=True)
    name = f"{point}-{step}"
    (d / f"{name}.held.rank{rank}").write_text(str(time.time()))
    noted = False
    while not (d / f"{name}.go").exists():
        if not noted and signalled():
            (d / f"{name}.signalled.rank{rank}").write_text(str(time.time()))
            noted = True
        time.sleep(POLL_S)
