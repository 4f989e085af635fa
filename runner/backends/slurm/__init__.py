"""The Slurm backend: a run is one batch job on a Slurm cluster.

- backend: `SlurmBackend` and its options (`SlurmUpOptions`: --requeue)
- submit: plan (the batch script, nothing contacted), submit (checks, staging, sbatch, follow)
  and cancel (USR1, grace, scancel)
- plan: the batch script and its torchrun line; jobs: the cluster's partitions, a run's jobs and
  state, check; status: describe, runs, logs (the follower of a job's node output); collect:
  mirror the run dir; node_exec: `srun --overlap` into the job; oci: the image as an OCI bundle;
  shell: the login node (SSH) or this machine, one shell protocol

May import: the inventory, runner.transport.ssh (the login node), delivery (collect_files), runner.core.runs,
runner.planning.jobspec, runner.backends.notify and the backends' own base; never another backend,
runner.api or runner.cli.
"""
