#!/usr/bin/env bash
# The fuzzers (tests/unit/test_fuzz_*.py: what the runner reads, the trainer's command lines) for longer
# than CI runs them: round after round of new random examples until MINUTES are spent, then the
# examples tried per target and the failures found recorded in bench/results/fuzz.json.
#
#   scripts/fuzz.sh [MINUTES]        # default 30; run it under the heavy lock on a shared machine:
#   flock /tmp/heavy-tests.lock scripts/fuzz.sh 30
#
# Each round is `HYPOTHESIS_PROFILE=long pytest tests/unit/test_fuzz_*.py` (tests/support/fuzz_support.py: no
# derandomizing, FUZZ_LONG_EXAMPLES examples per target and round, default 2000). A failing example
# is printed by hypothesis with the blob that reproduces it (@reproduce_failure) in its round's log,
# kept in a /tmp/fuzz-logs.* folder named in the JSON. The last round may run past MINUTES: rounds
# are not cut short. Exit 1 when a round found a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
minutes="${1:-30}"
[[ "$minutes" =~ ^[0-9]+$ ]] || { echo "usage: scripts/fuzz.sh [MINUTES]" >&2; exit 2; }
py=.venv/bin/python
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
logs="$(mktemp -d /tmp/fuzz-logs.XXXXXX)"
start=$(date +%s)
deadline=$((start + minutes * 60))
round=0
while (( $(date +%s) < deadline )) || (( round == 0 )); do
  round=$((round + 1))
  echo "fuzz: round $round ($(( (deadline - $(date +%s)) / 60 )) min left)" >&2
  HYPOTHESIS_PROFILE=long FUZZ_STATS="$work/stats.jsonl" \
    "$py" -m pytest -p no:cacheprovider -p no:randomly -q -W ignore::Warning tests/unit/test_fuzz_*.py \
    --junitxml="$work/round-$round.xml" >"$logs/round-$round.log" 2>&1 || true
done
"$py" - "$work" "$minutes" "$start" "$round" "$logs" <<'EOF'
"""Sum the rounds: examples per target (tests/support/fuzz_support.py's counts), failures per test (junit)."""
import collections, glob, json, os, platform, sys, time
import xml.etree.ElementTree as ET

work, minutes, start, rounds, logs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
examples = collections.Counter()
stats = os.path.join(work, "stats.jsonl")
if os.path.exists(stats):
    with open(stats) as f:
        for line in f:
            examples.update(json.loads(line))
failures, tests = [], collections.Counter()
for path in sorted(glob.glob(os.path.join(work, "round-*.xml"))):
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}.{case.get('name')}"
        tests[name] += 1
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            failures.append({"round": os.path.basename(path)[6:-4], "test": name,
                             "message": (bad.get("message") or "")[:500]})
now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
seconds = int(time.time()) - start


def section(mine) -> dict:
    """One fuzzer's record: per target, the examples tried and how many were accepted."""
    targets = sorted({k.removesuffix(": accepted") for k in examples if mine(k)})
    return {"seconds": seconds, "finished": now, "rounds": rounds,
            "examples": {t: {"total": examples[t], "accepted": examples[f"{t}: accepted"]} for t in targets},
            "failures": sum(1 for f in failures if mine(f["test"].rsplit(".", 1)[0].split("test_fuzz_")[-1]))}


try:
    with open("bench/results/fuzz.json") as f:
        out = json.load(f)
except (OSError, ValueError):
    out = {}
out = out if isinstance(out, dict) else {}
# targets are the runner's (tests/unit/test_fuzz_inventory.py) or the trainer's ("trainer ...")
for name, mine in (("runner", lambda k: not k.startswith("trainer")), ("trainer", lambda k: k.startswith("trainer"))):
    if any(mine(k) for k in examples):
        out[name] = section(mine)
out["last_run"] = {"command": f"scripts/fuzz.sh {minutes}", "finished": now, "seconds": seconds, "rounds": rounds,
                   "host": platform.node(), "profile": "long",
                   "examples_per_round_per_target": int(os.environ.get("FUZZ_LONG_EXAMPLES", "2000")),
                   "test_runs": dict(sorted(tests.items())), "failures_found": len(failures),
                   "failures": failures[:50], "logs": logs}
os.makedirs("bench/results", exist_ok=True)
with open("bench/results/fuzz.json", "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")
total = sum(v for k, v in examples.items() if not k.endswith(": accepted"))
print(f"fuzz: {rounds} rounds in {seconds} s, {total} examples, {len(failures)} failures: bench/results/fuzz.json")
sys.exit(1 if failures else 0)
EOF
