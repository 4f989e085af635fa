#!/usr/bin/env bash
# Every GPU check of the project in ONE call of a borrowed GPU machine, inside one wall-clock budget
# (a lent machine's time is counted from its start; one prepared call costs least):
#
#   OUT=/some/dir bench/gpu_all.sh [BUDGET_S]        (default 450; run from anywhere)
#
# 1. scripts/perseus-gpu-check.sh: the Perseus loop with NVML read-only (clocks never set), at
#    most 80 s; needs .build/perseus-wheels carried (`scripts/perseus-gpu-check.sh --build-wheels`
#    here first) or it uses its stand-in server.
# 2. bench/gpu_families.py: T5 / BLOOM / Wide-ResNet, tiny and one full-size stage each, at most 140 s (its own budget 120 s).
# 3. bench/gpu_session.sh: `pytest -m gpu` and bench/gpu_throughput.py with all the time left.
# Each part writes into its own folder; $OUT gets one gpu_all.tar.gz of them all (a lent machine
# returns few files) and summary.txt, which is also printed last.
set -u -o pipefail
cd "$(dirname "$0")/.."
BUDGET=${1:-450}
if [ -z "${OUT:-}" ]; then echo "gpu_all: set OUT to the directory that receives the results" >&2; exit 2; fi
mkdir -p "$OUT"
W=$(mktemp -d)
START=$(date +%s)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
part() {  # part NAME MAX_S CMD...: run CMD under min(MAX_S, time left), log to $W/NAME.log
  local name=$1 max=$2; shift 2
  local t=$(left); [ "$t" -gt "$max" ] && t=$max; [ "$t" -lt 20 ] && t=20
  local t0=$(date +%s)
  timeout -k 10 "$t" "$@" > "$W/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $(( $(date +%s) - t0 ))s (limit ${t}s)" >> "$W/summary.txt"
}

part perseus 80 bash scripts/perseus-gpu-check.sh "$W/perseus"
part families 140 python3 bench/gpu_families.py --out "$W/families"
session_budget=$(( $(left) - 15 ))
part session $(( session_budget + 15 )) env PYTEST_MAX_S=90 bash bench/gpu_session.sh "$W/session" "$session_budget"

{
  echo "--- perseus check"; cat "$W/perseus/check.txt" 2>/dev/null || tail -n 5 "$W/perseus.log"
  echo "--- families"; tail -n 25 "$W/families.log"
  echo "--- session"; cat "$W/session/session.json" 2>/dev/null; tail -n 3 "$W/session/pytest_gpu.txt" 2>/dev/null
  tail -n 40 "$W/session/gpu_throughput.log" 2>/dev/null
} >> "$W/summary.txt"
cp "$W/summary.txt" "$OUT/summary.txt"
tar -czf "$OUT/gpu_all.tar.gz" -C "$W" .
cat "$OUT/summary.txt"
echo "gpu_all: done in $(( $(date +%s) - START ))s"
