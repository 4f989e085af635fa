"""SSH through one bastion (issue 12, part 2), against a real one: the nodes live in a network
namespace this machine has no route to, behind a bastion sshd in another (tests/support/bastion.py).
Paramiko's connections and the OpenSSH streams both go through it, with both hops' host keys
verified; a wrong bastion key, a dead bastion and a hostile ~/.ssh/config are each refused or
ignored as they should be; an ssh_config alias (HostName, User, Port, IdentityFile, ProxyJump)
reaches a node."""

from __future__ import annotations

import socket
import subprocess
import threading
from pathlib import Path

import pytest
import yaml

from runner.core.errors import UserError
from runner.inventory import load_inventory
from runner.transport import ssh as ssh_mod
from runner.transport.jump import BASTIONS
from runner.transport.ssh import Remote, connect_each
from runner.transport.stream import ssh_stream
from tests.conftest import net_addr, require
from tests.support.bastion import NODE_PORT, BastionNet, available
from tests.support.runner_helpers import runner

pytestmark = [pytest.mark.sandbox]


@pytest.fixture(scope="module")
def bnet(tmp_path_factory):
    why = available()
    require("network namespaces", why is None, why or "")
    b = BastionNet(tmp_path_factory.mktemp("bastion"), nodes=2)
    b.up()
    try:
        yield b
    finally:
        b.down()
        assert b.leftovers() == [], "the bastion fixture left things behind"


def _inventory(b: BastionNet, path: Path, **defaults) -> Path:
    doc = {"defaults": {"user": "root", "port": NODE_PORT, "identity_file": str(b.user_key),
                        "known_hosts": str(b.known_hosts), "ssh_config": "none",
                        "proxy_jump": f"root@{b.bastion.addr}", **defaults},
           "nodes": [{"name": f"n{i}", "host": nd.addr} for i, nd in enumerate(b.nodes)]}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _nodes(b: BastionNet, tmp_path: Path, **defaults):
    return load_inventory(_inventory(b, tmp_path / "inv.yaml", **defaults), with_job=False).nodes


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


def test_nodes_answer_only_through_the_bastion_over_one_shared_connection(bnet, tmp_path):
    nodes = _nodes(bnet, tmp_path)
    with pytest.raises(OSError):  # no route from here: the namespace is really private
        socket.create_connection((nodes[0].host, NODE_PORT), timeout=3).close()
    direct = _nodes(bnet, tmp_path, proxy_jump="none")[0]
    with pytest.raises(UserError) as exc:
        Remote(direct).connect()
    assert f"node n0: cannot connect to {direct.host}:{NODE_PORT}" in _one_line(exc)

    held = len(BASTIONS)
    remotes, failed = connect_each(nodes)
    try:
        assert failed == {}
        assert len(BASTIONS) == held + 1  # both nodes ride one bastion connection
        assert remotes["n0"].bastion is remotes["n1"].bastion
        inner = str(bnet.nodes_net[1])  # the bastion's address on the nodes' side
        for n in nodes:
            r = remotes[n.name]
            client, _, server, port = r.run("echo $SSH_CONNECTION", check=True).out.split()
            assert (client, server, port) == (inner, n.host, str(NODE_PORT))  # it came from the bastion
            assert r.host_key_fp == subprocess.run(["ssh-keygen", "-lf", f"{bnet.nodes[int(n.name[1])].host_key}.pub"],
                                                   capture_output=True, text=True).stdout.split()[1]
    finally:
        for r in remotes.values():
            r.close()
    assert len(BASTIONS) == held  # closed with its last node


