#!/usr/bin/env bash
# The Perseus loop on one NVIDIA GPU, read-only: the GPU's NVML clock list and its energy counter
# reach the Perseus server's results. Clocks are never set: the trainer runs with
# profile.gpu_clocks off, and inside it every pynvml nvmlDeviceSet*/nvmlDeviceReset* call is
# replaced by one that refuses and records the attempt (a borrowed machine's settings stay as they are).
#
#   here (PyPI):   scripts/perseus-gpu-check.sh --build-wheels    # .build/perseus-wheels: the server's
#                                                                 # pure wheels (zeus 0.16, pydantic 1, fastapi...), ~1.2 MB
#   here (CPU):    scripts/perseus-gpu-check.sh --smoke [OUT]     # the same path without a GPU (~1-2 min)
#   GPU host:      bash scripts/perseus-gpu-check.sh OUT          # python3 with torch+CUDA, transformers,
#                                                                 # pandas, nvidia-ml-py; no network (~1 min)
#
# The server: Zeus's, installed from .build/perseus-wheels (carried to the GPU host) into a temp dir
# that only the server's process sees; it takes pandas from the host. Without the wheelhouse, or if
# that server does not import, a STAND-IN (stdlib, this script, not Zeus) answers the same four
# endpoints, so the trainer's client path (registration with the clock list, per-round results
# with NVML energies) is still recorded; check.txt says which server ran.
# OUT gets at most 8 files (what a device run brings back): check.txt, ranks.json (registration),
# results.json (every round's results), plans-0.csv, profile.csv, trainer.log, server.log,
# bundle.tar.gz (the server's dump and the trainer's run dir). Exit 0 when every check passed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHEELS=${PERSEUS_WHEELS:-$ROOT/.build/perseus-wheels}
REQ=docker/requirements-perseus.txt
MODE=gpu
case ${1:-} in
  --build-wheels) MODE=wheels; shift ;;
  --smoke) MODE=smoke; shift ;;
  -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
esac
log() { printf '[perseus-gpu-check] %s\n' "$*" >&2; }

if [[ $MODE == wheels ]]; then
  PY=${PYTHON:-.venv/bin/python}
  rm -rf "$WHEELS"; mkdir -p "$WHEELS"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --platform any --implementation py --python-version 3.12 \
    -d "$WHEELS" -r "$REQ"
  log "wheelhouse $WHEELS: $(ls "$WHEELS" | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1)"
  exit 0
fi

OUT=${1:-${OUT:-$ROOT/.build/perseus-gpu-check}}
if [[ $MODE == smoke ]]; then PY=${PYTHON:-$ROOT/.venv/bin/python}; else PY=${PYTHON:-python3}; fi
mkdir -p "$OUT"
rm -f "$OUT"/{check.txt,ranks.json,results.json,plans-0.csv,profile.csv,trainer.log,server.log,bundle.tar.gz}
WORK=$(mktemp -d /tmp/perseus-gpu-check.XXXXXX)
SERVER=
cleanup() { [[ -n $SERVER ]] && kill "$SERVER" 2>/dev/null || true; }
trap cleanup EXIT
T0=$(date +%s)
DUMP=$WORK/dump RUN=$WORK/run
mkdir -p "$DUMP"

# Two plans for the rank's F0 B0 (pp 1, one microbatch): numbers a plan might hold, never applied here.
printf '[[("forward", 1410), ("backward", 1410)]]\n' > "$WORK/plan-0.py"
printf '[[("forward", 1200), ("backward", 1005)]]\n' > "$WORK/plan-1.py"

# --- the server: Zeus from the wheelhouse, else the stand-in ----------------------------------
KIND=
if [[ -d $WHEELS ]] && "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps --no-compile \
     --target "$WORK/perseus" -r "$REQ" >"$WORK/pip.log" 2>&1; then
  if PYTHONPATH=$WORK/perseus:$ROOT "$PY" -m runner.agents.perseus_server --check >"$WORK/server-check.txt" 2>&1; then
    KIND="zeus ($(cat "$WORK/server-check.txt"))"
    PYTHONPATH=$WORK/perseus:$ROOT "$PY" -m runner.agents.perseus_server --port 0 --ready-file "$WORK/ready" \
      --dump-dir "$DUMP" --scheduler PlanSequence --plan "$WORK/plan-0.py" --plan "$WORK/plan-1.py" \
      >"$WORK/server.out" 2>&1 &
    SERVER=$!
  else
    log "Zeus's server does not import on $("$PY" -V): $(tail -1 "$WORK/server-check.txt"); using the stand-in"
  fi
