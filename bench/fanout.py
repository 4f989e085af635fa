"""Fan-out: how the runner holds up as nodes are added (issue 15), ratios taken in one run.

    .venv/bin/python -m bench.fanout [--nodes 32] [--baseline DIR]

1. `runner up --dry-run` (the whole command: start-up, inventory, plan, printing) for generated
   inventories of 1,000 and 10,000 nodes. Targets: 10,000 <= 10x 1,000; 1,000 under 0.5 s.
2. `runner check` and `runner status` against 32 sandbox nodes vs 1. The nodes are `--light`
   sandbox nodes (an sshd each, sharing this machine's engine: 32 engines do not fit in 2 cores);
   each holds a run dir with metrics, so status does its full work. Target: 32 nodes <= 2x 1 node.
3. Threads and open file descriptors of `runner up` while it watches 32 nodes vs 1 (the job: a
   stub torchrun that listens on the master port and sleeps; what is measured is the runner).

--baseline DIR measures another checkout's runner (e.g. one from before issue 15) the same way,
on the same nodes, in the same run. Results: bench/results/fanout.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import psutil
import yaml

from bench.sandbox_bench import REPO, runner

STATE = Path(os.environ.get("BENCH_FANOUT_SANDBOX", "/tmp/runner-bench-fanout"))
BASE_ADDR = os.environ.get("BENCH_FANOUT_BASE_ADDR", "127.0.7.11")
STUB_TAG = "runner-bench-stub:1"
RUN_ID = "20000101-000000-beef"
REPEATS = 5
# The master's stub torchrun listens on --master-port (as torchrun's TCPStore does), every other
# node's just sleeps; the image keeps no runner.agents.gate label, so workers start once the master listens.
STUB = b"""#!/bin/sh
rank=0; port=0
while [ $# -gt 0 ]; do
  case "$1" in --node-rank) rank=$2; shift;; --master-port) port=$2; shift;; esac; shift
done
if [ "$rank" = 0 ]; then
  exec python3 -c "import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', $port)); s.listen(); time.sleep(3600)"
