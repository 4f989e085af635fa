"""The inventory: which nodes exist, how to reach them, and the job to run on them, read from YAML
with every problem one line naming file, line and field.

- model: the dataclasses (Node, Job, Inventory, Jump, BuildSpec) and the rules fields follow
- safe_yaml: the one bounded loader every YAML file the runner is handed goes through (size,
  UTF-8, no aliases, depth, count), and bounded reads of the other files an inventory names
- schema: the validation kit every YAML of the runner goes through (Val, Checker, host spellings)
- load: load_inventory (and `--job` files)
- job_data, notify_spec, perseus_spec: the job's data, notification and Perseus sections
- ssh_config: ~/.ssh/config read for what a node leaves out (Host blocks, ProxyJump)
- slurm: the `slurm:` inventory; sbatch_options: the closed list of `slurm.sbatch` options

May import: runner.core.errors, runner.inventory.hostkeys, runner.agents.perseus_server (the plan reader), contract;
never the transport, delivery or backend layers.
"""

from runner.core.redact import looks_secret
from runner.inventory.load import load_inventory
from runner.inventory.model import (
    ARCH_ALIASES,
    ARCHES,
    REGISTRY_AUTH_KEYS,
    BuildSpec,
    Inventory,
    Job,
    Jump,
    Node,
    memory_bytes,
    read_env_file,
)

__all__ = ["ARCH_ALIASES", "ARCHES", "REGISTRY_AUTH_KEYS", "BuildSpec", "Inventory", "Job", "Jump", "Node",
           "load_inventory", "looks_secret", "memory_bytes", "read_env_file"]
