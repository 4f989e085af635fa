"""`trainer --print-config`: every config key with its value and a one-line description, as a YAML
file one can start a config from. The descriptions are the comments beside the fields in
trainer/config/ (one place to write them); docs/flags.md carries this output for the defaults
(tests/unit/test_cli_usability.py keeps the two equal; `python -m trainer.config.doc docs/flags.md`
rewrites it there after a key is added). Torch-free."""

from __future__ import annotations

import ast
import dataclasses
import functools
import io
import re
import sys
import tokenize
from pathlib import Path
from typing import Any

import yaml

from trainer.config import Config
from trainer.config import schema as config_module

HEADER = ("# Every trainer config key, its default and what it does (`trainer --print-config`).\n"
          "# Set a key in a YAML file given with --config, or with --section.key VALUE (docs/flags.md).\n")
COMMENT_COLUMN = 40


@functools.lru_cache(maxsize=1)
def descriptions() -> dict[str, str]:
    """{'train.steps': 'optimizer steps; None = one pass over text data', ...}: a field's trailing
    comment in trainer/config/schema.py plus the comment-only lines under it that continue it."""
    src = Path(config_module.__file__).read_text()
    comments: dict[int, tuple[int, str]] = {}  # line -> (column, text)
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = (tok.start[1], tok.string.lstrip("#").strip())
    code_lines = src.splitlines()
    classes = {n.name: n for n in ast.parse(src).body if isinstance(n, ast.ClassDef)}

    def doc_of(stmt: ast.AnnAssign) -> str:
        line = stmt.end_lineno or stmt.lineno
        if line not in comments:
            return ""
        col, text = comments[line]
        parts = [text]
        nxt = line + 1
        while nxt in comments and comments[nxt][0] == col and code_lines[nxt - 1].strip().startswith("#"):
            parts.append(comments[nxt][1])
            nxt += 1
        return " ".join(parts)

    out: dict[str, str] = {}

    def walk(cls_name: str, prefix: str) -> None:
        for stmt in classes[cls_name].body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                name = stmt.target.id
                ann = ast.unparse(stmt.annotation)
                if ann in classes:
                    walk(ann, f"{prefix}{name}.")
                else:
                    out[prefix + name] = doc_of(stmt)

    walk(Config.__name__, "")
    return out


def keys(cfg: Config) -> list[tuple[str, Any]]:
    """(dotted key, value) of every field, sections in declaration order."""
    out: list[tuple[str, Any]] = []

    def walk(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                walk(v, f"{prefix}{f.name}.")
            else:
                out.append((prefix + f.name, v))

    walk(cfg, "")
    return out


def _scalar(v: Any) -> str:
    text = yaml.safe_dump(v, default_flow_style=True, width=1 << 20).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def render(cfg: Config | None = None) -> str:
    """The config as commented YAML: `key: value  # description`, one line per key."""
    cfg = cfg or Config()
    docs = descriptions()
    lines = [HEADER.rstrip("\n")]
    section: list[str] = []
    for key, value in keys(cfg):
        *head, name = key.split(".")
        same = 0  # a section inside a section (parallel.diloco) nests one level deeper
        while same < min(len(head), len(section)) and head[same] == section[same]:
            same += 1
        lines += [f"{'  ' * depth}{head[depth]}:" for depth in range(same, len(head))]
        section = head
        entry = f"{'  ' * len(head)}{name}: {_scalar(value)}"
        lines.append(f"{entry.ljust(COMMENT_COLUMN - 2)}  # {docs[key]}" if docs[key] else entry)
    return "\n".join(lines) + "\n"


def print_config_main(argv: list[str]) -> int:
    """`trainer --print-config [--config X.yaml] [overrides]`: the values a run with these
    arguments would start from (YAML, env and flags applied; nothing checked, nothing run)."""
    from trainer.config import resolve
    from trainer.config.argv import parse_train_args

    path, overrides = parse_train_args([a for a in argv if a != "--print-config"])
    print(render(resolve(path, overrides, check=False)), end="")
    return 0


BLOCK = re.compile(r"(<!-- print-config -->\n```yaml\n)(.*?)(```\n<!-- /print-config -->)", re.S)


def write_doc(path: str) -> None:
    """Rewrite the defaults' block of a markdown file (docs/flags.md) from render()."""
    doc = Path(path)
    text, n = BLOCK.subn(lambda m: m[1] + render() + m[3], doc.read_text())
    if n != 1:
        raise SystemExit(f"{path}: no <!-- print-config --> block to rewrite")
    doc.write_text(text)


if __name__ == "__main__":
    write_doc(sys.argv[1] if len(sys.argv) > 1 else "docs/flags.md")
