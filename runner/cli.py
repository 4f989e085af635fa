"""`runner` command line: one subcommand per module, each registering itself here."""

from __future__ import annotations

import argparse
import logging
import sys

from runner.errors import Terminated, UserError, interrupt_code, interrupt_on_signals
from runner.fanout import raise_open_file_limit
from runner.redact import Formatter, printable

# Modules that contribute subcommands. Each exposes `register(subparsers)` which adds its
# parser(s) and sets `func` to a callable taking the parsed args and returning an exit code.
COMMAND_MODULES = [
    "runner.sandbox_cli",
    "runner.check", "runner.push", "runner.sync", "runner.launch", "runner.status", "runner.down", "runner.collect",
    # After the commands it extends: adds --scheduler to up/status/logs/ls/down/collect (Slurm runs).
    "runner.slurm_cli",
    "runner.kube_export",
    "runner.profile",  # per-node measurements; parallel.partition auto in `up`
    "runner.node_exec",  # `runner exec`: a shell or command in a node's job container
    "runner.notify",  # `up --notify`: told on this machine when the run ends
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, non-zero, no usage dump
        sys.stderr.write(f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = _Parser(prog="runner", description="Run containerized distributed PyTorch jobs on the "
                     "nodes of an inventory: check, push, up, logs, status, down, collect.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(Formatter("%(message)s"))  # secrets masked, a node's control characters visible
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[handler])
    if args.verbose:
        logging.getLogger("paramiko").setLevel(logging.WARNING)
    interrupt_on_signals()
    raise_open_file_limit()  # a file descriptor or two per node: the usual soft 1024 is too few
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        sys.stderr.write(f"runner: error: {printable(str(exc))}\n")
        return exc.exit_code
    except KeyboardInterrupt as exc:
        sys.stderr.write(f"runner: {'terminated' if isinstance(exc, Terminated) else 'interrupted'}\n")
        return interrupt_code(exc)


if __name__ == "__main__":
    sys.exit(main())
