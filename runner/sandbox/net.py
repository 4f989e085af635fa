"""The sandbox's network layer: each node in its own network namespace, on a real (shapeable) link.

Today's sandbox nodes share this machine's loopback, so node-to-node traffic never crosses an
interface: nothing can slow it down, cut it, or count it. This module gives each node a network
namespace joined to a bridge on the host by a veth pair, so node <-> node and host <-> node
traffic crosses real interfaces that `tc` can shape and `ip link` can cut:

    host: bridge rtbr<P> 10.X.Y.1/24 --+-- veth rt<P>h0 ==== eth0 10.X.Y.11/24 in netns rt<P>n0
            (egress = --uplink)        +-- veth rt<P>h1 ==== eth0 10.X.Y.12/24 in netns rt<P>n1
                                       ...  (both ends' egress = --link)

Every name carries a 6-hex-digit prefix P derived from the sandbox's state dir, so two sandboxes
on one machine never collide, every interface name fits Linux's 15-character IFNAMSIZ, and
`destroy()` can find everything a (possibly half-failed) `create()` made by name alone, with no
state file to go stale. The /24 is derived from P too (10.100-249.Y.0/24); `create()` refuses in
one line if that subnet is already routed on this machine, rather than shadow someone's network.

Shaping (`RATE[,DELAY]`, e.g. `100mbit`, `1gbit,5ms`):

- `link` shapes every node's link in both directions: the egress of the node's `eth0` (what the
  node sends) and the egress of its host-side veth (what the node receives). Node -> node traffic
  crosses two links (the sender's and the receiver's), so it is held to RATE and gets DELAY twice
  each way; host <-> node traffic crosses one (RTT = 2 x DELAY).
- `uplink` shapes the egress of the bridge device: the traffic this machine itself sends to the
  nodes. Bridged node <-> node traffic never passes through it (the bridge forwards between its
  ports without transmitting on its own device), and neither does node -> host traffic.
- RATE is a token bucket (`tbf`); DELAY is a `netem` qdisc below it. Some kernels are built
  without netem (`tc qdisc add ... netem` fails with "Specified qdisc kind is unknown"): asking
  for a delay there is an ERROR, raised before anything is made, so nobody runs an experiment
  believing a delay was applied. Support is probed once per process on a throwaway namespace.

The network is sealed: node namespaces get a default route via the bridge address, but the
bridge has IPv4 forwarding off, so a node reaches the other nodes and this machine and nothing
else. Where iptables exists, one FORWARD rule (tagged with a comment, removed by `destroy()`)
accepts bridge-to-bridge traffic: a Docker engine with iptables on sets FORWARD's policy to DROP,
and with br_netfilter loaded that policy would otherwise drop bridged node <-> node traffic.

Everything is `ip`/`tc` argv (no shell) and needs root. `destroy()` expects the nodes' processes
to be stopped first: a process still inside a namespace keeps it alive (with only `lo`) after its
name is removed; it is warned about by pid.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from runner.core.errors import UserError

log = logging.getLogger("runner.sandbox.net")

IFNAMSIZ = 15  # longest interface name Linux accepts (16 bytes with the NUL)
NODE_IF = "eth0"  # the node's end of its veth, inside its namespace
FIRST_NODE_HOST = 11  # node i is .(11 + i), as the loopback sandbox's 127.0.0.(11 + i)
MAX_NODES = 254 - FIRST_NODE_HOST
PREFIX_RE = re.compile(r"[0-9a-f]{6}")
IPT_COMMENT = "runner-sandbox-net {prefix}"

# tc's own units: SI multiples of bits per second (tc's "bps" means BYTES per second, a classic
# trap, so only the unambiguous *bit forms are accepted).
RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
DELAY_UNITS = {"us": 1, "ms": 10**3, "s": 10**6}
RATE_RE = re.compile(r"(\d+(?:\.\d+)?)([a-z]+)")
MIN_RATE_BIT = 1000
MAX_DELAY_US = 10 * 10**6
# Token bucket: a 10 ms burst (at least 16 KiB, so a full-size frame always fits) and at most
# 50 ms of queue. A transfer of N bytes then takes at least (N - burst) / rate.
BURST_S = 0.01
MIN_BURST_BYTES = 16 * 1024
QUEUE_LATENCY = "50ms"

_netem_supported: bool | None = None  # probed once per process


@dataclass(frozen=True)
class Shape:
    """One parsed `RATE[,DELAY]`: rate in bit/s, delay in microseconds (None: no delay)."""

    rate_bit: int
    delay_us: int | None
    spec: str

    @property
    def burst_bytes(self) -> int:
        return max(int(self.rate_bit / 8 * BURST_S), MIN_BURST_BYTES)


def parse_shape(spec: str, what: str = "--link") -> Shape:
    """`RATE[,DELAY]` -> Shape, or a one-line UserError naming the option and the bad part."""
    text = (spec or "").strip().lower()
    parts = text.split(",")
    if not text or len(parts) > 2:
        raise UserError(f"{what} {spec!r}: expected RATE[,DELAY], e.g. 100mbit or 1gbit,5ms")
    rate = _parse_rate(parts[0], spec, what)
    delay = _parse_delay(parts[1], spec, what) if len(parts) == 2 else None
    return Shape(rate, delay, spec)


def _parse_rate(text: str, spec: str, what: str) -> int:
    m = RATE_RE.fullmatch(text.strip())
    if not m or m.group(2) not in RATE_UNITS:
        raise UserError(f"{what} {spec!r}: bad rate {text.strip()!r}: expected a number and a unit "
                        f"({', '.join(RATE_UNITS)}; 1kbit = 1000 bit/s), e.g. 100mbit, 1gbit, 512kbit")
    bits = int(float(m.group(1)) * RATE_UNITS[m.group(2)])
    if bits < MIN_RATE_BIT:
        raise UserError(f"{what} {spec!r}: rate {text.strip()!r} is below the minimum of 1kbit")
    return bits


def _parse_delay(text: str, spec: str, what: str) -> int:
    m = RATE_RE.fullmatch(text.strip())
    if not m or m.group(2) not in DELAY_UNITS:
        raise UserError(f"{what} {spec!r}: bad delay {text.strip()!r}: expected a number and a unit "
                        f"({', '.join(DELAY_UNITS)}), e.g. 5ms")
    us = int(float(m.group(1)) * DELAY_UNITS[m.group(2)])
    if not 0 < us <= MAX_DELAY_US:
        raise UserError(f"{what} {spec!r}: delay {text.strip()!r} must be above 0 and at most 10s")
    return us


def prefix_for(state_dir: Path | str) -> str:
    """The 6-hex-digit prefix of a sandbox's network: a hash of its resolved state dir."""
    return hashlib.sha1(str(Path(state_dir).resolve()).encode()).hexdigest()[:6]


