"""The sandbox's network layer on real namespaces, veths, a bridge and tc qdiscs (no mocks).

Every test makes its own network under a random prefix (so parallel runs never collide) and the
`lab` fixture destroys it, even on failure, then checks that no namespace, link, qdisc or
iptables rule with that prefix is left. Traffic goes only to the namespaces a test made.

Shaping is asserted on the kernel's own counters (`tc -s qdisc`: the bytes that passed each
token bucket and netem, and how often a bucket held them back), plus one generous ratio of two
transfers timed in the same test (unshaped against shaped); no duration is compared with a
constant, so a busy machine cannot fail them.
"""

from __future__ import annotations

import os
import re
import secrets
import select
import shutil
import socket
import subprocess
import sys
import time

import pytest

from runner.core.errors import UserError
from runner.sandbox.net import IFNAMSIZ, MAX_NODES, NODE_IF, SandboxNet, parse_shape, prefix_for, subnet_for
from tests.conftest import require
from tests.support.netns_sandbox import counters_delta, qdisc_counters

PORT = 5001
MIB = 1 << 20

# Receives any number of connections one after another; answers each with the byte count it got.
SERVER = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(16)
print("ready", s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    n = 0
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        n += len(b)
    c.sendall(str(n).encode())
    c.close()
"""

# Sends N bytes and waits for the receiver's count: the time covers every byte crossing the link.
CLIENT = r"""
import socket, sys, time
addr, port, left = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
buf = memoryview(b"x" * (1 << 20))
t0 = time.monotonic()
c = socket.create_connection((addr, port), timeout=30)
while left:
    k = min(left, len(buf))
    c.sendall(buf[:k])
    left -= k
c.shutdown(socket.SHUT_WR)
got = int(c.recv(64))
print(got, time.monotonic() - t0)
"""


def _root() -> None:
    require("root", os.geteuid() == 0, "network namespaces and tc need root")
    require("iproute2", bool(shutil.which("ip") and shutil.which("tc")), "`ip`/`tc` are not installed")


def leftovers(net: SandboxNet) -> list[str]:
    """Everything on this machine that still carries the network's prefix."""
    out = []
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    out += [ln.split(":")[1].strip() for ln in links.splitlines() if net.prefix in ln]
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    out += [ln for ln in netns.splitlines() if net.prefix in ln]
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
    out += [ln for ln in qdiscs.splitlines() if net.prefix in ln]
    if shutil.which("iptables"):
        rules = subprocess.run(["iptables", "-w", "-S", "FORWARD"], capture_output=True, text=True).stdout
        out += [ln for ln in rules.splitlines() if net.prefix in ln]
    return out


class Lab:
    """Networks and server processes of one test, torn down by the fixture whatever happens."""

    def __init__(self):
        self.nets: list[SandboxNet] = []
        self.procs: list[subprocess.Popen] = []

    def net(self, **kw) -> SandboxNet:
        net = SandboxNet(secrets.token_hex(3), **kw)
        self.nets.append(net)
        return net

    def serve(self, net: SandboxNet, i: int | None) -> int:
        """A receiver in node i's namespace (None: on the host, at the bridge address); its port."""
        prefix, addr, port = (net.exec_prefix(i), net.addr(i), PORT) if i is not None else ([], net.host_addr, 0)
        proc = subprocess.Popen([*prefix, sys.executable, "-c", SERVER, addr, str(port)],
                                stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)
        ready, _, _ = select.select([proc.stdout], [], [], 15)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("ready"), f"receiver on {addr} did not start: {line!r}"
        return int(line.split()[1])

    def send(self, net: SandboxNet, frm: int | None, to_addr: str, port: int, nbytes: int) -> float:
        """Send nbytes from node `frm` (None: the host) to to_addr:port; seconds until all arrived."""
        prefix = net.exec_prefix(frm) if frm is not None else []
        proc = subprocess.run([*prefix, sys.executable, "-c", CLIENT, to_addr, str(port), str(nbytes)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"transfer {frm} -> {to_addr} failed: {proc.stderr.strip()[-300:]}"
        got, secs = proc.stdout.split()
        assert int(got) == nbytes
        return float(secs)

    def close(self) -> list[str]:
        for p in self.procs:
            p.kill()
            p.wait()
        left = []
        for net in self.nets:
            net.destroy()
            left += leftovers(net)
        return left


@pytest.fixture
def lab():
    _root()
    lab = Lab()
    try:
        yield lab
    finally:
        left = lab.close()
    assert left == [], f"destroy left these behind: {left}"


def can_connect(addr: str, port: int, timeout: float = 1.0) -> bool:
    try:
        socket.create_connection((addr, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def counted(ends: list[tuple[str, str | None]], fn) -> tuple[object, list[dict[str, dict[str, int]]]]:
    """fn()'s result, and what the qdiscs of each (dev, netns or None: this machine) counted meanwhile."""
    before = [qdisc_counters(dev, ns) for dev, ns in ends]
    out = fn()
    return out, [counters_delta(qdisc_counters(dev, ns), b) for (dev, ns), b in zip(ends, before, strict=True)]


# ---- 1: reachability and cleanup ----------------------------------------------------------------
def test_nodes_reach_each_other_and_the_host(lab):
    net = lab.net()
    net.create(3)
    net.create(3)  # idempotent
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert all(net.netns(i) in names for i in range(3))
    ports = {i: lab.serve(net, i) for i in range(3)}
    host_port = lab.serve(net, None)
    for i in range(3):
        for j in range(3):
            if i != j:
                lab.send(net, i, net.addr(j), ports[j], 256 * 1024)
        lab.send(net, i, net.host_addr, host_port, 256 * 1024)  # node -> host
        lab.send(net, None, net.addr(i), ports[i], 256 * 1024)  # host -> node
    st = net.status()
    assert st["bridge"]["exists"] and [n["link"] for n in st["nodes"]] == ["up"] * 3
    assert all(n["netns_exists"] and n["to_node"] == n["from_node"] == "unshaped" for n in st["nodes"])
    for p in lab.procs:
        p.kill()
        p.wait()
    lab.procs.clear()
    removed = net.destroy()
    assert net.bridge in removed and leftovers(net) == []
    assert net.destroy() == []  # safe to re-run


def test_nodes_are_sealed_in(lab):
    """A node's default route leads to the bridge, which forwards nowhere: nothing leaves. Asked of
    the kernel's routing (`ip route get ... iif`), so no packet is sent anywhere."""
    net = lab.net()
    net.create(1)
    outside = subprocess.run(["ip", "-4", "route", "get", "192.0.2.1", "from", net.addr(0), "iif", net.bridge],
                             capture_output=True, text=True)
    assert outside.returncode != 0 and "No route to host" in outside.stderr
    to_host = subprocess.run(["ip", "-4", "route", "get", net.host_addr, "from", net.addr(0), "iif", net.bridge],
                             capture_output=True, text=True)
    assert to_host.returncode == 0 and to_host.stdout.startswith("local ")


# ---- 2: link shaping ----------------------------------------------------------------------------
def test_link_rate_is_applied(lab):
    net = lab.net()
    net.create(2, link="50mbit")
    port = lab.serve(net, 1)
    nbytes = 16 * MIB
    # node0 -> node1 leaves node0's namespace through its eth0 (that link's from_node side), then
    # reaches node1 through node1's host veth (its to_node side): two token buckets.
    ends = [(NODE_IF, net.netns(0)), (net.host_veth(1), None)]
    shaped, (sent, recv) = counted(ends, lambda: lab.send(net, 0, net.addr(1), port, nbytes))
    print(f"\n16 MiB node0 -> node1 over 50mbit: {shaped:.2f} s; tbf counted {sent['tbf']} sending, "
          f"{recv['tbf']} receiving")
    # Every byte crossed both buckets, and the sender's held the stream back (a dequeue that found
    # too few tokens): the rate applies, by the kernel's count.
    assert sent["tbf"]["bytes"] >= nbytes and recv["tbf"]["bytes"] >= nbytes, (sent, recv)
    assert sent["tbf"]["overlimits"] > 0, sent
    assert {n["to_node"] for n in net.status()["nodes"]} == {"50Mbit"}
    net.create(2)  # re-run without a link spec: unshaped again
    assert {(n["to_node"], n["from_node"]) for n in net.status()["nodes"]} == {("unshaped", "unshaped")}
    assert not any("tbf" in qdisc_counters(dev, ns) for dev, ns in ends)
    unshaped = lab.send(net, 0, net.addr(1), port, nbytes)
    print(f"16 MiB node0 -> node1 unshaped: {unshaped:.3f} s")
    assert unshaped < 0.5 * shaped  # two transfers of this test: the bucket is off, not only reported off


# ---- 3: uplink shaping --------------------------------------------------------------------------
def test_uplink_shapes_host_to_node_but_not_node_to_node(lab):
    net = lab.net()
    net.create(2, uplink="50mbit")
    port = lab.serve(net, 0)
    nbytes = 8 * MIB
    uplink = [(net.bridge, None)]
    from_host, (up,) = counted(uplink, lambda: lab.send(net, None, net.addr(0), port, nbytes))
    node_to_node, (beside,) = counted(uplink, lambda: lab.send(net, 1, net.addr(0), port, nbytes))
    print(f"\n8 MiB with --uplink 50mbit: host -> node0 {from_host:.2f} s (the bridge's tbf counted {up['tbf']}), "
          f"node1 -> node0 {node_to_node:.3f} s (it counted {beside['tbf']})")
    # What this machine sends crosses the bridge's bucket and is held back by it ...
    assert up["tbf"]["bytes"] >= nbytes and up["tbf"]["overlimits"] > 0, up
    # ... bridged node <-> node traffic never passes it (a stray broadcast at most) ...
    assert beside["tbf"]["bytes"] < nbytes // 100, beside
    assert node_to_node < 0.5 * from_host  # ... and so is not held to its rate (two transfers of this test)
    assert net.status()["bridge"]["uplink"] == "50Mbit"


# ---- 4: partition -------------------------------------------------------------------------------
def test_set_link_partitions_and_restores_with_shaping(lab):
    net = lab.net()
    net.create(3, link="50mbit")
    ports = {i: lab.serve(net, i) for i in range(3)}
    cut = lab.procs[1]
    net.set_link(1, False)
    try:
        assert not can_connect(net.addr(1), ports[1], timeout=1.0)
        assert can_connect(net.addr(0), ports[0]) and can_connect(net.addr(2), ports[2])
        assert [n["link"] for n in net.status()["nodes"]] == ["up", "down", "up"]
        assert cut.poll() is None, "the cut node's process died"
    finally:
        net.set_link(1, True)
    deadline = time.monotonic() + 5
    while not can_connect(net.addr(1), ports[1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert can_connect(net.addr(1), ports[1])
    for args in ([], ["-n", net.netns(1)]):
        dev = net.host_veth(1) if not args else "eth0"
        shown = subprocess.run(["tc", *args, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
        assert "tbf" in shown and "rate 50Mbit" in shown, shown
    nbytes = 4 * MIB
    secs, (held,) = counted([(net.host_veth(1), None)], lambda: lab.send(net, None, net.addr(1), ports[1], nbytes))
    print(f"\n4 MiB host -> node1 after the link came back (50mbit): {secs:.2f} s; its tbf counted {held['tbf']}")
    assert held["tbf"]["bytes"] >= nbytes and held["tbf"]["overlimits"] > 0, held  # shaped again, by the kernel's count


def test_set_link_on_a_missing_node_is_one_line(lab):
    net = lab.net()
    net.create(1)
    with pytest.raises(UserError) as e:
        net.set_link(5, False)
    assert "\n" not in str(e.value) and "node 5" in str(e.value)


# ---- 5: delay -----------------------------------------------------------------------------------
def test_delay_without_netem_is_refused_in_one_line(lab):
    net = lab.net()
    if net.netem_supported():
        pytest.skip("this kernel has netem: a delay is applied, not refused (see the next test)")
    for kw in ({"link": "50mbit,20ms"}, {"uplink": "1gbit,5ms"}):
        with pytest.raises(UserError) as e:
            net.create(2, **kw)
        msg = str(e.value)
        assert "\n" not in msg and "no netem" in msg and "delay is not supported" in msg
        assert leftovers(net) == []  # refused before anything was made


def test_delay_is_applied_with_netem(lab):
    net = lab.net()
    if not net.netem_supported():
        pytest.skip("this kernel has no netem (`tc qdisc add ... netem` fails: "
                    "Specified qdisc kind is unknown), so a delay cannot be applied here")
    net.create(1, link="100mbit,20ms")
    port = lab.serve(net, 0)
    # One link, delayed each way: the connection's first packet to the node passes the netem under
    # its host veth's bucket, the node's answer the netem under its eth0's.
    ends = [(net.host_veth(0), None), (NODE_IF, net.netns(0))]
    ok, (to_node, from_node) = counted(ends, lambda: can_connect(net.addr(0), port, timeout=5))
    assert ok
    assert to_node["netem"]["packets"] > 0 and from_node["netem"]["packets"] > 0, (to_node, from_node)
    for dev, ns in ends:
        shown = subprocess.run(["tc", *(["-n", ns] if ns else []), "qdisc", "show", "dev", dev],
                               capture_output=True, text=True).stdout
        assert re.search(r"qdisc netem 10: parent 1:1 .*delay 20ms", shown), shown
    assert net.status()["nodes"][0]["to_node"].startswith("100Mbit, delay 20")


# ---- 6: validation ------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["fast", "100", "100mb", "100mbps", "-5mbit", "0mbit", "0.5bit",
                                  "", "100mbit,", "100mbit,20", "100mbit,20ms,1", "mbit", "1e3mbit",
                                  "100mbit,0ms", "100mbit,-1ms", "100mbit,11s"])
def test_bad_shape_is_one_line(spec):
    with pytest.raises(UserError) as e:
        parse_shape(spec, "--link")
    assert "\n" not in str(e.value) and str(e.value).startswith("--link ")


def test_good_shapes_parse():
    assert parse_shape("100mbit").rate_bit == 100_000_000
    assert parse_shape("1gbit").rate_bit == 1_000_000_000
    assert parse_shape("512kbit").rate_bit == 512_000
    assert parse_shape("1.5Gbit,5ms").rate_bit == 1_500_000_000
    assert parse_shape("50mbit,2.5ms").delay_us == 2500
    assert parse_shape("50mbit").delay_us is None


def test_bad_shape_is_refused_before_root_is_needed():
    with pytest.raises(UserError, match="bad rate"):
        SandboxNet("abcdef").create(1, uplink="lots")


def test_non_root_is_one_line():
    _root()  # (to drop to nobody we must be root)
    os.seteuid(65534)  # only the effective uid: the real one (root) brings it back
    try:
        with pytest.raises(UserError) as e:
            SandboxNet("abcdef").create(1)
    finally:
        os.seteuid(0)
    assert str(e.value) == "the sandbox's network layer (namespaces, veths, tc) needs root: run it as root"


# ---- names, subnets, failures -------------------------------------------------------------------
def test_names_fit_ifnamsiz_and_prefixes_differ(tmp_path):
    a, b = SandboxNet.for_state_dir(tmp_path / "a"), SandboxNet.for_state_dir(tmp_path / "b")
    assert a.prefix != b.prefix and a.prefix == prefix_for(tmp_path / "a" / ".." / "a")
    for net in (a, b):
        assert len(net.bridge) <= IFNAMSIZ and len(net.host_veth(MAX_NODES - 1)) <= IFNAMSIZ
        assert net.subnet == subnet_for(net.prefix) and str(net.subnet).startswith("10.")
        assert net.addr(0).endswith(".11") and net.host_addr.endswith(".1")
        assert net.exec_prefix(2) == ["nsenter", f"--net=/run/netns/{net.netns(2)}", "--"]


def test_a_subnet_already_routed_is_refused(lab):
    first = lab.net()
    first.create(1)
    second = lab.net(subnet=str(first.subnet))
    with pytest.raises(UserError) as e:
        second.create(1)
    msg = str(e.value)
    assert "\n" not in msg and str(first.subnet) in msg and "already routed" in msg and first.bridge in msg
    assert leftovers(second) == []


def test_destroy_after_a_half_failed_create(lab, monkeypatch):
    net = lab.net()
    real = SandboxNet._ensure_node

    def fail_on_node_1(self, i):
        real(self, i)
        if i == 1:
            raise RuntimeError("injected failure after node 1")

    monkeypatch.setattr(SandboxNet, "_ensure_node", fail_on_node_1)
    with pytest.raises(RuntimeError):
        net.create(3, link="50mbit")
    assert net.node_indices() == [0, 1] and leftovers(net)
    monkeypatch.undo()
    net.create(3, link="50mbit")  # a re-run completes it
    assert [n["to_node"] for n in net.status()["nodes"]] == ["50Mbit"] * 3
    net.destroy()
    assert leftovers(net) == []
