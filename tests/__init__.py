"""The test suite. Helpers (never test modules) are what tests import: runner_helpers.py (the
runner CLI, sandbox nodes, images, waiting), trainer_run.py (launching the trainer, metrics,
checkpoints, holding a run at a step), parallel_equiv.py (layout equivalence); fixtures are in
conftest.py. REPO, the checkout's root, is defined here once."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The trainer image of this pytest session: a tag of its own (built from the checkout by the
# `trainer_image` fixture, removed at the end), so a second suite on this machine (another
# checkout, CI beside a developer) building other code cannot move the tag under this one.
IMAGE = os.environ.get("RUNNER_TEST_IMAGE") or f"runner-trainer:test-{os.getpid()}"
