"""Issue 15 against the sandbox cluster (real sshd + dockerd per node): hostile values never reach a
node's shell, a refused inventory starts nothing, secrets never outlive a failed launch, SIGTERM
ends `up --max-restarts`, the master port is the master's own, one rule for "the latest run",
status in words, and exit codes that say what happened."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from runner.planning.plan import LABEL_NODE, LABEL_RANK, LABEL_RUN, LABEL_RUN_DIR
from tests import IMAGE
from tests.support.runner_helpers import (
    node_workdir,
    remotes,
    remove_host_image,
    run_containers,
    runner,
    sandbox_node,
    start_attached,
    torchrun_image,
    unique_tag,
    write_job,
)

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]
NODES = ("node-0", "node-1", "node-2")


def _engine(sandbox: Path, node: str, *args: str) -> subprocess.CompletedProcess:
    """docker against the node's own engine, through its socket on this machine."""
    return subprocess.run(["docker", "-H", sandbox_node(sandbox, node).docker_host, *args],
                          capture_output=True, text=True, timeout=120)


def _all_containers(sandbox: Path) -> dict[str, list[str]]:
    return {n: sorted(_engine(sandbox, n, "ps", "-aq").stdout.split()) for n in NODES}


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


def _with(sandbox: Path, dest: Path, **node1: object) -> Path:
    """The sandbox inventory with node-1's entry changed."""
    doc = yaml.safe_load(Path(sandbox).read_text())
    doc["nodes"][1].update(node1)
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest


def test_status_never_runs_a_hostile_label_in_a_shell(sandbox, pushed, tmp_path):
    """A container label is data from the node: a run-dir or run-id label built to break out of
    a shell command (by a pre-fix runner fed a hostile workdir, or by anyone on the node) runs nothing."""
    marks = [tmp_path / "pwned-dir", tmp_path / "pwned-id"]
    run_id = "20991231-235958-" + secrets.token_hex(2)
    made = []
    for label_run, label_dir in ((run_id, f"/tmp/x; touch {marks[0]}; echo"),
                                 (f"{run_id}; touch {marks[1]}; echo", "/tmp/y")):
        res = _engine(sandbox, "node-1", "create", "--label", f"{LABEL_RUN}={label_run}",
                      "--label", f"{LABEL_RUN_DIR}={label_dir}", "--label", f"{LABEL_NODE}=node-1",
                      "--label", f"{LABEL_RANK}=1", IMAGE, "true")
        assert res.returncode == 0, res.stderr
        made.append(res.stdout.strip())
    try:
        for args in (("status", run_id, "--json"), ("status", "--json"), ("ls",), ("logs",)):
            runner(*args, "-i", str(sandbox))
        assert not any(m.exists() for m in marks)
    finally:
        _engine(sandbox, "node-1", "rm", "-f", *made)


HOSTILE = {
    "workdir_shell": lambda tmp: {"workdir": f"{tmp}/w; touch {tmp}/pwned; echo"},
    "workdir_relative": lambda tmp: {"workdir": "relative-dir"},
    "workdir_colon": lambda tmp: {"workdir": f"{tmp}/a:b"},
    "missing_key": lambda tmp: {"identity_file": f"{tmp}/no-such-key"},
    "reserved_env": lambda tmp: {"env": {"NODE_RANK": "0"}},
}


def test_a_refused_inventory_starts_nothing_on_the_nodes(sandbox, pushed, tmp_path):
    envf = tmp_path / "rank.env"
    envf.write_text("HF_TOKEN=hf_x\nWORLD_SIZE=1\n")
    jobs = {"plain": write_job(tmp_path, "plain.yaml"), "env_file": write_job(tmp_path, "ef.yaml", env_file=str(envf))}
    cases = [(name, make(tmp_path), jobs["plain"]) for name, make in HOSTILE.items()] + [("env_file", {}, jobs["env_file"])]
    workdirs = {n: node_workdir(sandbox, n) for n in NODES}
    before = ({n: _tree(w) for n, w in workdirs.items()}, _all_containers(sandbox), _tree(tmp_path))
    for name, change, job in cases:
        inv = _with(sandbox, tmp_path / f"{name}.yaml", **change)
        for extra in ((), ("--dry-run",)):
            proc = runner("up", "-i", str(inv), "--job", str(job), *extra, timeout=300)
            if name == "missing_key" and extra:  # a dry run reads no key (it contacts nothing): it plans
                assert proc.returncode == 0 and "started" not in proc.stdout, (name, proc.stderr)
                continue
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("runner: error: "), (name, proc.stderr)
            assert "node-1" in lines[0] or name == "env_file", (name, lines)
            assert "started" not in proc.stdout, (name, proc.stdout)
    after = ({n: _tree(w) for n, w in workdirs.items()}, _all_containers(sandbox), _tree(tmp_path))
    assert after[0] == before[0] and after[1] == before[1]
    assert {p for p in after[2] - before[2] if not p.endswith(".yaml")} == set()  # no pwned, no w;... dir


