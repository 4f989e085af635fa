"""The Slurm backend: a run is one batch job on a Slurm cluster.

- command: routes up/status/logs/ls/down/collect of a Slurm inventory here (and `--scheduler`)
- submit: `up` (checks, staging, sbatch, follow) and `down` (USR1, grace, scancel)
- plan: the batch script and its torchrun line; jobs: a run's jobs and state; status: follow a
  job's node output; collect: mirror the run dir; oci: the image as an OCI bundle; shell: the
  login node (SSH) or this machine, one shell protocol

May import: the inventory, runner.transport.ssh (the login node), delivery (collect_files), runner.core.runs,
runner.planning.jobspec, runner.backends.notify; never another backend or runner.cli.main.
"""
