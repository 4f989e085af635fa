"""Test support, not a user feature: hold every rank at a known point of a run until a test says go.

    TRAINER_TEST_HOLD="POINT:STEP[,POINT:STEP...]"

POINT is `step` (step STEP has ended, its periodic checkpoint is written, the next step has not
begun; a preemption signal that arrives now stops the run after step STEP+1) or `save`
(checkpoint STEP is written by every rank but not yet renamed into place: a kill now leaves a
half-made checkpoint). At a held point each rank writes OUTPUT_DIR/.hold/POINT-STEP.held.rank<R>
and waits for OUTPUT_DIR/.hold/POINT-STEP.go; while it waits, once a preemption signal has reached
it, it writes POINT-STEP.signalled.rank<R>, so a test knows the signal landed before it says go.

This replaces sleeps a test had to hit ("send the signal within these 10 s"): a test waits on
files instead of time.

Switched on only where test code is: a process reads TRAINER_TEST_* (this hold, and the clock skew
of trainer/profiling/clocks.py) only once it has imported SWITCH_MODULE, a module that exists in
tests/hooks/ alone. The tests give it to every trainer they start through PYTHONPATH and
tests/hooks/sitecustomize.py (a runner job: `job.sync` of that folder, tests/support/trainer_run.py
`hold_env`, `HOOKS_SYNC`). The image, the runner and a user's job never carry it, so these
variables in a job's env (an inventory someone handed you) do nothing: before, one value of
TRAINER_TEST_HOLD held every rank forever.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from trainer.config import ConfigError

ENV = "TRAINER_TEST_HOLD"
SWITCH_MODULE = "trainer_test_hooks"  # tests/hooks/trainer_test_hooks.py
POINTS = ("step", "save")
POLL_S = 0.05


def enabled() -> bool:
    """Whether this process has the tests' switch (module doc)."""
    return SWITCH_MODULE in sys.modules


def test_env(name: str, environ: Mapping[str, str] | None = None) -> str:
    """A TRAINER_TEST_* variable of `environ`, or of this process's env where test support is
    switched on; "" everywhere else."""
    if environ is None:
        if not enabled():
            return ""
        environ = os.environ
    return environ.get(name, "")


def held_points(environ: Mapping[str, str] | None = None) -> set[tuple[str, int]]:
    spec = test_env(ENV, environ)
    out = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, step = item.partition(":")
        if point not in POINTS or not (step.isascii() and step.isdigit()) or len(step) > 18:
            raise ConfigError(f"{ENV}: '{item[:40]}' is not POINT:STEP with POINT one of {', '.join(POINTS)}")
        out.add((point, int(step)))
    return out


def hold(point: str, step: int, output_dir: str | Path, rank: int,
         signalled: Callable[[], bool] = lambda: False) -> None:
    """Wait here if the tests ask for (point, step); return at once otherwise."""
    if not enabled() or (point, step) not in held_points():
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
