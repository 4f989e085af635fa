"""`runner up` time until every rank runs (image already on the nodes) for 1..4 sandbox nodes,
beside the same launch without runner.agents.gate (workers started only once the master listens, the
path of an image without the gate) and a naive launcher that starts one container per node, one
node at a time, over ssh. The sandbox's nodes share this machine's cores: every node's start-up
(container, torch import) competes for them, which real nodes do not.

    .venv/bin/python -m bench.launch [--nodes 4] [--repeat 2]

Target (issue 7): 3 nodes <= 1.3 x one node. Results: bench/results/launch.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.sandbox_bench import REPO, STATE, runner, sandbox, ssh_argv, subset

IMAGE = "runner-trainer:latest"
NOGATE = "runner-trainer:bench-nogate"   # the same image, labelled without runner.agents.gate
PAYLOAD = ("import os, time; open('/out/started-' + os.environ['NODE_NAME'], 'w').write(repr(time.time()))")


def started(inv: Path, run_id: str) -> list[float]:
    doc = yaml.safe_load(inv.read_text())
    out = []
    for n in doc["nodes"]:
        p = Path(n["workdir"]) / "runs" / run_id / f"started-{n['name']}"
        out.append(float(p.read_text()) if p.exists() else float("nan"))
    return out


def time_runner(inv: Path) -> float:
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "runner", "up", "-i", str(inv)], capture_output=True, text=True,
                          cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    run_id = proc.stdout.split("run ", 1)[1].split()[0]
    return max(started(inv, run_id)) - t0


def time_naive(inv: Path, port: int) -> float:
    """What a user scripts by hand: for each node in turn, ssh in and `docker run -d` torchrun."""
    doc = yaml.safe_load(inv.read_text())
    nodes = doc["nodes"]
    run_id = f"naive-{int(time.time() * 1000)}"
    master = nodes[0]["host"]
    t0 = time.time()
    for rank, n in enumerate(nodes):
        rd = f"{n['workdir']}/runs/{run_id}"
        cmd = (f"mkdir -p {rd} && docker run -d --name {run_id}-{n['name']} --network host -v {rd}:/out "
               f"-e NODE_NAME={n['name']} -e OUTPUT_DIR=/out {IMAGE} torchrun --nnodes {len(nodes)} "
               f"--node-rank {rank} --nproc-per-node 1 --master-addr {master} --master-port {port} "
               f"--no-python python -c {shlex.quote(PAYLOAD)}")
        subprocess.run([*ssh_argv(doc, n), cmd], check=True, capture_output=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        ts = started(inv, run_id)
        if all(t == t for t in ts):  # no NaN
            break
        time.sleep(0.05)
    for n in nodes:
        subprocess.run([*ssh_argv(doc, n), f"docker rm -f {run_id}-{n['name']}"], capture_output=True)
    return max(ts) - t0


def build_nogate() -> None:
    """The trainer image relabelled io.runner.gate=0: `up` then starts workers only after the
    master listens (the path any image without the gate takes). Same layers: pushes nothing."""
    import io
    import tarfile

    import docker

    df = f'FROM {IMAGE}\nLABEL io.runner.gate="0"\n'.encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(df)
        tf.addfile(info, io.BytesIO(df))
    buf.seek(0)
    docker.DockerClient(base_url="unix:///var/run/docker.sock", version="auto").images.build(
        fileobj=buf, custom_context=True, tag=NOGATE, network_mode="host", rm=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    base = sandbox(args.nodes)
    job = {"image": IMAGE, "command": ["python", "-c", PAYLOAD], "master_port": "auto", "grace_period": 5}
    build_nogate()
    runner("push", "-i", str(subset(base, args.nodes, job)))
    runner("push", "-i", str(subset(base, args.nodes, {**job, "image": NOGATE})))
    rows = []
    for n in range(1, args.nodes + 1):
        inv, inv_ng = subset(base, n, job), subset(base, n, {**job, "image": NOGATE}, suffix="-nogate")
        r = ng = nv = float("inf")
        for i in range(args.repeat):  # interleaved, so all three see the same machine
            r = min(r, time_runner(inv))
            ng = min(ng, time_runner(inv_ng))
            nv = min(nv, time_naive(inv, 29400 + 10 * n + i))
        rows.append({"nodes": n, "runner_s": round(r, 2), "runner_nogate_s": round(ng, 2), "naive_s": round(nv, 2)})
        print(f"{n} node(s): runner up {r:6.2f}s   without the gate {ng:6.2f}s   naive one-node-at-a-time {nv:6.2f}s",
              flush=True)
    for row in rows:
        for k in ("runner", "runner_nogate", "naive"):
            row[f"{k}_vs_1_node"] = round(row[f"{k}_s"] / rows[0][f"{k}_s"], 2)
    out = REPO / "bench/results/launch.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"what": "seconds from command start until every rank's process runs",
                               "sandbox": str(STATE), "rows": rows}, indent=2))
    print("| nodes | runner up (s) | x 1 node | without gate (s) | x 1 node | naive (s) | x 1 node |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['nodes']} | {r['runner_s']} | {r['runner_vs_1_node']} | {r['runner_nogate_s']} | "
              f"{r['runner_nogate_vs_1_node']} | {r['naive_s']} | {r['naive_vs_1_node']} |")


if __name__ == "__main__":
    main()
