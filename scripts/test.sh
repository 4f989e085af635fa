#!/usr/bin/env bash
# Set up everything the tests need (packages, virtualenv, host dockerd, images) and run them.
# Extra arguments go to pytest (e.g. scripts/test.sh -k sandbox, or -p randomly for a random order).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build-image.sh runner-trainer:latest
.venv/bin/ruff check --quiet runner trainer contract tests bench
# --cov: branch coverage of runner/, trainer/ and contract/ over every test, the trainer ranks and
# runner CLI calls they start included ([tool.coverage] in pyproject.toml); the table is printed
# before pytest's closing line. Order: file order; `-p randomly` shuffles, `--reverse` reverses.
rm -f .coverage .coverage.*
exec .venv/bin/pytest -p no:cacheprovider --cov --cov-report=term "$@"
