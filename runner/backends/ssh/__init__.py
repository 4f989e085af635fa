"""The SSH backend: the inventory's own nodes reached over SSH, one container per node.

How a job reaches a node: dry_run plans it (`up --dry-run`, contacting nothing); launch (`up`:
preflight, push, the master first then the workers, the watcher, restarts) makes each node's
container from runner/planning/plan.py's NodePlan with the torchrun line of
runner/planning/jobspec.py; watch follows the nodes (heartbeats, a lost or failed node stops the
others); status (describe, runs, logs), down (cancel) and collect find the run by its container
labels and run dirs (runner/backends/ssh/node_runs.py); node_exec gives the argv into a node's
container; nodes_setup pushes, syncs and profiles; perseus starts job.perseus's server beside the
master. backend: `SshBackend` and its options (`SshUpOptions`).

May import: the verbs below the backends (push, sync, notify), delivery, transport, the inventory
and the backends' own base; never another backend, runner.api or runner.cli.
"""
