"""The type-checking habit (scripts/mypy_check.py, run by scripts/test.sh before pytest): mypy's
errors are held to .mypy-baseline.json, which only shrinks. Checked here without running mypy
(seconds): how the check compares counts, and what the committed baseline and configuration say."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests import REPO

spec = importlib.util.spec_from_file_location("mypy_check", REPO / "scripts" / "mypy_check.py")
assert spec is not None and spec.loader is not None
mypy_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mypy_check)


def test_counts_are_enforced_per_package_and_a_move_inside_one_is_free():
    base = {
        "runner/transport/ssh.py": 3,
        "runner/transport/sftp.py": 1,
        "runner/api.py": 0,
        "contract/plots.py": 0,
    }
    # Two errors move from ssh.py to a new file of the same package: nothing rises.
    moved = {"runner/transport/ssh.py": 1, "runner/transport/new.py": 2, "runner/transport/sftp.py": 1}
    assert mypy_check.compare(moved, base) == ({}, {})
    # One more in the package, and one in the strict contract: both over, and only the files that grew shown.
    worse = {"runner/transport/ssh.py": 3, "runner/transport/sftp.py": 2, "contract/timeline.py": 1}
    over, under = mypy_check.compare(worse, base)
    assert over == {"runner/transport": (5, 4), "contract": (1, 0)} and under == {}
    assert mypy_check.grown_files(worse, base, set(over)) == {
        "runner/transport/sftp.py",
        "contract/timeline.py",
    }
    # Fewer: under, named so the baseline is lowered.
    assert mypy_check.compare({"runner/transport/ssh.py": 1}, base) == ({}, {"runner/transport": (1, 4)})


@pytest.mark.parametrize(
    "path, unit",
    [
        ("runner/transport/ssh.py", "runner/transport"),
        ("runner/backends/ssh/status.py", "runner/backends"),
        ("runner/api.py", "runner/api.py"),
        ("trainer/train.py", "trainer/train.py"),
        ("contract/plots.py", "contract"),
        ("trainer/parallel/pipeline.py", "trainer/parallel"),
    ],
)
def test_a_package_is_the_second_level_folder_or_a_top_level_module(path, unit):
    assert mypy_check.package(path) == unit


def test_the_committed_baseline_is_at_most_half_of_the_count_it_started_from():
    """Issue 56: runner/ and contract/ held to at most half the errors of a default mypy run when
    the baseline was made; the per-file counts are what the check reads."""
    doc = json.loads((REPO / ".mypy-baseline.json").read_text())
    files = doc["files"]
    assert all(isinstance(n, int) and n > 0 for n in files.values()), files
    assert all(f.split("/")[0] in ("runner", "contract", "trainer") for f in files), sorted(files)
    held = sum(n for f, n in files.items() if f.startswith(("runner/", "contract/")))
    start = doc["start"]["runner"] + doc["start"]["contract"]
    assert held <= start // 2, (held, start)


def test_the_api_and_the_contract_are_checked_strictly():
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    assert cfg["files"] == ["runner", "contract", "trainer"] and cfg["cache_dir"].startswith(".build/")
    strict = [o for o in cfg["overrides"] if o.get("disallow_untyped_defs")]
    assert len(strict) == 1 and set(strict[0]["module"]) == {"runner.api", "contract", "contract.*"}
    # --strict's per-module flags, every one (`strict = true` in an override turns them on for all modules).
    assert (
        all(
            strict[0].get(flag) is True
            for flag in (
                "disallow_any_generics",
                "disallow_subclassing_any",
                "disallow_untyped_calls",
                "disallow_incomplete_defs",
                "check_untyped_defs",
                "disallow_untyped_decorators",
                "warn_unused_ignores",
                "warn_return_any",
                "strict_equality",
                "extra_checks",
            )
        )
        and strict[0].get("implicit_reexport") is False
    )
    assert not any("strict" in o for o in cfg["overrides"])


def test_the_test_command_runs_the_check_after_ruff_and_before_pytest():
    script = (REPO / "scripts" / "test.sh").read_text()
    ruff, mypy, pytest_ = (script.index(s) for s in ("ruff check", "scripts/mypy_check.py", "bin/pytest"))
    assert ruff < mypy < pytest_
