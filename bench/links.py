"""The sandbox on real links (`runner sandbox up --netns --link RATE`): the reduced Pi experiment's
step time, measured bubble and per-stage comm wait at 1gbit and 100mbit links, and how long a
partition (`runner sandbox link NODE down`) takes to stop the run, beside what a hand-started run
(no watcher: `up --detach`, the naive script's situation) does in the same time.

    .venv/bin/python -m bench.links [--steps 6] [--partitions 3]

Needs root and the trainer image on this host (scripts/build-image.sh). Results:
bench/results/links.json. Target (issue 13): the run stopped on every node <= 10 s after the cut.
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

STATE = Path("/tmp/runner-bench-links")
IMAGE = "runner-trainer:latest"
NODES = ("node-0", "node-1", "node-2")
RATES = ("1gbit", "100mbit")


def up_sandbox(link: str | None) -> Path:
    inv = STATE / "local.yaml"
    runner("sandbox", "--dir", str(STATE / "s"), "up", "--nodes", "3",
           *(["--link", link] if link else ["--netns"]), "--inventory", str(inv))
    return inv


def pi_experiment(inv: Path, steps: int) -> dict:
    """The sandbox's own job (configs/pi-qwen3-3stage-tiny.yaml, the guide's flags), profiled batch 2."""
    doc = yaml.safe_load(inv.read_text())
    job = dict(doc["job"])
    job["image"] = IMAGE
    job["args"] = ["--train_steps", str(steps), "--batch_size", "16", "--microbatch_num", "4", "--profile_batch", "2"]
    job["config"] = str(REPO / job["config"])
    jf = STATE / "pi-job.yaml"
    jf.write_text(yaml.safe_dump({"job": job}))
    proc = subprocess.run([sys.executable, "-m", "runner", "up", "-i", str(inv), "--job", str(jf),
                           "--logs-dir", str(STATE / "logs")], capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-2000:])
    run_id = proc.stdout.split("run ", 1)[1].split()[0]
    nodes = {n["name"]: Path(n["workdir"]) / "runs" / run_id for n in doc["nodes"]}
    metrics = [json.loads(x) for x in (nodes["node-2"] / "metrics.jsonl").read_text().splitlines() if x.strip()]
    times = [m["step_time_s"] for m in metrics if "step_time_s" in m][1:]  # step 1 pays the warm-up
    summary = json.loads((nodes["node-0"] / "timeline_batch2_summary.json").read_text())
    return {"run_id": run_id, "step_time_s_median": statistics.median(times), "step_times_s": times,
            "measured_bubble": summary["measured_bubble"], "theoretical_bubble": summary["theoretical_bubble"],
            "comm_wait_ms_per_stage": [r["comm_wait_ms"] for r in summary["ranks"]]}


def containers(inv: Path, node: str, run_id: str) -> list[str]:
    from tests.support.runner_helpers import node_docker

    res = node_docker(inv, node, "ps", "-q", "--filter", f"label=io.runner.run-id={run_id}")
    return res.stdout.split()


def sleep_job() -> Path:
    jf = STATE / "sleep-job.yaml"
    jf.write_text(yaml.safe_dump({"job": {"image": IMAGE, "command": ["python", "-c", "import time; time.sleep(600)"],
                                          "grace_period": 5, "master_port": "auto"}}))
    return jf


def partition_once(inv: Path, watched: bool, wait_s: float = 30.0) -> float | None:
    """Cut node-2's link once every rank runs; seconds until node-0/1 have no container of the run
    (None: still running `wait_s` after the cut)."""
    from tests.support.runner_helpers import start_attached, up_detached, wait_for

    proc = None
    if watched:
        proc, run_id = start_attached(inv, sleep_job(), STATE / "logs", "--reclaim-timeout", "120")
    else:
        run_id = up_detached(inv, sleep_job())
        wait_for(lambda: all(containers(inv, n, run_id) for n in NODES), 60)
    try:
        runner("sandbox", "--dir", str(STATE / "s"), "link", "node-2", "down")
        t0 = time.monotonic()
        gone = None
        while time.monotonic() - t0 < wait_s:
            if not containers(inv, "node-0", run_id) and not containers(inv, "node-1", run_id):
                gone = time.monotonic() - t0
                break
            time.sleep(0.1)
    finally:
        runner("sandbox", "--dir", str(STATE / "s"), "link", "node-2", "up")
        if proc is not None:
            proc.communicate(timeout=300)
        runner("down", run_id, "-i", str(inv), check=False)
    return gone


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--partitions", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "links.json"))
    a = ap.parse_args()
    runner("sandbox", "--dir", str(STATE / "s"), "down", "--purge", check=False)
    try:
        inv = up_sandbox(None)
        runner("push", "-i", str(inv), "--job", str(sleep_job()))
        pi = {}
        for rate in RATES:
            up_sandbox(rate)
            pi[rate] = pi_experiment(inv, a.steps)
        up_sandbox(None)
        watched = [partition_once(inv, True) for _ in range(a.partitions)]
        naive = partition_once(inv, False)
    finally:
        runner("sandbox", "--dir", str(STATE / "s"), "down", "--purge", check=False)
    res = {"config": vars(a), "pi_experiment": pi, "partition_stop_s": watched, "naive_stop_s": naive}
    Path(a.out).write_text(json.dumps(res, indent=2))
    print("| link | step time (median) | measured bubble | theory | comm wait per stage (ms) |")
    print("|---|---|---|---|---|")
    for rate, r in pi.items():
        print(f"| {rate} | {r['step_time_s_median']:.3f} s | {r['measured_bubble']:.2f} | {r['theoretical_bubble']:.2f} "
              f"| {', '.join(f'{x:.0f}' for x in r['comm_wait_ms_per_stage'])} |")
    shown = ", ".join(f"{x:.1f}" if x is not None else "not stopped" for x in watched)
    print(f"\npartition (node-2's link cut), run stopped on node-0/1 after: {shown} s (runner up, watched); "
          f"{'still running after 30 s' if naive is None else f'{naive:.1f} s'} (detached, no watcher)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