fi
exec sleep 3600
"""


def cli(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """The runner of checkout `root`, run from it (its own package is the one imported)."""
    proc = subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, cwd=root)
    if check and proc.returncode != 0:
        raise SystemExit(f"failed: runner {' '.join(args)}\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
    return proc


def timed(root: Path, *args: str, repeats: int = REPEATS, ok=(0,), cpu: dict | None = None) -> float:
    """Median wall time of the command over `repeats` runs; the runner process's own CPU seconds
    (user + sys, median) go into cpu["cpu_s"] when given."""
    times, cpus = [], []
    for _ in range(repeats):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = cli(root, *args, check=False)
        times.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
        if proc.returncode not in ok:
            raise SystemExit(f"failed ({proc.returncode}): runner {' '.join(args)}\n{proc.stderr[-1500:]}")
    if cpu is not None:
        cpu["cpu_s"] = round(statistics.median(cpus), 3)
    return round(statistics.median(times), 3)


# ---------------------------------------------------------------------------- 1. dry-run plans

def generated_inventory(tmp: Path, n: int) -> Path:
    key = tmp / "id_bench"
    key.write_text("not a key: a dry-run only checks the file exists\n")
    lines = [f"defaults: {{user: pi, identity_file: {key}, workdir: ~/runner, arch: amd64}}", "nodes:"]
    lines += [f"  - {{name: n{i}, host: 10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}}}" for i in range(n)]
    lines += ["job:", "  image: runner-trainer:latest", "  command: [python, -c, 'print(1)']",
              "  env: {OMP_NUM_THREADS: '1'}", "  master_port: auto"]
    p = tmp / f"gen-{n}.yaml"
    p.write_text("\n".join(lines) + "\n")
    return p


def dry_runs(roots: dict[str, Path]) -> dict:
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-fanout-") as d:
        invs = {n: generated_inventory(Path(d), n) for n in (1000, 10000)}
        for label, root in roots.items():
            row = {"cli_start_s": timed(root, "--help")}
            for n, inv in invs.items():
                row[f"{n}_s"] = timed(root, "up", "-i", str(inv), "--dry-run", repeats=3)
            row["ratio_10000_to_1000"] = round(row["10000_s"] / row["1000_s"], 2)
            out[label] = row
    return out


# ---------------------------------------------------------------------------- 2. check / status

def light_sandbox(n: int) -> Path:
    inv = STATE / "light.yaml"
    runner("sandbox", "--dir", str(STATE / "s"), "up", "--nodes", str(n), "--light", "--base-addr", BASE_ADDR,
           "--inventory", str(inv))
    return inv


def subset(inv: Path, n: int, job: dict | None = None) -> Path:
    doc = yaml.safe_load(inv.read_text())
    doc["nodes"] = doc["nodes"][:n]
    doc["job"] = job or {"image": "runner-trainer:latest", "master_port": "auto"}
    p = STATE / f"light-{n}{'-stub' if job else ''}.yaml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def seed_run_dirs(inv: Path) -> None:
    """A finished-looking run on every node: what `status` reads (run dir, metrics, config)."""
    for nd in yaml.safe_load(inv.read_text())["nodes"]:
        rd = Path(nd["workdir"]) / "runs" / RUN_ID
        rd.mkdir(parents=True, exist_ok=True)
        rd.joinpath("metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "loss": 3.0 / s, "tokens_per_s": 1000.0, "step_time_s": 1.0}) + "\n"
            for s in range(1, 51)))
        rd.joinpath("config.yaml").write_text("train: {steps: 100}\n")


def check_status(roots: dict[str, Path], inv: Path, n: int) -> dict:
    small, big = subset(inv, 1), subset(inv, n)
    out: dict = {}
    for label, root in roots.items():
        row = {}
        for what, args in (("check", ("check", "--json")), ("status", ("status", RUN_ID, "--json"))):
            c1: dict = {}
            cn: dict = {}
            one = timed(root, *args, "-i", str(small), ok=(0, 1), cpu=c1)
            many = timed(root, *args, "-i", str(big), ok=(0, 1), cpu=cn)
            # Wall time includes every node's side (sshd sessions, docker CLI, the engine), which
            # here shares this machine's cores; the runner's own CPU is what grows on real nodes.
            row[what] = {"1_s": one, f"{n}_s": many, "ratio": round(many / one, 2),
                         "runner_cpu_1_s": c1["cpu_s"], f"runner_cpu_{n}_s": cn["cpu_s"],
                         "runner_cpu_ratio": round(cn["cpu_s"] / max(c1["cpu_s"], 1e-3), 2)}
        out[label] = row
    return out


# ---------------------------------------------------------------------------- 3. threads and fds

def stub_image() -> None:
    from runner.delivery.host_engine import host_engine

    files = {"Dockerfile": (b"FROM runner-trainer:latest\nLABEL io.runner.gate=\"0\"\n"
                            b"COPY torchrun /opt/venv/bin/torchrun\n", 0o644), "torchrun": (STUB, 0o755)}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, (data, mode) in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tf.addfile(info, io.BytesIO(data))
    buf.seek(0)
    host_engine().client().images.build(
        fileobj=buf, custom_context=True, tag=STUB_TAG, network_mode="host", rm=True)


def watch_cost(root: Path, inv: Path) -> dict:
    """Threads and fds of `runner up` once every node runs and it only watches (max of samples)."""
    proc = subprocess.Popen([sys.executable, "-m", "runner", "up", "-i", str(inv), "--logs-dir", str(STATE / "logs")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root)
    try:
        for line in proc.stdout:
            if re.search(r"run \S+ started", line):
                break
        else:
            raise SystemExit(f"runner up did not start: {proc.stderr.read()[-1500:]}")
        time.sleep(5)  # the watcher's threads and connections are all up
        p = psutil.Process(proc.pid)
        samples = []
        for _ in range(5):
            samples.append((p.num_threads(), p.num_fds()))
            time.sleep(1)
        return {"threads": max(t for t, _ in samples), "fds": max(f for _, f in samples)}
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: stops the run on every node
        try:
            proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()


def watching(roots: dict[str, Path], inv: Path, n: int) -> dict:
    job = {"image": STUB_TAG, "command": ["sleep"], "master_port": "auto", "grace_period": 1,
           "env": {"OMP_NUM_THREADS": "1"}}
    small, big = subset(inv, 1, job), subset(inv, n, job)
    out: dict = {}
    for label, root in roots.items():
        one, many = watch_cost(root, small), watch_cost(root, big)
        out[label] = {"1": one, str(n): many,
                      "threads_per_node": round((many["threads"] - one["threads"]) / (n - 1), 2),
                      "fds_per_node": round((many["fds"] - one["fds"]) / (n - 1), 2)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--baseline", type=Path, help="another checkout, measured the same way")
    ap.add_argument("--skip-watch", action="store_true", help="leave out part 3 (it starts N containers)")
    ap.add_argument("--wait-quiet", type=float, default=0, metavar="LOAD",
                    help="first wait (up to 30 min) until the 1-minute load average is below LOAD")
    args = ap.parse_args(argv)
    roots = {"runner": REPO, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    end = time.time() + 1800
    while args.wait_quiet and os.getloadavg()[0] >= args.wait_quiet and time.time() < end:
        time.sleep(15)  # the nodes share this machine's cores with whatever else runs on it
    result: dict = {"nodes": args.nodes, "cpus": os.cpu_count(), "load_at_start": os.getloadavg()[0]}
    result["dry_run"] = dry_runs(roots)
    result["load_after_dry_run"] = os.getloadavg()[0]
    print(json.dumps(result["dry_run"], indent=1), flush=True)
    inv = light_sandbox(args.nodes)
    try:
        seed_run_dirs(inv)
        result["check_status"] = check_status(roots, inv, args.nodes)
        result["load_after_check_status"] = os.getloadavg()[0]
        print(json.dumps(result["check_status"], indent=1), flush=True)
        if not args.skip_watch:
            stub_image()
            result["watch"] = watching(roots, inv, args.nodes)
            print(json.dumps(result["watch"], indent=1), flush=True)
    finally:
        runner("sandbox", "--dir", str(STATE / "s"), "down", "--purge", check=False)
        host = ["docker", "-H", "unix:///var/run/docker.sock"]
        left = subprocess.run([*host, "ps", "-aq", "--filter", f"ancestor={STUB_TAG}"], capture_output=True, text=True)
        if left.stdout.split():
            subprocess.run([*host, "rm", "-f", *left.stdout.split()], capture_output=True)
        subprocess.run([*host, "rmi", "-f", STUB_TAG], capture_output=True)
    out = REPO / "bench" / "results" / "fanout.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    _table(result)
    print(f"\nresults: {out}")
    return 0


def _table(r: dict) -> None:
    n = r["nodes"]
    print("\n| measure | " + " | ".join(r["dry_run"]) + " |")
    print("|---|" + "---|" * len(r["dry_run"]))
    for key in ("cli_start_s", "1000_s", "10000_s", "ratio_10000_to_1000"):
        print(f"| dry-run {key} | " + " | ".join(str(v[key]) for v in r["dry_run"].values()) + " |")
    for what in ("check", "status"):
        print(f"| {what} 1 / {n} nodes (ratio) | " + " | ".join(
            f"{v[what]['1_s']} / {v[what][f'{n}_s']} s ({v[what]['ratio']}x)" for v in r["check_status"].values()) + " |")
        print(f"| {what} runner CPU 1 / {n} nodes (ratio) | " + " | ".join(
            f"{v[what]['runner_cpu_1_s']} / {v[what][f'runner_cpu_{n}_s']} s ({v[what]['runner_cpu_ratio']}x)"
            for v in r["check_status"].values()) + " |")
    if "watch" in r:
        print(f"| up watching {n}: threads, fds (per node) | " + " | ".join(
            f"{v[str(n)]['threads']}, {v[str(n)]['fds']} ({v['threads_per_node']}, {v['fds_per_node']})"
            for v in r["watch"].values()) + " |")


if __name__ == "__main__":
    sys.exit(main())
