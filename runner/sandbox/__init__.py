"""The sandbox cluster: real nodes on this machine for trying the runner and for the tests.

- cluster: `Sandbox`, N nodes each with its own sshd and dockerd (as root or a non-root user),
  their inventory written for `runner -i`
- net: nodes in their own network namespaces on a bridge, links shaped with tc, partitions
- slurm: a real Slurm cluster (several slurmd on one machine) with a login sshd
- the command line, `runner sandbox up|down|status|link`, is runner/cli/sandbox.py

May import: runner.core.errors, runner.inventory; nothing of the launch, delivery or backend layers
(the sandbox makes nodes; the runner reaches them like any other).
"""
