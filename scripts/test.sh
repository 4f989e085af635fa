#!/usr/bin/env bash
# Set up everything the tests need (packages, virtualenv, host dockerd, images) and run them.
# Extra arguments go to pytest (e.g. scripts/test.sh -k sandbox, or -p randomly for a random order).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build-image.sh runner-trainer:latest
.venv/bin/ruff check --quiet runner trainer contract tests bench
# Types: mypy over runner/, contract/ and trainer/ ([tool.mypy]), failing where a package has more
# errors than .mypy-baseline.json allows (it only shrinks; runner/api.py and contract/ strict). Its
# cache is .build/mypy: about a minute from cold, seconds after.
.venv/bin/python scripts/mypy_check.py
# The docs site, strictly: a broken link, a missing page or anchor, a bench table that no longer
# renders from bench/results/ fails here, in seconds, before the tests (mkdocs.yml; .build/ is ignored).
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir .build/site
# --cov: branch coverage of runner/, trainer/ and contract/ over every test ([tool.coverage] in
# pyproject.toml), the table printed before pytest's closing line. The tests' own process and the
# `runner` CLI processes they start (tests/support/runner_helpers.py; COVER_RUNNER=0: not those):
# measuring the trainer ranks they start too (COVER_SUBPROCESSES=1: every Python subprocess) costs
# 36-45% more CPU in each, which CI's time cannot take. Order: file order; `-p randomly`
# shuffles, `--reverse` reverses.
export COVERAGE_FILE=$PWD/.coverage
rm -f .coverage .coverage.*
if [[ ${COVER_SUBPROCESSES:-} == 1 ]]; then
  export COVERAGE_PROCESS_START=$PWD/pyproject.toml  # started in every Python subprocess (coverage's .pth)
fi
cov=(--cov --cov-report=term)
[[ ${COVERAGE:-1} == 0 ]] && cov=()  # COVERAGE=0: no measurement at all
# Two workers by default (TEST_WORKERS=0: one process): each cluster's tests on one worker, the rest
# beside them, filling the time the sandbox tests wait on nodes, links and grace periods
# (tests/support/worker_share.py). The longest groups go out first, by tests/durations.json; TEST_TIMES=FILE
# records each test's span there, and `python -m tests.support.worker_share FILE` rewrites durations.json.
workers=(-n "${TEST_WORKERS:-2}" --dist loadgroup)
[[ ${TEST_WORKERS:-2} == 0 ]] && workers=(-p no:xdist)
# --durations: the 30 slowest steps close every run, so CI's own output says where its time went.
rc=0
.venv/bin/pytest -p no:cacheprovider --durations=30 "${workers[@]}" "${cov[@]}" "$@" || rc=$?
# The floor of runner/backends/ (docs/testing.md): each of its modules at least 70% covered, in lines
# and in the table's figure (lines and branches), with the `runner` CLI processes the tests start
# measured (tests/support/runner_helpers.py runner_cmd). One line after the table; it fails only a
# whole run (no arguments: the README's and CI's command, every cluster up after setup.sh) that
# passed: a subset, or a run cut short by a failure, leaves modules low by design.
if [[ ${COVERAGE:-1} != 0 && -f .coverage ]]; then
  mkdir -p .build
  enforce=$([[ $# == 0 && $rc == 0 ]] && echo 1 || echo 0)
  .venv/bin/coverage json -q -o .build/backends-coverage.json --include='runner/backends/*' &&
  .venv/bin/python - .build/backends-coverage.json "$enforce" <<'PY' || rc=$((rc ? rc : enforce))
import json, sys
FLOOR = 70
files = json.load(open(sys.argv[1]))["files"]
low = {f: min(int(s["percent_covered_display"]), int(s["percent_statements_covered_display"]))  # as the table rounds
       for f, s in ((f, d["summary"]) for f, d in files.items())}
under = sorted((p, f) for f, p in low.items() if p < FLOOR)
lowest = min((p, f) for f, p in low.items())
names = ", ".join(f"{f} {p}%" for p, f in under[:5]) + (f" and {len(under) - 5} more" if len(under) > 5 else "")
print(f"coverage: runner/backends/: {len(low)} modules, the lowest {lowest[1]} {lowest[0]}%; under the "
      f"{FLOOR}% floor: {names or 'none'}" + ("" if sys.argv[2] == "1" else " (not enforced: a subset or a failed run)"))
sys.exit(1 if under and sys.argv[2] == "1" else 0)
PY
fi
exit $rc