def test_openssh_streams_go_through_the_bastion_whatever_the_users_ssh_config(bnet, tmp_path, monkeypatch):
    # A user config that would send ssh anywhere else: a stale ControlMaster socket that never
    # answers, a ProxyCommand that fails, another HostName and Port (on this session's loopback
    # net, where nothing listens). The streams run with -F /dev/null and never read it.
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(home / "cm.sock"))
    stale.listen()
    (home / ".ssh" / "config").write_text(
        f"Host *\n  HostName {net_addr(255, 254)}\n  Port 1\n  ControlMaster auto\n  ControlPath {home}/cm.sock\n"
        "  ProxyCommand false\n  StrictHostKeyChecking no\n")
    monkeypatch.setenv("HOME", str(home))
    node = _nodes(bnet, tmp_path)[0]
    payload = b"".join(i.to_bytes(4, "big") for i in range(50_000))  # 200 kB, not all one byte
    src, got = tmp_path / "payload.bin", tmp_path / "got.bin"
    src.write_bytes(payload)
    remote_path = tmp_path / "on-node.bin"  # the node's filesystem is this machine's
    with Remote(node).connect() as r:
        up = ssh_stream(r, f"cat > {remote_path}", [["cat", str(src)]], upload=True, stall_s=60)
        assert up.ssh_rc == 0 and up.moved == len(payload), up.ssh_err
        down = ssh_stream(r, f"cat {remote_path}", [["sh", "-c", f"cat > {got}"]], upload=False, stall_s=60)
        assert down.ssh_rc == 0 and down.moved == len(payload), down.ssh_err
        argv = r.openssh_argv()
        kh = next(a.split("=", 1)[1] for a in argv if a.startswith("UserKnownHostsFile="))
        pinned = Path(kh).read_text().splitlines()
    stale.close()
    assert got.read_bytes() == payload
    assert argv[argv.index("-F") + 1] == "/dev/null"
    # Both hops pinned: the node's key and the bastion's, the ones paramiko verified.
    assert sorted(pinned) == sorted([f"[{node.host}]:{NODE_PORT} {bnet.host_key(bnet.nodes[0])}",
                                     f"{bnet.bastion.addr} {bnet.host_key(bnet.bastion)}"])


def _bastion_fp(b: BastionNet) -> str:
    return subprocess.run(["ssh-keygen", "-lf", f"{b.bastion.host_key}.pub"], capture_output=True,
                          text=True).stdout.split()[1]


def test_a_wrong_bastion_host_key_is_refused_naming_the_bastion(bnet, tmp_path):
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    lines = bnet.known_hosts.read_text().splitlines()
    wrong = tmp_path / "known_hosts_wrong"
    wrong.write_text("".join(
        (f"{bnet.bastion.addr} {' '.join(Path(f'{other}.pub').read_text().split()[:2])}" if ln.startswith(
            f"{bnet.bastion.addr} ") else ln) + "\n" for ln in lines))
    where = f"bastion root@{bnet.bastion.addr}:22"
    node = _nodes(bnet, tmp_path, known_hosts=str(wrong))[0]
    with pytest.raises(UserError) as exc:
        Remote(node).connect()
    assert _one_line(exc).startswith(f"node n0: {where}: HOST KEY CHANGED"), exc.value

    node = _nodes(bnet, tmp_path, proxy_jump_host_key="SHA256:" + "A" * 43)[0]
    with pytest.raises(UserError) as exc:
        Remote(node).connect()
    msg = _one_line(exc)
    assert msg.startswith(f"node n0: {where}: host key mismatch") and _bastion_fp(bnet) in msg, msg

    # Unknown: refused, then recorded with --accept-new-host-keys, as for a node.
    fresh = tmp_path / "known_hosts_nodes_only"
    fresh.write_text("".join(ln + "\n" for ln in lines if not ln.startswith(f"{bnet.bastion.addr} ")))
    node = _nodes(bnet, tmp_path, known_hosts=str(fresh))[0]
    with pytest.raises(UserError) as exc:
        Remote(node).connect()
    assert _one_line(exc).startswith(f"node n0: {where}: unknown host key"), exc.value
    with Remote(node, accept_new_host_keys=True).connect() as r:
        assert r.run("true").rc == 0
    assert f"{bnet.bastion.addr} {bnet.host_key(bnet.bastion)}" in fresh.read_text().splitlines()

    node = _nodes(bnet, tmp_path, proxy_jump_host_key=_bastion_fp(bnet))[0]  # the right pin
    with Remote(node).connect() as r:
        assert r.run("true").rc == 0


