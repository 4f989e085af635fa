"""Nodes whose SSH user is not root: a Raspberry Pi's `pi`, in the `docker` group, without sudo.

The second sandbox (tests/conftest.py `nonroot_sandbox`: NONROOT_NODES nodes logging in as NONROOT_USER, each
engine serving that account's group) runs real trainer jobs through every command. The checks are
on what lands on the nodes: which uid:gid the containers run as, who owns every file of a run,
what `down`, `up --resume`, `--max-restarts` and `collect` leave behind.

Before containers ran as the SSH user's uid:gid, they wrote root-owned directories into the run
dir, and `up --resume` could not copy a checkpoint file into them ("Permission denied" from the
SFTP put to node-1). Runs left that way by an earlier runner are handed back to the user (resume)
or removed (`down --keep-runs`) through the node's engine, which the user may drive as root.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from runner.core.runs import RUN_ID_RE
from runner.planning.plan import container_name
from tests import IMAGE, REPO
from tests.conftest import NONROOT_NODES, NONROOT_USER
from tests.support.runner_helpers import (
    down_while_held,
    node_docker,
    node_workdir,
    remotes,
    run_containers,
    runner,
    runner_cmd,
    up_detached,
    wait_for,
)
from tests.support.trainer_run import HOOKS_SYNC, held, hold_env, numeric_metrics, release, run_trainer

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]
NODES = tuple(f"node-{i}" for i in range(NONROOT_NODES))
ARGS = ["--train.steps", "8", "--checkpoint.interval", "2"]


def account() -> tuple[int, int]:
    pw = pwd.getpwnam(NONROOT_USER)
    return pw.pw_uid, pw.pw_gid


def owners(root: Path) -> dict[str, tuple[int, int]]:
    """{path under root: (uid, gid)}, root itself as '.'."""
    st = root.lstat()
    out = {".": (st.st_uid, st.st_gid)}
    for p in root.rglob("*"):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_uid, st.st_gid)
    return out


def not_owned_by(root: Path, ids: tuple[int, int]) -> dict[str, tuple[int, int]]:
    return {p: o for p, o in owners(root).items() if o != ids}


def release_as_user(out: Path, point: str) -> None:
    """release(), the go-file owned as if the node's user wrote it (this test process is root)."""
    release(out, point)
    os.chown(out / ".hold" / f"{point}.go", *account())


def on_node(inventory: Path, node: str, *argv: str) -> str:
    with remotes(inventory)[node] as r:
        res = r.run(list(argv), timeout=120)
    assert res.rc == 0, f"{node}: {argv}: {res.err}"
    return res.out


