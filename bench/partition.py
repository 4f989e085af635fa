"""Heterogeneous pipeline: `parallel.partition: auto` against `uniform_transformer` and against the
best contiguous split found by running every one, on three sandbox nodes whose job containers get
Docker --cpus 0.3 / 0.6 / 1.0. The job: the reduced Pi config (configs/pi-qwen3-3stage-tiny.yaml)
at 12 layers, pp=3, 1F1B, batch 16 in 4 microbatches of 128 tokens, one thread per rank.

    .venv/bin/python -m bench.partition [--steps 6] [--rounds 3] [--no-exhaustive | --sweep RESULTS_JSON]
    .venv/bin/python -m bench.partition --measure-full    # re-measure the Qwen3-0.6B fixture

Before the profile and each run it waits (up to 15 min) until at most one other thread competes
for the machine's two cores. Each split is one `runner up` (auto goes through `up` itself: the
cached profile, then the split);
its step time is the median of steps 2.. of metrics.jsonl (step 1 warms up). After the exhaustive
sweep, uniform, auto and the sweep's best are run again in interleaved rounds: the medians of
those are the figures (the minimum of 55 noisy runs alone would flatter the best split).

It also plans the full Qwen3-0.6B (28 layers) for a Pi 4 + Pi 5 + laptop from the profile kept in
tests/fixtures/profile-qwen3-0.6b-pi4-pi5-laptop.json. No Pi is here: that profile is this
machine's CPU measured by the job's own probe under Docker limits standing in for the boards
(`--measure-full` re-measures it; see the fixture's `note`). Targets (issue 14): auto >= 1.3x
uniform's speed and within 10% of the best split. Results: bench/results/partition.json.
The sandbox nodes share this machine's two cores with whatever else runs: the quotas only
separate the nodes' speeds while the machine has spare time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import combinations
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runner.inventory import Inventory, Job, Node  # noqa: E402
from runner.profile.auto import plan_from_profile, problem_from_profile, render_plan  # noqa: E402
from runner.profile.measure import ClusterProfile  # noqa: E402
from runner.profile.split import brute_force, format_split, make_split  # noqa: E402

STATE = Path(os.environ.get("BENCH_SANDBOX", "/tmp/runner-bench-partition"))
BASE_ADDR = os.environ.get("BENCH_BASE_ADDR", "127.0.9.41")
IMAGE = os.environ.get("BENCH_IMAGE", "runner-trainer:latest")
CPUS = "0.3,0.6,1.0"
LAYERS = 12
FIXTURE = REPO / "tests" / "fixtures" / "profile-qwen3-0.6b-pi4-pi5-laptop.json"
RESULTS = REPO / "bench" / "results" / "partition.json"
# The stand-ins of --measure-full: (name, Docker --cpus, --memory). A Pi 5 is 2-3x a Pi 4 on CPU
# work (Raspberry Pi Ltd's figure); the laptop is this whole 2-core machine.
STAND_INS = [("pi4", 0.3, "8g"), ("pi5", 0.8, "8g"), ("laptop", 2.0, "16g")]
GUIDE_SPLIT = [0, 7, 21, 28]  # the Pi guide's hand split of Qwen3-0.6B


def sh(*cmd: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, cwd=REPO, env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def runner(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return sh(sys.executable, "-m", "runner", *args, env={"RUNNER_PROFILE_CACHE": str(STATE / "cache")}, check=check)


def job_inventory(steps: int) -> Path:
    inv = STATE / "local.yaml"
    runner("sandbox", "--dir", str(STATE / "s"), "up", "--nodes", "3", "--base-addr", BASE_ADDR, "--cpus", CPUS,
           "--inventory", str(inv))
    doc = yaml.safe_load(inv.read_text())
    doc["job"] = {"image": IMAGE, "config": str(REPO / "configs" / "pi-qwen3-3stage-tiny.yaml"),
                  "args": ["--train_steps", str(steps), "--batch_size", "16", "--microbatch_num", "4",
                           "--model.num_hidden_layers", str(LAYERS), "--profile_batch", "none"],
                  "env": {"OMP_NUM_THREADS": "1"}, "master_port": "auto"}
    out = STATE / "bench.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def busy() -> float:
    """Threads running or waiting for a CPU right now besides this one (/proc/loadavg's 4th field),
    the mean of 10 looks over 2 s."""
    seen = []
    for _ in range(10):
        seen.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1)
        time.sleep(0.2)
    return sum(seen) / len(seen)


BUSY: list[float] = []  # what wait_quiet saw before each measurement


def wait_quiet(limit: float = 1.0, timeout: float = 900) -> None:
    """Until at most `limit` other threads compete for the two cores (others' tests share this
    machine: under a load of 10 every container gets less than its quota and all nodes look alike),
    or `timeout` seconds; what it saw is kept in the results."""
    deadline = time.time() + timeout
    while True:
        b = busy()
        if b <= limit or time.time() > deadline:
            BUSY.append(round(b, 2))
            return
        time.sleep(10)


def step_time(inv: Path, partition: str) -> tuple[float, str]:
    """Median step time (steps 2..) of one `runner up` with this partition, and the split it ran."""
    wait_quiet()
    proc = runner("up", "-i", str(inv), "--logs-dir", str(STATE / "logs"), "--", "--parallel.partition", partition)
    run_id = proc.stdout.split("run ", 1)[1].split()[0]
    doc = yaml.safe_load(inv.read_text())
    last = Path(doc["nodes"][-1]["workdir"]) / "runs" / run_id
    recs = [json.loads(x) for x in (last / "metrics.jsonl").read_text().splitlines() if x.strip()]
    times = [r["step_time_s"] for r in recs if r.get("step", 0) >= 2]
    spec = yaml.safe_load((last / "config.yaml").read_text())["parallel"]["partition"]
    for n in doc["nodes"]:  # keep the nodes' disks small over ~60 runs
        sh("rm", "-rf", str(Path(n["workdir"]) / "runs" / run_id), check=False)
    return statistics.median(times), spec


def bench_sandbox(args) -> dict:
    inv = job_inventory(args.steps)
    runner("push", "-i", str(inv))
    wait_quiet()
    prof_doc = json.loads(runner("profile", "-i", str(inv), "--json", "--refresh", "--no-push").stdout)
    prof = ClusterProfile(prof_doc["nodes"], prof_doc["links"])
    order = [Node(n["node"], "x", cpus=n.get("cpus_limit")) for n in prof.nodes]
    order[0].role = "master"
    sinv = Inventory(str(inv), order, Job())
    auto, uniform, problem = plan_from_profile(prof, sinv)
    print(render_plan(auto, uniform, problem), flush=True)
    sweep: dict[str, float] = {}
    if args.sweep:  # the 55 runs of an earlier sweep on the same nodes (each split runs the same there)
        sweep = json.loads(Path(args.sweep).read_text())["sandbox"]["sweep_s"]
        print(f"  sweep: {len(sweep)} splits from {args.sweep}", flush=True)
    elif args.exhaustive:
        for cuts in combinations(range(1, LAYERS), 2):
            spec = "custom:" + ",".join(map(str, (0, *cuts, LAYERS)))
            sweep[spec], _ = step_time(inv, spec)
            print(f"  sweep {spec}: {sweep[spec]:.3f} s", flush=True)
    best = min(sweep, key=sweep.get) if sweep else None
    rounds: dict[str, list[float]] = {"uniform": [], "auto": [], "best": []}
    ran_auto = None
    for r in range(args.rounds):
        rounds["uniform"].append(step_time(inv, "uniform_transformer")[0])
        t, ran_auto = step_time(inv, "auto")
        rounds["auto"].append(t)
        if best:
            rounds["best"].append(step_time(inv, best)[0])
        print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in rounds.items() if v), flush=True)
    med = {k: statistics.median(v) for k, v in rounds.items() if v}
    predicted = {spec: make_split(problem, [int(x) for x in spec[7:].split(",")]).step_s(problem.microbatches)
                 for spec in sweep}
    return {
        "sweep_from": args.sweep, "nodes_cpus": CPUS, "layers": LAYERS, "steps": args.steps, "rounds": args.rounds, "image": IMAGE,
        "profile": prof_doc, "auto_split": auto.spec, "auto_ran": ran_auto, "uniform_split": uniform.spec,
        "best_split": best, "step_s": med, "rounds_s": rounds, "sweep_s": sweep, "predicted_sweep_s": predicted,
        "predicted_s": {"auto": auto.step_s(problem.microbatches), "uniform": uniform.step_s(problem.microbatches),
                        "model_best": brute_force(problem).spec},
        "busy_before_each_run": BUSY,
        "auto_speedup_vs_uniform": med["uniform"] / med["auto"],
        "auto_vs_best": (med["auto"] / med["best"]) if "best" in med else None,
    }


# ------------------------------------------------------------------ the full Qwen3-0.6B plan


def _fixture_inventory(prof: ClusterProfile) -> Inventory:
    nodes = [Node(n["node"], "x", role="master" if i == 0 else "worker") for i, n in enumerate(prof.nodes)]
    return Inventory(str(FIXTURE), nodes, Job())


def full_plan() -> dict:
    doc = json.loads(FIXTURE.read_text())
    prof = ClusterProfile(doc["nodes"], doc["links"])
    inv = _fixture_inventory(prof)
    auto, uniform, problem = plan_from_profile(prof, inv)
    guide = make_split(problem, GUIDE_SPLIT)
    m = problem.microbatches
    print(f"\nQwen3-0.6B ({problem.num_layers} layers) on {' + '.join(n['node'] for n in prof.nodes)} "
          f"(profile: {FIXTURE.relative_to(REPO)})")
    print(render_plan(auto, uniform, problem))
    print(f"  Pi guide's hand split ({guide.spec}): slowest stage {guide.bottleneck_s:.2f} s, step ~{guide.step_s(m):.1f} s"
          f" predicted ({guide.step_s(m) / auto.step_s(m):.2f}x auto's)")
    # What if the Pi 4 were a 4 GB one (3 GiB free for the job): the same measurements, its memory
    # capped, so its stage is bound by memory rather than time.
    small = json.loads(FIXTURE.read_text())
    small["nodes"][0]["memory_available"] = 3 * 2**30
    sprof = ClusterProfile(small["nodes"], small["links"])
    sproblem = problem_from_profile(sprof, inv)
    try:
        from runner.profile.split import best_split

        small_split = best_split(sproblem)
        print("  what if the Pi 4 had 4 GB, 3 GiB free for the job (same measurements):\n" + format_split(small_split, m, "auto").replace(
            "\n", "\n  "))
        small_doc = {"spec": small_split.spec, "step_s": small_split.step_s(m)}
    except Exception as e:  # noqa: BLE001 - the planner's one-line refusal is the result then
        print(f"  what if the Pi 4 had 4 GB, 3 GiB free: {e}")
        small_doc = {"error": str(e)}
    return {"auto": auto.spec, "auto_step_s": auto.step_s(m), "auto_bottleneck_s": auto.bottleneck_s,
            "uniform": uniform.spec, "uniform_step_s": uniform.step_s(m), "guide": guide.spec,
            "guide_step_s": guide.step_s(m), "stages": [{"node": s.node, "layers": s.num_layers,
                                                        "compute_s": s.compute_s, "memory_gib": s.memory_bytes / 2**30}
                                                       for s in auto.stages],
            "pi4_3gib_free": small_doc}


def measure_full(image: str) -> None:
    """Probe Qwen3-0.6B under each stand-in's limits, one at a time (so none shares the two cores),
    and the loopback link between two probe containers; write the fixture."""
    out = Path(tempfile.mkdtemp(prefix="qwen3-profile-"))
    (out / "config.yaml").write_bytes((REPO / "configs" / "pi-qwen3-3stage.yaml").read_bytes())
    train = ["--", "--config", "/out/config.yaml", "--train_steps", "5", "--batch_size", "16", "--microbatch_num", "4"]
    base = ["docker", "run", "--rm", "--network", "host", "-v", f"{out}:/out", "-e", "OMP_NUM_THREADS=2"]
    nodes = []
    for name, cpus, mem in STAND_INS:
        wait_quiet()
        t0 = time.time()
        sh(*base, "--cpus", str(cpus), "--memory", mem, "-e", f"NODE_NAME={name}", image, "python", "-m", "trainer",
           "probe", "--out", f"/out/{name}.json", "--min-seconds", "3", *train)
        doc = json.loads((out / f"{name}.json").read_text())
        doc.update(node=name, cpus_limit=cpus, memory_limit=mem, load_avg_after=os.getloadavg())
        nodes.append(doc)
        print(f"  {name}: {time.time() - t0:.0f} s, layer {doc['time_s']['block']:.3f} s, head {doc['time_s']['head']:.3f} s",
              flush=True)
    server = subprocess.Popen([*base, image, "python", "-m", "trainer", "probe", "--serve", "29977", "--no-compute",
                               "--out", "/out/server.json"], cwd=REPO)
    sh(*base, image, "python", "-m", "trainer", "probe", "--peer", "127.0.0.1:29977", "--no-compute",
       "--out", "/out/link.json")
    server.wait(timeout=120)
    link = json.loads((out / "link.json").read_text())["link"]
    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), platform.processor())
    doc = {"note": ("Qwen3-0.6B (configs/pi-qwen3-3stage.yaml, batch 16 in 4 microbatches of 128 tokens, fp32) measured "
                    "by `trainer probe` in the trainer image on " + cpu + " (2 cores), one stand-in at a time under Docker "
                    "limits: pi4 --cpus 0.3 --memory 8g, pi5 --cpus 0.8 --memory 8g, laptop --cpus 2 --memory 16g, "
                    "OMP_NUM_THREADS=2. No Raspberry Pi was measured: the CPU ratios follow Raspberry Pi Ltd's '2-3x' of "
                    "a Pi 5 over a Pi 4. Links: loopback between two probe containers (a Pi's 1 GbE is slower; at 2 MB "
                    "per microbatch boundary that adds ~17 ms to seconds of compute). Re-measure: python -m bench.partition "
                    "--measure-full"),
           "measured": time.strftime("%Y-%m-%d"), "image": image, "nodes": nodes, "links": [link, link]}
    FIXTURE.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {FIXTURE}")


# ------------------------------------------------------------------ main


def table(res: dict) -> str:
    s = res["sandbox"]
    rows = ["| split | layers per node (0.3 / 0.6 / 1.0 CPU) | step time | vs uniform |", "|---|---|---|---|"]

    def counts(spec: str) -> str:
        b = [int(x) for x in spec[7:].split(",")]
        return " / ".join(str(b[i + 1] - b[i]) for i in range(len(b) - 1))

    named = [("uniform_transformer", s["uniform_split"], s["step_s"]["uniform"]),
             ("auto", s["auto_ran"], s["step_s"]["auto"])]
    if s.get("best_split"):
        named.append(("best of all 55 (measured)", s["best_split"], s["step_s"]["best"]))
    for name, spec, t in named:
        rows.append(f"| {name} `{spec}` | {counts(spec)} | {t:.3f} s | {s['step_s']['uniform'] / t:.2f}x |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-exhaustive", dest="exhaustive", action="store_false")
    ap.add_argument("--sweep", metavar="RESULTS_JSON", help="take the exhaustive sweep's step times from an earlier "
                    "results file (same nodes and job) instead of running the 55 splits again")
    ap.add_argument("--measure-full", action="store_true", help="re-measure the Qwen3-0.6B fixture, then stop")
    ap.add_argument("--keep", action="store_true", help="leave the sandbox running")
    args = ap.parse_args(argv)
    if args.measure_full:
        measure_full(IMAGE)
        return 0
    res: dict = {"machine": f"{platform.node()} {os.cpu_count()} CPUs",
                 "load_avg_before": os.getloadavg()}
    try:
        res["sandbox"] = bench_sandbox(args)
    finally:
        if not args.keep:
            runner("sandbox", "--dir", str(STATE / "s"), "down", "--purge", check=False)
    res["load_avg_after"] = os.getloadavg()
    res["qwen3_0.6b"] = full_plan()
    s = res["sandbox"]
    print("\n" + table(res))
    print(f"\nauto {s['auto_speedup_vs_uniform']:.2f}x uniform (target >= 1.3x)"
          + (f"; {(s['auto_vs_best'] - 1) * 100:+.1f}% vs the best split (target within 10%)" if s["auto_vs_best"] else ""))
    RESULTS.write_text(json.dumps(res, indent=1) + "\n")
    print(f"results: {RESULTS.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
