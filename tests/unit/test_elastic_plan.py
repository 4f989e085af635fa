"""Elastic runs, the part decided before any node is contacted (runner/planning/elastic.py): the layout a run
takes over the nodes it has left (the global batch kept, dp as near the job's as the world allows,
pp taking the rest, stages that cannot fit a node's memory passed over), the refusals of a job that
could never shrink (one line each, naming file:line and what to do), `up --dry-run`'s elastic lines
with no socket opened, and the history `runner status` prints from a node's elastic.jsonl, bounded
and made visible whatever the node wrote. The runs themselves: tests/sandbox/test_elastic_sandbox.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.core.errors import UserError
from runner.inventory import load_inventory
from runner.inventory.elastic_spec import ElasticSpec
from runner.planning.elastic import (
    Layout,
    choose,
    job_layout,
    parse_events,
    render_events,
    replicas_args,
    sub_inventory,
)
from tests import REPO
from tests.support.runner_helpers import no_socket_env, runner

TINY = REPO / "configs/pi-qwen3-3stage-tiny.yaml"


def inventory(tmp_path: Path, nodes: int = 3, args: list[str] | None = None, elastic: str = "{min_nodes: 2}",
              memory: list[str] | None = None, slots: int = 1, extra: str = "", name: str = "inv.yaml") -> Path:
    """Sandbox-like nodes on loopback addresses nothing listens on."""
    rows = "".join(f"  - {{name: node-{i}, host: 127.33.241.{i + 1}, port: 22, slots: {slots}, arch: amd64"
                   f"{', memory: ' + memory[i] if memory else ''}}}\n" for i in range(nodes))
    args = args if args is not None else ["--parallel.partition", "uniform_transformer"]
    p = tmp_path / name
    p.write_text(f"nodes:\n{rows}job:\n  config: {TINY}\n  args: {json.dumps(args)}\n"
                 f"{'  elastic: ' + elastic + chr(10) if elastic else ''}{extra}")
    return p


@pytest.fixture(autouse=True)
def _no_profiles(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_PROFILE_CACHE", str(tmp_path / "no-profiles"))


def test_a_pipeline_loses_a_stage_and_keeps_its_batch(tmp_path):
    inv = load_inventory(str(inventory(tmp_path)))
    want = job_layout(inv)
    assert want == Layout(("node-0", "node-1", "node-2"), pp=3, dp=1, tp=1, batch_size=16)
    assert inv.job.elastic == ElasticSpec(min_nodes=2, rejoin=True, line=8)
    got = choose(inv, ["node-0", "node-1"], want)
    assert got == Layout(("node-0", "node-1"), pp=2, dp=1, tp=1, batch_size=16)
    assert got.args() == ["--parallel.pp", "2", "--parallel.dp", "1", "--train.batch_size", "16"]
    assert got.args(want) == ["--parallel.pp", "2", "--parallel.dp", "1"]  # the job's batch: not repeated
    # the master lost: the first node left is rank 0
    lost_master = choose(inv, ["node-1", "node-2"], want)
    assert lost_master.nodes == ("node-1", "node-2")
    sub = sub_inventory(inv, lost_master.nodes)
    assert [(n.name, n.role) for n in sub.ordered()] == [("node-1", "master"), ("node-2", "worker")]
    assert inv.master.name == "node-0"  # the inventory itself is not changed
    assert replicas_args(inv) == ["--checkpoint.replicas", "1"]
    kept = load_inventory(str(inventory(tmp_path, args=["--parallel.partition", "auto", "--checkpoint.replicas", "2"],
                                        name="kept.yaml")))
    assert replicas_args(kept) == []


def test_data_parallel_width_changes_keep_the_global_batch(tmp_path):
    # dp 3 (pp 1), 8 a rank = 24: two nodes take 12 each
    ddp = load_inventory(str(inventory(tmp_path, args=["--parallel.pp", "1", "--train.batch_size", "8"])))
    want = job_layout(ddp)
    assert (want.pp, want.dp, want.global_batch) == (1, 3, 24)
    assert choose(ddp, ["node-0", "node-2"], want) == Layout(("node-0", "node-2"), 1, 2, 1, 12)
    # 4 nodes as pp 2 x dp 2 (16 a rank = 32): three nodes cannot keep dp 2; dp 1 and dp 3 are as
    # near, and the one with more stages (less memory a node) wins: pp 3 x dp 1, 32 a rank
    four = load_inventory(str(inventory(tmp_path, nodes=4, args=["--parallel.pp", "2", "--parallel.partition",
                                                                  "uniform_transformer", "--train.microbatch_num", "4"],
                                        name="four.yaml")))
    want4 = job_layout(four)
    assert (want4.pp, want4.dp) == (2, 2)
    got = choose(four, ["node-0", "node-1", "node-3"], want4)
    assert (got.pp, got.dp, got.batch_size, got.global_batch) == (3, 1, 32, 32)
    # a global batch that dp cannot split evenly is passed over: 3 x 7 = 21 on two nodes is pp 2
    odd = load_inventory(str(inventory(tmp_path, args=["--parallel.pp", "1", "--train.batch_size", "7",
                                                       "--train.microbatch_num", "7", "--parallel.partition",
                                                       "uniform_transformer"], name="odd.yaml")))
    got = choose(odd, ["node-0", "node-1"], job_layout(odd))
    assert (got.pp, got.dp, got.batch_size) == (2, 1, 21)


def test_a_layout_a_node_cannot_hold_is_passed_over(tmp_path):
    # Each node just holds the trainer process and a third of the model: on two nodes dp 2 would
    # put the whole model on each, pp 2 half of it.
    inv = load_inventory(str(inventory(tmp_path, args=["--parallel.pp", "1", "--train.batch_size", "8",
                                                       "--model.hidden_size", "512", "--model.intermediate_size",
                                                       "2048", "--parallel.partition", "uniform_transformer"],
                                       memory=["480m", "480m", "480m"])))
    want = job_layout(inv)
    assert want.dp == 3
    with pytest.raises(UserError) as e:
        choose(inv, ["node-0", "node-1"], want)
    msg = str(e.value)
    assert msg.startswith("elastic: no layout runs on node-0, node-1: ")
    assert "pp 1 x dp 2: node node-0 cannot hold pipeline stage 0" in msg and "pp 2 x dp 1: node" in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("case,expected", [
    ("min_nodes", "inv.yaml:8: job.elastic.min_nodes: 4 is more than the inventory's 3 node(s); give at most 3"),
    ("custom", "job.elastic: parallel.partition custom:0,2,5,7 is a fixed split for 3 stages; give `auto`"),
    ("tp", "job.elastic: parallel.tp 2 spans nodes (node-0 runs 1 process(es)); a tp group cannot lose a node"),
    ("command", "job.elastic: job.command is not the trainer, so its layout cannot be planned again"),
    ("fits", "job.elastic: min_nodes 1: no layout runs on node-0: pp 1 x dp 1: node node-0 cannot hold"),
    ("rejoin", "inv.yaml:8: job.elastic.rejoin: must be true or false, got 'sometimes'"),
    ("field", "inv.yaml:8: job.elastic.min_node: unknown field (did you mean min_nodes?)"),
])
def test_a_job_that_could_never_shrink_is_one_line_before_anything_starts(tmp_path, no_network, capsys, case, expected):
    from runner.cli.main import main

    kw = {
        "min_nodes": {"elastic": "{min_nodes: 4}"},
        "custom": {"args": []},
        "tp": {"args": ["--parallel.tp", "2", "--parallel.pp", "1"]},
        "command": {"extra": "  command: [python3, -c, 'print(1)']\n"},
        "fits": {"elastic": "{min_nodes: 1}", "memory": ["600m", "600m", "600m"],
                 "args": ["--parallel.partition", "uniform_transformer", "--model.hidden_size", "512",
                          "--model.intermediate_size", "2048"]},
        "rejoin": {"elastic": "{rejoin: sometimes}"},
        "field": {"elastic": "{min_node: 2}"},
    }[case]
    inv = inventory(tmp_path, **kw)
    for argv in (["up", "-i", str(inv), "--dry-run"], ["up", "-i", str(inv)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("runner: error: ") and expected in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_elastic_in_a_slurm_inventory_is_refused(tmp_path):
    p = tmp_path / "slurm.yaml"
    p.write_text(f"slurm: {{nodes: 2, partition: debug}}\njob:\n  config: {TINY}\n  elastic: true\n")
    with pytest.raises(UserError) as e:
        from runner.inventory.slurm import load_slurm_inventory

        load_slurm_inventory(str(p))
    assert str(e.value).startswith(f"{p}:4: job.elastic: a Slurm allocation does not shrink node by node")


def test_the_elastic_flag_on_a_slurm_run_is_one_line_and_contacts_nothing(tmp_path):
    guard = no_socket_env(tmp_path)
    p = tmp_path / "slurm.yaml"
    p.write_text(f"slurm: {{nodes: 2, partition: debug}}\njob:\n  config: {TINY}\n")
    for dry in (["--dry-run"], []):
        res = runner("up", "-i", str(p), "--elastic", *dry, env=guard)
        assert res.returncode == 2 and res.stdout == "", (dry, res.stdout, res.stderr)
        assert res.stderr.strip() == ("runner: error: --elastic is for SSH runs: a Slurm allocation does not shrink "
                                      "node by node; use --requeue (a preempted job resumes from its latest checkpoint)")


def test_up_dry_run_shows_the_layout_without_each_node_and_contacts_nothing(tmp_path, no_network, capsys):
    from runner.cli.main import main

    inv = inventory(tmp_path)
    assert main(["up", "-i", str(inv), "--dry-run"]) == 0
    out = capsys.readouterr().out
    tail = out[out.index("elastic:"):].splitlines()
    assert tail == [
        "elastic: min_nodes 2, rejoin yes; starts as pp 3 x dp 1 x tp 1 on 3 node(s) (node-0, node-1, node-2); "
        "--checkpoint.replicas 1 added (the nodes left hold a whole checkpoint)",
        "  without node-0: pp 2 x dp 1 x tp 1 on 2 node(s) (node-1, node-2)",
        "  without node-1: pp 2 x dp 1 x tp 1 on 2 node(s) (node-0, node-2)",
        "  without node-2: pp 2 x dp 1 x tp 1 on 2 node(s) (node-0, node-1)"]
    commands = [ln for ln in out.splitlines() if ln.strip().startswith("command ")]
    assert len(commands) == 3 and all(ln.endswith("--checkpoint.replicas 1") for ln in commands), commands
    # --elastic on a job without the field: every default (min_nodes 1, rejoin)
    plain = inventory(tmp_path, elastic="", name="plain.yaml")
    assert main(["up", "-i", str(plain), "--dry-run"]) == 0
    assert "elastic:" not in capsys.readouterr().out
    assert main(["up", "-i", str(plain), "--elastic", "--detach"]) == 2  # nobody would be there to re-plan
    assert capsys.readouterr().err.startswith("runner: error: --detach: an elastic run needs `runner up` attached")
    assert main(["up", "-i", str(plain), "--dry-run", "--elastic"]) == 0
    out = capsys.readouterr().out
    assert "elastic: min_nodes 1, rejoin yes; starts as pp 3 x dp 1 x tp 1 on 3 node(s)" in out, out


def test_status_history_lines_are_bounded_and_visible():
    hostile = "\n".join([
        json.dumps({"time": "t1", "event": "layout", "layout": {"pp": 3, "dp": 1, "tp": 1, "nodes": ["a", "b", "c"]},
                    "from_step": None, "why": "start"}),
        json.dumps({"time": "t2", "event": "lost", "node": "c", "why": "node unreachable"}),
        json.dumps({"time": "t3", "event": "layout", "layout": {"pp": 2, "dp": 1, "tp": 1, "nodes": ["a", "b"]},
                    "from_step": 4, "steps_lost": 1, "split": "custom:0,4,7"}),
        "not json", "[1, 2]", json.dumps({"event": "lost", "node": "x" * 5000}),
    ])
    events = parse_events(hostile)
    assert len(events) == 4  # "not json" and a list are not events
    lines = render_events(events)
    assert lines[:3] == ["t1  layout pp 3 x dp 1 x tp 1 on a, b, c", "t2  lost c: node unreachable",
                         "t3  layout pp 2 x dp 1 x tp 1 on a, b from step 4 (1 step(s) redone), split custom:0,4,7"]
    assert len(lines) == 4 and len(lines[3]) == 400


def test_the_profile_cache_key_ignores_the_layout_flags_an_elastic_run_adds(tmp_path):
    from runner.inventory import Job, Node
    from runner.planning.profile_cache import node_key

    node = Node(name="n", host="127.0.0.1")
    inv = load_inventory(str(inventory(tmp_path)))
    want = job_layout(inv)
    shrunk = choose(inv, ["node-0", "node-1"], want)
    base = Job(args=list(inv.job.args))
    moved = Job(args=[*inv.job.args, *replicas_args(inv), *shrunk.args(want)])  # what the 2-node launch passes
    assert node_key(node, base, "img", 2, 2.0) == node_key(node, moved, "img", 2, 2.0)
    assert node_key(node, base, "img", 2, 2.0) != node_key(node, Job(args=["--train.batch_size", "8"]), "img", 2, 2.0)


def test_losing_the_fast_node_gives_the_slowest_the_fewest_layers(tmp_path):
    """Nodes at --cpus 0.3, 0.6, 1.0 (block times as `runner profile` measured them under those
    limits, cached for the 3-stage job): node-2, the fast one, lost. The survivors' cached profiles
    plan the 2-stage split, and the slow node-0 gets the fewer layers; the line `up` prints says so."""
    from runner.profile.auto import plan_from_profile, render_plan, with_pp
    from runner.profile.measure import ClusterProfile

    inv = load_inventory(str(inventory(tmp_path, args=["--parallel.partition", "auto", "--model.num_hidden_layers",
                                                       "12"])))
    lay = choose(inv, ["node-0", "node-1"], job_layout(inv))
    assert (lay.pp, lay.nodes) == (2, ("node-0", "node-1"))

    def doc(name: str, block: float) -> dict:
        return {"node": name, "time_s": {"embed": 0.001, "block": block, "head": 0.004},
                "train_bytes": {"embed": 1e5, "block": 1e5, "head": 1e5},
                "act_bytes": {"embed": 0, "block": 1e6, "head": 1e6}, "optim_s": {"embed": 0.0, "block": 0.0, "head": 0.0},
                "memory_available": 8 << 30, "runtime_bytes": 2e8, "boundary_bytes": 131072, "model_bytes": 1e6,
                "model": {"pp": 3, "pp_schedule": "1f1b", "virtual_stages": 1, "num_layers": 12, "microbatches": 4}}

    prof = with_pp(ClusterProfile([doc("node-0", 0.030), doc("node-1", 0.015)],
                                  [{"latency_s": 1e-4, "bandwidth_Bps": 1e8}]), lay.pp)
    split, uniform, problem = plan_from_profile(prof, sub_inventory(inv, lay.nodes))
    counts = [s.num_layers for s in split.stages]
    assert [s.node for s in split.stages] == ["node-0", "node-1"] and sum(counts) == 12
    assert counts[0] < counts[1], counts
    assert render_plan(split, uniform, problem).startswith(f"parallel.partition auto: {split.spec}")
