"""Both console entry points answer --help; mistakes get one line and a non-zero exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from runner.cli.main import build_parser
from tests.conftest import REPO
from tests.support.runner_helpers import listed_commands, subcommands


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=REPO, timeout=120)


# Every command of the runner, each listed by `runner --help` with its one-line summary: a new
# command is added here (and to docs/cli.md) or this test fails.
RUNNER_COMMANDS = ("sandbox", "check", "push", "sync", "up", "status", "ls", "logs", "down", "collect", "export",
                   "profile", "exec")


def test_runner_help_lists_every_command():
    r = run("runner", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: runner [-h] [-v] [--version] [--print-completion SHELL] COMMAND ...")
    assert listed_commands(r.stdout) == list(RUNNER_COMMANDS), r.stdout
    assert list(subcommands(build_parser())) == list(RUNNER_COMMANDS)  # none registered but unlisted
    cli_doc = (REPO / "docs" / "cli.md").read_text()
    assert [c for c in RUNNER_COMMANDS if f"runner {c}" not in cli_doc] == []
    for cmd in RUNNER_COMMANDS:  # each subcommand has its own help, naming itself
        sub = run("runner", cmd, "--help")
        assert sub.returncode == 0 and sub.stdout.startswith(f"usage: runner {cmd} "), (cmd, sub.stdout[:200])


def test_trainer_help_usage():
    r = run("trainer", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: trainer [train] [--config X.yaml | X.yaml]")


def test_console_scripts_are_these_programs():
    """The installed `runner` / `trainer` scripts run this checkout's code: same help, same version."""
    from importlib.metadata import version

    import tomllib

    bindir = Path(sys.executable).parent
    for prog in ("runner", "trainer"):
        r = subprocess.run([str(bindir / prog), "--help"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout == run(prog, "--help").stdout
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert version("runner-trainer") == declared


def test_runner_unknown_subcommand_is_one_line():
    r = run("runner", "frobnicate")
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "frobnicate" in lines[0], r.stderr


def test_runner_does_not_import_torch():
    code = "import sys, runner.cli.main; runner.cli.main.build_parser(); print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