def subnet_for(prefix: str) -> ipaddress.IPv4Network:
    """10.X.Y.0/24 from the prefix: X in 100..249 (clear of the 10.0-10.99 ranges that VPNs and
    clouds favour), Y any."""
    h = hashlib.sha1(f"runner-sandbox-net:{prefix}".encode()).digest()
    return ipaddress.IPv4Network(f"10.{100 + h[0] % 150}.{h[1]}.0/24")


class SandboxNet:
    """The namespaces, veths, bridge and qdiscs of one sandbox, found by their names' prefix."""

    def __init__(self, prefix: str, subnet: str | None = None):
        if not PREFIX_RE.fullmatch(prefix):
            raise UserError(f"sandbox network prefix {prefix!r} must be 6 lowercase hex digits")
        self.prefix = prefix
        self.subnet = ipaddress.IPv4Network(subnet) if subnet else subnet_for(prefix)
        if self.subnet.prefixlen != 24:
            raise UserError(f"sandbox subnet {self.subnet} must be a /24")
        self.bridge = f"rtbr{prefix}"

    @classmethod
    def for_state_dir(cls, state_dir: Path | str) -> SandboxNet:
        return cls(prefix_for(state_dir))

    # ---- names and addresses ------------------------------------------------------------------
    def netns(self, i: int) -> str:
        return f"rt{self.prefix}n{i}"

    def host_veth(self, i: int) -> str:
        """The host's end of node i's link: a port of the bridge. Downing it cuts the node off."""
        return f"rt{self.prefix}h{i}"

    @property
    def host_addr(self) -> str:
        return str(self.subnet.network_address + 1)

    def addr(self, i: int) -> str:
        return str(self.subnet.network_address + FIRST_NODE_HOST + i)

    def exec_prefix(self, i: int) -> list[str]:
        """argv prefix that runs a command (a node's sshd, dockerd) inside node i's network
        namespace and no other: `ip netns exec` would also give it a private mount namespace with
        a fresh /sys, hiding the cgroup mounts dockerd needs ("Devices cgroup isn't mounted")."""
        return ["nsenter", f"--net=/run/netns/{self.netns(i)}", "--"]

    # ---- create -------------------------------------------------------------------------------
    def create(self, n_nodes: int, link: str | Shape | None = None, uplink: str | Shape | None = None) -> None:
        """Make (or complete, or re-shape) the network for nodes 0..n_nodes-1; safe to re-run.

        Everything is validated before anything is made (rates, delay support, the subnet). A re-run
        brings every node's link up and sets the shaping to exactly what is asked (None removes it);
        nodes at n_nodes and beyond, if an earlier create made them, are left as they are.
        A create that fails half-way leaves what it made for `destroy()` (which finds it by name).
        """
        if not 1 <= n_nodes <= MAX_NODES:
            raise UserError(f"sandbox network: {n_nodes} nodes is outside 1..{MAX_NODES}")
        link_s = parse_shape(link, "--link") if isinstance(link, str) else link
        uplink_s = parse_shape(uplink, "--uplink") if isinstance(uplink, str) else uplink
        _require_root_and_tools()
        for what, s in (("--link", link_s), ("--uplink", uplink_s)):
            if s is not None and s.delay_us is not None and not self.netem_supported():
                raise UserError(f"{what} {s.spec!r}: a delay is not supported on this kernel (no netem: "
                                f"`tc qdisc add ... netem` fails); drop the delay or use a kernel with sch_netem")
        self._check_subnet_free()
        self._ensure_bridge()
        for i in range(n_nodes):
            self._ensure_node(i)
        self.shape(n_nodes, link_s, uplink_s)

    def shape(self, n_nodes: int, link: str | Shape | None, uplink: str | Shape | None) -> None:
        """Set every node link's and the uplink's shaping to exactly this (None: unshaped)."""
        link = parse_shape(link, "--link") if isinstance(link, str) else link
        uplink = parse_shape(uplink, "--uplink") if isinstance(uplink, str) else uplink
        for i in range(n_nodes):
            _apply_shape([], self.host_veth(i), link)
            _apply_shape(["-n", self.netns(i)], NODE_IF, link)
        _apply_shape([], self.bridge, uplink)

    def _check_subnet_free(self) -> None:
        """Refuse a subnet some other interface or route already covers (ours may, on a re-run)."""
        routes = json.loads(_ip("-j", "-4", "route", "show", "table", "all") or "[]")
        for r in routes:
            dst = r.get("dst", "")
            if dst == "default" or r.get("dev") == self.bridge:
                continue
            try:
                net = ipaddress.IPv4Network(dst, strict=False)
            except ValueError:
                continue
            if net.overlaps(self.subnet) and net.prefixlen > 0:
                raise UserError(f"sandbox network {self.prefix}: subnet {self.subnet} is already routed on "
                                f"this machine ({dst} dev {r.get('dev', '?')}); remove that route or use another "
                                f"state dir (its path picks the subnet)")

    def _ensure_bridge(self) -> None:
        if not _link_exists([], self.bridge):
            _ip("link", "add", "name", self.bridge, "type", "bridge", "stp_state", "0", "forward_delay", "0")
            # A fixed MAC: a bridge otherwise takes its lowest port's, which changes as nodes come
            # and go and leaves stale ARP entries in the nodes.
            mac = hashlib.sha1(f"runner-sandbox-net-mac:{self.prefix}".encode()).digest()[:5]
            _ip("link", "set", self.bridge, "address", "02:" + ":".join(f"{b:02x}" for b in mac))
        _ip("addr", "replace", f"{self.host_addr}/{self.subnet.prefixlen}", "dev", self.bridge)
        # Sealed: what a node sends to the bridge is delivered to this machine or to another
        # node, never routed on (per-interface forwarding gates packets received on it).
        # (A later write to net.ipv4.ip_forward resets it; re-running create seals it again.)
        try:
            Path(f"/proc/sys/net/ipv4/conf/{self.bridge}/forwarding").write_text("0\n")
        except OSError as e:
            log.warning("sandbox network %s: could not turn forwarding off on %s (%s); nodes may reach "
                        "beyond this machine", self.prefix, self.bridge, e.strerror)
        _ip("link", "set", self.bridge, "up")
        self._ensure_forward_rule()

    def _ensure_forward_rule(self) -> None:
        """Accept bridged node <-> node traffic even under a FORWARD policy of DROP (see module doc)."""
        if not shutil.which("iptables"):
            return
        rule = self._forward_rule()
        if subprocess.run(["iptables", "-w", "-C", "FORWARD", *rule], capture_output=True).returncode != 0:
            proc = subprocess.run(["iptables", "-w", "-I", "FORWARD", "1", *rule], capture_output=True, text=True)
            if proc.returncode != 0:
                log.warning("sandbox network %s: could not add the iptables FORWARD rule (%s); node <-> node "
                            "traffic may be dropped if FORWARD's policy is DROP", self.prefix, _last_line(proc))

    def _forward_rule(self) -> list[str]:
        return ["-i", self.bridge, "-o", self.bridge, "-m", "comment",
                "--comment", IPT_COMMENT.format(prefix=self.prefix), "-j", "ACCEPT"]

    def _ensure_node(self, i: int) -> None:
        ns, hv = self.netns(i), self.host_veth(i)
        if ns not in _netns_list():
            _ip("netns", "add", ns)
        if not _link_exists([], hv):
            if _link_exists(["-n", ns], NODE_IF):  # a stray eth0 (not our veth's: that dies with hv)
                _ip("-n", ns, "link", "del", NODE_IF)
            _ip("link", "add", hv, "type", "veth", "peer", "name", NODE_IF, "netns", ns)
        _ip("link", "set", hv, "master", self.bridge)
        _ip("link", "set", hv, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "replace", f"{self.addr(i)}/{self.subnet.prefixlen}", "dev", NODE_IF)
        _ip("-n", ns, "link", "set", NODE_IF, "up")
        _ip("-n", ns, "route", "replace", "default", "via", self.host_addr, "dev", NODE_IF)

    # ---- partition ----------------------------------------------------------------------------
    def set_link(self, i: int, up: bool, wait: float = 5.0) -> None:
        """Cut (up=False) or restore node i's link by downing its host-side veth: the node loses
        its carrier too, so nothing gets in or out, while its processes (inside the namespace) keep
        running. The qdiscs stay attached to both ends, so the link comes back with its shaping.
        Restoring waits (up to `wait` s) until the link is operationally up again."""
        _require_root_and_tools()
        hv = self.host_veth(i)
        if not _link_exists([], hv):
            raise UserError(f"sandbox network {self.prefix}: node {i} has no link ({hv} is missing); "
                            f"run `runner sandbox up` first")
        _ip("link", "set", hv, "up" if up else "down")
        if up:
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _operstate(hv) != "up":
                time.sleep(0.05)

    # ---- status -------------------------------------------------------------------------------
    def node_indices(self) -> list[int]:
        """Nodes that have a namespace or a host-side veth (what create made, even half-way)."""
        pat_ns = re.compile(rf"rt{self.prefix}n(\d+)")
        pat_hv = re.compile(rf"rt{self.prefix}h(\d+)")
        found = {int(m.group(1)) for name in _netns_list() if (m := pat_ns.fullmatch(name))}
        found |= {int(m.group(1)) for name in _link_names([]) if (m := pat_hv.fullmatch(name))}
        return sorted(found)

    def status(self) -> dict:
        """{"bridge": {...}, "nodes": [{...} per node]} for `runner sandbox status`.

        Per node: `netns` (exists), `link` ("up", "down" = cut by set_link, "missing"), `to_node`
        and `from_node` (the shaping of each direction: "50Mbit", "50Mbit, delay 5ms",
        "unshaped"). The bridge's `uplink` is the shaping of what this machine sends to nodes.
        """
        _require_root_and_tools()
        names = set(_netns_list())
        links = _link_names([])
        bridge = {"name": self.bridge, "exists": self.bridge in links, "addr": self.host_addr,
                  "subnet": str(self.subnet),
                  "uplink": _describe_qdisc([], self.bridge) if self.bridge in links else None}
        nodes = []
        for i in self.node_indices():
            ns, hv = self.netns(i), self.host_veth(i)
            has_ns, has_hv = ns in names, hv in links
            nodes.append({
                "node": i, "netns": ns, "netns_exists": has_ns, "addr": self.addr(i),
                "link": ("up" if _admin_up([], hv) else "down") if has_hv else "missing",
                "to_node": _describe_qdisc([], hv) if has_hv else None,
                "from_node": _describe_qdisc(["-n", ns], NODE_IF) if has_ns and has_hv else None,
            })
        return {"bridge": bridge, "nodes": nodes}

    # ---- destroy ------------------------------------------------------------------------------
    def destroy(self) -> list[str]:
        """Remove every namespace, veth, bridge (their qdiscs go with them) and iptables rule with
        this prefix, whatever state a create left; returns what it removed. Safe to re-run."""
        _require_root_and_tools()
        removed = []
        own = re.compile(rf"rt{self.prefix}h\d+")
        for name in _link_names([]):
            if own.fullmatch(name) and _ip_ok("link", "del", name):  # deleting a veth deletes its peer
                removed.append(name)
        for ns in _netns_list():
            if re.fullmatch(rf"rt{self.prefix}(n\d+|q)", ns):
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
                if pids:
                    log.warning("sandbox network %s: processes %s still run in %s; it lives on (with no "
                                "link) until they exit", self.prefix, " ".join(pids), ns)
                if _ip_ok("netns", "del", ns):
                    removed.append(ns)
        if self.bridge in _link_names([]) and _ip_ok("link", "del", self.bridge):
            removed.append(self.bridge)
        if shutil.which("iptables"):
            for _ in range(16):  # every copy (a create racing another may have added two)
                if subprocess.run(["iptables", "-w", "-D", "FORWARD", *self._forward_rule()],
                                  capture_output=True).returncode != 0:
                    break
                removed.append(f"iptables FORWARD rule {IPT_COMMENT.format(prefix=self.prefix)!r}")
        return removed

    # ---- netem --------------------------------------------------------------------------------
    def netem_supported(self) -> bool:
        """Whether this kernel has netem: tried once per process on `lo` of a throwaway namespace."""
        global _netem_supported
        if _netem_supported is None:
            _require_root_and_tools()
            ns = f"rt{self.prefix}q"
            _ip_ok("netns", "del", ns)
            _ip("netns", "add", ns)
            try:
                proc = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                                      capture_output=True, text=True)
                if proc.returncode != 0 and "unknown" not in proc.stderr.lower():
                    raise UserError(f"probing netem failed: tc qdisc add ... netem: {_last_line(proc)}")
                _netem_supported = proc.returncode == 0
            finally:
                _ip_ok("netns", "del", ns)
        return _netem_supported


