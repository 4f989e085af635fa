"""An elastic run's recovery (issue 27), on the namespaced sandbox: the reduced Pi pipeline (pp 3,
one stage a node) with `job.elastic`, node-2's link cut after step 4, taken back later. Measured
from the runner's own events (elastic.jsonl: epoch seconds) and the trainer's metrics:

  cut -> detected      the watcher's heartbeat misses node-2 (HEARTBEAT_S + HEARTBEAT_TIMEOUT_S)
  detected -> stopped  node-0/1's containers stopped and removed (grace <= 3 s)
  stopped -> planned   the survivors asked for their last step and pinged, the layout chosen
  planned -> synced    the old containers cleared, the checkpoint's files exchanged between the nodes
  synced -> step       containers started, torch imported, rendezvous, checkpoint loaded, first step

and the same for the rejoin (link back -> node-2 reached -> the 2-node layout stopped with its
preempt checkpoint -> the 3-node layout's first step). Beside it, what the user does without
elasticity: `runner up --resume` by hand on the 2 nodes after noticing (its launch-to-first-step
time is measured; noticing is not).

    .venv/bin/python -m bench.elastic [--repeat 1]

Needs root and the trainer image on this host (scripts/build-image.sh). Results:
bench/results/elastic.json. Target (issue 27): cut -> first new step <= 60 s on this machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.sandbox_bench import REPO, runner

STATE = Path("/tmp/runner-bench-elastic")
IMAGE = "runner-trainer:latest"
ARGS = ["--parallel.partition", "uniform_transformer", "--train.steps", "12", "--checkpoint.interval", "2",
        "--profile_batch", "none"]


def job(hold: str) -> Path:
    p = STATE / "elastic-job.yaml"
    p.write_text(yaml.safe_dump({"job": {
        "image": IMAGE, "config": str(REPO / "configs/pi-qwen3-3stage-tiny.yaml"), "args": ARGS,
        "master_port": "auto", "grace_period": 60, "env": {"OMP_NUM_THREADS": "1", "TRAINER_TEST_HOLD": hold},
        "elastic": {"min_nodes": 2, "rejoin": True}}}))
    return p


def wait(pred, timeout: float = 300.0):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise SystemExit("timed out")


def metrics(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.is_file() else []


def once(inv: Path, workdirs: dict[str, Path]) -> dict:
    link = lambda state: runner("sandbox", "--dir", str(STATE / "s"), "link", "node-2", state)  # noqa: E731
    before = {p.name for p in (workdirs["node-0"] / "runs").glob("*")} if (workdirs["node-0"] / "runs").is_dir() else set()
    proc = subprocess.Popen([sys.executable, "-m", "runner", "up", "-i", str(inv), "--job", str(job("step:4,step:8")),
                             "--logs-dir", str(STATE / "logs")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    try:
        run_id = wait(lambda: next(iter({p.name for p in (workdirs["node-0"] / "runs").glob("*")} - before), None))
        runs = {n: w / "runs" / run_id for n, w in workdirs.items()}
        hold = lambda n, r, s: (runs[n] / ".hold" / f"step-{s}.held.rank{r}").is_file()  # noqa: E731
        wait(lambda: all(hold(n, r, 4) for r, n in enumerate(runs)))
        cut = time.time()
        link("down")
        for n in runs:  # the ranks go on: only the link stops them
            (runs[n] / ".hold" / "step-4.go").write_text("")
        wait(lambda: hold("node-0", 0, 8) and hold("node-1", 1, 8))
        back = time.time()
        link("up")
        wait(lambda: all((runs[n] / ".hold" / f"step-8.signalled.rank{r}").is_file() for r, n in enumerate(list(runs)[:2])))
        for n in ("node-0", "node-1"):
            (runs[n] / ".hold" / "step-8.go").write_text("")
        out, err = proc.communicate(timeout=600)
    finally:
        link("up")
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise SystemExit(out[-2000:] + err[-3000:])
    ev = [json.loads(x) for x in (runs["node-0"] / "elastic.jsonl").read_text().splitlines()]
    lost = next(e for e in ev if e["event"] == "lost")
    shrink, grow = [e for e in ev if e["event"] == "layout"][1:3]
    came = next(e for e in ev if e["event"] == "back")
    first = lambda recs, step: next(r["time"] for r in recs if r["step"] == step)  # noqa: E731
    step_shrunk = first(metrics(runs["node-1"]), shrink["from_step"] + 1)
    step_grown = first(metrics(runs["node-2"]), grow["from_step"] + 1)
    return {"run_id": run_id,
            "shrink": {"detect_s": lost["detected"] - cut, "stop_s": lost["stopped"] - lost["detected"],
                       "replan_s": shrink["planned"] - lost["stopped"], "exchange_s": shrink["synced"] - shrink["planned"],
                       "restart_s": step_shrunk - shrink["synced"], "cut_to_step_s": step_shrunk - cut},
            "rejoin": {"reach_s": came["t"] - back, "stop_s": grow["planned"] - came["t"],
                       "exchange_s": grow["synced"] - grow["planned"], "restart_s": step_grown - grow["synced"],
                       "back_to_step_s": step_grown - back}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    inv = STATE / "local.yaml"
    runner("sandbox", "--dir", str(STATE / "s"), "up", "--nodes", "3", "--netns", "--inventory", str(inv))
    doc = yaml.safe_load(inv.read_text())
    workdirs = {n["name"]: Path(n["workdir"]) for n in doc["nodes"]}
    try:
        runner("push", "-i", str(inv), "--job", str(job("")))
        rows = [once(inv, workdirs) for _ in range(args.repeat)]
    finally:
        runner("sandbox", "--dir", str(STATE / "s"), "down", check=False)
    med = {phase: {k: statistics.median(r[phase][k] for r in rows) for k in rows[0][phase]} for phase in ("shrink", "rejoin")}
    out = {"repeat": args.repeat, "median": med, "runs": rows,
           "machine": "2 cores, namespaced sandbox, tiny Qwen3 pp 3 (configs/pi-qwen3-3stage-tiny.yaml)"}
    res = REPO / "bench" / "results" / "elastic.json"
    res.write_text(json.dumps(out, indent=1) + "\n")
    s, g = med["shrink"], med["rejoin"]
    print(f"node-2 cut -> first step on 2 nodes: {s['cut_to_step_s']:.1f} s = detect {s['detect_s']:.1f} + stop "
          f"{s['stop_s']:.1f} + re-plan {s['replan_s']:.1f} + file exchange {s['exchange_s']:.1f} + restart "
          f"{s['restart_s']:.1f}")
    print(f"node-2 back -> first step on 3 nodes: {g['back_to_step_s']:.1f} s = reach {g['reach_s']:.1f} + stop "
          f"with preempt checkpoint {g['stop_s']:.1f} + file exchange {g['exchange_s']:.1f} + restart {g['restart_s']:.1f}")
    print(f"-> {res.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
