"""`job.dp_sync: auto | allreduce | diloco` (runner/planning/dp_sync.py): auto picks DiLoCo where the
cached links between a stage's replicas cannot carry the step's gradient all-reduce within
SYNC_FRACTION of its compute, says why in `up --dry-run`, and the flags reach the trainer's command
and stay through an elastic run's re-plans. No connection: nodes on loopback addresses nothing
listens on, links written into a per-test cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.core.errors import UserError
from runner.inventory import load_inventory
from runner.planning import dp_sync, links
from runner.planning.links import LinkFigure, LinkMatrix
from runner.planning.step_load import WIRE_BYTES, step_load
from tests import REPO

TINY = REPO / "configs/pi-qwen3-3stage-tiny.yaml"
PP2 = ["--parallel.pp", "2", "--parallel.partition", "uniform_transformer"]


def inventory(tmp_path: Path, mode: str = "auto", nodes: int = 4, args: list[str] | None = None, extra: str = "") -> Path:
    rows = "".join(f"  - {{name: node-{i}, host: 127.33.242.{i + 1}, port: 22, slots: 1, arch: amd64}}\n"
                   for i in range(nodes))
    p = tmp_path / "inv.yaml"
    p.write_text(f"nodes:\n{rows}job:\n  config: {TINY}\n  args: {json.dumps(args if args is not None else PP2)}\n"
                 f"  dp_sync: {mode}\n{extra}")
    return p


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_PROFILE_CACHE", str(tmp_path / "cache"))


def _cache(inv_path: Path, rates: dict[tuple[int, int], float]) -> None:
    """Links into the cache as `runner check --links` writes them: {(i, j): Mbit/s}."""
    o = load_inventory(inv_path, check_files=False).ordered()
    for (i, j), mb in rates.items():
        links.save(o[i], o[j], LinkFigure(mb * 1e6 / 8, 0.001))


def _dry(inv: Path, capsys) -> str:
    from runner.cli.main import main

    assert main(["up", "-i", str(inv), "--dry-run"]) == 0
    return capsys.readouterr().out


def test_the_step_load_is_the_ring_all_reduce_of_each_stage(tmp_path):
    load = step_load(load_inventory(inventory(tmp_path), check_files=False))
    assert (load.pp, load.dp, load.tp, load.microbatches) == (2, 2, 1, 4)
    assert load.dp_groups() == [["node-0", "node-1"], ["node-2", "node-3"]]
    # dp 2: 2 (n-1)/n = 1 x the stage's fp32 parameters, each way between the two replicas
    assert load.allreduce_bytes(0) == load.stage_params[0] * WIRE_BYTES
    dp = [f for f in load.flows if f.kind == "data-parallel"]
    assert {(f.src, f.dst) for f in dp} == {("node-0", "node-1"), ("node-1", "node-0"), ("node-2", "node-3"),
                                            ("node-3", "node-2")}
    pipe = [f for f in load.flows if f.kind == "pipeline"]
    # rank g of stage 0 sends to rank g + 2 of stage 1: 4 microbatches of 4 x 128 tokens x hidden 64 x fp32
    assert {(f.src, f.dst) for f in pipe} == {("node-0", "node-2"), ("node-2", "node-0"), ("node-1", "node-3"),
                                              ("node-3", "node-1")}
    assert all(f.bytes == 4 * (4 * 128 * 64 * 4) and f.messages == 4 for f in pipe)
    assert load.compute_s > 0 and "assumed" in load.compute_from


def test_a_slow_replica_link_chooses_diloco_with_its_reason_and_flags(tmp_path, no_network, capsys):
    inv = inventory(tmp_path)
    _cache(inv, {(0, 1): 10, (2, 3): 10_000})
    out = _dry(inv, capsys)
    lines = out[out.index("dp_sync:"):].splitlines()
    load = step_load(load_inventory(inv, check_files=False))
    nbytes = load.allreduce_bytes(0)
    assert lines[0] == (f"dp_sync: diloco (auto): stage 0's gradient all-reduce sends {nbytes / 1e6:.1f} MB per step "
                        "per rank (dp 2, ring) over link node-0 -> node-1 (10.0 Mbit/s, 1.00 ms, measured by runner "
                        "check --links)")
    allreduce = nbytes / (10e6 / 8) + 2 * 0.001
    assert lines[1].startswith(f"  sync per step: allreduce {allreduce:.2f} s, diloco {allreduce / 50:.3f} s "
                               "(every 50 steps, fp32)"), lines[1]
    assert allreduce > dp_sync.SYNC_FRACTION * load.compute_s  # why it is DiLoCo
    commands = [ln for ln in out.splitlines() if ln.strip().startswith("command ")]
    assert len(commands) == 4
    assert all(ln.endswith("--parallel.dp_sync diloco --parallel.diloco.inner_steps 50") for ln in commands)


def test_fast_links_keep_allreduce_and_no_links_say_how_to_measure(tmp_path, no_network, capsys):
    inv = inventory(tmp_path)
    out = _dry(inv, capsys)
    assert ("dp_sync: allreduce (auto: no measured link between the replicas' nodes; run `runner check --links` "
            "and plan again)") in out
    _cache(inv, {(0, 1): 10_000, (2, 3): 10_000})
    out = _dry(inv, capsys)
    assert "dp_sync: allreduce (auto): stage " in out and "--parallel.dp_sync allreduce" in out
    assert "--parallel.diloco" not in out


def test_inner_steps_come_from_the_job_and_fixed_modes_pass_through(tmp_path):
    inv = load_inventory(inventory(tmp_path, "diloco", args=[*PP2, "--parallel.diloco.inner_steps", "20"]),
                         check_files=False)
    c = dp_sync.choose(inv)
    assert c is not None and c.args == ["--parallel.dp_sync", "diloco", "--parallel.diloco.inner_steps", "20"]
    c = dp_sync.choose(load_inventory(inventory(tmp_path, "allreduce"), check_files=False))
    assert c is not None and c.args == ["--parallel.dp_sync", "allreduce"]
    # one replica: nothing to sync, whatever the links
    one = load_inventory(inventory(tmp_path, "auto", nodes=2), check_files=False)
    c = dp_sync.choose(one)
    assert c is not None and c.mode == "allreduce" and "dp 1" in c.lines[0]


def test_decide_takes_the_slowest_link_of_any_stage(tmp_path):
    load = step_load(load_inventory(inventory(tmp_path), check_files=False))
    m = LinkMatrix(["node-0", "node-1", "node-2", "node-3"])
    m.measured = {("node-0", "node-1"): LinkFigure(1e9, 0.0), ("node-3", "node-2"): LinkFigure(1e5, 0.0)}
    c = dp_sync.decide(load, m, 10)
    assert c.mode == "diloco" and "stage 1's" in c.lines[0] and "node-3 -> node-2" in c.lines[0]
    # the threshold is SYNC_FRACTION of the compute: just under it, allreduce
    t = load.allreduce_bytes(1) / 1e5
    assert dp_sync.decide(load, m, 10, fraction=1.01 * t / load.compute_s).mode == "allreduce"
    assert dp_sync.decide(load, m, 10, fraction=0.99 * t / load.compute_s).mode == "diloco"


def test_a_bad_dp_sync_is_one_line_naming_the_field(tmp_path):
    inv = inventory(tmp_path, "sometimes")
    with pytest.raises(UserError) as e:
        load_inventory(inv, check_files=False)
    assert str(e.value).startswith(f"{inv}:") and "dp_sync: must be one of auto, allreduce, diloco" in str(e.value)


def test_the_elastic_re_plan_keeps_the_choice(tmp_path, no_network):
    """The flags join the prepared job's args, which an elastic run's every layout starts from."""
    from types import SimpleNamespace

    from runner.backends.ssh.dry_run import prepare
    from runner.backends.ssh.elastic_loop import ElasticRun

    inv_path = inventory(tmp_path, extra="  elastic: {min_nodes: 2}\n")
    _cache(inv_path, {(0, 1): 10, (2, 3): 10})
    inv = load_inventory(inv_path, check_files=False)
    opts = SimpleNamespace(trainer_args=[], env=[], notify=None, elastic=False, resume=False, detach=False)
    prepared = prepare(inv, opts)
    assert prepared.dp_sync.mode == "diloco"
    run = ElasticRun(prepared.inv, prepared.elastic, False, tmp_path)
    want = run.layout
    for lost in ("node-3", "node-1"):
        run.layout = __import__("runner.planning.elastic", fromlist=["choose"]).choose(
            prepared.inv, [n.name for n in prepared.inv.ordered() if n.name != lost], want)
        args = run.inventory().job.args
        assert args[args.index("--parallel.dp_sync") + 1] == "diloco", args
        assert args.count("--parallel.dp_sync") == 1


def test_without_check_links_the_profile_neighbour_links_are_used(tmp_path, no_network, capsys):
    """`runner profile`'s `link-<a>-<b>-<key>.json` (runner/profile/measure.py), the newest per pair;
    a file of another pair whose names share the prefix is not taken for it."""
    inv = inventory(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "link-node-0-node-1-0123456789abcdef.json").write_text(
        json.dumps({"peer": "x:1", "latency_s": 0.002, "bandwidth_Bps": 2e6 / 8}))
    (cache / "link-node-2-node-3-extra-0123456789abcdef.json").write_text(
        json.dumps({"peer": "x:1", "latency_s": 0.0, "bandwidth_Bps": 1.0}))
    out = _dry(inv, capsys)
    assert ("dp_sync: diloco (auto): stage 0's gradient all-reduce sends " in out
            and "over link node-0 -> node-1 (2.0 Mbit/s, 2.00 ms, measured by runner profile)" in out), out
    m = dp_sync.known_links(load_inventory(inv, check_files=False))
    assert m.measured == {("node-0", "node-1"): LinkFigure(2e6 / 8, 0.002)}


@pytest.mark.parametrize("mode, flags, line", [
    ("auto", "--parallel.dp_sync allreduce", "dp_sync: allreduce (auto: a Slurm allocation's links are not measured "
                                             "before it starts; set job.dp_sync: diloco for slow links)"),
    ("diloco", "--parallel.dp_sync diloco --parallel.diloco.inner_steps 50", "dp_sync: diloco (job.dp_sync), inner_steps 50"),
])
def test_a_slurm_job_applies_its_dp_sync_and_says_so(tmp_path, no_network, mode, flags, line):
    """job.dp_sync on a Slurm inventory reached neither the batch script nor the plan (auto was
    silently ignored): an explicit mode is applied, auto keeps allreduce and says why."""
    from runner.api import backend_for
    from runner.api import load_inventory as load_any

    text = (REPO / "hosts/slurm.yaml").read_text().replace("  grace_period: 120", f"  grace_period: 120\n  dp_sync: {mode}")
    p = tmp_path / "slurm.yaml"
    p.write_text(text.replace("config: configs/", f"config: {REPO}/configs/"))
    out = backend_for(load_any(p)).plan().render()
    assert f"-m trainer --config /out/config.yaml {flags} \"$@\"" in out
    assert line in out.splitlines()
