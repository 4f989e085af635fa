"""`trainer --print-completion SHELL`: a static completion script (shtab) for the trainer's
commands, options, seed flags and every `--section.key`. The trainer parses its own argv (any key
is an option), so the parser here exists only to describe it to shtab."""

from __future__ import annotations

import argparse
import sys

SHELLS = ("bash", "zsh", "tcsh")


def completion_parser(commands) -> argparse.ArgumentParser:
    """commands: the names `trainer COMMAND` takes (trainer/cli.py COMMANDS)."""
    from trainer.config import config_keys
    from trainer.config.argv import OWN_OPTIONS
    from trainer.config.flags import FLAGS

    p = argparse.ArgumentParser(prog="trainer", add_help=False, allow_abbrev=False)
    p.add_argument("command", nargs="?", choices=sorted(commands), help="command (default train)")
    p.add_argument("config", nargs="?", help="YAML config").complete = {"bash": "_shtab_compgen_files",
                                                                          "zsh": "_files", "tcsh": "f"}
    takes = {"--config": {"metavar": "X.yaml"}, "--print-completion": {"choices": SHELLS}}
    for opt in OWN_OPTIONS:
        p.add_argument(opt, **takes.get(opt, {"action": "store_true"}), help=opt)
    for flag, alias in FLAGS.items():
        if flag not in OWN_OPTIONS:
            p.add_argument(flag, help=f"{alias.source}: {alias.canonical}")
    for key in config_keys():
        if f"--{key}" not in FLAGS:
            p.add_argument(f"--{key}", help=key)
    return p


def print_completion(argv: list[str], commands) -> int:
    i = argv.index("--print-completion")
    shell = argv[i + 1] if i + 1 < len(argv) else ""
    if shell not in SHELLS:
        print("error: --print-completion needs a shell: bash, zsh or tcsh", file=sys.stderr)
        return 2
    try:
        import shtab
    except ImportError:
        print("error: shell completion needs the shtab package: pip install shtab", file=sys.stderr)
        return 2
    print(shtab.complete(completion_parser(commands), shell=shell), end="")
    return 0
