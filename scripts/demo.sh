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

# Plots of what came back: the pipeline Gantt chart from the merged timeline (master node) and
# loss / tokens-per-second from metrics.jsonl (the node that owns the loss).
run=$(ls -td artifacts/*/ | head -n 1)
for d in "$run"*/; do .venv/bin/trainer plot "$d" >/dev/null 2>&1 || true; done
echo "[demo] collected run: $run"
find "$run" \( -name 'timeline_batch*_all.json' -o -name '*.png' -o -name metrics.jsonl \) | sort | sed 's/^/[demo]   /'