def ckpt_job(tmp: Path, name: str = "job.yaml", args: list[str] = ARGS, **env: str) -> Path:
    """configs/tiny.yaml (DDP, fp32 CPU: bitwise reproducible)."""
    job = {"image": IMAGE, "config": str(REPO / "configs" / "tiny.yaml"), "args": args,
           "env": {"OMP_NUM_THREADS": "1", **env}, "master_port": "auto", "grace_period": 60,
           **({"sync": [HOOKS_SYNC]} if "TRAINER_TEST_HOLD" in env else {})}  # the hold's switch (hold_env)
    p = tmp / name
    p.write_text(yaml.safe_dump({"job": job}))
    return p


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_sandbox_nodes_log_in_as_the_user_in_the_engines_group(nonroot_sandbox, tmp_path):
    uid, gid = account()
    inv = yaml.safe_load(nonroot_sandbox.read_text())
    assert inv["defaults"]["user"] == NONROOT_USER
    home = Path(pwd.getpwnam(NONROOT_USER).pw_dir)
    state = Path(inv["defaults"]["identity_file"]).parent
    for i, n in enumerate(inv["nodes"]):
        wd = Path(n["workdir"])
        assert (wd.parent.parent, wd.name) == (home, f"node-{i}")
        assert (wd.stat().st_uid, wd.stat().st_gid) == (uid, gid)
        # Its own uid, only its own group, and that group is what the engine's socket serves.
        got = on_node(nonroot_sandbox, n["name"], "sh", "-c", 'id -u; id -g; id -Gn; stat -c "%G %a" '
                      '"${DOCKER_HOST#unix://}"; docker info --format "{{.DockerRootDir}}"').split("\n")
        assert got[:5] == [str(uid), str(gid), NONROOT_USER, f"{NONROOT_USER} 660", str(state / f"node-{i}" / "docker")]
    # Out of the engine's group (its socket given to root's group here), the user gets one line
    # saying what to do, as a Pi user not in the docker group would.
    sock = Path(on_node(nonroot_sandbox, "node-1", "sh", "-c", 'echo "${DOCKER_HOST#unix://}"').strip())
    os.chown(sock, 0, 0)
    try:
        chk = runner("check", "-i", str(nonroot_sandbox), "--json")
    finally:
        os.chown(sock, 0, gid)
    assert chk.returncode == 1, chk.stderr
    problems = {r["node"]: r["problems"] for r in json.loads(chk.stdout)}
    assert problems["node-1"] == [
        f"docker engine: permission denied on the engine's socket: the SSH user {NONROOT_USER} is not in its "
        f"group; `sudo usermod -aG docker {NONROOT_USER}` on the node, then connect again"], problems
    assert all(problems[n] == [] for n in NODES if n != "node-1"), problems
    # sshd refuses root, as on a Pi.
    d = inv["defaults"]
    root = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={d['known_hosts']}",
                           "-o", "GlobalKnownHostsFile=/dev/null", "-i", d["identity_file"], "-p", str(d["port"]),
                           f"root@{inv['nodes'][0]['host']}", "true"], capture_output=True, text=True, timeout=60)
    assert root.returncode == 255 and "Permission denied (publickey)" in root.stderr, root.stderr
    st = runner("sandbox", "--dir", str(state), "status", "--json")
    assert [(r["node"], r["user"], r["sshd"], r["dockerd"]) for r in json.loads(st.stdout)] == [
        (n, NONROOT_USER, True, True) for n in NODES], st.stdout
    # `up` again changes nothing; as another user it is refused while the nodes run.
    pids = sorted(p.read_text() for p in state.glob("node-*/sshd.pid"))
    again = runner("sandbox", "--dir", str(state), "up", "--nodes", str(NONROOT_NODES), "--base-addr", inv["nodes"][0]["host"],
                   "--user", NONROOT_USER, "--inventory", str(tmp_path / "again.yaml"))
    assert again.returncode == 0, again.stderr
    assert sorted(p.read_text() for p in state.glob("node-*/sshd.pid")) == pids
    assert yaml.safe_load((tmp_path / "again.yaml").read_text())["nodes"] == inv["nodes"]
    other = runner("sandbox", "--dir", str(state), "up", "--nodes", str(NONROOT_NODES), "--base-addr", inv["nodes"][0]["host"],
                   "--inventory", str(tmp_path / "root.yaml"))
    assert other.returncode == 2 and other.stderr.strip().endswith(
        "before changing address/port/--light/--user/--netns"), other.stderr
    assert not (tmp_path / "root.yaml").exists()