# ---- tc -----------------------------------------------------------------------------------------
def _apply_shape(ns_args: list[str], dev: str, shape: Shape | None) -> None:
    """Replace dev's root qdisc: tbf at the rate (+ netem delay as its child), or the default."""
    subprocess.run(["tc", *ns_args, "qdisc", "del", "dev", dev, "root"], capture_output=True)
    if shape is None:
        return
    _tc(*ns_args, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{shape.rate_bit}bit",
        "burst", str(shape.burst_bytes), "latency", QUEUE_LATENCY)
    if shape.delay_us is not None:
        # Packets wait in netem for the delay, so it must hold rate x delay worth of them.
        limit = max(1000, int(shape.rate_bit / 8 * shape.delay_us / 1e6 / 1000) + 1000)
        _tc(*ns_args, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
            "delay", f"{shape.delay_us}us", "limit", str(limit))


def _describe_qdisc(ns_args: list[str], dev: str) -> str:
    """`tc qdisc show` -> "50Mbit", "50Mbit, delay 5ms", "unshaped" (or a foreign qdisc's kind)."""
    out = subprocess.run(["tc", *ns_args, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
    parts = []
    for line in out.splitlines():
        words = line.split()
        if len(words) < 2 or words[0] != "qdisc":
            continue
        kind = words[1]
        if kind in ("tbf", "htb") and "rate" in words:
            parts.append(words[words.index("rate") + 1])
        elif kind == "netem" and "delay" in words:
            parts.append(f"delay {words[words.index('delay') + 1]}")
        elif kind not in ("noqueue", "noop", "pfifo_fast", "fq_codel", "mq"):
            parts.append(kind)
    return ", ".join(parts) or "unshaped"


def _tc(*args: str) -> None:
    proc = subprocess.run(["tc", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"tc {' '.join(args)} failed: {_last_line(proc)}")


# ---- ip -----------------------------------------------------------------------------------------
def _ip(*args: str) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"ip {' '.join(args)} failed: {_last_line(proc)}")
    return proc.stdout


def _ip_ok(*args: str) -> bool:
    return subprocess.run(["ip", *args], capture_output=True).returncode == 0


def _netns_list() -> list[str]:
    """Named namespaces ("name (id: 3)" lines -> names)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _link_names(ns_args: list[str]) -> list[str]:
    out = subprocess.run(["ip", *ns_args, "-o", "link", "show"], capture_output=True, text=True).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2]


def _link_exists(ns_args: list[str], dev: str) -> bool:
    return subprocess.run(["ip", *ns_args, "link", "show", "dev", dev], capture_output=True).returncode == 0


def _admin_up(ns_args: list[str], dev: str) -> bool:
    out = subprocess.run(["ip", *ns_args, "-o", "link", "show", "dev", dev], capture_output=True, text=True).stdout
    m = re.search(r"<([^>]*)>", out)
    return m is not None and "UP" in m.group(1).split(",")


def _operstate(dev: str) -> str:
    try:
        return Path(f"/sys/class/net/{dev}/operstate").read_text().strip()
    except OSError:
        return "missing"


def _require_root_and_tools() -> None:
    if os.geteuid() != 0:
        raise UserError("the sandbox's network layer (namespaces, veths, tc) needs root: run it as root")
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            raise UserError(f"the sandbox's network layer needs `{tool}` (Debian: apt-get install iproute2)")


def _last_line(proc: subprocess.CompletedProcess) -> str:
    text = proc.stderr if isinstance(proc.stderr, str) else (proc.stderr or b"").decode(errors="replace")
    return (text.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