def test_a_dead_bastion_fails_every_node_behind_it_in_one_connect_timeout(bnet, tmp_path, monkeypatch):
    monkeypatch.setattr(ssh_mod, "CONNECT_TIMEOUT", 2.0)
    # TCP is accepted (the kernel's backlog) but no SSH banner ever comes: a hung bastion.
    dead = socket.socket()
    dead.bind((net_addr(9, 1), 0))
    dead.listen(64)
    port = dead.getsockname()[1]
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        dead.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(dead.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    inv = _inventory(bnet, tmp_path / "dead.yaml", proxy_jump=f"root@{net_addr(9, 1)}:{port}")
    doc = yaml.safe_load(inv.read_text())
    doc["nodes"] = [{"name": f"n{i}", "host": str(bnet.nodes_net[1 + i % 5]), "port": 2200 + i} for i in range(6)]
    inv.write_text(yaml.safe_dump(doc))
    nodes = load_inventory(inv, with_job=False).nodes
    try:
        remotes, failed = connect_each(nodes)
    finally:
        stop.set()
        t.join()
        for s in accepted:
            s.close()
        dead.close()
    assert remotes == {}
    for n in nodes:
        msg = failed[n.name]
        assert msg.startswith(f"node {n.name}: bastion root@{net_addr(9, 1)}:{port}: cannot connect") and (
            "no SSH answer within 2s (bastion hung" in msg) and "\n" not in msg, msg
    assert len(accepted) == 1  # one attempt for all six nodes (one timeout in all), not one each

    refused = _nodes(bnet, tmp_path, proxy_jump=f"root@{net_addr(9, 1)}:{port}")[0]  # nothing listens now
    with pytest.raises(UserError) as exc:
        Remote(refused).connect()
    assert _one_line(exc).startswith(f"node n0: bastion root@{net_addr(9, 1)}:{port}: cannot connect to "
                                     f"{net_addr(9, 1)}:{port}: "), exc.value


def _alias_config(b: BastionNet, path: Path) -> Path:
    path.write_text(f"""# as a user would write it for `ssh gpu-0`
Host gpu-*
    User root
    Port {NODE_PORT}
    IdentityFile {b.user_key}
    ProxyJump jump
Host gpu-0
    HostName {b.nodes[0].addr}
Host gpu-1
    HostName {b.nodes[1].addr}
Host jump
    HostName {b.bastion.addr}
    User root
    IdentityFile {b.user_key}
""")
    return path


def _alias_inventory(b: BastionNet, tmp_path: Path) -> Path:
    inv = tmp_path / "alias.yaml"
    inv.write_text(f"defaults: {{ssh_config: {_alias_config(b, tmp_path / 'ssh_config')}, "
                   f"known_hosts: {b.known_hosts}}}\n"
                   "nodes:\n  - {name: a, host: gpu-0}\n  - {name: b, host: gpu-1}\n")
    return inv


def test_an_ssh_config_alias_reaches_its_node_through_its_bastion(bnet, tmp_path):
    nodes = load_inventory(_alias_inventory(bnet, tmp_path), with_job=False).nodes
    for n, nd in zip(nodes, bnet.nodes, strict=True):
        assert (n.host, n.port, n.user, n.identity_file) == (nd.addr, NODE_PORT, "root", str(bnet.user_key))
        assert str(n.proxy_jump) == f"root@{bnet.bastion.addr}:22"
        with Remote(n).connect() as r:
            assert r.run("echo $SSH_CONNECTION", check=True).out.split()[2:] == [nd.addr, str(NODE_PORT)]
            out = subprocess.run([*r.openssh_argv(), "echo streamed"], capture_output=True, text=True, timeout=60)
            assert (out.returncode, out.stdout) == (0, "streamed\n"), out.stderr


def test_runner_check_through_the_bastion(bnet, tmp_path, host_docker):
    """`runner check` (SSH, host keys, the node's engine over SSH, probes) with nothing but an
    ssh_config alias per node: every node ok, its interface the one behind the bastion."""
    inv = _alias_inventory(bnet, tmp_path)
    proc = runner("check", "-i", str(inv), env={"HOME": str(tmp_path), "COLUMNS": "250"}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all 2 node(s) ok" in proc.stdout, proc.stdout
    assert proc.stdout.count(bnet.veth_nodes) == 2, proc.stdout  # each node's route to the master
