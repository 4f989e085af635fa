"""The trainer: what runs in the container under torchrun (or srun, mpirun, one process).

`python -m trainer` (trainer/cli.py) resolves the config (trainer/config/), builds the model
(trainer/models/), applies the layout (trainer/parallel/) and runs the loop (trainer/train.py)
with checkpoints, metrics and profiling (trainer/profiling/). It never imports runner/; what it
shares with the runner is contract/ (docs/contract.md).
"""
