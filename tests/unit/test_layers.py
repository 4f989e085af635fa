"""The two halves meet only through env, /out and contract/: every import in runner/, trainer/ and
contract/ (top level and inside functions alike) is read from the source with `ast` and checked:

- runner never imports trainer, trainer never imports runner;
- contract (the torch-free module both use: timelines, plots, metrics, presets, memory
  arithmetic) imports neither, and no torch;
- code that runs on a node or in a container beside torchrun imports only the standard library
  (the relay agent, sent as source over SSH to a node with any python3) or the standard library
  and torch (the worker's gate, in the image).

- runner/ and trainer/ in layers of packages, each importing only its own and the layers below it
  (RUNNER_LAYERS: the command line, the API, the backends, profiling and the sandbox, delivery,
  transport, planning, the inventory, the base; TRAINER_LAYERS: the command line and tools, the
  loop, checkpoints/profiling/metrics, parallelism, models and data, the runtime, the config); a
  module no layer names is an error, so a new package is placed on purpose;
- each package's top level holds only its entry modules (TOP_LEVEL): runner/ its __init__,
  __main__ and api; trainer/ at most six; everything else in a package named after what it holds;
- no import circles anywhere in runner/, trainer/ or contract/: a module never needs, however
  indirectly, a module that needs it (imports inside functions count: a circle hidden in a
  function is still a circle, and it is what made the layout hard to cut into packages).

- no module over 500 lines and no function over 80, unless it says why on a `# long: <reason>`
  line (in the module, or inside the function).

The checkers are tested on package trees made here with one violation of each kind, so these
tests can fail."""

from __future__ import annotations

import ast
import graphlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STDLIB = frozenset(sys.stdlib_module_names)

