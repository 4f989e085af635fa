"""The pure plan and `runner up --dry-run`: ranks, commands, env and masking, with no socket opened
(the Pi and EC2 addresses in hosts/ must never be contacted)."""

from __future__ import annotations

import io
import socket
from contextlib import redirect_stdout
from pathlib import Path

import paramiko
import pytest

import docker
from runner.cli import main as cli_main
from runner.errors import UserError
from runner.inventory import load_inventory
from runner.plan import LABEL_NODE, LABEL_RANK, LABEL_RUN, MASK, Facts, make_plan
from tests.test_inventory import shipped

SECRET = "hf_SUPERSECRET_123"


@pytest.fixture
def no_network(monkeypatch):
    """Any socket, SSH client or docker client creation fails the test."""
    def boom(*a, **k):
        raise AssertionError("a network connection was attempted")

    class NoSocket(socket.socket):
        def __init__(self, *a, **k):
            raise AssertionError("a socket was opened")

    monkeypatch.setattr(socket, "socket", NoSocket)
    monkeypatch.setattr(socket, "create_connection", boom)
    monkeypatch.setattr(paramiko.SSHClient, "connect", boom)
    monkeypatch.setattr(paramiko.Transport, "__init__", boom)
    monkeypatch.setattr(docker, "DockerClient", boom)
    monkeypatch.setattr(docker, "from_env", boom)


