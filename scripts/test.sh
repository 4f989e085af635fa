#!/usr/bin/env bash
# Set up everything the tests need (packages, virtualenv, host dockerd, images) and run them.
# Extra arguments go to pytest (e.g. scripts/test.sh -k sandbox).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build-image.sh runner-trainer:latest
.venv/bin/ruff check --quiet runner trainer contract tests bench
exec .venv/bin/pytest -p no:cacheprovider "$@"