else
  log "no usable wheelhouse at $WHEELS (scripts/perseus-gpu-check.sh --build-wheels, then carry it); using the stand-in"
fi
if [[ -z $KIND ]]; then
  KIND="STAND-IN (stdlib, not Zeus: the wheelhouse was missing or Zeus did not import)"
  cat >"$WORK/standin.py" <<'EOF'
"""A STAND-IN for Zeus's pipeline frequency server (not Zeus): the four endpoints the trainer's
client uses, PlanSequence's behaviour, and Zeus's dump layout (ranks.json, N.sched.json, N.prof.json)."""
import ast, json, logging, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ready, dump, plans = Path(sys.argv[1]), Path(sys.argv[2]), [ast.literal_eval(Path(p).read_text()) for p in sys.argv[3:]]
job = "standin+dp1+pp1+tp1+PlanSequence"
d = dump / job
d.mkdir(parents=True)
logging.basicConfig(filename=dump / "server.log", level=logging.INFO, format="%(asctime)s %(message)s")
ranks, served, results = [], {}, {}

class H(BaseHTTPRequestHandler):
    def _send(self, status, doc):
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self):
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")

    def do_POST(self):
        if self.path == "/register_job":
            logging.info("register_job %s", self._body())
            return self._send(200, job)
        if self.path.startswith("/register_rank/"):
            ranks.append(self._body())
            (d / "ranks.json").write_text(json.dumps(ranks))
            return self._send(200, None)
        if self.path.startswith("/result/"):
            r = self._body()
            n = served[r["rank"]] - 1
            results.setdefault(n, []).append(r)
            (d / f"{n}.prof.json").write_text(json.dumps(results[n]))
            return self._send(200, None)
        self._send(404, {"detail": "not found"})

    def do_GET(self):
        rank = int(self.path.split("rank=")[1])
        n = served.get(rank, 0)
        if n >= len(plans):
            logging.info("[profiling-done] all %d plans ran", len(plans))
            return self._send(400, {"detail": f"[profiling-done] all {len(plans)} plans ran"})
        served[rank] = n + 1
        sched = {"rank": rank, "frequencies": [list(p) for p in plans[n][rank]]}
        (d / f"{n}.sched.json").write_text(json.dumps([sched]))
        self._send(200, sched)

    def log_message(self, fmt, *args):
        logging.info(fmt, *args)

srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
ready.write_text(f"{srv.server_address[1]}\n")
srv.serve_forever()
EOF
  "$PY" "$WORK/standin.py" "$WORK/ready" "$DUMP" "$WORK/plan-0.py" "$WORK/plan-1.py" >"$WORK/server.out" 2>&1 &
  SERVER=$!
fi
for _ in $(seq 600); do [[ -f $WORK/ready ]] && break; kill -0 "$SERVER" 2>/dev/null || break; sleep 0.1; done
[[ -f $WORK/ready ]] || { log "server did not start:"; tail -5 "$WORK/server.out" >&2; exit 1; }
URL=http://127.0.0.1:$(tr -d '\n' <"$WORK/ready")
log "server $KIND on $URL after $(( $(date +%s) - T0 )) s"

