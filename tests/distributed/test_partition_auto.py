"""parallel.partition auto, the planner (runner/profile/split.py): the dynamic programme against
brute force on random profiles (same bottleneck, same split under the tie rule), memory limits,
the one-line errors, and the mapping of a measured profile onto stages (runner/profile/auto.py)."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from contract.partition import uniform_bounds
from runner.core.errors import UserError
from runner.inventory import Inventory, Job, Node
from runner.profile.auto import job_partition, plan_from_profile, problem_from_profile
from runner.profile.split import (
    INF,
    Link,
    Problem,
    StageNode,
    best_split,
    brute_force,
    make_split,
    stage_memory,
)

GIB = 2**30


def _node(rng: random.Random, name: str, mem: float = INF) -> StageNode:
    return StageNode(name, time_s={"embed": rng.uniform(0, 2), "block": rng.uniform(0.1, 3), "head": rng.uniform(0, 4)},
                     train_bytes={"embed": rng.uniform(0, 3), "block": rng.uniform(0.5, 2), "head": rng.uniform(0, 3)},
                     act_bytes={"embed": rng.uniform(0, 1), "block": rng.uniform(0, 1), "head": rng.uniform(0, 1)},
                     memory_available=mem, runtime_bytes=rng.uniform(0, 1),
                     optim_s={"embed": 0.01, "block": 0.01, "head": 0.01})


def _problem(rng: random.Random, with_memory: bool) -> Problem:
    p = rng.randint(2, 4)
    layers = rng.randint(p, 10)
    stages = [_node(rng, f"n{s}", rng.uniform(4, 30) if with_memory else INF) for s in range(p)]
    links = [None if rng.random() < 0.2 else Link(rng.uniform(0, 0.01), rng.uniform(1, 100)) for _ in range(p - 1)]
    return Problem(stages, layers, rng.randint(1, 8), links, rng.uniform(0, 5), rng.choice(["1f1b", "gpipe"]))


@pytest.mark.parametrize("with_memory", [False, True])
def test_dp_equals_brute_force_on_random_profiles(with_memory):
    rng = random.Random(14 + with_memory)
    infeasible = 0
    for _ in range(400):
        pr = _problem(rng, with_memory)
        brute = brute_force(pr)
        if brute is None:
            infeasible += 1
            with pytest.raises(UserError, match="parallel.partition auto"):
                best_split(pr)
            continue
        dp = best_split(pr)
        assert dp.bottleneck_s == brute.bottleneck_s, (pr, dp.bounds, brute.bounds)
        assert dp.bounds == brute.bounds  # the same tie rule: smallest boundaries first
        assert all(st.num_layers >= 1 for st in dp.stages)
        assert all(st.memory_bytes <= st.memory_available for st in dp.stages)
    if with_memory:
        assert 0 < infeasible < 400  # the limits bind sometimes, not always: both paths were exercised


def test_memory_limit_moves_layers_off_a_fast_node():
    """The fast node would take most layers; its memory caps it, the split respects the cap."""
    fast = StageNode("fast", {"embed": 0.0, "block": 1.0, "head": 0.0}, {"embed": 0, "block": 1.0, "head": 0},
                     {"embed": 0, "block": 0.0, "head": 0})
    slow = StageNode("slow", {"embed": 0.0, "block": 4.0, "head": 0.0}, {"embed": 0, "block": 1.0, "head": 0},
                     {"embed": 0, "block": 0.0, "head": 0})
    assert best_split(Problem([fast, slow], 8, 4, [None])).bounds == [0, 7, 8]  # 7 x 1.0 vs 1 x 4.0
    split = best_split(Problem([replace(fast, memory_available=3.0), slow], 8, 4, [None]))
    assert split.bounds == [0, 3, 8]  # at most 3 layers fit on `fast`
    assert split.stages[0].memory_bytes == 3.0 and split.bottleneck_s == 20.0


def test_in_flight_activations_count_against_memory():
    """1F1B: stage 0 of 3 holds 3 microbatches' activations, the last stage 1; GPipe holds all m."""
    node = StageNode("n", {"embed": 0, "block": 1, "head": 0}, {"embed": 0, "block": 10, "head": 0},
                     {"embed": 0, "block": 1, "head": 0}, runtime_bytes=5)
    pr = Problem([node] * 3, 6, 8, [None, None], boundary_bytes=2)
    assert stage_memory(pr, 0, 0, 2) == 5 + 20 + 3 * 2
    assert stage_memory(pr, 2, 4, 6) == 5 + 20 + 1 * (2 + 2)
    gp = Problem([node] * 3, 6, 8, [None, None], boundary_bytes=2, schedule="gpipe")
    assert stage_memory(gp, 2, 4, 6) == 5 + 20 + 8 * (2 + 2)