def test_secrets_file_never_outlives_a_launch_that_failed_before_its_containers(sandbox, pushed, tmp_path):
    """The secrets are staged, then the master's container cannot be created (a container of
    someone else's holds its name): no container of the run ever exists, and the file goes."""
    envf = tmp_path / ".env"
    envf.write_text("HF_TOKEN=hf_must_not_stay\n")
    name = "sec-" + secrets.token_hex(3)
    (node_workdir(sandbox, "node-0") / "runs" / name).mkdir(parents=True)
    squat = _engine(sandbox, "node-0", "create", "--name", f"runner-{name}-node-0", IMAGE, "true")
    assert squat.returncode == 0, squat.stderr
    dirs = {n: node_workdir(sandbox, n) / "secrets" for n in NODES}
    before = {n: _tree(d) for n, d in dirs.items()}
    try:
        proc = runner("up", "-i", str(sandbox), "--job", str(write_job(tmp_path, env_file=str(envf))),
                      "--resume", name)
    finally:
        _engine(sandbox, "node-0", "rm", "-f", f"runner-{name}-node-0")
    assert proc.returncode == 2 and "docker refused to start" in proc.stderr, proc.stderr
    assert {n: _tree(d) for n, d in dirs.items()} == before


@pytest.mark.timeout(300)
def test_sigterm_stops_up_with_max_restarts_and_exits_143(sandbox, pushed, tmp_path):
    proc, run_id = start_attached(sandbox, write_job(tmp_path, sleep=120, grace=5), tmp_path / "logs",
                                  "--max-restarts", "2")
    try:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 143, err
        # (start_attached read the first "started" line; a relaunch would print another)
        assert "restart 1/2" not in err and f"run {run_id} started" not in out, out + err
        assert run_containers(sandbox, run_id) == {n: [] for n in NODES}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        runner("down", run_id, "-i", str(sandbox))


def _in_process(argv: list[str]) -> int:
    """The CLI in this process (to hook a moment inside a launch); signal handlers restored."""
    from runner.cli.main import main

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return main(argv)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_master_port_is_chosen_when_the_master_starts(sandbox, pushed, tmp_path, monkeypatch):
    """A port free at preflight but taken during the push (another run's master) is not used."""
    from runner.delivery import push as push_mod
    from runner.transport.rendezvous import pick_master_port

    name = "mp-" + secrets.token_hex(3)
    (node_workdir(sandbox, "node-0") / "runs" / name).mkdir(parents=True)
    held: list[socket.socket] = []
    real_push = push_mod.push_to_nodes

    def push_then_take_the_port(cl, *a, **k):
        port = pick_master_port(cl[cl.inv.master.name].listening_ports(), name)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        s.listen()
        held.append(s)
        return real_push(cl, *a, **k)

    monkeypatch.setattr(push_mod, "push_to_nodes", push_then_take_the_port)
    job = write_job(tmp_path, sleep=60)
    try:
        rc = _in_process(["up", "-i", str(sandbox), "--job", str(job), "--resume", name, "--detach"])
        assert rc == 0 and held
        taken = held[0].getsockname()[1]
        with remotes(sandbox)["node-0"] as r:
            env = r.run(["docker", "inspect", "--format", "{{json .Config.Env}}", f"runner-{name}-node-0"]).out
        port = int(next(e for e in json.loads(env) if e.startswith("MASTER_PORT=")).split("=")[1])
        assert port != taken, port
    finally:
        for s in held:
            s.close()
        runner("down", name, "-i", str(sandbox))


