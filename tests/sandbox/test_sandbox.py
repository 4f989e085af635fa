"""The sandbox cluster is real: sshd per loopback address with verified host keys, a dockerd per
node with its own image store and workdir, and `down` leaves nothing behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import REPO, net_addr

pytestmark = pytest.mark.sandbox


def sandbox(state, *args):
    return subprocess.run([sys.executable, "-m", "runner", "sandbox", "--dir", str(state), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=180)


def ssh(inv: dict, node: dict, command: str, known_hosts: str | None = None, stdin=None):
    d = inv["defaults"]
    return subprocess.run(
        ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
         "-o", f"UserKnownHostsFile={known_hosts or d['known_hosts']}", "-o", "GlobalKnownHostsFile=/dev/null",
         "-i", d["identity_file"], "-p", str(d["port"]), f"{d['user']}@{node['host']}", command],
        capture_output=True, text=True, input=stdin, timeout=60)


def leftovers(state) -> list[str]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if str(state) in cmd and p.pid != os.getpid():
            out.append(cmd)
    return out


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, host_docker, have_sshd):
    tmp = tmp_path_factory.mktemp("sb2")
    state, inv_path = tmp / "state", tmp / "local.yaml"
    up = sandbox(state, "up", "--nodes", "2", "--base-addr", net_addr(3, 11), "--inventory", str(inv_path))
    assert up.returncode == 0, up.stderr
    yield state, yaml.safe_load(inv_path.read_text())
    sandbox(state, "down")


def test_ssh_reaches_each_node_with_verified_host_key(two_nodes):
    state, inv = two_nodes
    assert [n["host"] for n in inv["nodes"]] == [net_addr(3, 11), net_addr(3, 12)]
    assert inv["nodes"][0]["role"] == "master" and "role" not in inv["nodes"][1]
    for i, node in enumerate(inv["nodes"]):
        r = ssh(inv, node, "echo $SANDBOX_NODE; docker info --format '{{.DockerRootDir}}'")
        assert r.returncode == 0, r.stderr
        name, root = r.stdout.split()
        assert name == f"node-{i}"
        assert root == str(state / f"node-{i}" / "docker")


def test_unknown_host_key_is_refused(two_nodes, tmp_path):
    _, inv = two_nodes
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    r = ssh(inv, inv["nodes"][0], "true", known_hosts=str(empty))
    assert r.returncode != 0
    assert "Host key verification failed" in r.stderr


def test_nodes_have_separate_image_stores_and_workdirs(two_nodes):
    _, inv = two_nodes
    n0, n1 = inv["nodes"]
    # An (empty) image imported on node 0 only.
    tar = subprocess.run(["tar", "-c", "--files-from", "/dev/null"], capture_output=True).stdout
    r = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o",
                        f"UserKnownHostsFile={inv['defaults']['known_hosts']}", "-i",
                        inv["defaults"]["identity_file"], "-p", str(inv["defaults"]["port"]),
                        f"root@{n0['host']}", "docker import - sandbox-probe:1"], input=tar,
                       capture_output=True)
    assert r.returncode == 0, r.stderr
    assert ssh(inv, n0, "docker image inspect sandbox-probe:1 >/dev/null").returncode == 0
    assert ssh(inv, n1, "docker image inspect sandbox-probe:1 >/dev/null").returncode != 0
    assert ssh(inv, n0, f"echo hello > {n0['workdir']}/only-on-0").returncode == 0
    assert ssh(inv, n0, f"cat {n0['workdir']}/only-on-0").stdout == "hello\n"
    assert ssh(inv, n1, f"test -e {n1['workdir']}/only-on-0").returncode != 0
    assert n0["workdir"] != n1["workdir"]


def test_up_is_idempotent(two_nodes):
    state, _ = two_nodes
    before = sorted(p.read_text() for p in state.glob("node-*/sshd.pid"))
    again = sandbox(state, "up", "--nodes", "2", "--base-addr", net_addr(3, 11),
                    "--inventory", str(state.parent / "local.yaml"))
    assert again.returncode == 0, again.stderr
    assert sorted(p.read_text() for p in state.glob("node-*/sshd.pid")) == before
    st = sandbox(state, "status", "--json")
    rows = yaml.safe_load(st.stdout)
    assert [(r["sshd"], r["dockerd"]) for r in rows] == [(True, True), (True, True)]


def test_down_leaves_nothing_running(tmp_path, host_docker, have_sshd):
    state, inv_path = tmp_path / "state", tmp_path / "inv.yaml"
    assert sandbox(state, "up", "--nodes", "2", "--base-addr", net_addr(4, 11),
                   "--inventory", str(inv_path)).returncode == 0
    try:
        inv = yaml.safe_load(inv_path.read_text())
        # A running container on node 1 (image streamed from the host engine).
        save = subprocess.Popen(["docker", "-H", host_docker, "save", "runner-base:bookworm"], stdout=subprocess.PIPE)
        load = subprocess.run(
            ["ssh", "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={inv['defaults']['known_hosts']}",
             "-i", inv["defaults"]["identity_file"], "-p", "2222", f"root@{inv['nodes'][1]['host']}", "docker load"],
            stdin=save.stdout, capture_output=True)
        save.wait()
        assert load.returncode == 0, load.stderr
        run = ssh(inv, inv["nodes"][1], "docker run -d --network host runner-base:bookworm sleep 6061")
        assert run.returncode == 0, run.stderr
        assert [p for p in psutil.process_iter(["cmdline"]) if p.info.get("cmdline") == ["sleep", "6061"]]
        assert len(leftovers(state)) >= 4  # 2 sshd + 2 dockerd at least
        # Each node's engine keeps its socket and exec root under /run (short socket paths).
        run_dirs = {Path(a.removeprefix("unix://")).parent for p in psutil.process_iter(["cmdline"])
                    for a in (p.info.get("cmdline") or []) if a.startswith("unix:///run/runner-sandbox/")
                    and any(str(state) in c for c in p.info["cmdline"])}
        assert len(run_dirs) == 2 and all(d.is_dir() for d in run_dirs), run_dirs
        down = sandbox(state, "down")
        assert down.returncode == 0, down.stderr
        assert leftovers(state) == []
        assert [d for d in run_dirs if d.exists()] == [] and not next(iter(run_dirs)).parent.exists()
        assert not [p for p in psutil.process_iter(["cmdline"]) if p.info.get("cmdline") == ["sleep", "6061"]]
        for node in inv["nodes"]:
            with socket.socket() as s:
                assert s.connect_ex((node["host"], 2222)) != 0, f"{node['name']} sshd still listening"
        again = sandbox(state, "down")
        assert again.returncode == 0 and "nothing was running" in again.stdout
    finally:
        sandbox(state, "down")


def test_zero_nodes_is_one_clear_line(tmp_path):
    r = sandbox(tmp_path / "s", "up", "--nodes", "0", "--inventory", str(tmp_path / "i.yaml"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "--nodes must be between 1" in r.stderr
    assert not (tmp_path / "i.yaml").exists()


def test_taken_address_is_refused_and_nothing_starts(tmp_path, have_sshd):
    state = tmp_path / "state"
    with socket.socket() as blocker:
        blocker.bind((net_addr(5, 12), 2222))
        blocker.listen()
        r = sandbox(state, "up", "--nodes", "2", "--base-addr", net_addr(5, 11),
                    "--inventory", str(tmp_path / "i.yaml"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0
    assert f"{net_addr(5, 12)}:2222 (node-1) is already in use" in r.stderr
    assert leftovers(state) == []
    assert not (tmp_path / "i.yaml").exists()


def test_failed_sshd_rolls_back_that_nodes_dockerd(tmp_path, host_docker, have_sshd):
    """node-1's sshd cannot start (unreadable host key) after its dockerd did: `up` fails with one
    line and nothing of either node is left running (node-1's dockerd included)."""
    state = tmp_path / "state"
    (state / "node-1").mkdir(parents=True)
    (state / "node-1" / "ssh_host_ed25519_key").write_text("not a key\n")
    try:
        r = sandbox(state, "up", "--nodes", "2", "--base-addr", net_addr(6, 11), "--inventory", str(tmp_path / "i.yaml"))
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip().count("\n") == 0 and "sshd -f failed" in r.stderr, r.stderr
        assert leftovers(state) == []
        assert not (tmp_path / "i.yaml").exists()
    finally:
        sandbox(state, "down")
