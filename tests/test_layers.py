"""The two halves meet only through env, /out and contract/: every import in runner/, trainer/ and
contract/ (top level and inside functions alike) is read from the source with `ast` and checked:

- runner never imports trainer, trainer never imports runner;
- contract (the torch-free module both use: timelines, plots, metrics, presets, memory
  arithmetic) imports neither, and no torch;
- code that runs on a node or in a container beside torchrun imports only the standard library
  (the relay agent, sent as source over SSH to a node with any python3) or the standard library
  and torch (the worker's gate, in the image).

The checker is tested on a package tree made here with one violation of each kind, so this test
can fail."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STDLIB = frozenset(sys.stdlib_module_names)

# package -> top-level names it must never import
FORBIDDEN = {"runner": {"trainer"}, "trainer": {"runner"}, "contract": {"runner", "trainer", "torch", "transformers"}}
# node-side modules -> the only top-level names they may import (besides the standard library)
NODE_SIDE = {"runner/relay_agent.py": set(), "runner/gate.py": {"torch"}}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, top-level module) of every absolute import in the file (relative ones stay inside
    their own package), `from __future__` left out."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if not node.level and node.module != "__future__":
                found.append((node.lineno, node.module.split(".")[0]))
    return found


def violations(root: Path) -> list[str]:
    """Every import that breaks a rule above, as 'file:line imports NAME (rule)'."""
    out = []
    for package, banned in FORBIDDEN.items():
        for path in sorted((root / package).rglob("*.py")):
            for line, name in imports_of(path):
                if name in banned:
                    out.append(f"{path.relative_to(root)}:{line} imports {name} ({package} never imports {name})")
    for rel, allowed in NODE_SIDE.items():
        path = root / rel
        if not path.exists():
            out.append(f"{rel}: missing (a node-side module named in tests/test_layers.py)")
            continue
        for line, name in imports_of(path):
            if name not in STDLIB and name not in allowed:
                out.append(f"{rel}:{line} imports {name} (runs on a node: standard library"
                           f"{' and ' + ', '.join(sorted(allowed)) if allowed else ''} only)")
    return out


def test_the_halves_meet_only_through_contract_and_node_code_needs_nothing_else():
    assert violations(REPO) == []


def test_the_checker_finds_each_kind_of_violation(tmp_path):
    files = {
        "runner/relay_agent.py": "import json\nimport yaml\n",
        "runner/gate.py": "import os\n\ndef go():\n    from torch.distributed import run\n",
        "runner/up.py": "def main():\n    from trainer.config import resolve\n",
        "trainer/train.py": "from __future__ import annotations\nimport runner.errors\n",
        "trainer/parallel/compose.py": "from . import mesh\nfrom ..models import build\n",
        "contract/plots.py": "import torch\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert violations(tmp_path) == [
        "runner/up.py:2 imports trainer (runner never imports trainer)",
        "trainer/train.py:2 imports runner (trainer never imports runner)",
        "contract/plots.py:1 imports torch (contract never imports torch)",
        "runner/relay_agent.py:2 imports yaml (runs on a node: standard library only)",
    ]


@pytest.mark.parametrize("rel", sorted(NODE_SIDE))
def test_node_side_modules_say_where_they_run(rel):
    doc = ast.get_docstring(ast.parse((REPO / rel).read_text())) or ""
    assert "node" in doc or "container" in doc, f"{rel}: its docstring should say where it runs"
