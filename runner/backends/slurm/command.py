"""Slurm rides on the runner's own commands: `up`, `status`, `logs`, `ls`, `down` and `collect`
get `--scheduler {auto,ssh,slurm}` and go to runner/slurm*.py for a Slurm inventory.

auto (the default) means slurm for an inventory with a `slurm:` section and no `nodes:` list, ssh
otherwise; an inventory with both runs over SSH unless `--scheduler slurm` is given. Registered
after the modules that define those commands (runner/cli.py's COMMAND_MODULES order).
"""

from __future__ import annotations

import argparse

from runner.errors import UserError

ROUTED = ("up", "status", "logs", "ls", "down", "collect")


def register(sub: argparse._SubParsersAction) -> None:
    for name in ROUTED:
        p = sub.choices.get(name)
        if p is None:
            continue
        p.add_argument("--scheduler", choices=("auto", "ssh", "slurm"), default="auto",
                       help="ssh nodes or a Slurm cluster (default auto: slurm for an inventory with a "
                            "`slurm:` section and no `nodes:`)")
        if name == "up":
            p.add_argument("--requeue", action="store_true",
                           help="(slurm) a preempted job goes back in the queue and resumes from its latest checkpoint")
        p.set_defaults(func=_routed(name, p.get_default("func")))


def scheduler(args) -> str:
    from runner.inventory.slurm import top_level_keys

    keys = top_level_keys(args.inventory)
    if args.scheduler == "slurm":
        if keys and "slurm" not in keys:
            raise UserError(f"{args.inventory}: --scheduler slurm needs a `slurm:` section (partition, nodes, ...)")
        return "slurm"
    if args.scheduler == "ssh":
        return "ssh"
    return "slurm" if "slurm" in keys and "nodes" not in keys else "ssh"


def _routed(name: str, ssh_func):
    def run(args) -> int:
        if scheduler(args) == "ssh":
            if getattr(args, "requeue", False):
                raise UserError("--requeue is for Slurm runs (--scheduler slurm); SSH runs use --max-restarts")
            return ssh_func(args)
        return _slurm(name, args)

    return run


def _slurm(name: str, args) -> int:
    from runner.inventory.slurm import load_slurm_inventory

    dry = name == "up" and args.dry_run
    inv = load_slurm_inventory(args.inventory, job_path=getattr(args, "job", None), check_files=not dry,
                               with_job=name == "up")
    if name == "up":
        from runner.backends.slurm.submit import cmd_up
        from runner.inventory_arg import remember_inventory

        if not dry:
            remember_inventory(args.inventory)
        return cmd_up(args, inv)
    if name == "down":
        from runner.backends.slurm.submit import cmd_down

        return cmd_down(args, inv)
    if name == "collect":
        from runner.backends.slurm.collect import cmd_collect

        return cmd_collect(args, inv)
    from runner.backends.slurm import status as slurm_status
    from runner.backends.slurm.shell import open_shell

    sh = open_shell(inv, args.accept_new_host_keys)
    try:
        return {"status": slurm_status.cmd_status, "logs": slurm_status.cmd_logs,
                "ls": slurm_status.cmd_ls}[name](args, inv, sh)
    finally:
        sh.close()
