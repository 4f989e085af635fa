"""parallel.partition auto end to end on the session sandbox, its nodes made unequal by the new
inventory field `cpus` (Docker --cpus on the job's container): the middle node gets SLOW_CPUS, the
others a whole CPU. The nodes are profiled in the job's image under those limits (`runner profile`,
the same measuring `up` does on a cache miss), `runner up` picks the split from those profiles
(printed, written to partition.json, passed as custom:...), the trainer runs it and records it
in config.yaml, `up --resume` keeps it, and the losses equal the uniform split's (a split changes
speed, not numbers).

The quotas separate the nodes' speeds only while the machine has CPU to spare: on a machine
saturated by other work every process gets less than the slow node's quota and all measure alike.
So the one speed-sensitive step, measuring the nodes (`runner profile`, the module's profile
cache), runs with the other test worker idle (`machine_alone`); the runs that split from those
profiles (a split changes speed, not numbers) run beside it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests import IMAGE, REPO
from tests.support.runner_helpers import node_workdir, runner
from tests.support.trainer_run import HOOKS, HOOKS_SYNC, hold_env, losses, run_trainer
from tests.support.worker_share import machine_alone

# Under a third of the others: their quotas separate the speeds while the machine has spare time.
# Not less: every start on the slow node (its profile, the first launch) imports torch and
# transformers, ~8 s of CPU, so 0.1 CPU spent ~3 minutes of the suite importing.
SLOW_CPUS = 0.3
LAYERS = 12
ARGS = ["--batch_size", "16", "--microbatch_num", "4", "--model.num_hidden_layers", str(LAYERS),
        "--profile_batch", "none", "--train_steps", "4"]
CONFIG = "configs/pi-qwen3-3stage-tiny.yaml"


def unequal_inventory(sandbox: Path, tmp: Path) -> Path:
    """A copy of the session sandbox's inventory with per-node cpus and an auto-partitioned job."""
    doc = yaml.safe_load(Path(sandbox).read_text())
    for node, cpus in zip(doc["nodes"], [1.0, SLOW_CPUS, 1.0], strict=True):
        node["cpus"] = cpus
    doc["job"] = {"image": IMAGE, "config": CONFIG, "master_port": "auto",
                  "args": [*ARGS, "--parallel.partition", "auto", "--train.exit_interval", "2"],
                  # the hooks' PYTHONPATH in every run (hold_env sets the same): the env is part of a
                  # profile's key, so the elastic test's held runs plan from the fixture's profiles
                  "env": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(HOOKS)}, "sync": [HOOKS_SYNC]}
    p = tmp / "unequal.yaml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


@pytest.fixture
def unequal(sandbox, tmp_path) -> Path:
    return unequal_inventory(sandbox, tmp_path)


