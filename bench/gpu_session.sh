#!/usr/bin/env bash
# One GPU session within a fixed wall-clock budget; everything it writes goes under $OUT.
#
#   OUT=/some/dir bench/gpu_session.sh [--smoke] [BUDGET_S]      (from anywhere; BUDGET_S default 450)
#
# 1. environment.txt: nvidia-smi, torch / CUDA / transformers versions.
# 2. pytest -m gpu tests/test_gpu.py, at most PYTEST_MAX_S (default 150 s): pytest_gpu.txt (one
#    line per test as it finishes, so a cut-off run still shows what passed) and pytest_gpu.xml
#    (JUnit, written at the end).
# 3. bench gpu_throughput (bench/gpu_throughput.py) with all the time left: gpu_throughput.json,
#    rewritten after every row (a run cut off keeps the rows before), gpu_throughput.log, and each
#    row's output in gpu_throughput_logs/. The headline rows run first; rows the budget cannot fit
#    are listed in the JSON as skipped.
# 4. session.json: each phase's exit code and seconds, the budget, and whether a phase was cut off.
#
# Runs with the machine's python3 (PYTHON to choose another) and PYTHONPATH=<repo>: torch with CUDA
# and transformers are all it needs, and pytest for step 2 (a machine without it: put pytest and
# its pure-Python dependencies in a directory, e.g. .gpu_vendor/ in the repo, and name it in
# PYTEST_VENDOR; without either, step 2 is recorded as skipped and the bench still runs). --smoke runs the same bookkeeping on a CPU machine in about
# a minute (the bench's tiny CPU rows, the GPU tests skipping); tests/test_bench_imports.py runs it.
set -u -o pipefail
cd "$(dirname "$0")/.."
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
BUDGET=${1:-450}
case "$BUDGET" in ''|*[!0-9]*) echo "gpu_session: BUDGET_S must be a whole number of seconds, got '$BUDGET'" >&2; exit 2;; esac
if [ -z "${OUT:-}" ]; then echo "gpu_session: set OUT to the directory that receives the results" >&2; exit 2; fi
mkdir -p "$OUT"
PY=${PYTHON:-python3}
PYTEST_MAX=${PYTEST_MAX_S:-150}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! $PY -c 'import pytest' 2>/dev/null && [ -n "${PYTEST_VENDOR:-}" ]; then
  export PYTHONPATH="$PYTHONPATH:$(cd "$PYTEST_VENDOR" && pwd)"
fi
START=$(date +%s)
PHASES=""

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET - $(elapsed) )); }
say() { echo "[gpu_session +$(elapsed)s] $*" | tee -a "$OUT/session.log"; }
phase() {  # phase NAME RC SECONDS CUT
  PHASES="$PHASES${PHASES:+,}{\"name\": \"$1\", \"rc\": $2, \"seconds\": $3, \"cut_off\": $4}"
}

say "budget ${BUDGET}s, smoke $SMOKE, python $($PY -c 'import sys; print(sys.version.split()[0])')"

t0=$(date +%s)
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi 2>&1 || echo "nvidia-smi: not available"
  $PY -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "devices", torch.cuda.device_count())'
  $PY -c 'import pytest; print("pytest", pytest.__version__)' 2>&1 | tail -n 1
} > "$OUT/environment.txt" 2>&1
phase environment $? $(( $(date +%s) - t0 )) false

# The GPU tests first, capped (PYTEST_MAX_S, default 150): what they leave goes to the bench, which
# can always use more time (more rows).
t0=$(date +%s)
test_budget=$(left)
[ "$test_budget" -gt "$PYTEST_MAX" ] && test_budget=$PYTEST_MAX
[ "$test_budget" -lt 30 ] && test_budget=30
if $PY -c 'import pytest' 2>/dev/null; then
  say "pytest -m gpu, at most ${test_budget}s"
  timeout -k 10 "$test_budget" $PY -m pytest -m gpu tests/test_gpu.py -v -rA -p no:cacheprovider \
    --junitxml="$OUT/pytest_gpu.xml" > "$OUT/pytest_gpu.txt" 2>&1
  rc=$?
else
  echo "pytest is not installed for $PY (and no PYTEST_VENDOR): the GPU tests did not run" > "$OUT/pytest_gpu.txt"
  rc=127
fi
phase pytest_gpu $rc $(( $(date +%s) - t0 )) $([ $rc = 124 ] || [ $rc = 137 ] && echo true || echo false)
say "pytest exit $rc: $(tail -n 1 "$OUT/pytest_gpu.txt")"

# The bench: everything left; its own --budget stops it starting rows that cannot fit, and
# `timeout` is only the backstop.
t0=$(date +%s)
bench_budget=$(left)
[ "$bench_budget" -lt 60 ] && bench_budget=60
args=(--budget "$bench_budget" --json "$OUT/gpu_throughput.json" --logs "$OUT/gpu_throughput_logs")
[ "$SMOKE" = 1 ] && args+=(--smoke)
say "bench gpu_throughput, budget ${bench_budget}s"
timeout -k 10 $(( bench_budget + 30 )) $PY -m bench.gpu_throughput "${args[@]}" > "$OUT/gpu_throughput.log" 2>&1
rc=$?
phase gpu_throughput $rc $(( $(date +%s) - t0 )) $([ $rc = 124 ] || [ $rc = 137 ] && echo true || echo false)
say "bench exit $rc; $(grep -cE '^  \S+ batch [0-9]+ ' "$OUT/gpu_throughput.log" || true) row(s) measured or failed"

printf '{"budget_s": %s, "smoke": %s, "wall_s": %s, "phases": [%s]}\n' "$BUDGET" \
  "$([ "$SMOKE" = 1 ] && echo true || echo false)" "$(elapsed)" "$PHASES" > "$OUT/session.json"
say "done in $(elapsed)s: $OUT/session.json"
