"""The job's containers get an /etc/hosts line for every node (runner/planning/plan.py hosts_of):
torch's c10d looks up the name of each store connection's address, and with no DNS server in reach
(a Pi cluster on a bare switch, the namespaced sandbox) every lookup waits out the resolver, 10 s,
on the path to the first step. Measured before the change on the namespaced sandbox: a rejoining
node's container spent 10.0 s of its regroup in one such lookup (bench/results/elastic.json, run
20261206-160036-1039: `rejoin 10.01 s` in its regroup line). The sandbox half of this is checked
by tests/sandbox/test_elastic_rejoin_in_place_sandbox.py (the container's /etc/hosts)."""

from __future__ import annotations

from types import SimpleNamespace as NS

from runner.inventory import load_inventory
from runner.planning.plan import Facts, hosts_of, make_plan
from runner.transport import probe
from tests.unit.test_plan import NODES3, inventory


def _probe(monkeypatch, route: str, master: str = "10.0.0.1", addrdev: str | None = None) -> probe.Probe:
    lines = [f"master_ip={master}", f"route={route}", "arch=x86_64", "home=/root", "docker_rc=0", "docker=24.0.7"]
    if addrdev:
        lines.append(f"addrdev={addrdev}")
    remote = NS(node=NS(name="n1", user="root", workdir=None), home="/root", listening_ports=lambda: set())
    monkeypatch.setattr(probe, "node_paths", lambda node, home: NS(workdir="/root/runner"))
    monkeypatch.setattr(probe, "_probe_session", lambda remote, script, clock: (lines, None))
    return probe.probe(remote, master, clock=False)


def test_the_probe_takes_the_routes_source_address_and_nothing_else(monkeypatch):
    got = _probe(monkeypatch, "10.0.0.1 dev eth0 src 10.0.0.7 uid 0")
    assert (got.ifname, got.src_ip, got.facts().src_ip) == ("eth0", "10.0.0.7", "10.0.0.7")
    # the master's own address routes via lo: its address is the master address itself
    local = _probe(monkeypatch, "local 10.0.0.1 dev lo src 10.0.0.1 uid 0", addrdev="eth0")
    assert (local.ifname, local.src_ip) == ("eth0", "10.0.0.1")
    for bad in ("10.0.0.1 dev eth0 src node-1.example", "10.0.0.1 dev eth0 src 10.0.0.7;reboot",
                "10.0.0.1 dev eth0 src", "10.0.0.1 dev eth0"):
        assert _probe(monkeypatch, bad).src_ip is None, bad


def test_hosts_name_every_node_by_its_own_address_else_an_ip_literal(tmp_path, no_network):
    nodes = ("  - {name: m, host: 10.9.0.1, arch: amd64, role: master}\n"
             "  - {name: pi_two, host: pi2.local, arch: arm64}\n"
             "  - {name: w3, host: pi3.local, arch: arm64}\n")
    inv = load_inventory(inventory(tmp_path, nodes))
    facts = {"m": Facts(ifname="eth0", src_ip="10.9.0.1"), "pi_two": Facts(ifname="eth0", src_ip="192.168.1.22"),
             "w3": Facts(ifname="eth0")}  # w3: no src known and a name for an address: no line
    assert hosts_of(inv.ordered(), facts) == {"m": "10.9.0.1", "pi-two": "192.168.1.22"}
    assert hosts_of(inv.ordered(), {}) == {"m": "10.9.0.1"}  # a dry-run: only what the inventory says


def test_every_container_of_the_job_gets_the_whole_map(tmp_path, no_network):
    inv = load_inventory(inventory(tmp_path, NODES3))
    facts = {n: Facts(ifname="eth0", src_ip=f"10.9.0.{i}") for i, n in ((1, "m"), (2, "w1"), (3, "w2"))}
    plan = make_plan(inv, "r1", facts, master_port=29500, strict=True)
    assert [p.hosts for p in plan.nodes] == [{"m": "10.9.0.1", "w1": "10.9.0.2", "w2": "10.9.0.3"}] * 3


def test_docker_gets_each_ipv4_address_in_its_ipv6_mapped_form_too():
    """c10d's sockets are IPv6 ones holding IPv4-mapped addresses: glibc looks ::ffff:a.b.c.d up as IPv6,
    and an IPv4 line never answers it (seen on the namespaced sandbox: the PTR query went out anyway)."""
    from runner.planning.plan import extra_hosts

    assert extra_hosts({"node-0": "10.9.0.1", "v6": "fd00::2"}) == [
        "node-0:10.9.0.1", "node-0:::ffff:10.9.0.1", "v6:fd00::2"]