def test_workers_never_join_a_listener_that_is_not_the_masters(sandbox, pushed, tmp_path, monkeypatch, capsys):
    """Someone else listens on the master port once the master's container exists: the runner
    does not take that for the master's store (no worker gets the go); the master's own failure
    to bind is the job's failure (exit 4), not a user error."""
    from runner.backends.ssh import launch as launch_mod

    held: list[socket.socket] = []
    real_create = launch_mod.create_container

    def create_and_squat(remote, np):
        if np.rank == 0:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", int(np.env["MASTER_PORT"])))
            s.listen()
            held.append(s)
        return real_create(remote, np)

    monkeypatch.setattr(launch_mod, "create_container", create_and_squat)
    gates = {n: node_workdir(sandbox, n) / "gates" for n in ("node-1", "node-2")}
    before = {n: _tree(g) for n, g in gates.items()}
    try:
        rc = _in_process(["up", "-i", str(sandbox), "--job", str(write_job(tmp_path)), "--rendezvous-timeout", "60"])
    finally:
        for s in held:
            s.close()
    err = capsys.readouterr().err
    assert held and rc == 4, err
    assert "master listening" not in err
    new = {n: _tree(g) - before[n] for n, g in gates.items()}
    assert all(not any("/go-" in p for p in files) for files in new.values()), new


def test_a_job_that_exits_2_is_not_a_user_error(sandbox, pushed, tmp_path):
    tag = unique_tag("exit2")
    torchrun_image(tag, b"#!/bin/sh\necho 'fake torchrun: exits 2'\nexit 2\n")
    try:
        proc = runner("up", "-i", str(sandbox), "--job", str(write_job(tmp_path, image=tag)))
    finally:
        remove_host_image(tag)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "exited (2)" in proc.stderr or "exited with code 2" in proc.stderr, proc.stderr


RUN_IDS = ("20000101-000000-abcd", "29991231-235959-beef", "zz-by-hand")
METRICS = [{"step": s, "loss": 3.0 - 0.25 * s, "tokens_per_s": 1000.0, "step_time_s": 2.0} for s in (1, 2, 3)]


@pytest.fixture
def own_workdirs(sandbox, tmp_path) -> Path:
    """The sandbox's nodes with workdirs of this test's own, holding hand-made run dirs."""
    doc = yaml.safe_load(Path(sandbox).read_text())
    for nd in doc["nodes"]:
        wd = tmp_path / "wd" / nd["name"]
        nd["workdir"] = str(wd)
        for rid in RUN_IDS:
            (wd / "runs" / rid).mkdir(parents=True)
        rd = wd / "runs" / RUN_IDS[1]
        rd.joinpath("metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in METRICS))
        rd.joinpath("config.yaml").write_text("train: {steps: 10}\n")
    inv = tmp_path / "own.yaml"
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    return inv


def test_latest_run_is_one_rule_for_every_command(own_workdirs, tmp_path):
    """Runner-made ids sort by time; a hand-made name is never "the latest" over them."""
    st = runner("status", "-i", str(own_workdirs), "--json")
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["run_id"] == RUN_IDS[1]
    col = runner("collect", "-i", str(own_workdirs), "--dest", str(tmp_path / "art"), "--quiet", "--no-plots")
    assert col.returncode == 0, col.stderr
    assert sorted(p.name for p in (tmp_path / "art").iterdir()) == [RUN_IDS[1]]
    logs = runner("logs", "-i", str(own_workdirs), "--logs-dir", str(tmp_path / "none"))
    assert f"run {RUN_IDS[1]}:" in logs.stderr, logs.stderr


def test_status_shows_step_loss_tokens_and_eta(own_workdirs):
    st = runner("status", RUN_IDS[1], "-i", str(own_workdirs), "--json")
    assert st.returncode == 0, st.stderr
    for row in json.loads(st.stdout)["nodes"]:
        assert row["progress"] == {"step": 3, "total": 10, "loss": 2.25, "tokens_per_s": 1000.0, "eta_s": 14.0}, row
    table = runner("status", RUN_IDS[1], "-i", str(own_workdirs))
    assert table.returncode == 0, table.stderr
    assert re.search(r"step 3/10 .*loss 2\.2500 .*1\.0K tok/s .*ETA 0:00:14", table.stdout), table.stdout
    assert '{"step"' not in table.stdout


def test_run_ids_that_are_not_names_are_refused(sandbox):
    proc = runner("status", "x; touch /tmp/nope", "-i", str(sandbox))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not os.path.exists("/tmp/nope")
