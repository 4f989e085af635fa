"""Test support: Python imports `sitecustomize` at start-up from its path, so every process started
with tests/hooks/ on PYTHONPATH (the trainers the tests start: tests/support/trainer_run.py) switches on the
trainer's test hooks (trainer/runtime/hold.py). Nothing else is done here."""

import trainer_test_hooks  # noqa: F401
