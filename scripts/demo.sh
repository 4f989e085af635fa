#!/usr/bin/env bash
# The main job on the local sandbox cluster, end to end, the way a user runs it on three Pis:
#   set-up -> image -> 3 sandbox nodes -> runner up (push, master first, logs) -> runner collect.
# Idempotent: re-running reuses the engine, the images and the running nodes.
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=${NODES:-3}
INV=${INVENTORY:-hosts/local.yaml}
say() { printf '[demo] %s\n' "$*"; }

scripts/setup.sh
scripts/build-image.sh runner-trainer:latest
.venv/bin/runner sandbox up --nodes "$NODES" --inventory "$INV"

# `runner up` streams every rank's log prefixed [node/rank]; keep a copy to read the run id from.
up_log=$(mktemp)
trap 'rm -f "$up_log"' EXIT
.venv/bin/runner up --inventory "$INV" "$@" | tee "$up_log"
run=$(sed -n 's/^run \([^ ]*\) started.*/\1/p' "$up_log" | head -n 1)
[[ -n $run ]] || { echo "[demo] error: no run id in the output of runner up" >&2; exit 1; }
.venv/bin/runner collect "$run" --inventory "$INV"

# Plots of what came back (collect renders them; this is a no-op then): the pipeline Gantt chart
# from the merged timeline (master node) and loss / tokens-per-second from metrics.jsonl.
dir=artifacts/$run
for d in "$dir"/*/; do
  if compgen -G "$d/timeline_batch*_all.json" >/dev/null || [[ -f $d/metrics.jsonl ]]; then
    ls "$d"/*.png >/dev/null 2>&1 || .venv/bin/trainer plot "$d" >/dev/null
  fi
done
timeline=$(find "$dir" -name 'timeline_batch*_all.json' | sort | head -n 1)
gantt=$(find "$dir" -name 'timeline_batch*gantt*.png' | sort | head -n 1)
loss=$(find "$dir" \( -name 'metrics*.png' -o -name 'loss*.png' \) | sort | head -n 1)
for what in timeline gantt loss; do
  [[ -n ${!what} ]] || { echo "[demo] error: run $run: no $what file under $dir" >&2; exit 1; }
done
say "run $run collected under $dir/"
say "  timeline (Chrome trace, open in https://ui.perfetto.dev): $timeline"
say "  pipeline Gantt chart: $gantt"
say "  loss and tokens/s:    $loss"
