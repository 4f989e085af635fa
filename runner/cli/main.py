"""`runner` command line: one subcommand per module, each registering itself here; each verb's
handler calls runner.api (through runner/cli/common.py's open_backend) and renders what it returns.

Start-up: building the parser imports only the verbs' parser modules (argparse, the backend
registry's option declarations); a verb imports what it needs (the inventory reader, paramiko,
docker, rich, matplotlib) when it runs. `runner --version` and `--help` stay under 0.15 s
(bench/startup.py)."""

from __future__ import annotations

import argparse
import importlib
import sys

from runner.core.errors import Terminated, UserError, interrupt_code, interrupt_on_signals

# What contributes subcommands (modules of runner/cli/), in the order `runner --help` lists them.
# Each has `register(subparsers)`, which adds its parser(s) and sets `func` to a callable taking
# the parsed args and returning an exit code; none touches another's parser. Imported when the
# parser is built: `runner --version` alone needs none of them.
COMMANDS = (
    "sandbox",
    "check", "push", "sync",
    "up",          # up (--dry-run: the plan), with every backend's own options
    "runs",        # status, ls, logs
    "down", "collect",
    "export",      # the job for another scheduler (Kubernetes)
    "profile",     # per-node measurements; parallel.partition auto in `up`
    "node_exec",   # `runner exec`: a shell or command in a node's job container
)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        # `--dry` must not quietly mean `--dry-run`, nor a new option change what an old
        # abbreviation meant: only whole option names.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, non-zero, no usage dump
        sys.stderr.write(f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
        raise SystemExit(2)

    def _check_value(self, action: argparse.Action, value) -> None:
        # A mistyped command or choice: the closest one, else the list.
        if action.choices is not None and value not in action.choices:
            from contract.suggest import did_you_mean

            hint = did_you_mean(str(value), [str(c) for c in action.choices])
            shown = hint or f" (choose from {', '.join(map(str, action.choices))})"
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{shown}")


class _Lazy(argparse.Action):
    """`--version` / `--print-completion SHELL`: work done only when the option is given, so
    neither costs the other commands anything at start."""

    def __init__(self, option_strings, dest, run, **kwargs):
        self.run = run
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(self.run(parser, values), end="")
        parser.exit()


def _version(parser, _values) -> str:
    from contract.version import version

    return f"runner {version()}\n"


def _completion(parser, shell) -> str:
    from runner.cli.completion import script

    return script(parser, shell)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="runner", description="Run containerized distributed PyTorch jobs on the "
                     "nodes of an inventory: check, push, up, logs, status, down, collect.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action=_Lazy, nargs=0, run=_version, help="print the version and exit")
    parser.add_argument("--print-completion", action=_Lazy, run=_completion, choices=("bash", "zsh", "tcsh"),
                        metavar="SHELL", help="print a shell completion script (bash, zsh or tcsh) and exit: "
                        "`runner --print-completion bash > ~/.local/share/bash-completion/completions/runner`")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"runner.cli.{name}").register(sub)
    return parser


def subparser_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command args were parsed for: `runner sandbox up` -> sandbox up's."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if chosen is None:
            return parser
        parser = subs[0].choices[chosen]


def unrecognized(parser: argparse.ArgumentParser, extra: list[str], argv: list[str]) -> str:
    """'unrecognized arguments: ...' with the closest option of the command for each; for a
    command that passes arguments on to the trainer (`up`, `profile`), where those go."""
    from contract.suggest import close_matches

    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    flags = [w.partition("=")[0] for w in extra if w.startswith("-")]
    notes, trainer_like = [], []
    for flag in flags:
        # An abbreviation of one option (what argparse's allow_abbrev would accept) or a close spelling
        # is surely the runner's; a weak likeness may be a trainer flag as well.
        sure = [o for o in options if o.startswith(flag) and len(flag) > 2] or close_matches(flag, options, cutoff=0.75)
        near = sure or close_matches(flag, options)
        if near:
            notes.append(f"{flag + ': ' if len(flags) > 1 else ''}did you mean {near[0]}?")
        if not sure:
            trainer_like.append(flag)
    if trainer_like and any(a.dest == "trainer_args" for a in parser._actions):
        notes.append(f"trainer arguments go after `--`: runner {_trainer_args_last(argv, set(trainer_like))}")
    return f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(notes)})" if notes else "")


def _trainer_args_last(argv: list[str], trainer_flags: set[str]) -> str:
    """argv rewritten with the trainer's flags (and the values after them) behind `--`."""
    own: list[str] = []
    theirs: list[str] = []
    into, after_dashes = own, False
    for word in argv:
        if word == "--" and not after_dashes:
            into, after_dashes = theirs, True
            continue
        if word.startswith("-") and not after_dashes:  # an option: whose is it
            into = theirs if word.partition("=")[0] in trainer_flags else own
        into.append(word)
    import shlex

    return shlex.join([*own, "--", *theirs])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--version"]:  # what scripts and package managers ask most: no parser to build for it
        sys.stdout.write(_version(None, None))
        raise SystemExit(0)  # as the parser's --version action ends
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.error(unrecognized(subparser_of(parser, args), extra, argv))
    from runner.core.fanout import raise_open_file_limit
    from runner.core.redact import Formatter, printable

    if getattr(args, "inventory", "") is None:  # a verb on an inventory, given without -i
        from runner.inventory.choice import resolve_inventory

        try:
            resolve_inventory(args)
        except UserError as exc:
            sys.stderr.write(f"runner: error: {printable(str(exc))}\n")
            return exc.exit_code
    import logging

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
