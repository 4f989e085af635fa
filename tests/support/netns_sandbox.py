"""The namespaced sandbox (`runner sandbox up --netns`: each node in its own network namespace on
a bridge, links that can be shaped and cut), shared by every test that needs real links: one per
session (tests/conftest.py's `netns_sandbox`), the trainer image relay-pushed onto it once."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from runner.sandbox.net import SandboxNet
from tests import IMAGE
from tests.support.runner_helpers import parse_push, runner, write_job


def sandbox_cmd(state: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return runner("sandbox", "--dir", str(state), *args, timeout=timeout)


def leftovers(prefix: str) -> list[str]:
    """Namespaces and links of that sandbox network still on this machine."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [w for w in (ns + links).split() if w.startswith(f"rt{prefix}") or w.startswith(f"rtbr{prefix}")]


def uplink_bytes(net: SandboxNet) -> int:
    """Bytes this machine has sent into the sandbox network: the bridge device's own transmit
    counter (bridged node <-> node traffic never passes it; see runner/sandbox/net.py)."""
    return int(Path(f"/sys/class/net/{net.bridge}/statistics/tx_bytes").read_text())


# One qdisc of `tc -s qdisc show`: its kind and handle, then its counters on the next line.
QDISC_STATS_RE = re.compile(r"^qdisc (\S+) (\S+) .*\n\s*Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)",
                            re.M)


def qdisc_counters(dev: str, netns: str | None = None) -> dict[str, dict[str, int]]:
    """{kind: {"bytes", "packets", "dropped", "overlimits"}} of dev's qdiscs (in netns, or on this
    machine), from `tc -s qdisc show`: the kernel's own count of what passed a shaper and of how
    often the shaper held it back (tbf's overlimits: a dequeue that found too few tokens). A test
    of shaping asserts on these, not on how long a transfer took on a machine that may be busy."""
    ns_args = ["-n", netns] if netns else []
    out = subprocess.run(["tc", *ns_args, "-s", "qdisc", "show", "dev", dev], capture_output=True, text=True,
                         check=True).stdout
    return {m[1]: {"bytes": int(m[3]), "packets": int(m[4]), "dropped": int(m[5]), "overlimits": int(m[6])}
            for m in QDISC_STATS_RE.finditer(out)}


def counters_delta(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """What each qdisc counted between two qdisc_counters() readings (a qdisc new since: all of it)."""
    return {k: {f: v - before.get(k, {}).get(f, 0) for f, v in c.items()} for k, c in after.items()}


def netns_cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    state = tmp_path_factory.mktemp("sandbox-netns") / "s"
    inv = state.parent / "local.yaml"
    up = sandbox_cmd(state, "up", "--nodes", "3", "--netns", "--inventory", str(inv))
    assert up.returncode == 0, up.stderr
    inv.write_text(inv.read_text().replace("image: runner-trainer:latest", f"image: {IMAGE}"))
    net = SandboxNet.for_state_dir(state)
    try:
        sent = uplink_bytes(net)
        push = runner("push", "-i", str(inv), "--job", str(write_job(state.parent)), timeout=1200)
        sent = uplink_bytes(net) - sent
        assert push.returncode == 0, push.stderr
        rows = parse_push(push.stdout)
        # The first push is one relay chain; what crossed the bridge from this machine is one copy
        # of the image (plus tar, SSH and TCP framing; less where the link probe chose ssh -C), not three.
        assert {n: (r["action"], r["source"]) for n, r in rows.items()} == {
            "node-0": ("relay", "host"), "node-1": ("relay", "node-0"), "node-2": ("relay", "node-1")}, rows
        image = rows["node-0"]["image_mb"] * 1e6
        print(f"\n[figure] relay push of the trainer image to 3 namespaced nodes: this host sent {sent / 1e6:.0f} MB "
              f"for a {image / 1e6:.0f} MB image")
        assert sent < 1.1 * image, (sent, image)
        yield {"state": state, "inv": inv, "net": net}
    finally:
        down = sandbox_cmd(state, "down", "--purge")  # the nodes' image copies (GBs) go too
        assert down.returncode == 0, down.stderr
        assert leftovers(net.prefix) == []