# --- NVML, read only: the clocks before and after ---------------------------------------------
cat >"$WORK/clocks.py" <<'EOF'
import json, sys
doc = {}
try:
    import pynvml as n
    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByIndex(0)
    doc["name"] = str(n.nvmlDeviceGetName(h))
    for key, read in [("applications_graphics_mhz", lambda: n.nvmlDeviceGetApplicationsClock(h, n.NVML_CLOCK_GRAPHICS)),
                      ("applications_memory_mhz", lambda: n.nvmlDeviceGetApplicationsClock(h, n.NVML_CLOCK_MEM)),
                      ("default_applications_graphics_mhz",
                       lambda: n.nvmlDeviceGetDefaultApplicationsClock(h, n.NVML_CLOCK_GRAPHICS)),
                      ("max_graphics_mhz", lambda: n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_GRAPHICS))]:
        try:
            doc[key] = read()
        except Exception as e:  # this field is not supported here: say so, compare the rest
            doc[key] = f"{type(e).__name__}: {e}"
except Exception as e:  # no GPU or no NVML: nothing to compare
    doc["unavailable"] = f"{type(e).__name__}: {e}"
json.dump(doc, open(sys.argv[1], "w"))
EOF
"$PY" "$WORK/clocks.py" "$WORK/clocks-before.json"

# --- the trainer: the project's client path, gpu_clocks off, NVML setters refused ---------------
cat >"$WORK/guarded_trainer.py" <<'EOF'
"""`python -m trainer ...` with every pynvml setter and resetter replaced by a refusal."""
import os, runpy, sys
import pynvml

def refuse(name):
    def f(*args, **kwargs):
        with open(os.environ["NVML_SET_ATTEMPTS"], "a") as fh:
            fh.write(name + "\n")
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
    return f

for name in dir(pynvml):
    if name.startswith(("nvmlDeviceSet", "nvmlDeviceReset")):
        setattr(pynvml, name, refuse(name))
sys.argv = ["trainer", *sys.argv[1:]]
runpy.run_module("trainer", run_name="__main__", alter_sys=True)
EOF
if [[ $MODE == smoke ]]; then
  MODEL=(--model.preset tiny-llama --data.seq_len 32 --train.batch_size 4 --parallel.device cpu)
else  # ~0.1 s a step on an H100: the energy counter moves within every step
  MODEL=(--model.preset smollm-135m --data.seq_len 1024 --train.batch_size 32 --parallel.device cuda
         --train.compile false)
fi
# warm-up + 2 plans x 3 steps, then [profiling-done] ends the run (train_steps 50 is never reached)
set +e
NVML_SET_ATTEMPTS=$WORK/nvml-set-attempts.txt PYTHONPATH=$ROOT OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} \
  timeout 300 "$PY" "$WORK/guarded_trainer.py" "${MODEL[@]}" --train_steps 50 --num_prof_steps 3 \
  --perseus_url "$URL" --profile.gpu_clocks off --profile_batch none --export_timing_csv --output-dir "$RUN" \
  >"$OUT/trainer.log" 2>&1
TRAINER_RC=$?
set -e
"$PY" "$WORK/clocks.py" "$WORK/clocks-after.json"
log "trainer exited $TRAINER_RC after $(( $(date +%s) - T0 )) s"

# --- what reached the server, checked -----------------------------------------------------------
set +e
SMOKE=$([[ $MODE == smoke ]] && echo 1 || echo 0) KIND=$KIND TRAINER_RC=$TRAINER_RC \
  "$PY" - "$OUT" "$DUMP" "$RUN" "$WORK" <<'EOF' | tee "$OUT/check.txt"
import csv, glob, json, os, sys
out, dump, run, work = sys.argv[1:5]
smoke = os.environ["SMOKE"] == "1"
fails = []
def check(ok, what):
    print(("PASS " if ok else "FAIL ") + what)
    ok or fails.append(what)