def test_a_reconnected_node_reaches_the_cluster_a_view_was_made_from(tmp_path, no_network):
    """An in-place run's lost node answers again on the launch's view; when the in-place rejoin
    cannot go on, the restart path makes its next view from the run's cluster: before, that one
    still held the dead connection (`AssertionError: not connected` in clear_earlier_attempt,
    seen in bench/elastic.py when the running job ended before the newcomer was ready)."""
    from runner.transport.cluster import Cluster

    inv = load_inventory(inventory(tmp_path, NODES3))
    root = Cluster(inv)
    root.remotes = {n.name: f"old-{n.name}" for n in inv.nodes}
    view = root.view(inv)
    view.reconnected("w2", "new-w2")
    assert view.view(inv).remotes["w2"] == "new-w2"
    assert root.view(inv).remotes["w2"] == "new-w2"


def test_the_probe_takes_the_nodes_hostname_and_nothing_else(monkeypatch):
    """Its containers share it (host networking) and torchrun looks it up: it becomes their first line."""
    def with_name(name: str) -> probe.Probe:
        monkeypatch.setattr(probe, "_probe_session", lambda remote, script, clock: (
            ["route=10.0.0.1 dev eth0 src 10.0.0.7", "arch=x86_64", f"hostname={name}", "docker=24.0.7"], None))
        remote = NS(node=NS(name="n1", user="root", workdir=None), home="/root", listening_ports=lambda: set())
        monkeypatch.setattr(probe, "node_paths", lambda node, home: NS(workdir="/root/runner"))
        return probe.probe(remote, "10.0.0.1", clock=False)

    assert (with_name("pi-3.lan").hostname, with_name("pi-3.lan").facts().hostname) == ("pi-3.lan", "pi-3.lan")
    for bad in ("", "vm;reboot", "a b", "-lead", "trail-", "x" * 254, "pi\x1b[2J", "::ffff:10.0.0.1", "#comment"):
        assert with_name(bad).hostname is None, bad
    assert with_name("x" * 253).hostname == "x" * 253


def test_each_container_answers_its_own_hostname_first_with_its_address(tmp_path, no_network):
    from runner.planning.plan import extra_hosts

    inv = load_inventory(inventory(tmp_path, NODES3))
    facts = {"m": Facts(ifname="eth0", src_ip="10.9.0.1", hostname="vm"),
             "w1": Facts(ifname="eth0", src_ip="10.9.0.2", hostname="vm"), "w2": Facts(ifname="eth0", src_ip="10.9.0.3")}
    plan = make_plan(inv, "r1", facts, master_port=29500, strict=True)
    assert [(p.node, p.own_host) for p in plan.nodes] == [("m", ("vm", "10.9.0.1")), ("w1", ("vm", "10.9.0.2")),
                                                          ("w2", None)]
    # every node's hostname may be the same (the sandbox's): each container's first line is its own
    assert extra_hosts(plan.nodes[1].hosts, plan.nodes[1].own_host)[:4] == [
        "vm:10.9.0.2", "vm:::ffff:10.9.0.2", "m:10.9.0.1", "m:::ffff:10.9.0.1"]
    assert extra_hosts(plan.nodes[2].hosts, plan.nodes[2].own_host)[0] == "m:10.9.0.1"
    # no address known (no route's src, a name in the inventory): Debian's line for its own name
    named = load_inventory(inventory(tmp_path, "  - {name: pi, host: pi.local, arch: arm64, role: master}\n"))
    got = make_plan(named, "r1", {"pi": Facts(ifname="eth0", hostname="raspberrypi")}, master_port=29500)
    assert got.nodes[0].own_host == ("raspberrypi", "127.0.1.1")


def test_a_node_named_localhost_keeps_docker_s_loopback_lines(tmp_path, no_network):
    """A hostname Docker's own lines answer (localhost, ip6-*) is not pointed at the node's address:
    `localhost` must stay the loopback inside the container (a store on localhost, a single-node run)."""
    inv = load_inventory(inventory(tmp_path, NODES3))
    for name in ("localhost", "LocalHost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"):
        facts = {n: Facts(ifname="eth0", src_ip=f"10.9.0.{i}", hostname=name)
                 for i, n in ((1, "m"), (2, "w1"), (3, "w2"))}
        assert [p.own_host for p in make_plan(inv, "r1", facts, master_port=29500).nodes] == [None] * 3, name
