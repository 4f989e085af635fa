"""Shell completion scripts for `runner` and `trainer`, made by shtab from the argparse parsers.
Static: the shell completes from the printed script alone, with no Python run at each TAB
(argcomplete's way costs a Python start per keypress), and shtab is imported only to print one."""

from __future__ import annotations

import argparse

from runner.core.errors import UserError

SHELLS = ("bash", "zsh", "tcsh")


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    try:
        import shtab
    except ImportError:
        raise UserError("shell completion needs the shtab package: pip install shtab") from None
    return shtab.complete(parser, shell=shell)