try:
    print(f"server: {os.environ['KIND']}")
    before, after = (json.load(open(f"{work}/clocks-{w}.json")) for w in ("before", "after"))
    print(f"NVML clocks before: {before}")
    print(f"NVML clocks after:  {after}")
    check(os.environ["TRAINER_RC"] == "0", f"the trainer exited 0 ({os.environ['TRAINER_RC']})")
    check(not os.path.exists(f"{work}/nvml-set-attempts.txt"),
          "no NVML set/reset call was attempted" + ("" if not os.path.exists(f"{work}/nvml-set-attempts.txt")
                                                  else f": {open(f'{work}/nvml-set-attempts.txt').read().split()}"))
    check(before == after, "the GPU's applications clocks are unchanged" + (" (smoke: no GPU)" if smoke else ""))
    jobs = [d for d in glob.glob(f"{dump}/*") if os.path.isdir(d)]
    check(len(jobs) == 1, f"one job in the server's dump ({len(jobs)})")
    ranks = json.load(open(f"{jobs[0]}/ranks.json"))
    json.dump(ranks, open(f"{out}/ranks.json", "w"), indent=1)
    freqs = ranks[0]["available_frequencies"]
    check(smoke or (len(freqs) > 1 and all(isinstance(f, int) and f > 0 for f in freqs) and freqs == sorted(freqs, reverse=True)),
          f"NVML clock list reached the server: {len(freqs)} clocks, {freqs[:1]}..{freqs[-1:]} MHz"
          + (" (smoke: no GPU, [] expected)" if smoke else ""))
    rounds = sorted(glob.glob(f"{jobs[0]}/*.prof.json"), key=lambda p: int(os.path.basename(p).split(".")[0]))
    results = [json.load(open(p)) for p in rounds]
    json.dump(results, open(f"{out}/results.json", "w"), indent=1)
    check(len(results) == 2, f"exactly 2 rounds of results, then [profiling-done] ({len(results)})")
    for i, per_rank in enumerate(results):
        r = per_rank[0]
        check(len(r["iter_time"]) == 3 and all(t > 0 for t in r["iter_time"]),
              f"round {i}: 3 iteration times {[round(t, 4) for t in r['iter_time']]} s")
        e, fe, be = r["iter_energy"], r["energy_breakdown"]["forward"], r["energy_breakdown"]["backward"]
        if smoke:
            check(e == [0.0] * 3, f"round {i}: no sensor here, energies 0 {e}")
            continue
        check(all(x > 0 for x in e), f"round {i}: iteration energies {[round(x, 2) for x in e]} J")
        inst = [x for step in fe + be for x in step]
        check(all(x > 0 for x in inst), f"round {i}: every instruction's energy > 0: forward "
              f"{[[round(x, 3) for x in s] for s in fe]} J, backward {[[round(x, 3) for x in s] for s in be]} J")
        w = [sum(s) for s in r["time_breakdown"]["forward"]], [sum(s) for s in r["time_breakdown"]["backward"]]
        print(f"     round {i}: average power {sum(e) / sum(r['iter_time']):.0f} W; forward {w[0]} s, backward {w[1]} s")
    rows = list(csv.DictReader(open(f"{run}/plans-0.csv")))
    check(len(rows) == 4 and {x["applied"] for x in rows} == {"false"}, "plans-0.csv: 2 plans recorded, none applied")
    log = open(f"{run}/logs/rank0.log").read()
    check(smoke or "energy sensor: NVML GPU-" in log,
          "the rank read its GPU's NVML energy counter" + (" (smoke: not checked)" if smoke else ""))
    check(log.count("NOT applied (profile.gpu_clocks off)") == 2, "clocks stayed off: each plan logged as not applied")
    check(os.path.getsize(f"{run}/profile.csv") > 0 and os.path.exists(f"{run}/time-energy-0.csv"),
          "profile.csv and time-energy-0.csv written")
except Exception as e:  # a file the run should have written is missing or malformed
    check(False, f"the results could not be read: {type(e).__name__}: {e}")
print(f"{'OK' if not fails else 'FAILED'}: {len(fails)} failure(s)")
sys.exit(1 if fails else 0)
EOF
CHECK_RC=${PIPESTATUS[0]}
set -e
cp "$RUN/plans-0.csv" "$RUN/profile.csv" "$OUT/" 2>/dev/null || true
cp "$DUMP/server.log" "$OUT/server.log" 2>/dev/null || cp "$WORK/server.out" "$OUT/server.log"
tar -czf "$OUT/bundle.tar.gz" -C "$WORK" dump run server.out clocks-before.json clocks-after.json 2>/dev/null || true
rm -rf "$WORK"
log "done in $(( $(date +%s) - T0 )) s; results in $OUT"
exit "$CHECK_RC"
