"""Measuring nodes for the job's pipeline, and `parallel.partition: auto` planned from it.

- measure: each node measured in the job's image under its own limits (the trainer's profile run)
- split: contiguous layer ranges per stage that minimise the slowest stage (time and memory)
- auto: `runner up` with `partition: auto`: profile (cached), choose the split, pin it in the job
- the command line, `runner profile`, is runner/cli/profile.py; the cache is runner/planning/profile_cache.py

May import: runner.delivery (the image is pushed before measuring), runner.transport, plan,
sizing, paths, the inventory, errors; never the backends or the CLI.
"""
