"""`parallel.partition: auto` with links `runner check --links` cached (runner/planning/link_use.py):
profile_cluster (runner/profile/measure.py) takes a cached pair's figure instead of probing that
link, the split's transfer times are computed from it (a slow link moves layers off its two
stages), and the plan's last line names the links taken. The cache is written by check --links' own
save (runner/planning/links.py) into a temporary RUNNER_PROFILE_CACHE; no connection is opened:
the cluster and the probe containers are stand-ins, the test asserting what they were asked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runner.inventory import load_inventory
from runner.planning import links
from runner.planning.links import LinkFigure
from runner.profile import measure
from runner.profile.auto import plan_from_profile, render_plan
from tests import REPO

TINY = REPO / "configs/pi-qwen3-3stage-tiny.yaml"
BOUNDARY = 131072.0                          # one microbatch's activations, bytes
SLOW = LinkFigure(1.25e6, 0.002)             # 10 Mbit/s, 2 ms: as check --links cached it
FAST = LinkFigure(1.25e9, 0.0001)
PROBED = {"latency_s": 1e-4, "bandwidth_Bps": 1e8}  # what `runner profile`'s probe would measure


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("RUNNER_PROFILE_CACHE", str(tmp_path / "cache"))


def inv3(tmp_path: Path, nodes: int = 3):
    rows = "".join(f"  - {{name: node-{i}, host: 127.33.245.{i + 1}, port: 22, slots: 1, arch: amd64}}\n"
                   for i in range(nodes))
    p = tmp_path / "inv.yaml"
    p.write_text(f"nodes:\n{rows}job:\n  image: runner-test:tiny\n  config: {TINY}\n"
                 f"  args: [--parallel.partition, auto, --model.num_hidden_layers, '12']\n")
    return load_inventory(p, check_files=False)


def node_doc(pp: int = 3) -> dict:
    return {"time_s": {"embed": 0.001, "block": 0.010, "head": 0.004},
            "train_bytes": {"embed": 1e5, "block": 1e5, "head": 1e5},
            "act_bytes": {"embed": 0.0, "block": 1e6, "head": 1e6}, "optim_s": {"embed": 0.0, "block": 0.0, "head": 0.0},
            "memory_available": float(8 << 30), "runtime_bytes": 2e8, "boundary_bytes": BOUNDARY, "model_bytes": 1e6,
            "model": {"family": "qwen3", "pp": pp, "pp_schedule": "1f1b", "virtual_stages": 1, "num_layers": 12,
                      "microbatches": 4, "hidden_size": 64, "seq_len": 128, "microbatch": 4, "dtype": "fp32"}}


class _Remote:
    def __init__(self, node):
        self.node = node


class _Cluster:
    """What profile_cluster asks of a cluster before it probes: the inventory, and a call per node."""

    def __init__(self, inv):
        self.inv = inv

    def each(self, fn):
        return {n.name: fn(_Remote(n)) for n in self.inv.ordered()}


@pytest.fixture
def probes_asked(monkeypatch):
    """Stands in for the probe containers: records which links profile_cluster asks to measure."""
    asked: list[set[int]] = []

    def run_probes(cl, order, probes, tags, need_compute, need_link, *rest, **kw):
        asked.append(set(need_link))
        return {n.name: {**(node_doc() if n.name in need_compute else {}),
                         **({"link": dict(PROBED)} if i in need_link else {})} for i, n in enumerate(order)}

    monkeypatch.setattr("runner.delivery.images.node_image_id", lambda r, tag: "sha256:" + "ab" * 32)
    monkeypatch.setattr(measure, "run_probes", run_probes)
    return asked


def test_cached_check_links_replace_the_probe_and_move_the_split(tmp_path, probes_asked):
    inv = inv3(tmp_path)
    a, b, c = inv.ordered()
    links.save(a, b, SLOW)  # the real path `runner check --links` caches with
    links.save(b, c, FAST)
    prof = measure.profile_cluster(_Cluster(inv), {})
    assert probes_asked == [set()]  # compute measured (nothing cached), no link probed
    assert [lk["bandwidth_Bps"] for lk in prof.links] == [1.25e6, 1.25e9]
    assert [lk["from"] for lk in prof.links] == ["runner check --links"] * 2
    split, uniform, problem = plan_from_profile(prof, inv)
    assert (problem.links[0].bandwidth_Bps, problem.links[0].latency_s) == (1.25e6, 0.002)
    hop = 0.002 + BOUNDARY / 1.25e6  # 0.1069 s per microbatch each way over the slow link
    assert split.stages[0].comm_s == pytest.approx(hop)
    assert split.stages[1].comm_s == pytest.approx(hop + 0.0001 + BOUNDARY / 1.25e9)
    # both ends of the slow link keep one layer each; the fast end takes the other ten
    assert split.bounds == [0, 1, 2, 12]
    assert split.bottleneck_s == pytest.approx(0.001 + 0.010 + hop)
    text = render_plan(split, uniform, problem, prof)
    last = text.splitlines()[-1]
    assert re.fullmatch(r"parallel\.partition auto: links from runner check --links \(cached \d{4}-\d\d-\d\d \d\d:\d\d UTC, "
                        r"\d+ min ago\): node-0 -> node-1 10\.0 Mbit/s 2\.00 ms, node-1 -> node-2 10000\.0 Mbit/s 0\.10 ms",
                        last), last


def test_without_the_cache_the_probe_measures_and_the_split_is_even(tmp_path, probes_asked):
    """What the planner did before: each neighbour link probed, the layers spread evenly."""
    inv = inv3(tmp_path)
    prof = measure.profile_cluster(_Cluster(inv), {})
    assert probes_asked == [{0, 1}]
    split, uniform, problem = plan_from_profile(prof, inv)
    assert problem.links[0].bandwidth_Bps == 1e8
    assert split.bounds == [0, 4, 8, 12]
    assert "check --links" not in render_plan(split, uniform, problem, prof)


def test_refresh_measures_every_link_again(tmp_path, probes_asked):
    inv = inv3(tmp_path)
    a, b, c = inv.ordered()
    links.save(a, b, SLOW)
    links.save(b, c, FAST)
    prof = measure.profile_cluster(_Cluster(inv), {}, refresh=True)
    assert probes_asked == [{0, 1}]
    assert [lk["bandwidth_Bps"] for lk in prof.links] == [1e8, 1e8]


def test_one_pair_cached_the_other_probed_and_the_line_says_so(tmp_path, probes_asked):
    """check --links measured node-1 -> node-2 only (the other direction is found too)."""
    inv = inv3(tmp_path)
    a, b, c = inv.ordered()
    links.save(c, b, SLOW)  # stored as node-2 -> node-1: the pair is used in either direction
    prof = measure.profile_cluster(_Cluster(inv), {})
    assert probes_asked == [{0}]
    assert [lk["bandwidth_Bps"] for lk in prof.links] == [1e8, 1.25e6]
    split, uniform, problem = plan_from_profile(prof, inv)
    assert split.bounds == [0, 10, 11, 12]  # the slow link now between stages 1 and 2
    last = render_plan(split, uniform, problem, prof).splitlines()[-1]
    assert last.endswith("node-1 -> node-2 10.0 Mbit/s 2.00 ms; 1 other link(s) from runner profile"), last


def test_the_age_of_the_cached_links_is_said():
    from runner.planning.link_use import when

    at = 1_765_000_000.0
    assert when(at, now=at + 600) == "cached 2025-12-06 05:46 UTC, 10 min ago"
    assert when(at, now=at + 5400) == "cached 2025-12-06 05:46 UTC, 1.5 h ago"
    assert when(None) == "cached"  # a file written without measured_at
