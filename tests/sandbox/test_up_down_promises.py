"""What the README promises about `runner up` / `down`, run for real on the sandbox:

- `--max-restarts` relaunches a failed run from its latest checkpoint, with two ranks per node and
  each node's checkpoint files completed from the others (no shared storage), and the result is
  the uninterrupted run's, bit for bit;
- `--no-push` uses what the nodes have and refuses, with one line and nothing started, when a node
  lacks the image;
- `down` kills (SIGKILL) a container that ignores SIGTERM once the grace period is over.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests import IMAGE
from tests.support.runner_helpers import (
    REPO,
    build_image,
    node_docker,
    node_workdir,
    remove_host_image,
    run_containers,
    runner,
    runner_cmd,
    torchrun_image,
    unique_tag,
    up_detached,
    wait_for,
    write_job,
)
from tests.support.trainer_run import HOOKS_SYNC, held, hold_env, numeric_metrics, release, run_trainer

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]
NODES = ("node-0", "node-1", "node-2")


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_max_restarts_resumes_from_the_checkpoint_two_ranks_per_node(sandbox, pushed, tmp_path):
    """Six ranks (two per node), a checkpoint every 2 steps. All ranks are held after step 3; then
    node-1's container is killed. The runner stops the others, relaunches with --resume: each node
    gets the step-2 files it lacks (DDP's replicated tensors exist once, on node-0), and steps 3-6
    give exactly what one uninterrupted 6-rank run gives."""
    args = ["--train.steps", "6", "--checkpoint.interval", "2"]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"job": {
        "image": IMAGE, "config": str(REPO / "configs" / "tiny.yaml"), "args": args,
        "nproc_per_node": 2, "env": {"OMP_NUM_THREADS": "1", **hold_env("step:3")}, "master_port": "auto",
        "grace_period": 30, "sync": [HOOKS_SYNC]}}))
    out_f, err_f = tmp_path / "up.out", tmp_path / "up.err"
    with out_f.open("w") as o, err_f.open("w") as e:
        proc = subprocess.Popen(runner_cmd("up", "-i", str(sandbox), "--job", str(job), "--max-restarts", "1",
                                           "--logs-dir", str(tmp_path / "logs")), stdout=o, stderr=e, cwd=REPO)
    try:
        run_id = wait_for(lambda: (re.search(r"run (\S+) started", _text(out_f)) or [None, None])[1], 600)
        run_dir = {n: node_workdir(sandbox, n) / "runs" / run_id for n in NODES}
        wait_for(lambda: all(held(run_dir[n], "step-3", [2 * k, 2 * k + 1]) for k, n in enumerate(NODES)), 600)
        assert node_docker(sandbox, "node-1", "kill", f"runner-{run_id}-node-1").returncode == 0
        wait_for(lambda: "restart 1/1" in _text(err_f), 300)
        for n in NODES:
            release(run_dir[n], "step-3")  # the relaunch passes step 3 without waiting
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=120)
    out, err = _text(out_f), _text(err_f)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "node node-1 (rank 1) failed: container exited with code 137" in err, err[-3000:]
    assert re.search(rf"run {run_id}: resuming from step-2 \(step 2\): copied \d+ to node-\d", out), out[-3000:]
    assert out.count(f"run {run_id} started") == 2
    # each node holds its own two ranks' logs, in the same run dir across both attempts
    for k, n in enumerate(NODES):
        assert {p.name for p in (run_dir[n] / "logs").iterdir()} == {f"rank{2 * k}.log", f"rank{2 * k + 1}.log"}
        assert (run_dir[n] / "checkpoints" / "latest").read_text().strip() == "step-6"
    straight = tmp_path / "straight"
    run_trainer(straight, "--config", "configs/tiny.yaml", *args, nproc=6)
    assert [m["step"] for m in numeric_metrics(run_dir["node-0"])] == [1, 2, 3, 4, 5, 6]
    assert numeric_metrics(run_dir["node-0"]) == numeric_metrics(straight)
    assert run_containers(sandbox, run_id) == {n: [] for n in NODES}


def test_no_push_uses_what_nodes_have_and_refuses_what_they_lack(sandbox, pushed, tmp_path):
    tag = unique_tag("nopush")
    build_image(tag, {"Dockerfile": f"FROM {IMAGE}\n".encode() + b"COPY marker /opt/marker\n",
                      "marker": str(time.time()).encode()})
    job = write_job(tmp_path, image=tag)
    def runs(n: str) -> set[str]:
        d = node_workdir(sandbox, n) / "runs"
        return {p.name for p in d.iterdir()} if d.is_dir() else set()

    runs_before = {n: runs(n) for n in NODES}
    try:
        bad = runner("up", "-i", str(sandbox), "--job", str(job), "--no-push")
        assert bad.returncode == 2, bad.stdout + bad.stderr
        lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("runner: error: ") and tag in lines[0], bad.stderr
        assert "node-0" in lines[0] and "push" in lines[0], lines[0]  # names a node and what to do
        for n in NODES:  # nothing started, no run dir made
            assert node_docker(sandbox, n, "ps", "-aq", "--filter", f"ancestor={tag}").stdout.strip() == ""
            assert runs(n) == runs_before[n]
        assert runner("push", "-i", str(sandbox), "--job", str(job)).returncode == 0
        ok = runner("up", "-i", str(sandbox), "--job", str(job), "--no-push")
    finally:
        remove_host_image(tag)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "push node-" not in ok.stderr and "exporting" not in ok.stderr, ok.stderr
    assert all(f"[{n}/{k}] done {n}" in ok.stdout for k, n in enumerate(NODES)), ok.stdout


# A torchrun that, as the container's PID 1 without a SIGTERM handler, ignores SIGTERM (the kernel
# drops default-handled signals to PID 1); the master's listens on the rendezvous port like the real one.
DEAF_TORCHRUN = b"""#!/bin/sh
# test image only: ignores SIGTERM, so only the SIGKILL after the grace period stops it
exec /opt/venv/bin/python -c '
import socket, sys, time
a = sys.argv[1:]
if a[a.index("--node-rank") + 1] == "0":
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("", int(a[a.index("--master-port") + 1])))
    s.listen()
print("deaf torchrun up", flush=True)
while True:
    time.sleep(60)
' "$@"
"""


def test_down_kills_after_the_grace_period(sandbox, pushed, tmp_path):
    tag = unique_tag("deaf")
    torchrun_image(tag, DEAF_TORCHRUN, gate=False)
    try:
        run_id = up_detached(sandbox, write_job(tmp_path, image=tag, grace=2))
        since = str(int(time.time()) - 1)
        down = runner("down", run_id, "-i", str(sandbox))
    finally:
        remove_host_image(tag)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"run {run_id}: stopped and removed on node-0, node-1, node-2" in down.stdout
    until = str(int(time.time()) + 1)
    for n in NODES:
        name = f"runner-{run_id}-{n}"

        def events(kind: str, attr: str, n=n, name=name) -> list[str]:
            res = node_docker(sandbox, n, "events", "--since", since, "--until", until, "--filter",
                              f"container={name}", "--filter", f"event={kind}", "--format",
                              f"{{{{.Actor.Attributes.{attr}}}}}")
            return res.stdout.split()

        assert events("kill", "signal") == ["15", "9"], n  # SIGTERM, then SIGKILL after the grace
        assert events("die", "exitCode") == ["137"], n
    assert run_containers(sandbox, run_id) == {n: [] for n in NODES}
