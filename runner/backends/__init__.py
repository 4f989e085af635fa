"""Where a job runs besides the SSH nodes of an inventory: one package per scheduler.

- slurm: `up --scheduler slurm` (or an inventory with a `slurm:` section): sbatch on this machine or
  a login node, the same torchrun contract (docs/contract.md), follow, down, collect, requeue

May import: the inventory, transport (runner.ssh), delivery and run-id layers; never runner.cli.
"""
