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

With `--path in-place` (or `both`) the same cut with `--elastic.in_place true` (issue 58): the
survivors regroup in their processes, stages from memory (trainer/parallel/stage_relayout.py):

  cut -> detected      as above
  detected -> file     the runner chose the layout and wrote regroup.json to the survivors
  file -> resumed      the ranks left the old group, met in the new one, rebuilt and loaded their stages
  resumed -> step      the first new step logged

and node-2's link back, it joins the running ranks in place (`rejoin`):

  back -> reached      the runner's retry reaches node-2 again (the `back` event)
  reached -> ready     its one container started, torch imported, its trainer waits (`ready`);
                       the 2-node layout trains on meanwhile. Split: the runner's launch (the watch
                       taking the node back, port, plan, files, container created and started),
                       container start -> the trainer's process, its imports up to `ready`
  ready -> file        regroup.json of the 3-node layout written
  file -> resumed      the running ranks switched at their next step boundary, node-2 took its stage
  resumed -> step      node-2's first step
  pause                the running ranks' gap between their last 2-node step and the first 3-node
                       one, less their usual step time: what the rejoin cost the training

plus the steps redone and the replicas' cost: the training thread's seconds per refresh against the
median step (target, issue 58: cut -> first new step <= 15 s, <= 1 step redone, replicas < 3%).

    .venv/bin/python -m bench.elastic [--repeat 1] [--path both|restart|in-place] [--image TAG]

Needs root and the trainer image on this host (scripts/build-image.sh). Results:
bench/results/elastic.json. Target (issue 27): cut -> first new step <= 60 s on this machine.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.sandbox_bench import REPO, runner
from tests.support.trainer_run import HOOKS_SYNC, hold_env

STATE = Path("/tmp/runner-bench-elastic")
IMAGE = "runner-trainer:latest"
IN_PLACE_STEPS = 200  # the in-place run: long enough that the 2-node layout still trains when node-2 is ready
ARGS = ["--parallel.partition", "uniform_transformer", "--train.steps", "12", "--checkpoint.interval", "2",
        "--profile_batch", "none"]


def job(hold: str, in_place: bool = False, rejoin: bool | None = None, steps: int | None = None) -> Path:
    p = STATE / "elastic-job.yaml"
    p.write_text(yaml.safe_dump({"job": {
        "image": IMAGE, "config": str(REPO / "configs/pi-qwen3-3stage-tiny.yaml"),
        "args": ARGS + (["--elastic.in_place", "true"] if in_place else []) + (["--train.steps", str(steps)] if steps else []),
        "master_port": "auto", "grace_period": 60, "env": {"OMP_NUM_THREADS": "1", **hold_env(hold)},
        "sync": [HOOKS_SYNC],  # the hold is test support, switched on by tests/hooks/ (trainer/runtime/hold.py)
        "elastic": {"min_nodes": 2, "rejoin": (not in_place) if rejoin is None else rejoin}}}))
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


