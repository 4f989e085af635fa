"""runner/planning/links.py without a cluster: the rounds `check --links` measures pairs in, the
matrix it prints, the warnings for links too slow for the job's step, and the per-pair cache the
planners read back (a subset of the nodes finds its pairs; a node at another address does not)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.inventory import Node, load_inventory
from runner.planning import links
from runner.planning.links import LinkFigure, LinkMatrix
from runner.planning.step_load import step_load
from tests import REPO

TINY = REPO / "configs/pi-qwen3-3stage-tiny.yaml"


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_PROFILE_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_rounds_cover_every_pair_once_and_no_node_twice_in_a_round(n):
    names = [f"n{i}" for i in range(n)]
    rnds = links.rounds(names)
    flat = [p for r in rnds for p in r]
    assert sorted(flat) == sorted(links.pairs(names)) and len(flat) == n * (n - 1) // 2
    assert len(rnds) == (n - 1 if n % 2 == 0 else n)
    for r in rnds:
        used = [x for p in r for x in p]
        assert len(used) == len(set(used))
        assert all(names.index(a) < names.index(b) for a, b in r)  # the earlier node sends


def test_the_matrix_has_one_row_per_node_in_mbit_and_ms():
    m = LinkMatrix(["node-0", "node-1", "node-2"])
    m.measured = {("node-0", "node-1"): LinkFigure(117.5e6, 0.00025), ("node-1", "node-2"): LinkFigure(1.2e6, 0.0031)}
    lines = links.render(m).splitlines()
    assert lines[1].split() == ["from", "\\", "to", "node-0", "node-1", "node-2"]
    rows = {ln.split()[0]: ln for ln in lines[2:]}
    assert rows["node-0"].split()[1:] == ["-", "940.0", "/", "0.25", "not", "measured"]
    # the other direction shows the measured one's figure in parentheses
    assert rows["node-1"].split()[1:] == ["(940.0", "/", "0.25)", "-", "9.6", "/", "3.10"]
    assert rows["node-2"].split()[1:] == ["not", "measured", "(9.6", "/", "3.10)", "-"]


def _inv(tmp_path: Path, nodes: int = 3):
    rows = "".join(f"  - {{name: node-{i}, host: 127.33.243.{i + 1}, port: 22, slots: 1, arch: amd64}}\n"
                   for i in range(nodes))
    p = tmp_path / "inv.yaml"
    p.write_text(f"nodes:\n{rows}job:\n  config: {TINY}\n")
    return load_inventory(p, check_files=False)


def test_a_link_too_slow_for_the_pipeline_step_is_one_warning_line(tmp_path):
    load = step_load(_inv(tmp_path))  # 3 stages, one node each: node-0 -> node-1 -> node-2
    m = LinkMatrix(["node-0", "node-1", "node-2"])
    m.measured = {("node-0", "node-1"): LinkFigure(1.25e9, 0.0001), ("node-1", "node-2"): LinkFigure(1.25e6, 0.002),
                  ("node-0", "node-2"): LinkFigure(1.25e3, 0.002)}  # no flow there: never warned about
    warned = links.warnings(m, load)
    per = 4 * (4 * 128 * 64 * 4)  # 4 microbatches of 4 x 128 tokens x hidden 64, fp32
    t = per / 1.25e6 + 4 * 0.002
    assert t > links.SLOW_FRACTION * load.compute_s
    assert warned == [f"warning: link node-1 -> node-2 (10.0 Mbit/s) is too slow for stage 1's pipeline traffic: "
                      f"activations and their gradients, {per / 1e6:.1f} MB per step, take {t:.2f} s, over 20% of "
                      f"the step's ~{load.compute_s:.2f} s compute ({load.compute_from})"]
    # a looser limit: no line
    assert links.warnings(m, load, fraction=1.01 * t / load.compute_s) == []


def test_the_cache_is_per_pair_and_per_address(tmp_path):
    inv = _inv(tmp_path)
    a, b, c = inv.ordered()
    links.save(a, b, LinkFigure(1e6, 0.001))
    links.save(b, c, LinkFigure(2e6, 0.002))
    doc = json.loads(next((tmp_path / "cache").glob("links-node-0-node-1-*.json")).read_text())
    assert (doc["from"], doc["to"], doc["bandwidth_Bps"], doc["latency_s"]) == ("node-0", "node-1", 1e6, 0.001)
    m = links.cached_matrix([a, b, c])
    assert m.measured == {("node-0", "node-1"): LinkFigure(1e6, 0.001), ("node-1", "node-2"): LinkFigure(2e6, 0.002)}
    assert m.get("node-1", "node-0") == LinkFigure(1e6, 0.001)  # one direction serves both
    assert links.cached_matrix([b, c]).measured == {("node-1", "node-2"): LinkFigure(2e6, 0.002)}  # a subset
    moved = Node(name="node-2", host="127.33.243.99", port=22)
    assert links.load(b, moved) is None  # the node at another address is measured again
    # a hand-edited file is not a figure
    p = next((tmp_path / "cache").glob("links-node-1-node-2-*.json"))
    p.write_text(json.dumps({"bandwidth_Bps": -1, "latency_s": 0}))
    assert links.load(b, c) is None
