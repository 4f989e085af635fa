"""The elastic planner with links `runner check --links` cached (runner/planning/link_use.py,
runner/planning/elastic.py link_lines, runner/backends/ssh/elastic_loop.py): after a loss the new
layout's pipeline hops are printed with their cached figures, and check --links' own rule warns
where a hop cannot carry the step's activations; with partition auto the re-plan's split weighs
the new neighbours' cached link, which `runner profile` never measured, without probing it. The
cache is written by check --links' save into a temporary RUNNER_PROFILE_CACHE; no connection."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from runner.backends.ssh.elastic_loop import ElasticRun
from runner.inventory import load_inventory
from runner.inventory.elastic_spec import ElasticSpec
from runner.planning import links
from runner.planning.elastic import choose, job_layout, link_lines, sub_inventory
from runner.planning.link_use import best_order
from runner.planning.links import LinkFigure
from runner.planning.step_load import step_load
from tests import REPO
from tests.unit.test_partition_auto_links import BOUNDARY, FAST, SLOW, _Cluster, probes_asked  # noqa: F401

TINY = REPO / "configs/pi-qwen3-3stage-tiny.yaml"
PER_STEP = 4 * (4 * 128 * 64 * 4)  # 4 microbatches of 4 x 128 tokens x hidden 64, fp32: 0.5 MB
DATE = r"cached \d{4}-\d\d-\d\d \d\d:\d\d UTC, \d+ min ago"


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("RUNNER_PROFILE_CACHE", str(tmp_path / "cache"))


def inventory(tmp_path: Path, partition: list[str], nodes: int = 3):
    rows = "".join(f"  - {{name: node-{i}, host: 127.33.246.{i + 1}, port: 22, slots: 1, arch: amd64}}\n"
                   for i in range(nodes))
    p = tmp_path / "inv.yaml"
    p.write_text(f"nodes:\n{rows}job:\n  image: runner-test:tiny\n  config: {TINY}\n  args: {json.dumps(partition)}\n"
                 f"  elastic: {{min_nodes: 2}}\n")
    return load_inventory(p, check_files=False)


def cache_links(inv, a_c: LinkFigure = SLOW) -> None:
    """As `runner check --links` leaves it: node-0 -> node-1 and node-1 -> node-2 fast, node-0 -> node-2 slow."""
    a, b, c = inv.ordered()
    links.save(a, b, FAST)
    links.save(b, c, FAST)
    links.save(a, c, a_c)


def test_the_new_layout_names_its_hop_and_the_slow_link_warning(tmp_path):
    inv = inventory(tmp_path, ["--parallel.partition", "uniform_transformer"])
    cache_links(inv)
    want = job_layout(inv)
    before = link_lines(inv, want)  # all three nodes: two fast hops, no warning
    assert len(before) == 1
    assert re.fullmatch(rf"elastic: pipeline hops over links from runner check --links \({DATE}\): "
                        r"stage 0->1 node-0 -> node-1 10000\.0 Mbit/s 0\.10 ms; stage 1->2 node-1 -> node-2 "
                        r"10000\.0 Mbit/s 0\.10 ms", before[0]), before[0]
    lay = choose(inv, ["node-0", "node-2"], want)  # node-1 lost
    assert (lay.pp, lay.nodes) == (2, ("node-0", "node-2"))
    hop, warn = link_lines(inv, lay)
    assert re.fullmatch(rf"elastic: pipeline hops over links from runner check --links \({DATE}\): "
                        r"stage 0->1 node-0 -> node-2 10\.0 Mbit/s 2\.00 ms", hop), hop
    t = PER_STEP / 1.25e6 + 4 * 0.002  # 0.43 s a step over the slow link
    sub = sub_inventory(inv, lay.nodes)
    sub.job.args += lay.args()
    compute = step_load(sub).compute_s
    assert t > links.SLOW_FRACTION * compute
    assert warn == (f"elastic: warning: link node-0 -> node-2 (10.0 Mbit/s) is too slow for stage 0's pipeline "
                    f"traffic: activations and their gradients, {PER_STEP / 1e6:.1f} MB per step, take {t:.2f} s, "
                    f"over 20% of the step's ~{compute:.2f} s compute ({step_load(sub).compute_from})")


def test_nothing_is_said_where_the_cache_lacks_the_layouts_hops(tmp_path):
    inv = inventory(tmp_path, ["--parallel.partition", "uniform_transformer"])
    a, b, c = inv.ordered()
    links.save(a, b, SLOW)  # not a hop of node-0, node-2
    assert link_lines(inv, choose(inv, ["node-0", "node-2"], job_layout(inv))) == []


def test_after_a_loss_the_runner_prints_the_links_of_the_layout_it_chose(tmp_path, monkeypatch, capsys):
    inv = inventory(tmp_path, ["--parallel.partition", "uniform_transformer"])
    cache_links(inv)
    monkeypatch.setattr(ElasticRun, "_watch", lambda self, cl, run_id: None)  # no retry thread: no SSH

    class Node:
        def abandon(self):
            pass

    cl = {n.name: Node() for n in inv.nodes}
    el = ElasticRun(inv, ElasticSpec(min_nodes=2), accept_new=False, log_dir=tmp_path / "logs")
    assert el.after_failure(cl, "run-1", {"node-1": "unreachable"}, last_step=10)  # type: ignore[arg-type]
    err = [ln for ln in capsys.readouterr().err.splitlines() if "check --links" in ln or "too slow" in ln]
    assert len(err) == 2, err
    assert err[0].startswith("runner: run run-1: elastic: pipeline hops over links from runner check --links (")
    assert err[0].endswith("): stage 0->1 node-0 -> node-2 10.0 Mbit/s 2.00 ms")
    assert err[1].startswith("runner: run run-1: elastic: warning: link node-0 -> node-2 (10.0 Mbit/s) is too slow")


def test_partition_auto_replans_over_the_cached_link_of_the_new_neighbours(tmp_path, probes_asked):  # noqa: F811
    """node-1 lost: node-0 and node-2 become pipeline neighbours; `runner profile` measured only
    node-0 -> node-1 and node-1 -> node-2, check --links every pair: the split takes its figure."""
    from runner.profile import measure
    from runner.profile.auto import plan_from_profile, render_plan, with_pp

    inv = inventory(tmp_path, ["--parallel.partition", "auto", "--model.num_hidden_layers", "12"])
    cache_links(inv)
    lay = choose(inv, ["node-0", "node-2"], job_layout(inv))
    sub = sub_inventory(inv, lay.nodes)
    sub.job.args += lay.args()
    prof = with_pp(measure.profile_cluster(_Cluster(sub), {}), lay.pp)
    assert probes_asked == [set()]  # the new pair was not probed
    split, uniform, problem = plan_from_profile(prof, sub)
    hop = 0.002 + BOUNDARY / 1.25e6
    assert [s.comm_s for s in split.stages] == pytest.approx([hop, hop])
    assert split.bounds == [0, 6, 12]
    assert split.bottleneck_s == pytest.approx(6 * 0.010 + 0.004 + hop)
    assert split.step_s(4) == pytest.approx(0.061 + hop + 4 * (0.064 + hop))
    assert render_plan(split, uniform, problem, prof).splitlines()[-1].endswith(
        "): node-0 -> node-2 10.0 Mbit/s 2.00 ms")


def test_a_pipeline_of_three_survivors_is_ordered_around_the_slow_link(tmp_path, monkeypatch, capsys):
    """4 nodes, pp 4; node-1 lost. check --links measured every pair, node-0 <-> node-2 at 10 Mbit/s:
    in the inventory's order node-0 -> node-2 would be a hop; node-0, node-3, node-2 crosses only
    fast links, and the launch's inventory takes that order."""
    inv = inventory(tmp_path, ["--parallel.partition", "uniform_transformer", "--parallel.pp", "4"], nodes=4)
    a, b, c, d = inv.ordered()
    for x, y in ((a, b), (a, d), (b, c), (b, d), (c, d)):
        links.save(x, y, FAST)
    links.save(a, c, SLOW)
    want = job_layout(inv)
    assert (want.pp, want.nodes) == (4, ("node-0", "node-1", "node-2", "node-3"))
    lay = choose(inv, ["node-0", "node-2", "node-3"], want)
    assert (lay.pp, lay.dp, lay.nodes) == (3, 1, ("node-0", "node-3", "node-2"))
    # per microbatch, 131072 bytes of activations: 0.1 ms + 0.10 ms on each fast hop, vs 106.9 ms on the slow one
    order, cost = best_order(sub_inventory(inv, ["node-0", "node-2", "node-3"]), 3, BOUNDARY)
    assert order == ["node-0", "node-3", "node-2"]
    assert cost == pytest.approx((0.0001 + BOUNDARY / 1.25e9,) * 2)
    assert SLOW.seconds(BOUNDARY) == pytest.approx(0.1069, abs=1e-4)
    lines = link_lines(inv, lay)
    assert lines[0].endswith("stage 0->1 node-0 -> node-3 10000.0 Mbit/s 0.10 ms; "
                             "stage 1->2 node-3 -> node-2 10000.0 Mbit/s 0.10 ms"), lines[0]
    assert lines[1] == ("elastic: pipeline order node-0, node-3, node-2 (inventory order node-0, node-2, node-3): "
                        "its hops are the fastest of the orders over the cached links")
    assert len(lines) == 2  # no hop too slow: no warning
    monkeypatch.setattr(ElasticRun, "_watch", lambda self, cl, run_id: None)

    class Node:
        def abandon(self):
            pass

    el = ElasticRun(inv, ElasticSpec(min_nodes=2), accept_new=False, log_dir=tmp_path / "logs")
    assert el.after_failure({n.name: Node() for n in inv.nodes}, "run-2", {"node-1": "unreachable"}, 5)  # type: ignore[arg-type]
    assert [n.name for n in el.inventory().ordered()] == ["node-0", "node-3", "node-2"]
    assert el.inventory().job.args[-4:] == ["--parallel.pp", "3", "--parallel.dp", "1"]
    assert "pipeline order node-0, node-3, node-2" in capsys.readouterr().err


def test_the_inventory_order_is_kept_without_every_pair_measured(tmp_path):
    inv = inventory(tmp_path, ["--parallel.partition", "uniform_transformer", "--parallel.pp", "4"], nodes=4)
    a, b, c, d = inv.ordered()
    links.save(a, c, SLOW)
    links.save(c, d, FAST)  # node-0 <-> node-3 not measured: no order is judged
    lay = choose(inv, ["node-0", "node-2", "node-3"], job_layout(inv))
    assert lay.nodes == ("node-0", "node-2", "node-3")
    hop, warn = link_lines(inv, lay)
    assert "stage 0->1 node-0 -> node-2 10.0 Mbit/s 2.00 ms; stage 1->2 node-2 -> node-3 10000.0 Mbit/s" in hop
    assert warn.startswith("elastic: warning: link node-0 -> node-2 (10.0 Mbit/s) is too slow for stage 0's pipeline")