def once_in_place(inv: Path, workdirs: dict[str, Path]) -> dict:
    """The same cut with `--elastic.in_place true` (issue 58): the survivors regroup in their processes;
    node-2's link back, it joins the running ranks in place (one container started, its stage from
    their memory, the switch at a step boundary)."""
    link = lambda state: runner("sandbox", "--dir", str(STATE / "s"), "link", "node-2", state)  # noqa: E731
    before = {p.name for p in (workdirs["node-0"] / "runs").glob("*")} if (workdirs["node-0"] / "runs").is_dir() else set()
    proc = subprocess.Popen([sys.executable, "-m", "runner", "up", "-i", str(inv), "--job",
                             str(job("step:4,step:8", in_place=True, rejoin=True, steps=IN_PLACE_STEPS)), "--logs-dir",
                             str(STATE / "logs")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        run_id = wait(lambda: next(iter({p.name for p in (workdirs["node-0"] / "runs").glob("*")} - before), None))
        runs = {n: w / "runs" / run_id for n, w in workdirs.items()}
        hold = lambda n, r, s: (runs[n] / ".hold" / f"step-{s}.held.rank{r}").is_file()  # noqa: E731
        wait(lambda: all(hold(n, r, 4) for r, n in enumerate(runs)))
        time.sleep(1.0)  # the step-4 replica exchange (its own thread) has ended
        cut = time.time()
        link("down")
        for n in ("node-0", "node-1"):
            (runs[n] / ".hold" / "step-4.go").write_text("")
        wait(lambda: hold("node-0", 0, 8) and hold("node-1", 1, 8))
        back = time.time()
        link("up")
        # The 2-node layout trains on from step 8 while node-2 is reached and its container starts; the
        # runner writes the 3-node regroup.json once node-2's trainer says `ready`, and the running
        # ranks switch at the next step end (their vote carries the file's epoch).
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
    moved = [e for e in ev if e["event"] == "layout"][1]
    recs = metrics(runs["node-1"])
    step = next(r["time"] for r in recs if r["step"] == moved["from_step"] + 1)
    came = next((e for e in ev if e["event"] == "back"), None)
    grown = next((e for e in ev if e["event"] == "layout" and e.get("in_place") and e["why"].endswith("back")), None)
    rejoin = None
    if came is not None and grown is not None:  # joined in place (else the run restarted: no figures)
        step3 = next(r["time"] for r in metrics(runs["node-2"]) if r["step"] == grown["from_step"] + 1)
        times2 = json.loads((runs["node-2"] / "regroup-status.local0.json").read_text())["times"]
        ready = times2["ready"]
        # The running ranks' pause: the gap between their last step in the 2-node layout (node-1 logs it)
        # and the first in the 3-node one (node-2 logs it), less their usual step time before it.
        old_t = {r["step"]: r["time"] for r in metrics(runs["node-1"])}
        k = grown["from_step"]
        usual = statistics.median(old_t[i + 1] - old_t[i] for i in range(max(5, k - 5), k) if i in old_t and i + 1 in old_t)
        rejoin = {"reach_s": came["t"] - back, "ready_s": ready - came["t"], "file_s": grown["planned"] - ready,
                  "regroup_s": grown["resumed"] - grown["planned"], "first_step_s": step3 - grown["resumed"],
                  "back_to_step_s": step3 - back, "pause_s": step3 - old_t[k] - usual, "step_s": usual,
                  "from_step": grown["from_step"],
                  # reached -> ready, split: the runner's own part (the watch noticing, port, plan, files,
                  # container created and started), the launcher's (container start -> trainer process
                  # exec'd) and the trainer's (its imports up to `ready`)
                  "launch_s": grown["launched"] - came["t"], "exec_s": times2["started"] - grown["launched"],
                  "imports_s": ready - times2["started"]}
    # The replicas' cost: the training thread's seconds per refresh against a step's (pp 3, before the cut).
    cost = [float(x) for x in re.findall(r"stage replicas: \d+ refresh\(es\), ([0-9.]+) s on the training thread, "
                                         r"([0-9.]+) s CPU", (runs["node-0"] / "logs" / "rank0.log").read_text())[-1]]
    refreshes = int(re.findall(r"stage replicas: (\d+) refresh", (runs["node-0"] / "logs" / "rank0.log").read_text())[-1])
    step_s = statistics.median(r["step_time_s"] for r in metrics(runs["node-2"]))
    return {"run_id": run_id,
            "in_place": {"detect_s": lost["detected"] - cut, "file_s": moved["planned"] - lost["detected"],
                         "regroup_s": moved["resumed"] - moved["planned"], "first_step_s": step - moved["resumed"],
                         "cut_to_step_s": step - cut, "from_step": moved["from_step"],
                         "steps_redone": 4 - moved["from_step"],
                         "replica_cost_pct": 100 * cost[0] / refreshes / step_s,
                         "replica_exchange_cpu_pct": 100 * cost[1] / refreshes / step_s},
            "rejoin_in_place": rejoin}


def main() -> int:
    global IMAGE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--path", choices=("both", "restart", "in-place"), default="both",
                    help="the restart path (issue 27), the in-place one (issue 58), or both; a path not run keeps "
                         "its figures from the last results file")
    ap.add_argument("--image", default=IMAGE, help="the trainer image (scripts/build-image.sh TAG)")
    args = ap.parse_args()
    IMAGE = args.image  # job() reads it
    inv = STATE / "local.yaml"
    runner("sandbox", "--dir", str(STATE / "s"), "up", "--nodes", "3", "--netns", "--inventory", str(inv))
    doc = yaml.safe_load(inv.read_text())
    workdirs = {n["name"]: Path(n["workdir"]) for n in doc["nodes"]}
    try:
        runner("push", "-i", str(inv), "--job", str(job("")))
        rows = [once(inv, workdirs) for _ in range(args.repeat)] if args.path != "in-place" else []
        fast = [once_in_place(inv, workdirs) for _ in range(args.repeat)] if args.path != "restart" else []
    finally:
        runner("sandbox", "--dir", str(STATE / "s"), "down", check=False)
    res = REPO / "bench" / "results" / "elastic.json"
    old = json.loads(res.read_text()) if res.is_file() else {}
    med = {phase: {k: statistics.median(r[phase][k] for r in rows) for k in rows[0][phase]} for phase in ("shrink", "rejoin")} \
        if rows else old["median"]
    out = {"repeat": args.repeat if rows else old.get("repeat"), "median": med, "runs": rows or old["runs"],
           "machine": "2 cores, namespaced sandbox, tiny Qwen3 pp 3 (configs/pi-qwen3-3stage-tiny.yaml)"}
    if fast:
        out["in_place"] = {"repeat": len(fast), "median": {k: statistics.median(r["in_place"][k] for r in fast)
                                                           for k in fast[0]["in_place"]}, "runs": fast}
        joined = [r["rejoin_in_place"] for r in fast if r["rejoin_in_place"]]
        out["in_place"]["rejoin"] = {"joined": f"{len(joined)}/{len(fast)}", "median": {
            k: statistics.median(r[k] for r in joined) for k in joined[0]} if joined else None}
    elif "in_place" in old:
        out["in_place"] = old["in_place"]
    res.write_text(json.dumps(out, indent=1) + "\n")
    if "in_place" in out:
        f = out["in_place"]["median"]
        print(f"in place: node-2 cut -> first step on 2 nodes: {f['cut_to_step_s']:.1f} s = detect {f['detect_s']:.1f} + "
              f"file {f['file_s']:.1f} + regroup {f['regroup_s']:.1f} + first step {f['first_step_s']:.1f}; "
              f"{f['steps_redone']:.0f} step(s) redone; replicas {f['replica_cost_pct']:.2f}% of a step")
        j = out["in_place"].get("rejoin") or {}
        if j.get("median"):
            g = j["median"]
            print(f"in place: node-2 back -> first step on 3 nodes: {g['back_to_step_s']:.1f} s = reach "
                  f"{g['reach_s']:.1f} + its container up and `ready` {g['ready_s']:.1f} (the others training; the "
                  f"runner's launch {g['launch_s']:.1f}, container to trainer {g['exec_s']:.1f}, imports "
                  f"{g['imports_s']:.1f}) + file "
                  f"{g['file_s']:.1f} + regroup {g['regroup_s']:.1f} + first step {g['first_step_s']:.1f}; the running "
                  f"ranks paused {g['pause_s']:.1f} s beyond a {g['step_s']:.2f} s step (joined in place {j['joined']})")
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
