"""The CLI reference of docs/cli.md, generated from the runner's own argparse parser.

    python docs/hooks/cli_reference.py docs/cli.md     # rewrite the block between the markers

The page keeps the generated block between `<!-- cli-reference -->` and `<!-- /cli-reference -->`;
a test renders the parser again and compares, so a new command or option that is not in the
reference fails the suite (as docs/flags.md's block is checked against the trainer's parser).
Tables are built from the parser's actions, not from argparse's help text, so the Python version's
help formatting does not change the page.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

BEGIN, END = "<!-- cli-reference -->", "<!-- /cli-reference -->"


def build_parser() -> argparse.ArgumentParser:
    try:  # the parser's home: runner/cli/main.py (runner.cli before the CLI became a package)
        from runner.cli.main import build_parser as build
    except ImportError:
        from runner.cli import build_parser as build
    return build()


def _subparsers(parser: argparse.ArgumentParser) -> tuple[dict[str, argparse.ArgumentParser], dict[str, str]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return {}, {}
    helps = {c.dest: c.help or "" for c in subs[0]._choices_actions}
    return dict(subs[0].choices), helps


def _cell(text: str) -> str:
    """One table cell: one line, pipes escaped, and `<run>` shown as text outside code spans (it would
    be read as an HTML tag)."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;") for i, p in enumerate(parts))


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:
        params = {**vars(action), "prog": prog}
        params = {k: (", ".join(map(str, v)) if isinstance(v, (list, tuple)) else v) for k, v in params.items()}
        text = text % params
    return _cell(text)


def _name(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.nargs == 0:
            return names
        meta = action.metavar or (("{" + ",".join(map(str, action.choices)) + "}") if action.choices
                                  else action.dest.upper())
        if isinstance(meta, tuple):
            meta = " ".join(meta)
        return f"{names} `{meta}`"
    meta = action.metavar or action.dest
    return f"`{meta}`" + (" ..." if action.nargs in ("*", "+", argparse.REMAINDER) else "")


def _default(action: argparse.Action) -> str:
    d = action.default
    if action.nargs == 0 or d is None or d is argparse.SUPPRESS or d == [] or d is False:
        return ""
    return f"`{d}`"


def _options(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for a in parser._actions:
        if isinstance(a, (argparse._SubParsersAction, argparse._HelpAction)) or a.help == argparse.SUPPRESS:
            continue
        rows.append(f"| {_name(a)} | {_default(a)} | {_help(a, parser.prog)} |")
    if not rows:
        return []
    return ["| argument | default | meaning |", "|---|---|---|", *rows]


def _section(parser: argparse.ArgumentParser, path: list[str], summary: str, depth: int) -> list[str]:
    out = [f"{'#' * depth} `{' '.join(path)}`", ""]
    text = _cell(parser.description or summary)
    if text:
        out += [text, ""]
    table = _options(parser)
    if table:
        out += [*table, ""]
    subs, helps = _subparsers(parser)
    for name, sub in subs.items():  # `runner X` beside `runner`, `runner sandbox up` under its command
        out += _section(sub, [*path, name], helps.get(name, ""), 3 if len(path) == 1 else 4)
    return out


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The reference: every command and subcommand with each argument, its default and meaning."""
    parser = parser or build_parser()
    subs, helps = _subparsers(parser)
    out = ["| command | what it does |", "|---|---|"]
    out += [f"| [`runner {n}`](#runner-{n}) | {_cell(helps.get(n, ''))} |" for n in subs]
    out += ["", *_section(parser, ["runner"], "", 3)]
    return "\n".join(out).rstrip() + "\n"


def block(text: str) -> str:
    """The generated part of a page: what stands between the markers."""
    m = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
    if not m:
        raise ValueError(f"no {BEGIN} ... {END} block")
    return m[1]


def rewrite(page: Path) -> bool:
    """Put a freshly rendered reference between the page's markers; True if it changed."""
    text = page.read_text()
    old = block(text)
    new = render()
    if old == new:
        return False
    page.write_text(text.replace(BEGIN + "\n" + old + END, BEGIN + "\n" + new + END))
    return True


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/cli.md")
    print(f"{target}: {'rewritten' if rewrite(target) else 'up to date'}")