def test_ties_balanced_then_smallest_boundaries_deterministic():
    same = StageNode("n", {"embed": 0, "block": 1, "head": 0}, {}, {})
    split = best_split(Problem([same] * 3, 7, 4, [None, None]))
    assert split.bounds == [0, 2, 4, 7] and split.bottleneck_s == 3  # not 1,3,3: the second slowest counts too
    assert best_split(Problem([same] * 3, 7, 4, [None, None])).bounds == split.bounds


def test_transfers_are_part_of_the_stage_time():
    n = StageNode("n", {"embed": 0, "block": 1, "head": 0}, {}, {})
    pr = Problem([n, n], 4, 4, [Link(0.5, 10.0)], boundary_bytes=10)
    split = best_split(pr)
    assert [s.comm_s for s in split.stages] == [1.5, 1.5]  # 0.5 s latency + 10 B / 10 B/s, each side sends once
    assert split.bottleneck_s == 2 + 1.5


def test_errors_name_the_node():
    small = StageNode("pi-4", {"embed": 1, "block": 1, "head": 1}, {"embed": 3 * GIB, "block": GIB, "head": GIB},
                      {"embed": 0, "block": 0, "head": 0}, memory_available=3.5 * GIB, runtime_bytes=0.3 * GIB)
    big = StageNode("laptop", small.time_s, small.train_bytes, small.act_bytes, memory_available=64 * GIB)
    with pytest.raises(UserError, match=r"node pi-4 \(stage 0\) cannot hold even one layer with the embeddings: "
                                        r"needs 4\.30 GiB, has 3\.50 GiB"):
        best_split(Problem([small, big], 8, 4, [None]))
    with pytest.raises(UserError, match=r"node pi-4 \(stage 1\) cannot build the model"):
        best_split(Problem([big, small], 8, 4, [None], model_bytes=4 * GIB))
    with pytest.raises(UserError, match="3 layers cannot fill 4 stages"):
        best_split(Problem([big] * 4, 3, 4, [None] * 3))
    roomy = StageNode("pi-5", small.time_s, small.train_bytes, small.act_bytes, memory_available=6 * GIB)
    with pytest.raises(UserError, match=r"no split of 20 layers fits .* pi-5 \d+, pi-5 \d+"):
        best_split(Problem([roomy, roomy], 20, 4, [None]))


def test_uniform_bounds_match_the_trainer():
    """The runner prints the uniform split beside auto's; the trainer runs it: one function
    (contract.partition), earlier stages taking the remainder."""
    from trainer.config.partition import partition_layers

    assert uniform_bounds(28, 3) == [0, 10, 19, 28] and uniform_bounds(12, 3) == [0, 4, 8, 12]
    assert uniform_bounds(7, 3) == [0, 3, 5, 7] and uniform_bounds(5, 1) == [0, 5]

    for layers in range(3, 30):
        for p in range(1, min(layers, 6) + 1):
            ranges = partition_layers("uniform_transformer", layers, p)
            assert uniform_bounds(layers, p) == [r.start for r in ranges] + [layers]


# ------------------------------------------------------------------ the runner's side


