#!/usr/bin/env bash
# One GPU session within a fixed wall-clock budget; everything it writes goes under OUT.
#
#   bash bench/gpu_session.sh [--smoke] OUT [BUDGET_S]        (from anywhere; BUDGET_S default 240)
#
# 1. environment.txt: nvidia-smi (read only), torch / CUDA / transformers / pytest versions.
# 2. pytest -m gpu tests/gpu/test_gpu.py, at most PYTEST_MAX_S (default 80 s; the tests run most telling
#    first): pytest_gpu.txt (one line per test as it finishes, so a cut-off run still shows what
#    passed) and pytest_gpu.xml (JUnit, written at the end). A failing test does not stop the session.
# 3. bench gpu_throughput (bench/gpu_throughput.py) with the time left less 10 s: gpu_throughput.json
#    and .csv, rewritten after every row (a run cut off keeps the rows before), gpu_throughput.log,
#    and each row's output in gpu_throughput_logs/. Headline rows first (smollm-360m trainer
#    defaults, then its per-layer compiled plain loop, ...); a row that fails, runs out of memory
#    or times out is recorded as such and the next one runs; rows the budget cannot fit are listed
#    as skipped.
# 4. session.json: each phase's exit code and seconds, the budget, and whether a phase was cut off.
# The whole session ends within BUDGET_S (each phase has its own `timeout`). It changes no GPU
# setting (clocks, persistence, MIG).
#
# Runs with the machine's python3 (PYTHON to choose another) and PYTHONPATH=<repo>: torch with CUDA
# and transformers are all it needs, and pytest for step 2. A machine without pytest: put pytest and
# its pure-Python dependencies in a directory and name it in PYTEST_VENDOR (default: .gpu_vendor/ in
# the repo, if present), e.g. on a machine with network access:
#   pip install --target .gpu_vendor --no-deps pytest pluggy iniconfig packaging pygments exceptiongroup tomli
# Without either, step 2 is recorded as not run and the bench still runs. --smoke runs the same
# bookkeeping on a CPU machine (the bench's tiny CPU rows, the GPU tests skipping).
set -u -o pipefail
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
if [ -z "${1:-}" ]; then echo "gpu_session: usage: gpu_session.sh [--smoke] OUT [BUDGET_S]" >&2; exit 2; fi
BUDGET=${2:-240}
case "$BUDGET" in ''|*[!0-9]*) echo "gpu_session: BUDGET_S must be a whole number of seconds, got '$BUDGET'" >&2; exit 2;; esac
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PYTEST_MAX=${PYTEST_MAX_S:-80}
VENDOR=${PYTEST_VENDOR:-.gpu_vendor}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! $PY -c 'import pytest' 2>/dev/null && [ -d "$VENDOR" ]; then
  export PYTHONPATH="$PYTHONPATH:$(cd "$VENDOR" && pwd)"
fi
START=$(date +%s)
PHASES=""

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET - $(elapsed) )); }
say() { echo "[gpu_session +$(elapsed)s] $*" | tee -a "$OUT/session.log"; }
phase() {  # phase NAME RC SECONDS CUT
  PHASES="$PHASES${PHASES:+,}{\"name\": \"$1\", \"rc\": $2, \"seconds\": $3, \"cut_off\": $4}"
}
cutoff() { { [ "$1" = 124 ] || [ "$1" = 137 ]; } && echo true || echo false; }

say "budget ${BUDGET}s, smoke $SMOKE, python $($PY -c 'import sys; print(sys.version.split()[0])'), out $OUT"

t0=$(date +%s)
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  timeout 20 nvidia-smi 2>&1 || echo "nvidia-smi: not available"
  timeout 60 $PY -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "devices", torch.cuda.device_count())'
  $PY -c 'import pytest; print("pytest", pytest.__version__, pytest.__file__)' 2>&1 | tail -n 1
} > "$OUT/environment.txt" 2>&1
phase environment $? $(( $(date +%s) - t0 )) false

# The GPU tests first, capped: what they leave goes to the bench.
t0=$(date +%s)
test_budget=$(( $(left) - 70 ))
[ "$test_budget" -gt "$PYTEST_MAX" ] && test_budget=$PYTEST_MAX
[ "$test_budget" -lt 10 ] && test_budget=10
if $PY -c 'import pytest' 2>/dev/null; then
  say "pytest -m gpu, at most ${test_budget}s"
  timeout -k 5 "$test_budget" $PY -m pytest -m gpu tests/gpu/test_gpu.py -v -rA -p no:cacheprovider \
    --junitxml="$OUT/pytest_gpu.xml" > "$OUT/pytest_gpu.txt" 2>&1
  rc=$?
else
  echo "pytest is not installed for $PY (and no PYTEST_VENDOR): the GPU tests did not run" > "$OUT/pytest_gpu.txt"
  rc=127
fi
phase pytest_gpu $rc $(( $(date +%s) - t0 )) "$(cutoff $rc)"
say "pytest exit $rc: $(tail -n 1 "$OUT/pytest_gpu.txt")"

# The bench: everything left but 10 s; its own --budget stops it starting rows that cannot fit and
# bounds each row's timeout, `timeout` is only the backstop.
t0=$(date +%s)
bench_budget=$(( $(left) - 10 ))
[ "$bench_budget" -lt 30 ] && bench_budget=30
args=(--budget "$bench_budget" --json "$OUT/gpu_throughput.json" --logs "$OUT/gpu_throughput_logs")
[ "$SMOKE" = 1 ] && args+=(--smoke)
say "bench gpu_throughput, budget ${bench_budget}s"
timeout -k 5 $(( bench_budget + 5 )) $PY -m bench.gpu_throughput "${args[@]}" > "$OUT/gpu_throughput.log" 2>&1
rc=$?
phase gpu_throughput $rc $(( $(date +%s) - t0 )) "$(cutoff $rc)"
say "bench exit $rc; $(grep -cE '^  \S+ batch [0-9]+ ' "$OUT/gpu_throughput.log" || true) row(s) measured or failed"

printf '{"budget_s": %s, "smoke": %s, "wall_s": %s, "phases": [%s]}\n' "$BUDGET" \
  "$([ "$SMOKE" = 1 ] && echo true || echo false)" "$(elapsed)" "$PHASES" > "$OUT/session.json"
say "done in $(elapsed)s: $OUT/session.json"