def test_a_run_as_the_ssh_user_through_down_resume_restart_and_collect(nonroot_sandbox, nonroot_pushed, tmp_path):
    """One run, 8 steps, a checkpoint every 2. Held after step 4: the containers run as the user,
    every file is the user's, status and logs show step 4. `down` leaves step-5.preempt on both
    nodes. `up --resume --max-restarts 1` copies each node the files it lacks and continues; held
    after step 6, node-1's container is killed, and the relaunch resumes from step-6. The metrics
    equal an uninterrupted run's bit for bit; collect brings files the caller owns."""
    inv, ids = nonroot_sandbox, account()
    job = ckpt_job(tmp_path, **hold_env("step:4", "step:6"))
    run_id = up_detached(inv, job)
    out = {n: node_workdir(inv, n) / "runs" / run_id for n in NODES}
    wait_for(lambda: all(held(out[n], "step-4", [i]) for i, n in enumerate(NODES)), 300)

    for n in NODES:
        cfg = json.loads(on_node(inv, n, "docker", "inspect", "--format", "{{json .Config}}", container_name(run_id, n)))
        assert cfg["User"] == f"{ids[0]}:{ids[1]}"
        # the node's engine logs to json-file without max-size: the runner's bound (node_runs.NODE_LOG_MAX)
        log = json.loads(on_node(inv, n, "docker", "inspect", "--format", "{{json .HostConfig.LogConfig}}",
                                 container_name(run_id, n)))
        assert log == {"Type": "json-file", "Config": {"max-size": "256m", "max-file": "2"}}, log
        assert {"HOME=/tmp", f"USER={NONROOT_USER}"} <= set(cfg["Env"])
        assert not_owned_by(out[n], ids) == {}
    assert (out["node-0"] / "checkpoints" / "latest").read_text().strip() == "step-4"
    st = runner("status", run_id, "-i", str(inv), "--json")
    assert st.returncode == 0, st.stderr
    rows = json.loads(st.stdout)["nodes"]
    assert [(r["node"], r["rank"], r["state"]) for r in rows] == [(n, i, "running") for i, n in enumerate(NODES)]
    step4 = json.loads(rows[0]["last_metrics"])
    assert (step4["step"], rows[0]["progress"]["step"], rows[0]["progress"]["total"]) == (4, 4, 8)
    logs = runner("logs", run_id, "-i", str(inv))
    assert logs.returncode == 0, logs.stderr
    assert f"[node-0/0] [rank0] step 4 loss {step4['loss']:.4f}" in logs.stdout.splitlines(), logs.stdout[-2000:]

    # down: SIGTERM reaches every held rank, then they go on and write the preempt checkpoint.
    down = down_while_held(inv, run_id, out, "step-4", release_as_user)
    assert down.returncode == 0 and f"run {run_id}: stopped and removed on {', '.join(NODES)}" in down.stdout, \
        down.stdout + down.stderr
    for n in NODES:
        assert (out[n] / "checkpoints" / "latest").read_text().strip() == "step-5.preempt"
        assert not_owned_by(out[n], ids) == {}
    assert not (out["node-1"] / "checkpoints" / "step-5.preempt" / "__0_0.distcp").exists()  # node-1 must get it

    out_f, err_f = tmp_path / "up.out", tmp_path / "up.err"
    with out_f.open("w") as o, err_f.open("w") as e:
        proc = subprocess.Popen(runner_cmd("up", "-i", str(inv), "--job", str(job), "--resume", run_id,
                                           "--max-restarts", "1", "--logs-dir", str(tmp_path / "logs")),
                                stdout=o, stderr=e, cwd=REPO)
    try:
        wait_for(lambda: all(held(out[n], "step-6", [i]) for i, n in enumerate(NODES)), 600)
        assert re.search(rf"run {run_id}: resuming from step-5\.preempt \(step 5\): copied \d+ to node-\d", _text(out_f))
        assert node_docker(inv, "node-1", "kill", container_name(run_id, "node-1")).returncode == 0
        wait_for(lambda: "restart 1/1" in _text(err_f), 300)
        for n in NODES:
            release_as_user(out[n], "step-6")  # the relaunch passes step 6 without waiting
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=120)
    stdout, stderr = _text(out_f), _text(err_f)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "node node-1 (rank 1) failed: container exited with code 137" in stderr, stderr[-3000:]
    assert re.search(rf"run {run_id}: resuming from step-6 \(step 6\): copied \d+ to node-1", stdout), stdout[-3000:]
    assert stdout.count(f"run {run_id} started") == 2
    straight = tmp_path / "straight"
    run_trainer(straight, "--config", "configs/tiny.yaml", *ARGS, nproc=len(NODES))
    assert [m["step"] for m in numeric_metrics(out["node-0"])] == list(range(1, 9))
    assert numeric_metrics(out["node-0"]) == numeric_metrics(straight)
    for n in NODES:
        assert (out[n] / "checkpoints" / "latest").read_text().strip() == "step-8"
        assert not_owned_by(out[n], ids) == {}
    digests = {n: {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                   for p in (out[n] / "checkpoints" / "step-6").iterdir()} for n in NODES}
    assert all(digests[n] == digests["node-0"] for n in NODES) and "__0_0.distcp" in digests["node-1"]
    st = runner("status", run_id, "-i", str(inv), "--json")
    assert [(r["state"], r["rank"], r["exit_code"]) for r in json.loads(st.stdout)["nodes"]] == [
        ("finished", i, 0) for i in range(len(NODES))], st.stdout

    # collect: the user's files on the nodes arrive as the caller's, byte for byte.
    col = runner("collect", run_id, "-i", str(inv), "--dest", str(tmp_path / "art"), "--quiet", "--no-plots")
    assert col.returncode == 0, col.stderr
    me = (os.getuid(), os.getgid())
    for n in NODES:
        local = tmp_path / "art" / run_id / n
        remote = {str(p.relative_to(out[n])): p for p in out[n].rglob("*") if p.is_file()}
        assert set(remote) <= {str(p.relative_to(local)) for p in local.rglob("*") if p.is_file()}
        for rel, p in remote.items():
            assert (local / rel).read_bytes() == p.read_bytes(), rel
        assert not_owned_by(local, me) == {}

    # down --keep-runs 0: the run dirs go, as the user, with no permission error. Other tests' runs
    # on this session cluster (earlier in the group) go too: keep 0 keeps none.
    rm = runner("down", run_id, "--keep-runs", "0", "-i", str(inv))
    assert rm.returncode == 0, rm.stdout + rm.stderr
    for n in NODES:
        removed = re.search(rf"^{n}: removed (\d+) run dir\(s\): (.+)$", rm.stdout, re.M)
        assert removed and run_id in removed[2].split(", ") and int(removed[1]) == len(removed[2].split(", ")), \
            rm.stdout
        assert not out[n].exists()
    assert run_containers(inv, run_id) == {n: [] for n in NODES}


