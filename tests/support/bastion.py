"""A bastion and nodes behind it, in Linux network namespaces: the nodes answer SSH only from the
bastion, as the private nodes of a VPC do, so a test sees the runner really go through it.

    this machine --veth /30-- netns rt-bast-<tag>: bastion sshd :22
                                   |
                               --veth /29-- netns rt-nodes-<tag>: one sshd :2222 per node address

This machine gets a route marking the nodes' subnet unreachable: a direct connect fails at once and
no packet goes out to the default gateway. Every sshd is a sandbox "light" node (runner/sandbox/cluster.py
writes its config; sessions use this machine's Docker engine), started inside its namespace.
Names carry the tag (the pytest pid), and the subnets are picked free, so two sessions do not
collide. `down()` removes every process, namespace, veth and route, and is safe to call twice or
after a failed `up()`. Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import subprocess
import time
from pathlib import Path

import psutil

from runner.inventory.hostkeys import known_hosts_name
from runner.sandbox.cluster import SSHD, Sandbox, SandboxNode, _sshd_config
from runner.sandbox.processes import read_pid, run

HOST_NET = ipaddress.IPv4Network("10.251.0.0/16")   # this machine <-> bastion, /30 each
NODES_NET = ipaddress.IPv4Network("10.252.0.0/16")  # bastion <-> nodes, /29 each (up to 5 nodes)
NODE_PORT = 2222  # the nodes' sshd port (the bastion's is 22): a Port other than the default goes through too


def available() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if not shutil.which("ip"):
        return "needs iproute2 (ip)"
    if not (shutil.which("sshd") or os.path.exists(SSHD)):
        return "needs openssh-server"
    return None


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
    return proc


ROUTE_TYPES = {"unicast", "unreachable", "blackhole", "prohibit", "local", "broadcast", "throw", "nat", "anycast",
               "multicast"}


def _free_subnet(net: ipaddress.IPv4Network, prefix: int, start: int) -> ipaddress.IPv4Network:
    """The first /prefix of net from index start (wrapping) that no route of this machine touches."""
    used = []
    for line in _ip("-4", "-o", "route", "show", "table", "all").stdout.splitlines():
        words = line.split()
        dest = words[1] if words and words[0] in ROUTE_TYPES and len(words) > 1 else (words or ["default"])[0]
        if dest != "default":
            used.append(ipaddress.IPv4Network(dest, strict=False))
    subnets = list(net.subnets(new_prefix=prefix))
    for i in range(len(subnets)):
        cand = subnets[(start + i) % len(subnets)]
        if not any(cand.overlaps(u) for u in used):
            return cand
    raise RuntimeError(f"no free /{prefix} left in {net}")


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class BastionNet:
    def __init__(self, state: Path, nodes: int = 2, tag: int | None = None):
        assert 1 <= nodes <= 5
        self.state = Path(state).resolve()
        self.tag = tag if tag is not None else os.getpid()
        self.n = nodes
        self.ns_bastion, self.ns_nodes = f"rt-bast-{self.tag}", f"rt-nodes-{self.tag}"
        self.veth_host, self.veth_bastion = f"rtb{self.tag}h", f"rtb{self.tag}b"
        self.veth_inner, self.veth_nodes = f"rtn{self.tag}b", f"rtn{self.tag}n"
        self.sandbox = Sandbox(self.state)  # for its user key and authorized_keys
        self.host_net: ipaddress.IPv4Network | None = None
        self.nodes_net: ipaddress.IPv4Network | None = None

    # -- layout -----------------------------------------------------------------------------
    @property
    def user_key(self) -> Path:
        return self.sandbox.user_key

    @property
    def known_hosts(self) -> Path:
        """The bastion's and every node's ed25519 host key, as OpenSSH names them."""
        return self.state / "known_hosts"

    @property
    def host_addr(self) -> str:
        return str(self.host_net[1])

    @property
    def bastion(self) -> SandboxNode:
        return SandboxNode(0, str(self.host_net[2]), 22, self.state / "bastion", self.state / "bastion", light=True)

    @property
    def nodes(self) -> list[SandboxNode]:
        return [SandboxNode(i, str(self.nodes_net[1 + i]), NODE_PORT, self.state / f"node-{i}", self.state / f"node-{i}", light=True)
                for i in range(1, self.n + 1)]

    # -- up / down --------------------------------------------------------------------------
    def up(self) -> BastionNet:
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _up(self) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        self.host_net = _free_subnet(HOST_NET, 30, self.tag)
        self.nodes_net = _free_subnet(NODES_NET, 29, self.tag)
        inner = str(self.nodes_net[1])  # the bastion's address on the nodes' side
        for ns in (self.ns_bastion, self.ns_nodes):
            _ip("netns", "add", ns)
            _ip("link", "set", "lo", "up", ns=ns)
        _ip("link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_bastion)
        _ip("link", "set", self.veth_bastion, "netns", self.ns_bastion)
        _ip("addr", "add", f"{self.host_addr}/30", "dev", self.veth_host)
        _ip("link", "set", self.veth_host, "up")
        _ip("addr", "add", f"{self.bastion.addr}/30", "dev", self.veth_bastion, ns=self.ns_bastion)
        _ip("link", "set", self.veth_bastion, "up", ns=self.ns_bastion)
        _ip("link", "add", self.veth_inner, "type", "veth", "peer", "name", self.veth_nodes)
        _ip("link", "set", self.veth_inner, "netns", self.ns_bastion)
        _ip("link", "set", self.veth_nodes, "netns", self.ns_nodes)
        _ip("addr", "add", f"{inner}/29", "dev", self.veth_inner, ns=self.ns_bastion)
        _ip("link", "set", self.veth_inner, "up", ns=self.ns_bastion)
        for nd in self.nodes:
            _ip("addr", "add", f"{nd.addr}/29", "dev", self.veth_nodes, ns=self.ns_nodes)
        _ip("link", "set", self.veth_nodes, "up", ns=self.ns_nodes)
        # From here the nodes' subnet fails at once instead of going out by the default route.
        _ip("route", "add", "unreachable", str(self.nodes_net))
        self.sandbox._ensure_user_key()
        Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation dir sshd insists on
        self._start(self.bastion, self.ns_bastion)
        for nd in self.nodes:
            self._start(nd, self.ns_nodes)
        self.known_hosts.write_text("".join(
            f"{known_hosts_name(nd.addr, nd.port)} {self.host_key(nd)}\n" for nd in [self.bastion, *self.nodes]))

    def _start(self, nd: SandboxNode, ns: str) -> None:
        nd.root.mkdir(parents=True, exist_ok=True)
        for kind, key in (("ed25519", nd.host_key), ("ecdsa", nd.host_key_ecdsa)):
            if not key.exists():
                run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", f"rt-bastion-{nd.name}", "-f", str(key)])
        nd.sshd_config.write_text(_sshd_config(nd, self.sandbox.authorized_keys))
        # sshd listens before it forks away: once this returns, the node accepts connections.
        run(["ip", "netns", "exec", ns, SSHD, "-f", str(nd.sshd_config), "-E", str(nd.root / "sshd.log")])
        deadline = time.monotonic() + 10
        while read_pid(nd.sshd_pid) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd of {nd.name} in {ns} wrote no pid file (see {nd.root}/sshd.log)")
            time.sleep(0.05)

    @staticmethod
    def host_key(nd: SandboxNode) -> str:
        """'ssh-ed25519 AAAA...' of a node."""
        return " ".join(Path(f"{nd.host_key}.pub").read_text().split()[:2])

    def down(self) -> None:
        """Every process in the namespaces (sshds and their sessions), then the namespaces (their
        veth ends go with them), the host's veth end and the route."""
        procs = []
        for ns in (self.ns_bastion, self.ns_nodes):
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                with contextlib.suppress(psutil.Error):
                    procs.append(psutil.Process(int(pid)))
                    procs[-1].terminate()
        # Gone or a zombie (a daemonized sshd's parent is pid 1, which may be slow to reap it).
        deadline = time.monotonic() + 5
        while procs and time.monotonic() < deadline:
            procs = [p for p in procs if _running(p)]
            time.sleep(0.05)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        for ns in (self.ns_bastion, self.ns_nodes):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.veth_host], capture_output=True)
        if self.nodes_net is not None:
            subprocess.run(["ip", "route", "del", "unreachable", str(self.nodes_net)], capture_output=True)

    def leftovers(self) -> list[str]:
        """What down() should have removed and is still there (tests assert it is nothing)."""
        out = []
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        out += [ns for ns in (self.ns_bastion, self.ns_nodes) if ns in netns.split()]
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        out += [v for v in (self.veth_host,) if f" {v}@" in links or f" {v}:" in links]
        if self.nodes_net is not None:
            routes = subprocess.run(["ip", "route", "show", "table", "all"], capture_output=True, text=True).stdout
            out += [f"route {self.nodes_net}" for r in routes.splitlines() if str(self.nodes_net) in r]
        return out
