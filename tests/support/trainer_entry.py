"""The trainer's entry point as a script, for `torchrun --start-method fork --run-path` (the
warm launches of tests/support/trainer_zygote.py: workers forked from a torchrun that has the trainer
imported run the same `trainer.cli.main` that `torchrun -m trainer` runs in a new interpreter)."""

import sys

from trainer.cli import main

raise SystemExit(main(sys.argv[1:]))