OLD, RESUMED = "29990101-000000-aaaa", "29990102-000000-bbbb"


def test_runs_an_earlier_runner_left_root_owned_are_resumed_and_removed(nonroot_sandbox, nonroot_pushed, tmp_path):
    """On a Pi upgraded from a runner whose containers ran as root: run dirs the user made, with
    root-owned files in them (made here the same way, by a root container on the node's engine,
    which the user may drive). `up --resume` hands the run's files back to the user first, so the
    relaunched ranks (now the user's uid) can write; `down --keep-runs 1` removes the older one,
    which the user's own `rm -rf` cannot."""
    inv, ids = nonroot_sandbox, account()
    runs = {n: node_workdir(inv, n) / "runs" for n in NODES}
    # Runs other tests left on these shared nodes (a stopped Pi experiment, say) are older than
    # RESUMED, so `--keep-runs 1` removes them too: what it must remove is known beforehand.
    others = {n: sorted(p.name for p in runs[n].iterdir() if RUN_ID_RE.match(p.name)) if runs[n].is_dir() else []
              for n in NODES}
    for n in NODES:
        for run in (OLD, RESUMED, "mydata"):
            on_node(inv, n, "mkdir", "-p", f"{runs[n]}/{run}")
        for run, script in ((OLD, "mkdir -p /out/logs /out/checkpoints/step-2 && chmod 700 /out/checkpoints"),
                            (RESUMED, "mkdir -p /out/logs /out/checkpoints && : > /out/metrics.jsonl")):
            on_node(inv, n, "docker", "run", "--rm", "--user", "0:0", "--network", "none", "-v",
                    f"{runs[n]}/{run}:/out", IMAGE, "sh", "-c", script)
        assert owners(runs[n] / OLD)["checkpoints"] == (0, 0)
        with remotes(inv)[n] as r:  # the failure this guards against
            res = r.run(["rm", "-rf", f"{runs[n]}/{OLD}/checkpoints"])
        assert res.rc == 1 and "Permission denied" in res.err, res.err

    res = runner("up", "-i", str(inv), "--job", str(ckpt_job(tmp_path, args=["--train.steps", "2"])),
                 "--resume", RESUMED, "--logs-dir", str(tmp_path / "logs"), timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for n in NODES:
        assert f"run {RESUMED}: {n}: files not owned by {NONROOT_USER} handed back to it" in res.stdout, res.stdout
        assert not_owned_by(runs[n] / RESUMED, ids) == {}
    assert f"run {RESUMED}: no checkpoint on the nodes yet: the run starts from step 0" in res.stdout
    assert [m["step"] for m in numeric_metrics(runs["node-0"] / RESUMED)] == [1, 2]

    rm = runner("down", "--keep-runs", "1", "-i", str(inv))
    assert rm.returncode == 0, rm.stdout + rm.stderr
    for n in NODES:
        gone = sorted([*others[n], OLD])
        assert f"{n}: removed {len(gone)} run dir(s): {', '.join(gone)}" in rm.stdout.splitlines(), rm.stdout
        assert sorted(p.name for p in runs[n].iterdir()) == [RESUMED, "mydata"]  # the newest; not a run id
    again = runner("down", "--keep-runs", "0", "-i", str(inv))
    assert again.returncode == 0 and f"node-1: removed 1 run dir(s): {RESUMED}" in again.stdout.splitlines()
    for n in NODES:
        assert [p.name for p in runs[n].iterdir()] == ["mydata"]
        shutil.rmtree(runs[n] / "mydata")  # made by this test: the next one finds the nodes as they were