def inventory(tmp_path: Path, nodes: str, job: str = "") -> Path:
    envf = tmp_path / ".env"
    envf.write_text(f"HF_TOKEN={SECRET}\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("model: {preset: tiny}\n")
    p = tmp_path / "inv.yaml"
    p.write_text(f"nodes:\n{nodes}job:\n  image: {{amd64: t:amd, arm64: t:arm}}\n  config: {cfg}\n"
                 f"  env_file: {envf}\n  env: {{OMP_NUM_THREADS: '2', HF_TOKEN: visible-would-leak}}\n{job}")
    return p


NODES3 = ("  - {name: w1, host: 10.9.0.2, arch: arm64}\n"
          "  - {name: m, host: 10.9.0.1, arch: amd64, role: master, slots: 2}\n"
          "  - {name: w2, host: 10.9.0.3, arch: arm64, env: {EXTRA: '1'}}\n")


def test_plan_ranks_env_commands(tmp_path, no_network):
    inv = load_inventory(inventory(tmp_path, NODES3, "  master_port: 29555\n  args: [--train_steps, '5']\n"))
    facts = {"m": Facts(ifname="eth0"), "w1": Facts(ifname="wlan0"), "w2": Facts(ifname="eth1")}
    plan = make_plan(inv, "20260101-000000-abcd", facts, secret_keys=list(inv.job.secrets()), strict=True)
    assert [(n.node, n.rank) for n in plan.nodes] == [("m", 0), ("w1", 1), ("w2", 2)]
    assert [n.image for n in plan.nodes] == ["t:amd", "t:arm", "t:arm"]
    m, w1, w2 = plan.nodes
    tr = m.command[m.command.index("torchrun"):]
    assert tr == ["torchrun", "--nnodes", "3", "--node-rank", "0", "--nproc-per-node", "2",
                  "--master-addr", "10.9.0.1", "--master-port", "29555", "--rdzv-backend", "static",
                  "--max-restarts", "0", "-m", "trainer", "--config", "/out/config.yaml", "--train_steps", "5"]
    assert "--node-rank" in w2.command and w2.command[w2.command.index("--node-rank") + 1] == "2"
    assert w1.command[w1.command.index("--nproc-per-node") + 1] == "1"
    for n, ifn in ((m, "eth0"), (w1, "wlan0"), (w2, "eth1")):
        assert n.env["GLOO_SOCKET_IFNAME"] == n.env["NCCL_SOCKET_IFNAME"] == ifn
        assert n.env["MASTER_ADDR"] == "10.9.0.1" and n.env["MASTER_PORT"] == "29555"
        assert n.env["NNODES"] == "3" and n.env["NODE_RANK"] == str(n.rank) and n.env["NODE_NAME"] == n.node
        assert n.env["RUN_ID"] == "20260101-000000-abcd" and n.env["OUTPUT_DIR"] == "/out"
        assert n.env["OMP_NUM_THREADS"] == "2"
        assert "HF_TOKEN" not in n.env  # the env_file wins, and it never sits in container config
        assert n.labels[LABEL_RUN] == "20260101-000000-abcd" and n.labels[LABEL_NODE] == n.node
        assert n.labels[LABEL_RANK] == str(n.rank)
        assert n.container == f"runner-20260101-000000-abcd-{n.node}"
        assert n.mounts[n.run_dir] == "/out" and n.run_dir.endswith("/runs/20260101-000000-abcd")
        assert n.secrets_file and n.mounts[n.secrets_file] == "/run/runner/secrets.env"
        assert SECRET not in repr(n)
    assert w2.env["EXTRA"] == "1" and "EXTRA" not in m.env


def test_strict_plan_demands_probed_facts(tmp_path):
    inv = load_inventory(inventory(tmp_path, "  - {name: a, host: 10.9.0.1}\n", "  master_port: 29555\n"))
    with pytest.raises(UserError, match="arch unknown"):
        make_plan(inv, "r", {}, strict=True)
    with pytest.raises(UserError, match="no interface routes to master"):
        make_plan(inv, "r", {"a": Facts(arch="amd64")}, strict=True)
    plan = make_plan(inv, "r", {"a": Facts(arch="arm64", ifname="eth0", home="/home/pi")}, strict=True)
    assert plan.nodes[0].image == "t:arm" and plan.nodes[0].run_dir == "/home/pi/runner/runs/r"


def run_cli(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = cli_main(list(argv))
    return rc, buf.getvalue()


def test_dry_run_masks_secrets_and_opens_nothing(tmp_path, no_network, capsys):
    p = inventory(tmp_path, NODES3)
    rc, out = run_cli("up", "--inventory", str(p), "--dry-run", "--", "--train_steps", "7")
    assert rc == 0
    assert SECRET not in out + capsys.readouterr().err
    assert f"HF_TOKEN={MASK}" in out and "visible-would-leak" not in out
    assert "[m/0] 10.9.0.1" in out and "[w1/1] 10.9.0.2" in out and "[w2/2] 10.9.0.3" in out
    assert "--train_steps 7" in out and "--node-rank 2" in out
    assert "GLOO_SOCKET_IFNAME=<probed at launch>" in out


@pytest.mark.parametrize("name", ["pis.yaml", "ec2.yaml"])
def test_dry_run_shipped_inventories_no_connection(tmp_path, no_network, name):
    p = shipped(name, tmp_path)
    rc, out = run_cli("up", "--inventory", str(p), "--dry-run")
    assert rc == 0
    if name == "pis.yaml":
        for i, host in enumerate(("192.168.1.10", "192.168.1.11", "192.168.1.12")):
            assert f"[pi-{i}/{i}] {host}  arch=arm64  image=runner-trainer:arm64" in out
        assert "--train_steps 5 --batch_size 16 --microbatch_num 4 --profile_batch 1" in out
        assert "MASTER_ADDR=192.168.1.10" in out and "--nnodes 3" in out
    else:
        assert "--nproc-per-node 4" in out and "gpus=all" in out and "MASTER_PORT=29500" in out


def test_mixed_arch_dry_run_with_given_arch(tmp_path, no_network):
    p = inventory(tmp_path, "  - {name: a, host: 10.9.0.1}\n  - {name: b, host: 10.9.0.2}\n")
    rc, out = run_cli("up", "--inventory", str(p), "--dry-run", "--arch", "a=amd64", "--arch", "b=aarch64")
    assert rc == 0
    assert "[a/0] 10.9.0.1  arch=amd64  image=t:amd" in out and "[b/1] 10.9.0.2  arch=arm64  image=t:arm" in out