@pytest.fixture(scope="module")
def profiles(sandbox, pushed, tmp_path_factory) -> dict[str, str]:
    """One profile cache for this module's runs, filled here: the unequal nodes measured by
    `runner profile` in the job's image under their limits, with the other test worker idle (the
    quotas separate the speeds only with CPU to spare). The node-1 layer time it recorded is checked
    by the first test (from the run's partition.json)."""
    env = {"RUNNER_PROFILE_CACHE": str(tmp_path_factory.mktemp("profile-cache"))}
    inv = unequal_inventory(sandbox, tmp_path_factory.mktemp("profile-inventory"))
    with machine_alone():
        proc = runner("profile", "-i", str(inv), "--no-push", env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "measured" in proc.stdout, proc.stdout[-3000:]
    return env


@pytest.mark.sandbox
@pytest.mark.docker
def test_auto_gives_the_slow_node_fewer_layers_and_the_same_losses(unequal, pushed, tmp_path, profiles):
    t0 = time.time()
    env = profiles
    proc = runner("up", "-i", str(unequal), "--logs-dir", str(tmp_path / "logs"), timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # planned from the profiles measured alone (the fixture), not measured again beside other work
    assert "profile: measuring" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    run_id = re.search(r"run (\S+) started", proc.stdout)[1]
    spec = re.search(r"^parallel\.partition auto: (custom:[\d,]+)", proc.stdout, re.M)[1]
    bounds = [int(x) for x in spec[len("custom:"):].split(",")]
    counts = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    assert counts[1] < min(counts[0], counts[2]), (spec, proc.stdout[-3000:])
    assert counts[1] < LAYERS // 3  # fewer than uniform_transformer gives it

    # The profile behind it: measured in the job's image under each node's limit, node-1 slowest.
    runs = {n: node_workdir(unequal, n) / "runs" / run_id for n in ("node-0", "node-1", "node-2")}
    record = json.loads((runs["node-0"] / "partition.json").read_text())
    assert record["spec"] == spec and record["uniform"] == "custom:0,4,8,12"
    nodes = record["profile"]["nodes"]
    assert [n["cgroup_cpus"] for n in nodes] == [1.0, SLOW_CPUS, 1.0]
    layer = [n["time_s"]["block"] for n in nodes]
    assert layer[1] > 1.5 * max(layer[0], layer[2]), layer
    assert record["profile"]["links"][0]["bandwidth_Bps"] > 0

    # `runner profile` answers from the cache `up` planned from: the same numbers, the same split,
    # no probe.
    prof = runner("profile", "-i", str(unequal), "--json", "--no-push", env=env, timeout=300)
    assert prof.returncode == 0, prof.stderr[-2000:]
    doc = json.loads(prof.stdout)
    assert doc["cached"] == {"node-0": True, "node-1": True, "node-2": True} and "profile: measuring" not in prof.stderr
    assert doc["split"]["spec"] == spec and doc["uniform"]["spec"] == "custom:0,4,8,12"
    assert [n["time_s"] for n in doc["nodes"]] == [n["time_s"] for n in nodes]
    table = runner("profile", "-i", str(unequal), "--no-push", env=env, timeout=300)
    assert table.returncode == 0 and f"parallel.partition auto: {spec}" in table.stdout
    assert "node-1" in table.stdout and f"cpus {SLOW_CPUS}" in table.stdout and "cached" in table.stdout

    # The trainer ran that split and recorded it as the run's partition.
    layers = f"layers {bounds[1]}-{bounds[2] - 1}" if counts[1] > 1 else f"layer {bounds[1]}"
    assert f"[node-0/0] stage 1 (pp rank 1): {layers} ({counts[1]} layers" in proc.stdout
    for run in runs.values():
        assert yaml.safe_load((run / "config.yaml").read_text())["parallel"]["partition"] == spec

    # up --resume continues with the recorded split (exit_interval 2 ended the first launch), even
    # with the nodes equal now: no new profile, which would split 12 layers otherwise.
    equal = yaml.safe_load(unequal.read_text())
    for node in equal["nodes"]:
        node.pop("cpus")
    again = tmp_path / "equal.yaml"
    again.write_text(yaml.safe_dump(equal, sort_keys=False))
    res = runner("up", "-i", str(again), "--resume", run_id, "--logs-dir", str(tmp_path / "logs"), timeout=1200,
                 env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"parallel.partition auto: the run's split {spec} (from its partition.json)" in res.stdout
    assert "profile: measuring" not in res.stdout + res.stderr
    assert yaml.safe_load((runs["node-0"] / "config.yaml").read_text())["parallel"]["partition"] == spec
    got = losses(runs["node-2"])
    assert len(got) == 4

    # Losses: the uniform split, three local processes, the same job. Both are pp=3, fp32 on CPU, one
    # thread, no clipping: a split moves layers between ranks, never the arithmetic of a layer, so
    # the losses are equal bit for bit (the resume at step 2 is bitwise too).
    ref_dir = tmp_path / "uniform"
    run_trainer(ref_dir, "--config", CONFIG, *ARGS, "--parallel.partition", "uniform_transformer", nproc=3)
    ref = losses(ref_dir)
    assert len(ref) == 4
    assert got == ref, f"auto {got} vs uniform {ref}"
    print(f"auto split {spec} on cpus 1.0/{SLOW_CPUS}/1.0, layer times {layer}; test took {time.time() - t0:.0f} s")


@pytest.mark.sandbox
@pytest.mark.docker
def test_an_elastic_run_losing_a_fast_node_splits_again_giving_the_slow_node_fewer_layers(unequal, pushed, tmp_path,
                                                                                          profiles):
    """The same unequal nodes (cpus 1.0 / 0.3 / 1.0), `up --elastic`, held after step 2 (its
    checkpoint written): node-2, a fast one, stops answering (its sshd stopped). The runner plans
    the 2-stage pipeline over node-0 and node-1 from the profiles it has (nothing measured again)
    and prints the split: the slow node-1 gets the fewer layers. node-2 answers again: its old
    container is removed, it is taken back (`--elastic` rejoins), the 3-stage split is the first one
    again, from the cache too, and the run ends on all three."""
    import signal

    from tests.support.runner_helpers import run_containers, runner_cmd, signal_sshd, wait_for
    from tests.support.trainer_run import held, release

    doc = yaml.safe_load(unequal.read_text())
    doc["job"]["args"] = [a for a in doc["job"]["args"] if a not in ("--train.exit_interval", "2")] + \
        ["--checkpoint.interval", "2"]
    # step 2: the 3-node layout, before node-2 goes; step 3: the 2-node layout has trained (its
    # stage lines are out) and cannot end the run before node-2 is back.
    doc["job"]["env"].update(hold_env("step:2", "step:3"))
    inv = tmp_path / "elastic.yaml"
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    runs_dir = node_workdir(inv, "node-0") / "runs"
    before = {p.name for p in runs_dir.iterdir()} if runs_dir.is_dir() else set()
    out_file = tmp_path / "up.out"  # a file, not a pipe nobody reads while the run goes on
    with out_file.open("w") as out_fh:
        proc = subprocess.Popen(runner_cmd("up", "-i", str(inv), "--elastic", "--logs-dir", str(tmp_path / "logs")),
                                stdout=out_fh, stderr=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, **profiles})
    seen: list[str] = []

    def said(text: str) -> bool:
        seen.append(proc.stderr.readline())
        return text in seen[-1]

    try:
        run_id = wait_for(lambda: next(iter({p.name for p in runs_dir.iterdir()} - before), None)
                          if runs_dir.is_dir() else None, 600)
        runs = {n: node_workdir(inv, n) / "runs" / run_id for n in ("node-0", "node-1", "node-2")}
        wait_for(lambda: all(held(runs[n], "step-2", [r]) for r, n in enumerate(runs)), 600)
        signal_sshd(inv, "node-2", signal.SIGSTOP)
        wait_for(lambda: said(f"run {run_id}: lost node-2: going on with pp 2 x dp 1 x tp 1"), 300, interval=0)
        two = {"node-0": 0, "node-1": 1}  # the 2-node layout's ranks
        wait_for(lambda: all(held(runs[n], "step-3", [r]) for n, r in two.items()), 600)
        signal_sshd(inv, "node-2", signal.SIGCONT)
        wait_for(lambda: said("runner: node node-2 is reachable again: stopped and removed its container"), 300,
                 interval=0)
        # The runner stops the 2-node layout to take node-2 back: once its held ranks have the signal
        # they go on, end after step 4 with the preempt checkpoint, and the 3 nodes resume from it.
        wait_for(lambda: all(held(runs[n], "step-3", [r], "signalled") for n, r in two.items()), 300)
        for n in two:
            release(runs[n], "step-3")
        _, err = proc.communicate(timeout=600)
    finally:
        signal_sshd(inv, "node-2", signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    err, out = "".join(seen) + err, out_file.read_text()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    # Nothing is measured again: every split (the start, after the loss, after the rejoin) comes
    # from the profiles the module measured alone.
    assert "profile: measuring" not in out + err, err[-3000:]
    splits = re.findall(r"^parallel\.partition auto: (custom:[\d,]+)", out, re.M)
    assert len(splits) == 3 and splits[2] == splits[0], (splits, out[-3000:])  # 3 nodes, 2, 3 again
    assert f"run {run_id}: node-2 back: going on with pp 3 x dp 1 x tp 1 on 3 node(s)" in err, err[-3000:]
    bounds = [int(x) for x in splits[1][len("custom:"):].split(",")]
    assert len(bounds) == 3 and bounds[-1] == LAYERS
    counts = [bounds[1] - bounds[0], bounds[2] - bounds[1]]
    assert counts[1] < counts[0], (splits, out[-3000:])  # node-1 at 0.3 CPU: the fewer layers
    layers = f"layers {bounds[1]}-{LAYERS - 1}" if counts[1] > 1 else f"layer {bounds[1]}"
    assert f"[node-0/0] stage 1 (pp rank 1): {layers} + norm + head ({counts[1]} layers" in out, out[-3000:]
    assert f"run {run_id} started on node-0, node-1\n" in out
    # The rejoin stopped the 2-node layout with its grace: its ranks wrote the preempt checkpoint
    # after step 4, and the 3 nodes went on from it.
    assert "[node-0/0] [rank0] resumed from /out/checkpoints/step-4.preempt at step 4" in out, out[-3000:]
    assert f"run {run_id} finished: all 3 node(s) exited 0" in out
    record = json.loads((runs["node-0"] / "partition.json").read_text())  # the last layout's
    assert record["spec"] == splits[2] and [s["node"] for s in record["stages"]] == ["node-0", "node-1", "node-2"]
    assert yaml.safe_load((runs["node-1"] / "config.yaml").read_text())["parallel"]["partition"] == splits[2]
    assert run_containers(inv, run_id) == {"node-0": [], "node-1": [], "node-2": []}
