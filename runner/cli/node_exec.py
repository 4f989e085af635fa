"""`runner exec NODE [-- CMD...]`: a command (default: an interactive shell) in the node's running
job container, or on the node itself with `--host` (Slurm: in the run's job allocation on that
node, `srun --overlap`); its exit code is the runner's.

runner.api's exec_argv gives the argv (the OpenSSH client pinned to the host key paramiko
verified, or srun); it runs here on our terminal: OpenSSH owns it (raw mode, window size,
signals), so a TTY session behaves as `ssh -t` does.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from runner.cli.common import add_inventory_args, open_backend


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("exec", help="a command (default: a shell) in a node's running job container, or on the node",
                       description="Run CMD in NODE's running container of the run (default: the latest run with "
                                   "one there), or on the node itself with --host. Without CMD: an interactive "
                                   "shell. The exit code is CMD's.")
    add_inventory_args(p)
    p.add_argument("node", help="node name from the inventory (Slurm: a node of the run's job)")
    p.add_argument("command", nargs="*", metavar="-- CMD", help="command and its arguments, after `--`")
    p.add_argument("--run", metavar="RUN", help="run id or prefix (default: the latest run running on NODE)")
    p.add_argument("--host", action="store_true", help="(ssh) on the node itself, not in its job container")
    tty = p.add_mutually_exclusive_group()
    tty.add_argument("-t", "--tty", dest="tty", action="store_true", default=None,
                     help="allocate a terminal for CMD (default: only for the interactive shell, when stdin is one)")
    tty.add_argument("-T", "--no-tty", dest="tty", action="store_false", help="never allocate a terminal")
    split_at_dashes(p)
    p.set_defaults(func=cmd_exec)


def split_at_dashes(p: argparse.ArgumentParser) -> None:
    """Everything after the first `--` is CMD, whatever options come between NODE and it
    (argparse alone gives a second positional nothing once a first one has been matched)."""
    base = type(p)

    class _ExecParser(base):
        def parse_known_args(self, args=None, namespace=None):
            args = list(sys.argv[1:] if args is None else args)
            cut = args.index("--") if "--" in args else len(args)
            ns, rest = super().parse_known_args(args[:cut], namespace)
            if cut < len(args):
                if ns.command:
                    self.error(f"the command goes after `--` only (got {shlex.join(ns.command)} before it)")
                ns.command = args[cut + 1:]
            return ns, rest

    p.__class__ = _ExecParser


def wants_tty(args) -> bool:
    if args.tty is not None:
        return args.tty
    return not args.command and sys.stdin.isatty()


def cmd_exec(args) -> int:
    backend = open_backend(args, with_job=False)
    return interactive(backend.exec_argv(args.run, args.node, args.command, tty=wants_tty(args), host=args.host))


def interactive(argv: list[str]) -> int:
    """argv on our terminal, its exit code ours. Ctrl-C goes to it (same process group), not to us:
    the runner waits for it to end."""
    import signal
    import subprocess

    from runner.core.errors import UserError

    try:
        p = subprocess.Popen(argv)
    except FileNotFoundError:
        raise UserError(f"{argv[0]}: not found on this machine (install the OpenSSH client)") from None
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return p.wait()
    except KeyboardInterrupt:  # SIGTERM to the runner (runner/core/errors.py): the session ends with it
        p.terminate()
        p.wait()
        raise
    finally:
        signal.signal(signal.SIGINT, old)