# package -> top-level names it must never import
FORBIDDEN = {"runner": {"trainer"}, "trainer": {"runner"}, "contract": {"runner", "trainer", "torch", "transformers"}}
# node-side modules -> the only top-level names they may import (besides the standard library)
NODE_SIDE = {"runner/agents/relay_agent.py": set(), "runner/agents/gate.py": {"torch"},
             "runner/agents/torchrun.py": {"torch"}, "runner/agents/__init__.py": set(),
             # the Perseus server, in the image's own Zeus environment on the master node
             "runner/agents/perseus_server.py": {"zeus", "fastapi", "pydantic", "uvicorn"}}


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
            out.append(f"{rel}: missing (a node-side module named in tests/unit/test_layers.py)")
            continue
        for line, name in imports_of(path):
            if name not in STDLIB and name not in allowed:
                out.append(f"{rel}:{line} imports {name} (runs on a node: standard library"
                           f"{' and ' + ', '.join(sorted(allowed)) if allowed else ''} only)")
    return out


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, packages=("runner", "trainer", "contract")) -> dict[str, set[str]]:
    """{module: modules of the packages it imports}, every import in the file (in functions too);
    `from a.b import c` counts as importing a.b.c when that is a module, else a.b; a package's own
    parents (imported by Python on the way) are not edges."""
    files = {module_name(root, p): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != mod and not mod.startswith(name + "."):
                    graph[mod].add(name)
    return graph


def import_cycle(root: Path) -> list[str] | None:
    """One circle of imports (its modules in order, the first repeated at the end), or None."""
    try:
        tuple(graphlib.TopologicalSorter(import_graph(root)).static_order())
    except graphlib.CycleError as exc:
        return list(reversed(exc.args[1]))
    return None


def test_no_import_circles():
    cycle = import_cycle(REPO)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_checker_finds_a_circle_through_a_function_and_a_relative_import(tmp_path):
    files = {
        "runner/__init__.py": "",
        "runner/a.py": "from runner.b import x\n",
        "runner/b.py": "def f():\n    from .c import y\n",
        "runner/c.py": "import runner.a\n",
        "runner/d.py": "from runner import a\n",  # outside the circle: not reported
        "trainer/__init__.py": "",
        "contract/__init__.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    cycle = import_cycle(tmp_path)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"runner.a", "runner.b", "runner.c"}, cycle
    (tmp_path / "runner/c.py").write_text("import runner.d as later\n")  # c -> d -> a -> b -> c
    assert set(import_cycle(tmp_path)) == {"runner.a", "runner.b", "runner.c", "runner.d"}
    (tmp_path / "runner/d.py").write_text("")
    assert import_cycle(tmp_path) is None


# Top to bottom, by package: a module belongs to the first layer naming it or its package. Each layer
# imports only itself and the layers below it; a new package is placed here on purpose.
RUNNER_LAYERS = {
    "command line": ["runner.cli", "runner.__main__"],
    "api": ["runner.api"],
    "backends": ["runner.backends"],
    "profiling, sandbox": ["runner.profile", "runner.sandbox"],
    "delivery": ["runner.delivery"],
    "transport": ["runner.transport"],
    "planning": ["runner.planning"],
    "inventory": ["runner.inventory"],
    "base": ["runner.core", "runner.agents", "runner"],
}
TRAINER_LAYERS = {
    "command line": ["trainer.cli", "trainer.__main__", "trainer.tools"],
    "loop": ["trainer.train"],
    "checkpoints, profiling, metrics": ["trainer.checkpoint", "trainer.profiling", "trainer.metrics"],
    "parallelism": ["trainer.parallel", "trainer.optim"],
    "models, data": ["trainer.models", "trainer.data"],
    "runtime": ["trainer.runtime"],
    "config": ["trainer.config", "trainer"],
}
LAYERS = {"runner": RUNNER_LAYERS, "trainer": TRAINER_LAYERS}
# What may stand at a package's top level besides its packages: everything else lives in a package
# whose name says what it holds.
TOP_LEVEL = {"runner": {"__init__", "__main__", "api"},
             "trainer": {"__init__", "__main__", "cli", "train", "optim", "metrics"}}


def layer_of(module: str, layers: dict[str, list[str]]) -> int | None:
    for i, prefixes in enumerate(layers.values()):
        # "runner" names the package's own __init__; "runner.inventory" its modules too
        if any(module == p or ("." in p and module.startswith(p + ".")) for p in prefixes):
            return i
    return None


def layer_violations(root: Path, layers: dict[str, list[str]] = RUNNER_LAYERS, package: str = "runner") -> list[str]:
    """'a imports b (layer of a above ... never below)' for each import that goes up a layer, and
    'a: in no layer' for each module of the package no layer names."""
    names = list(layers)
    graph = import_graph(root, (package,))
    out = []
    for mod in sorted(graph):
        mine = layer_of(mod, layers)
        if mine is None:
            out.append(f"{mod}: in no layer (add it to {package.upper()}_LAYERS in tests/unit/test_layers.py)")
            continue
        for dep in sorted(graph[mod]):
            theirs = layer_of(dep, layers)
            if theirs is not None and theirs < mine:
                out.append(f"{mod} ({names[mine]}) imports {dep} ({names[theirs]}): a layer imports only itself "
                           "and the layers below it")
    return out


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_imports_go_down_the_layers(package):
    assert layer_violations(REPO, LAYERS[package], package) == []


def loose_modules(root: Path, package: str) -> list[str]:
    """The modules at the package's top level that TOP_LEVEL does not allow there."""
    return sorted(p.stem for p in (root / package).glob("*.py") if p.stem not in TOP_LEVEL[package])


@pytest.mark.parametrize("package", sorted(TOP_LEVEL))
def test_top_level_keeps_only_its_entry_modules(package):
    assert loose_modules(REPO, package) == [], f"{package}/: move these into a package named after what they hold"
    assert len(TOP_LEVEL["runner"]) <= 3 and len(TOP_LEVEL["trainer"]) <= 6


def test_the_top_level_checker_finds_a_loose_module(tmp_path):
    for rel in ("runner/__init__.py", "runner/api.py", "runner/helpers.py", "runner/cli/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert loose_modules(tmp_path, "runner") == ["helpers"]


TEST_TIERS = ("unit", "distributed", "docker", "sandbox", "slurm", "gpu")


def misplaced_tests(tests: Path) -> list[str]:
    """Test modules outside a tier folder, and helpers (not test_*.py) inside one: a test goes to
    the tier it needs, a helper to tests/support/ (CONTRIBUTING.md)."""
    out = [p.name for p in tests.glob("*.py") if p.name not in ("__init__.py", "conftest.py")]
    for tier in TEST_TIERS:
        out += [f"{tier}/{p.name}" for p in (tests / tier).glob("*.py")
                if p.name != "__init__.py" and not p.name.startswith("test_")]
    out += [f"support/{p.name}" for p in (tests / "support").glob("test_*.py")]
    return sorted(out)


def test_tests_live_in_their_tier_and_helpers_in_support():
    assert misplaced_tests(REPO / "tests") == []


def test_the_tier_checker_finds_a_loose_test_and_a_helper_in_a_tier(tmp_path):
    for rel in ("conftest.py", "test_loose.py", "unit/test_ok.py", "unit/helpers.py", "support/x.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert misplaced_tests(tmp_path) == ["test_loose.py", "unit/helpers.py"]


def test_the_layer_checker_finds_an_upward_import_and_an_unplaced_module(tmp_path):
    layers = {"top": ["runner.cli.main"], "mid": ["runner.ssh"], "base": ["runner.core.errors", "runner"]}
    files = {"runner/__init__.py": "", "runner/cli/main.py": "from runner import ssh\n",
             "runner/ssh.py": "from runner.core.errors import E\n", "runner/core/errors.py": "def f():\n    import runner.cli.main\n",
             "runner/stray.py": "", "trainer/__init__.py": "", "contract/__init__.py": ""}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert layer_violations(tmp_path, layers) == [
        "runner.core.errors (base) imports runner.cli.main (top): a layer imports only itself and the layers below it",
        "runner.stray: in no layer (add it to RUNNER_LAYERS in tests/unit/test_layers.py)"]


def cli_backend_imports(root: Path) -> list[str]:
    """'runner/cli/x.py:N imports NAME' for each import in runner/cli/ (top level or in a function,
    absolute or relative) of a backend's internals: the command line reaches the backends through
    runner.api and the registry (runner.backends itself, none of its modules), so that adding a
    backend is its package and one registry line, and no verb branches on a backend's modules."""
    out = []
    backends = root / "runner" / "backends"
    for path in sorted((root / "runner" / "cli").rglob("*.py")):
        here = module_name(root, path).split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module
                # `from runner.backends import ssh` imports a backend's package: a module, not a name
                names = [f"{base}.{a.name}" if base == "runner.backends" and (
                    (backends / a.name).is_dir() or (backends / f"{a.name}.py").exists()) else base
                    for a in node.names]
            else:
                continue
            for name in dict.fromkeys(names):  # `from m import a, b`: m once
                if name.startswith("runner.backends."):
                    out.append(f"{path.relative_to(root)}:{node.lineno} imports {name} (the CLI goes through "
                               "runner.api and the runner.backends registry)")
    return out


def test_the_cli_imports_no_backend_internals():
    assert cli_backend_imports(REPO) == []


def test_the_cli_import_checker_finds_each_way_into_a_backend(tmp_path):
    files = {"runner/__init__.py": "", "runner/api.py": "", "runner/backends/__init__.py": "BACKENDS = {}\n",
             "runner/backends/ssh/__init__.py": "", "runner/backends/ssh/status.py": "",
             "runner/backends/slurm/__init__.py": "", "runner/backends/slurm/jobs.py": "",
             "runner/backends/options.py": "", "runner/cli/__init__.py": "",
             "runner/cli/ok.py": "from runner.backends import BACKENDS\nfrom runner import api\nimport runner.api\n",
             "runner/cli/in_function.py": "def f():\n    from runner.backends.ssh.status import x\n",
             "runner/cli/plain.py": "import runner.backends.slurm.jobs as j\n",
             "runner/cli/package.py": "from runner.backends import BACKENDS, ssh\n",
             "runner/cli/relative.py": "from ..backends.options import flag_of\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert [v.split(" (")[0] for v in cli_backend_imports(tmp_path)] == [
        "runner/cli/in_function.py:2 imports runner.backends.ssh.status",
        "runner/cli/package.py:1 imports runner.backends.ssh",
        "runner/cli/plain.py:1 imports runner.backends.slurm.jobs",
        "runner/cli/relative.py:1 imports runner.backends.options"]


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 80
LONG_REASON = "# long: "


def too_long(root: Path, packages=("runner", "trainer", "contract")) -> list[str]:
    """'file: N lines' and 'file:line name: N lines' for each module or function over its limit
    without a `# long:` reason."""
    out = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            lines = path.read_text().splitlines()
            rel = path.relative_to(root)
            if len(lines) > MAX_MODULE_LINES and not any(ln.startswith(LONG_REASON) for ln in lines):
                out.append(f"{rel}: {len(lines)} lines")
            for node in ast.walk(ast.parse("\n".join(lines))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    body = lines[node.lineno - 1:node.end_lineno]
                    if len(body) > MAX_FUNCTION_LINES and not any(LONG_REASON in ln for ln in body):
                        out.append(f"{rel}:{node.lineno} {node.name}: {len(body)} lines")
    return out


def test_modules_and_functions_stay_short_or_say_why():
    assert too_long(REPO) == []


def test_the_length_checker_counts_modules_and_functions(tmp_path):
    long_fn = "def f():\n" + "    x = 1\n" * 80
    files = {"runner/a.py": long_fn, "runner/b.py": long_fn.replace("    x = 1\n", "    # long: a table\n", 1),
             "trainer/c.py": "x = 1\n" * 501, "trainer/d.py": "# long: one source sent whole\n" + "x = 1\n" * 501,
             "contract/e.py": "x = 1\n" * 500}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert too_long(tmp_path) == ["runner/a.py:1 f: 81 lines", "trainer/c.py: 501 lines"]


def test_the_halves_meet_only_through_contract_and_node_code_needs_nothing_else():
    assert violations(REPO) == []


def test_the_checker_finds_each_kind_of_violation(tmp_path):
    files = {
        "runner/agents/__init__.py": "",
        "runner/agents/relay_agent.py": "import json\nimport yaml\n",
        "runner/agents/gate.py": "import os\n\ndef go():\n    from torch.distributed import run\n",
        "runner/agents/torchrun.py": "import sys\n\nfrom . import gate\n",
        "runner/agents/perseus_server.py": "def serve():\n    import uvicorn\n",
        "runner/up.py": "def main():\n    from trainer.config import resolve\n",
        "trainer/train.py": "from __future__ import annotations\nimport runner.core.errors\n",
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
        "runner/agents/relay_agent.py:2 imports yaml (runs on a node: standard library only)",
    ]


@pytest.mark.parametrize("rel", sorted(NODE_SIDE))
def test_node_side_modules_say_where_they_run(rel):
    doc = ast.get_docstring(ast.parse((REPO / rel).read_text())) or ""
    assert "node" in doc or "container" in doc, f"{rel}: its docstring should say where it runs"
