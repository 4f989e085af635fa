"""The measured start of the `runner` CLI processes the tests run (tests/support/runner_helpers.py
runner_cmd, docs/testing.md): the runner's own code is measured into a data file of its own beside
the tests' (which pytest-cov combines), the runner behaves as `python -m runner` does, and nothing
it starts is measured: coverage's variables are gone from its environment."""

from __future__ import annotations

import os
import subprocess
import sys

import coverage

from tests.support import runner_helpers
from tests.support.runner_helpers import REPO

_RUN = "runpy.run_module('runner', run_name='__main__', alter_sys=True)\n"


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}


def _measured(tmp_path) -> str:
    return runner_helpers._MEASURED.format(config=str(REPO / "pyproject.toml"), data=str(tmp_path / ".coverage"))


def test_a_measured_runner_prints_the_same_and_saves_its_own_data(tmp_path):
    env = _plain_env()
    measured = subprocess.run([sys.executable, "-c", _measured(tmp_path), "up", "-i", "hosts/pis.yaml", "--dry-run"],
                              capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    plain = subprocess.run([sys.executable, "-m", "runner", "up", "-i", "hosts/pis.yaml", "--dry-run"],
                           capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert (measured.returncode, measured.stdout, measured.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert plain.returncode == 0 and "node" in plain.stdout
    (data_file,) = tmp_path.glob(".coverage.*")   # parallel = true: the process's own file
    data = coverage.CoverageData(str(data_file))
    data.read()
    measured_files = {os.path.relpath(f, REPO) for f in data.measured_files()}
    assert {"runner/cli/main.py", "runner/backends/ssh/dry_run.py"} <= measured_files
    assert data.has_arcs()  # branch = true, as the tests' own data: the two combine


def test_what_a_measured_runner_starts_is_not_measured(tmp_path):
    """The runner's children (a Slurm job's ranks get the submitter's environment through sbatch)
    see none of coverage's variables, and a COVERAGE_FILE the runner was given stays as it was."""
    probe = ("import coverage, subprocess, sys\n"
             "print(coverage.Coverage.current() is not None)\n"
             "print(sorted(k for k in os.environ if k.startswith('COVERAGE')))\n"
             "print(subprocess.run([sys.executable, '-c', 'import coverage; print(coverage.Coverage.current())'],"
             " capture_output=True, text=True).stdout.strip())\n")
    code = _measured(tmp_path)
    assert code.endswith(_RUN)
    for given, names in (({}, "[]"), ({"COVERAGE_FILE": "/given/.cov"}, "['COVERAGE_FILE']")):
        res = subprocess.run([sys.executable, "-c", code.replace(_RUN, probe)], capture_output=True, text=True,
                             env={**_plain_env(), **given}, timeout=120)
        assert res.returncode == 0, res.stderr
        assert res.stdout.splitlines() == ["True", names, "None"]


def test_no_measured_start_when_every_subprocess_is_measured_or_it_is_turned_off(monkeypatch):
    monkeypatch.setenv("COVER_RUNNER", "0")
    assert runner_helpers.runner_cmd("ls")[1:] == ["-m", "runner", "ls"]
    monkeypatch.delenv("COVER_RUNNER")
    monkeypatch.setenv("COVERAGE_PROCESS_START", str(REPO / "pyproject.toml"))  # COVER_SUBPROCESSES=1
    assert runner_helpers.runner_cmd("ls")[1:] == ["-m", "runner", "ls"]