def test_job_partition_reads_config_then_args(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("parallel:\n  pp: 3\n  partition: auto\n")
    assert job_partition(Job(config=str(cfg))) == "auto"
    assert job_partition(Job(config=str(cfg), args=["--parallel.partition", "uniform"])) == "uniform"
    assert job_partition(Job(args=["--partition_method=auto"])) == "auto"
    assert job_partition(Job(args=["--train_steps", "5"])) is None


def _doc(name: str, block: float, mem: float = 8 * GIB) -> dict:
    return {"node": name, "time_s": {"embed": 0.001, "block": block, "head": 0.004},
            "train_bytes": {"embed": 1e5, "block": 1e5, "head": 1e5}, "act_bytes": {"embed": 0, "block": 1e6, "head": 1e6},
            "optim_s": {"embed": 0.0, "block": 0.0, "head": 0.0}, "memory_available": mem, "runtime_bytes": 2e8,
            "boundary_bytes": 131072, "model_bytes": 1e6,
            "model": {"pp": 3, "pp_schedule": "1f1b", "virtual_stages": 1, "num_layers": 12, "microbatches": 4}}


def _inv(slots: list[int]) -> Inventory:
    nodes = [Node(f"node-{i}", f"10.0.0.{i + 1}", slots=s, role="master" if i == 0 else "worker")
             for i, s in enumerate(slots)]
    return Inventory("inv.yaml", nodes, Job())


def test_profile_maps_stages_to_nodes_and_slowest_gets_fewest_layers():
    prof = SimpleNamespace(nodes=[_doc("node-0", 0.010), _doc("node-1", 0.030), _doc("node-2", 0.010)],
                           links=[{"latency_s": 1e-4, "bandwidth_Bps": 1e9}] * 2)
    prof.model = prof.nodes[0]["model"]
    split, uniform, problem = plan_from_profile(prof, _inv([1, 1, 1]))
    assert [s.node for s in split.stages] == ["node-0", "node-1", "node-2"]
    counts = [s.num_layers for s in split.stages]
    assert counts[1] < min(counts[0], counts[2]) and counts[1] < 4
    assert split.bottleneck_s < uniform.bottleneck_s and uniform.bounds == [0, 4, 8, 12]
    # Two processes per node, pp=3 over 6 ranks: stage k = ranks 2k, 2k+1 = node-k.
    two = problem_from_profile(prof, _inv([2, 2, 2]))
    assert [s.name for s in two.stages] == ["node-0", "node-1", "node-2"]
    # pp=3 over 2 nodes of 3 slots: stage 1 = ranks 2,3 spans node-0 and node-1, at node-1's pace.
    prof2 = SimpleNamespace(nodes=prof.nodes[:2], links=prof.links[:1], model=prof.model)
    spread = problem_from_profile(prof2, _inv([3, 3]))
    assert [s.name for s in spread.stages] == ["node-0", "node-0+node-1", "node-1"]
    assert spread.stages[1].time_s["block"] == 0.030 and spread.links == [None, None]


def test_auto_refuses_schedules_with_several_stages_per_rank():
    prof = SimpleNamespace(nodes=[_doc("node-0", 0.01)] * 3, links=[None, None])
    prof.model = {**prof.nodes[0]["model"], "pp_schedule": "interleaved1f1b", "virtual_stages": 2}
    with pytest.raises(UserError, match="one stage per pipeline rank"):
        plan_from_profile(prof, _inv([1, 1, 1]))


def test_make_split_reports_what_it_predicts():
    n = StageNode("n", {"embed": 1, "block": 1, "head": 1}, {}, {}, optim_s={"block": 0.5})
    sp = make_split(Problem([n, n], 4, 4, [None]), [0, 2, 4])
    assert sp.spec == "custom:0,2,4"
    assert sp.bottleneck_s == 3 and sp.step_s(4) == 3 + 3 + 3 * 3 + 1.0


# ------------------------------------------------------------------ the trainer's side


def test_trainer_takes_auto_as_parameters_without_a_profile():
    from trainer.config.partition import METHODS, check_partition_syntax, describe_custom, partition_layers

    assert "auto" in METHODS
    check_partition_syntax("auto")
    kw = dict(layer_params=10, embed_params=35, head_params=35)
    assert partition_layers("auto", 12, 3, **kw) == partition_layers("parameters", 12, 3, **kw)
    assert describe_custom("auto", 12, 3).startswith("auto: no profile of the nodes reached this run")
    with pytest.raises(ValueError, match="2 layers cannot fill 3 pipeline stages"):
        partition_layers("auto", 2, 3, **kw)


@pytest.mark.multiproc
def test_plain_torchrun_auto_logs_its_fallback(tmp_path):
    from tests.support.trainer_run import run_trainer

    run_trainer(tmp_path, "--config", "configs/pi-qwen3-3stage-tiny.yaml", "--parallel.partition", "auto",
                "--train_steps", "1", "--profile_batch", "none", nproc=3)
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "parallel.partition auto: no profile of the nodes reached this run" in log
    assert log.count("so the split is `parameters`") == 1
    assert "pipeline 1f1b, partition auto:" in log


def test_full_qwen3_plan_from_the_measured_fixture():
    """Qwen3-0.6B (28 layers) on a Pi 4 + Pi 5 + laptop profile kept as a fixture (measured by
    `python -m bench.partition --measure-full`; stand-ins under Docker limits, see its note)."""
    import json
    from pathlib import Path

    from runner.profile.measure import ClusterProfile

    doc = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "profile-qwen3-0.6b-pi4-pi5-laptop.json").read_text())
    prof = ClusterProfile(doc["nodes"], doc["links"])
    assert [n["node"] for n in prof.nodes] == ["pi4", "pi5", "laptop"] and prof.model["num_layers"] == 28
    split, uniform, problem = plan_from_profile(prof, _inv([1, 1, 1]))
    counts = [s.num_layers for s in split.stages]
    assert sum(counts) == 28 and counts[0] == min(counts) and counts[0] < 28 // 3
    assert split.bottleneck_s < uniform.bottleneck_s
    guide = make_split(problem, [0, 7, 21, 28])  # the Pi guide's hand split
    assert split.bottleneck_s < guide.bottleneck_s
    assert all(s.memory_bytes <= s.memory_available for s in split.stages)
    assert split.bounds == brute_force(problem).bounds
