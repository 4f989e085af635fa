"""DiLoCo against DDP over 10 Mbit/s links: dp 3 of the tiny Llama, one rank per namespaced node.

    flock /tmp/heavy-tests.lock .venv/bin/python -m bench.diloco [--ddp-steps 200] [--diloco-steps 600]

The network is the namespaced sandbox's (runner/sandbox/net.py: `runner sandbox up --netns --link
10mbit` makes the same namespaces, bridge and tbf shaping: node -> node traffic at 10 Mbit/s). What
is left out is the sandbox's sshd/dockerd per node and the runner: each rank is this checkout's
trainer under torchrun, started with `nsenter --net` in its node's namespace (the same code, no
image to rebuild), with a static rendezvous on node-0's address as the runner starts one.

Every run: configs/tiny.yaml (139,584 parameters, batch 4 x 32 tokens per rank), constant LR 1e-3
after 10 warmup steps (the same schedule however long a run is), seed 1234. DDP runs --ddp-steps;
its loss there (the mean of its last 10 steps: one step's loss is one batch's) is the target. Each
DiLoCo variant (H 20 and 50, fp32 and int8; outer lr 0.7, Nesterov 0.9) runs --diloco-steps and
reports: the first step whose 10-step mean loss is at or below the target, the wall time and
dp_sync_bytes (per rank) there, and its 10-step mean loss at DDP's wall time for --ddp-steps. Wall
time is measured from the start of step 1 (metrics.jsonl's record times), so start-up is left out.
Needs root (namespaces). Results: bench/results/diloco.json; table in docs/diloco.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "bench" / "results" / "diloco.json"
STATE = Path("/tmp/runner-bench-diloco/s")
LINK = "10mbit"
NODES = 3
WINDOW = 10
JOB = ("--config", "configs/tiny.yaml", "--schedule.decay", "constant", "--schedule.warmup_steps", "10",
       "--logging.log_interval", "1", "--logging.seed_line", "false")
DILOCO = ("--parallel.dp_sync", "diloco", "--parallel.diloco.outer_lr", "0.7", "--parallel.diloco.outer_momentum", "0.9")
VARIANTS = {
    "ddp": (),
    "diloco_h20_fp32": (*DILOCO, "--parallel.diloco.inner_steps", "20", "--parallel.diloco.sync_dtype", "fp32"),
    "diloco_h20_int8": (*DILOCO, "--parallel.diloco.inner_steps", "20", "--parallel.diloco.sync_dtype", "int8"),
    "diloco_h50_fp32": (*DILOCO, "--parallel.diloco.inner_steps", "50", "--parallel.diloco.sync_dtype", "fp32"),
    "diloco_h50_int8": (*DILOCO, "--parallel.diloco.inner_steps", "50", "--parallel.diloco.sync_dtype", "int8"),
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(net, name: str, args: tuple[str, ...], steps: int, out: Path, port: int) -> list[dict]:
    """One dp 3 run, rank k in node k's namespace; node-0's metrics.jsonl (rank 0 logs)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs = []
    for k in range(NODES):
        cmd = [*net.exec_prefix(k), sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES),
               "--node-rank", str(k), "--nproc-per-node", "1", "--master-addr", net.addr(0), "--master-port",
               str(port), "-m", "trainer", *JOB, *args, "--train.steps", str(steps),
               "--output-dir", str(out / name / f"node{k}")]
        log = (out / f"{name}-node{k}.log").open("w")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=3600) for p in procs]
    if any(codes):
        raise SystemExit(f"bench.diloco: {name} exited {codes}; see {out}/{name}-node*.log")
    path = out / name / "node0" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curve(rows: list[dict]) -> list[dict]:
    """Per step: elapsed seconds since step 1 began, the 10-step mean loss, cumulative bytes."""
    t0 = rows[0]["time"] - rows[0]["step_time_s"]
    out = []
    for i, r in enumerate(rows):
        window = [x["loss"] for x in rows[max(0, i - WINDOW + 1): i + 1]]
        out.append({"step": r["step"], "s": r["time"] - t0, "loss": sum(window) / len(window),
                    "bytes": r.get("dp_sync_bytes", 0), "sync_s": r.get("dp_sync_s", 0.0)})
    return out


