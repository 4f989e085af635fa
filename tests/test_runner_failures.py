"""The runner when things go wrong, against the sandbox cluster (real sshd, dockerd, containers):
a node unreachable for `down`/`status`/`ls`/`logs`, a node lost in the middle of a run, stale
containers at a relaunch, `--resume` run resolution, the rendezvous timeout, and the status,
logs and failure output a user reads.

A node is made unreachable by stopping its sshd (the listener and every session it forked):
SIGSTOP is a network partition (connections hang), SIGKILL a dead host (connections refused).
Its dockerd keeps running, so its container does too, as on a real node behind a broken link.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from runner.plan import LABEL_RUN
from tests.conftest import REPO
from tests.runner_helpers import (
    node_engine_containers,
    remotes,
    run_containers,
    runner,
    runner_cmd,
    signal_sshd,
    wait_for,
    write_job,
)

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]
NODES = ("node-0", "node-1", "node-2")


def _detached(sandbox: Path, job: Path, *extra: str) -> str:
    up = runner("up", "-i", str(sandbox), "--job", str(job), "--detach", *extra)
    assert up.returncode == 0, up.stdout + up.stderr
    return re.search(r"run (\S+) started", up.stdout)[1]


def _all_running(sandbox: Path, run_id: str) -> None:
    wait_for(lambda: all(len(v) == 1 for v in run_containers(sandbox, run_id, running_only=True).values()), 30)


def _restore(sandbox: Path, node: str) -> None:
    """SIGCONT whatever is stopped; restart sshd if it was killed (`runner sandbox up` is idempotent)."""
    try:
        signal_sshd(sandbox, node, signal.SIGCONT)
    except Exception:  # noqa: BLE001 - killed: no process to continue
        pass
    from tests.runner_helpers import sandbox_node

    nd = sandbox_node(sandbox, node)
    state = nd.root.parent
    hosts = [n["host"] for n in __import__("yaml").safe_load(Path(sandbox).read_text())["nodes"]]
    up = subprocess.run(runner_cmd("sandbox", "--dir", str(state), "up", "--nodes", str(len(hosts)),
                                   "--base-addr", hosts[0], "--inventory", str(sandbox)),
                        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert up.returncode == 0, up.stderr


class _Engines:
    """Persistent SSH connections to some nodes, to poll their containers fast."""

    def __init__(self, sandbox: Path, nodes: tuple[str, ...]):
        self.r = {n: r for n, r in remotes(sandbox).items() if n in nodes}

    def count(self, run_id: str) -> dict[str, int]:
        out = {}
        for n, r in self.r.items():
            res = r.run(["docker", "ps", "-aq", "--filter", f"label={LABEL_RUN}={run_id}"], timeout=20)
            out[n] = len(res.out.split())
        return out

    def close(self) -> None:
        for r in self.r.values():
            r.close()


def test_down_with_a_partitioned_node_stops_the_others_and_reruns_clean(sandbox, pushed, tmp_path):
    run_id = _detached(sandbox, write_job(tmp_path, sleep=300, grace=5))
    _all_running(sandbox, run_id)
    try:
        assert signal_sshd(sandbox, "node-2", signal.SIGSTOP) >= 1
        t0 = time.time()
        down = runner("down", run_id, "-i", str(sandbox), timeout=120)
        took = time.time() - t0
        # Healthy nodes: stopped and removed. node-2: named, one line; exit non-zero (re-run needed).
        assert down.returncode == 2, down.stdout + down.stderr
        assert f"run {run_id}: stopped and removed on node-0, node-1; NOT reached: node-2" in down.stdout
        err = down.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("runner: error: node node-2: cannot connect"), down.stderr
        assert f"runner down {run_id}" in err[0]
        assert node_engine_containers(sandbox, "node-0", run_id) == []
        assert node_engine_containers(sandbox, "node-1", run_id) == []
        assert node_engine_containers(sandbox, "node-2", run_id) == [f"runner-{run_id}-node-2"]  # still there
        # status/ls/logs still answer for the reachable nodes and name the missing one.
        st = runner("status", run_id, "-i", str(sandbox), "--json", timeout=120)
        assert st.returncode == 0, st.stderr
        rows = {r["node"]: r for r in json.loads(st.stdout)["nodes"]}
        assert rows["node-2"]["state"] == "unreachable" and "node node-2" in rows["node-2"]["error"]
        assert rows["node-0"]["state"] == rows["node-1"]["state"] == "no container"  # removed by down
        assert [ln for ln in st.stderr.splitlines() if "node-2" in ln] == st.stderr.strip().splitlines()
        assert len(st.stderr.strip().splitlines()) == 1
        ls = runner("ls", "-i", str(sandbox), "--json", timeout=120)
        assert ls.returncode == 0 and run_id in [r["run_id"] for r in json.loads(ls.stdout)], ls.stderr
        assert "node node-2" in ls.stderr
    finally:
        signal_sshd(sandbox, "node-2", signal.SIGCONT)
    print(f"\n[figure] down with node-2 partitioned took {took:.1f}s")
    again = runner("down", run_id, "-i", str(sandbox), timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"run {run_id}: stopped and removed on node-2" in again.stdout
    assert run_containers(sandbox, run_id) == {n: [] for n in NODES}
    third = runner("down", run_id, "-i", str(sandbox))  # idempotent
    assert third.returncode == 0 and "already down" in third.stdout


def test_node_lost_mid_run_others_stopped_within_10s_then_reclaimed(sandbox, pushed, tmp_path):
    """node-2 partitioned while the run is attached: the runner names it, stops node-0/1 within
    10 s of the loss, and removes node-2's container when it answers again."""
    job = write_job(tmp_path, sleep=300, grace=30)
    proc = subprocess.Popen(runner_cmd("up", "-i", str(sandbox), "--job", str(job), "--logs-dir", str(tmp_path / "l"),
                                       "--reclaim-timeout", "90"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    engines = _Engines(sandbox, ("node-0", "node-1"))
    try:
        run_id = None
        for line in proc.stdout:
            m = re.search(r"run (\S+) started", line)
            if m:
                run_id = m[1]
                break
        assert run_id, proc.stderr.read()
        _all_running(sandbox, run_id)
        time.sleep(2)  # a few heartbeats in: the loss, not the start-up, is what is measured
        signal_sshd(sandbox, "node-2", signal.SIGSTOP)
        t_loss = time.time()
        wait_for(lambda: sum(engines.count(run_id).values()) == 0, 20, interval=0.1)
        stopped_in = time.time() - t_loss
        assert node_engine_containers(sandbox, "node-2", run_id) == [f"runner-{run_id}-node-2"]
        time.sleep(3)  # the runner is now retrying node-2
        signal_sshd(sandbox, "node-2", signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    finally:
        signal_sshd(sandbox, "node-2", signal.SIGCONT)
        engines.close()
        if proc.poll() is None:
            proc.kill()
    print(f"\n[figure] node lost -> node-0/1 containers gone in {stopped_in:.2f}s")
    assert stopped_in <= 10.0, stopped_in
    assert proc.returncode == 1, err
    assert f"runner: error: run {run_id}: node node-2 (rank 2) failed: node unreachable" in err, err
    m = re.search(r"stopped the run on the other nodes \(([\d.]+)s after the loss\)", err)
    assert m and float(m[1]) <= 10.0, err
    assert "runner: node node-2 is reachable again: stopped and removed its container" in err, err
    assert node_engine_containers(sandbox, "node-2", run_id) == []
    assert run_containers(sandbox, run_id) == {n: [] for n in NODES}


def test_dead_node_orphan_removed_by_resume_relaunch(sandbox, pushed, tmp_path):
    """node-2's sshd killed mid-run and not back within --reclaim-timeout: the runner says its
    container may still run. Once the node is back, `up --resume <prefix>` removes that stale
    container (same name) before creating the new ones."""
    job = write_job(tmp_path, sleep=300, grace=30)
    proc = subprocess.Popen(runner_cmd("up", "-i", str(sandbox), "--job", str(job), "--logs-dir", str(tmp_path / "l"),
                                       "--reclaim-timeout", "2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        run_id = None
        for line in proc.stdout:
            m = re.search(r"run (\S+) started", line)
            if m:
                run_id = m[1]
                break
        assert run_id, proc.stderr.read()
        _all_running(sandbox, run_id)
        signal_sshd(sandbox, "node-2", signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err
        assert "node node-2 (rank 2) failed: lost contact" in err or "node node-2 (rank 2) failed: node unreachable" in err
        assert "runner: error: node node-2 still unreachable" in err and f"runner down {run_id}" in err, err
        assert node_engine_containers(sandbox, "node-2", run_id) == [f"runner-{run_id}-node-2"]  # orphan
    finally:
        _restore(sandbox, "node-2")
    short = write_job(tmp_path, "short.yaml", sleep=1)
    res = runner("up", "-i", str(sandbox), "--job", str(short), "--resume", run_id[:-2], "--logs-dir", str(tmp_path / "l"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"run {run_id} started" in res.stdout
    assert "removed containers left by an earlier attempt on node-2" in res.stderr
    assert "[node-2/2] done node-2" in res.stdout
    assert run_containers(sandbox, run_id) == {n: [] for n in NODES}
