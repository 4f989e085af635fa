"""Both console entry points answer --help; mistakes get one line and a non-zero exit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=REPO, timeout=120)


@pytest.mark.parametrize("prog", ["runner", "trainer"])
def test_help_exits_zero(prog):
    r = run(prog, "--help")
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout.lower()


def test_console_scripts_installed():
    bindir = __import__("pathlib").Path(sys.executable).parent
    for prog in ("runner", "trainer"):
        r = subprocess.run([str(bindir / prog), "--help"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr


def test_runner_unknown_subcommand_is_one_line():
    r = run("runner", "frobnicate")
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "frobnicate" in lines[0], r.stderr


def test_runner_does_not_import_torch():
    code = "import sys, runner.cli; runner.cli.build_parser(); print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