def at_time(c: list[dict], s: float) -> dict:
    """The last point of curve `c` at or before `s` seconds (its end if it ended sooner)."""
    return [p for p in c if p["s"] <= s][-1]


def summarise(c: list[dict], ddp: list[dict]) -> dict:
    """Against DDP's curve: where this run reaches DDP's final 10-step loss, this run's loss at DDP's
    whole run time (its last if it ended sooner) and DDP's at this run's end (equal wall time)."""
    target, end = ddp[-1]["loss"], c[-1]
    reached = next((p for p in c if p["step"] >= WINDOW and p["loss"] <= target), None)
    mine, theirs = at_time(c, ddp[-1]["s"]), at_time(ddp, end["s"])
    return {"steps": end["step"], "wall_s": end["s"], "final_loss10": end["loss"],
            "bytes_total": end["bytes"], "sync_s_total": end["sync_s"],
            "reached_step": reached and reached["step"], "reached_s": reached and reached["s"],
            "reached_bytes": reached and reached["bytes"],
            "loss10_at_ddp_time": mine["loss"], "step_at_ddp_time": mine["step"],
            "ddp_loss10_at_end": theirs["loss"], "ddp_step_at_end": theirs["step"]}


def result(curves: dict[str, list[dict]], ddp_steps: int, diloco_steps: int) -> dict:
    ddp = curves["ddp"]
    return {"setup": {"nodes": NODES, "link": LINK, "model": "tiny-llama (139,584 parameters)",
                      "job": " ".join(JOB), "ddp_steps": ddp_steps, "diloco_steps": diloco_steps,
                      "loss_window": WINDOW, "outer": "lr 0.7, Nesterov 0.9",
                      "where": "namespaced sandbox network (runner/sandbox/net.py), one rank per node, "
                               "trainer from this checkout under torchrun (no containers)",
                      "machine": "2 shared cores (other jobs ran beside it: compute-bound times are noisy)"},
            "target_loss10": ddp[-1]["loss"], "ddp_wall_s": ddp[-1]["s"],
            "runs": {name: summarise(c, ddp) for name, c in curves.items()},
            "curves": {n: [[p["step"], round(p["s"], 3), round(p["loss"], 5), p["bytes"], round(p["sync_s"], 4)]
                           for p in c] for n, c in curves.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ddp-steps", type=int, default=200)
    ap.add_argument("--diloco-steps", type=int, default=600)
    ap.add_argument("--only", nargs="*", default=list(VARIANTS), help="variants to run (default all)")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.diloco: network namespaces need root", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))
    from runner.sandbox.net import SandboxNet

    net = SandboxNet.for_state_dir(STATE)
    out = Path(tempfile.mkdtemp(prefix="bench-diloco-"))
    curves: dict[str, list[dict]] = {}
    try:
        net.create(NODES, link=LINK)
        for name in a.only:
            steps = a.ddp_steps if name == "ddp" else a.diloco_steps
            t = time.perf_counter()
            curves[name] = curve(run(net, name, VARIANTS[name], steps, out, free_port()))
            print(f"{name}: {steps} steps in {time.perf_counter() - t:.0f} s with start-up", flush=True)
    finally:
        net.destroy()
    out_json = result(curves, a.ddp_steps, a.diloco_steps)
    RESULT.write_text(json.dumps(out_json, indent=1) + "\n")
    print(f"target: DDP's 10-step mean loss at step {a.ddp_steps}: {out_json['target_loss10']:.4f}, "
          f"reached in {out_json['ddp_wall_s']:.1f} s")
    print("| run | reached at step | wall s | MB sent per rank | loss at DDP's time |")
    print("|---|---|---|---|---|")
    for name, r in out_json["runs"].items():
        reached = "-" if r["reached_step"] is None else f"{r['reached_step']}"
        wall = "-" if r["reached_s"] is None else f"{r['reached_s']:.1f}"
        mb = "-" if r["reached_bytes"] is None else f"{r['reached_bytes'] / 1e6:.2f}"
        print(f"| {name} | {reached} | {wall} | {mb} | {r['loss10_at_ddp_time']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
