"""Test support: the switch of the trainer's test hooks (trainer/runtime/hold.py SWITCH_MODULE).

A process that has imported this module reads TRAINER_TEST_HOLD and TRAINER_TEST_CLOCK_SKEW_NS;
every other one (the image, a user's run) never does. It lives here, outside every package the
image or a wheel ships, and reaches a trainer through tests/hooks/sitecustomize.py: tests put this
folder on PYTHONPATH (tests/support/trainer_run.py trainer_env, hold_env; in a runner job's container through
job.sync, HOOKS_SYNC)."""
