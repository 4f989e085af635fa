"""The SSH backend: the inventory's own nodes reached over SSH, one container per node.

How a job reaches a node: launch (`up`: preflight, push, the master first then the workers, the
watcher, restarts) makes each node's container from runner/planning/plan.py's NodePlan with the torchrun
line of runner/planning/jobspec.py; watch follows the nodes (heartbeats, a lost or failed node stops the
others); status (`status`, `ls`, `logs`), down and collect find the run by its container labels
and run dirs (runner/backends/ssh/node_runs.py); perseus starts job.perseus's server beside the master.
dry_run prints what `up --dry-run` would start, contacting nothing. backend: `SshBackend`, what
runner/backends gives each verb to.

May import: the verbs below the backends (push, sync, notify), delivery, transport, the inventory;
never another backend or runner.cli.main.
"""
