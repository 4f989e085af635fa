#!/usr/bin/env bash
# The main job on the local sandbox cluster, end to end, the way a user runs it on three Pis:
#   set-up -> image -> 3 sandbox nodes -> runner up (push, master first, logs) -> runner collect.
# Idempotent: re-running reuses the engine, the images and the running nodes.
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=${NODES:-3}
INV=${INVENTORY:-hosts/local.yaml}

scripts/setup.sh
scripts/build-image.sh runner-trainer:latest
.venv/bin/runner sandbox up --nodes "$NODES" --inventory "$INV"
.venv/bin/runner up --inventory "$INV" "$@"
.venv/bin/runner collect --inventory "$INV"
