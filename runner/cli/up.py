"""`runner up`: the parser (every backend's own options added from its Options dataclass) and the
handler: runner.api's plan, printed for --dry-run, else submitted."""

from __future__ import annotations

import argparse
import sys

from runner.backends import BACKENDS, SCHEDULERS, flag_of, own_fields
from runner.cli.common import add_inventory_args, open_backend

NOTIFY_HELP = ("when the run ends: run CMD here with `sh -c` (RUNNER_RUN_ID, RUNNER_STATE, RUNNER_EXIT, "
               "RUNNER_SUMMARY ... in its env), or POST JSON to an http(s):// URL (default: $RUNNER_NOTIFY, then "
               "job.notify, a URL)")


def backend_fields() -> list:
    """Every backend's own option fields, the default backend's first (each field once)."""
    seen, out = set(), []
    for name in (n for n in SCHEDULERS if n in BACKENDS):
        for f in own_fields(BACKENDS[name].Options):
            if f.name not in seen:
                seen.add(f.name)
                out.append(f)
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="launch the job on every node (master first) and follow it",
                       description="Launch the inventory's job. Extra trainer args go after `--`.")
    add_inventory_args(p)
    p.add_argument("--job", help="YAML file with a job section, overriding the inventory's")
    p.add_argument("--dry-run", action="store_true", help="print the plan per node; contact nothing")
    p.add_argument("--ignore-sizing", action="store_true",
                   help="launch even where the memory estimate says a node cannot hold its stage")
    p.add_argument("--detach", "-d", action="store_true", help="return once every container is started")
    p.add_argument("--resume", nargs="?", const="latest", metavar="RUN",
                   help="continue a run from its latest checkpoint (default: the latest run)")
    p.add_argument("--notify", metavar="CMD|URL", help=NOTIFY_HELP)
    # A backend's own options: None when not given, so that one given to a run of another backend
    # is refused (runner/backends/options.py) rather than silently dropped.
    for f in backend_fields():
        p.add_argument(flag_of(f), dest=f.name, default=None, help=f.metadata["help"], **f.metadata["argparse"])
    p.add_argument("trainer_args", nargs="*", help="extra trainer arguments (after --)")
    p.set_defaults(func=main)


def up_options(args: argparse.Namespace) -> dict:
    """The options given on the command line: the common ones, and each backend option given."""
    given = {"resume": args.resume, "ignore_sizing": args.ignore_sizing, "trainer_args": list(args.trainer_args),
             "notify": args.notify}
    given.update({f.name: getattr(args, f.name) for f in backend_fields() if getattr(args, f.name) is not None})
    return given


def main(args: argparse.Namespace) -> int:
    from runner.core.errors import UserError

    backend = open_backend(args, check_files=not args.dry_run)
    plan = backend.plan(backend.options(up_options(args)))  # another backend's option: refused here
    if args.dry_run:
        sys.stdout.write(plan.render())
        sys.stdout.flush()
        if plan.refusal and not plan.options.ignore_sizing:
            raise UserError(plan.refusal)
        return 0
    from runner.inventory.choice import remember_inventory

    remember_inventory(args.inventory)  # the default of the next command here (runner/inventory/choice.py)
    run = backend.submit(plan, detach=args.detach)
    return int(run.exit_code or 0)
