"""`runner check --links` on the namespaced sandbox (tests/support/netns_sandbox.py): one pair of nodes held to
10 Mbit/s by an htb class on both nodes' eth0 (filtered on the other's address, so the other links
stay as they are), then the matrix the command prints and the cache it writes are read back: the
shaped link within 20% of 10 Mbit/s, every other link faster, and the too-slow warning on that
link only. The shaping is taken off whatever happens (the session's other tests share the nodes)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.support.runner_helpers import runner

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]
SHAPED_MBIT = 10
ROW_RE = re.compile(r"^(node-\d)\s+(.*)$")
CELL_RE = re.compile(r"\(?([\d.]+) / ([\d.]+)\)?|-|not measured")


def _tc(ns: str, *args: str) -> None:
    subprocess.run(["tc", "-n", ns, *args], check=True, capture_output=True, text=True)


def _shape_pair(net, i: int, j: int) -> None:
    for a, b in ((i, j), (j, i)):
        ns = net.netns(a)
        _tc(ns, "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "htb", "default", "20")
        _tc(ns, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb", "rate", f"{SHAPED_MBIT}mbit")
        _tc(ns, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:20", "htb", "rate", "10gbit")
        _tc(ns, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip",
            "dst", f"{net.addr(b)}/32", "flowid", "1:10")


def _unshape(net, *nodes: int) -> None:
    for a in nodes:
        subprocess.run(["tc", "-n", net.netns(a), "qdisc", "del", "dev", "eth0", "root"], capture_output=True)


def _matrix(out: str) -> dict[tuple[str, str], tuple[float, float]]:
    """{(from, to): (Mbit/s, ms)} of the measured cells (not the mirrored, parenthesised ones)."""
    lines = out[out.index("links (Mbit/s"):].splitlines()
    names = lines[1].split()[3:]  # "from \ to" then the node names
    got = {}
    for line in lines[2:2 + len(names)]:
        m = ROW_RE.match(line)
        assert m, line
        cells = re.findall(r"\([^)]*\)|[\d.]+ / [\d.]+|-|not measured", m[2])
        assert len(cells) == len(names), (line, cells)
        for to, cell in zip(names, cells, strict=True):
            if "/" in cell and not cell.startswith("("):
                mb, ms = (float(x) for x in cell.split(" / "))
                got[m[1], to] = (mb, ms)
    return got


def test_check_links_reports_the_shaped_link_and_the_others_faster(netns_sandbox, tmp_path, monkeypatch):
    inv, net = netns_sandbox["inv"], netns_sandbox["net"]
    cache = tmp_path / "profiles"
    _shape_pair(net, 1, 2)
    try:
        proc = runner("check", "-i", str(inv), "--links", timeout=300, env={"RUNNER_PROFILE_CACHE": str(cache)})
    finally:
        _unshape(net, 1, 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = _matrix(proc.stdout)
    assert set(got) == {("node-0", "node-1"), ("node-0", "node-2"), ("node-1", "node-2")}, proc.stdout
    slow = got["node-1", "node-2"][0]
    print(f"\n[figure] check --links: node-1 -> node-2 shaped to {SHAPED_MBIT} Mbit/s measured {slow:.2f} Mbit/s; "
          f"node-0 -> node-1 {got['node-0', 'node-1'][0]:.0f}, node-0 -> node-2 {got['node-0', 'node-2'][0]:.0f} Mbit/s")
    print(proc.stdout[proc.stdout.index("links (Mbit/s"):])
    assert abs(slow - SHAPED_MBIT) <= 0.2 * SHAPED_MBIT, proc.stdout
    for pair in (("node-0", "node-1"), ("node-0", "node-2")):
        assert got[pair][0] > 2 * SHAPED_MBIT, (pair, proc.stdout)
    warned = [ln for ln in proc.stdout.splitlines() if ln.startswith("warning: link ")]
    assert warned and all(ln.startswith(("warning: link node-1 -> node-2 ", "warning: link node-2 -> node-1 "))
                          for ln in warned), proc.stdout
    # the cache the planners read: one file per measured pair, the same figure
    docs = {(d["from"], d["to"]): d for d in (json.loads(p.read_text()) for p in cache.glob("links-*.json"))}
    assert set(docs) == set(got)
    assert abs(docs["node-1", "node-2"]["bandwidth_Bps"] * 8 / 1e6 - slow) <= 0.05  # printed to 0.1
