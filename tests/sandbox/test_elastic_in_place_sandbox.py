"""`elastic.in_place` end to end on real links (issue 58): the reduced Pi pipeline (pp 3, one stage a
node) on the namespaced sandbox, `job.elastic` on and `--elastic.in_place true` in the job's args.

Held after step 4 (its checkpoint written, each rank's stage replica exchanged), node-2's link is
cut and the others let go into step 5, where they wait on node-2. The runner names node-2 lost,
writes regroup.json into node-0's and node-1's run dirs and waits for their ranks' `resumed`: the
survivors regroup as pp 2 in their own processes (no container stopped or started), their stages
from memory, and train on from step 4. Held again after step 8, node-2's link comes back and its old
container is removed (rejoin off); the run ends with exit 0. Steps 5-10 equal a pp 2 run resumed by
hand from the step-4 checkpoint (1e-5, as tests/sandbox/test_elastic_sandbox.py), the events name the
in-place layout, and nothing of the run is left on any node.

The time from the cut to the new layout training is bench/elastic.py's figure, printed, not asserted.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import yaml

from tests import IMAGE, REPO
from tests.sandbox.test_elastic_sandbox import (
    ARGS,
    CONFIG,
    NODES,
    STEPS,
    existing_runs,
    first_run_id,
    metrics,
    run_dirs,
    start,
)
from tests.support.netns_sandbox import sandbox_cmd
from tests.support.runner_helpers import run_containers, wait_for
from tests.support.trainer_run import HOOKS_SYNC, held, hold_env, release, run_trainer

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]


def in_place_job(tmp_path: Path, hold: str, rejoin: bool = False) -> Path:
    """The reduced Pi pipeline's elastic job with --elastic.in_place true, held at `hold`; `rejoin`:
    a node coming back is taken back (in place)."""
    p = tmp_path / "in-place-job.yaml"
    p.write_text(yaml.safe_dump({"job": {
        "image": IMAGE, "config": str(REPO / CONFIG), "args": [*ARGS, "--elastic.in_place", "true"],
        "master_port": "auto", "grace_period": 60, "env": {"OMP_NUM_THREADS": "1", **hold_env(hold)},
        "sync": [HOOKS_SYNC], "elastic": {"min_nodes": 2, "rejoin": rejoin}}}))
    return p


def test_a_cut_node_s_survivors_regroup_in_place_with_the_hand_resumed_losses(netns_sandbox, tmp_path):
    state, inv = netns_sandbox["state"], netns_sandbox["inv"]
    before = existing_runs(inv)
    proc = start(inv, in_place_job(tmp_path, "step:4,step:8"), tmp_path / "logs")
    seen: list[str] = []

    def said(text: str) -> bool:
        seen.append(proc.stderr.readline())
        return text in seen[-1]

    try:
        run_id = wait_for(lambda: first_run_id(inv, before), 300)
        runs = run_dirs(inv, run_id)
        wait_for(lambda: all(held(runs[n], "step-4", [r]) for r, n in enumerate(NODES)), 300)
        time.sleep(1.0)  # the step-4 replicas' exchange (milliseconds, on its own thread) has ended
        assert sandbox_cmd(state, "link", "node-2", "down").returncode == 0
        t_cut = time.time()
        for n in ("node-0", "node-1"):  # into step 5, where they wait on node-2
            release(runs[n], "step-4")
        wait_for(lambda: said(f"run {run_id}: lost node-2: regrouped in place as pp 2 x dp 1 x tp 1 on 2 node(s)"),
                 300, interval=0)
        # node-0 is pipeline rank 0, node-1 rank 1 now: held after step 8, in the same processes
        wait_for(lambda: held(runs["node-0"], "step-8", [0]) and held(runs["node-1"], "step-8", [1]), 300)
        assert sandbox_cmd(state, "link", "node-2", "up").returncode == 0
        wait_for(lambda: said("runner: node node-2 is reachable again: stopped and removed its container"), 120,
                 interval=0)
        for n in ("node-0", "node-1"):
            release(runs[n], "step-8")
        _, err = proc.communicate(timeout=300)
        out, err = (tmp_path / "logs" / "up.out").read_text(), "".join(seen) + err
    finally:
        sandbox_cmd(state, "link", "node-2", "up")
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert f"run {run_id} started on node-0, node-1, node-2\n" in out and out.count(f"run {run_id} started") == 1
    assert run_containers(inv, run_id) == {n: [] for n in NODES}
    events = [json.loads(x) for x in (tmp_path / "logs" / run_id / "elastic.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events][:3] == ["layout", "lost", "layout"], events  # "back": noted with the next change
    moved = events[2]
    assert (moved["layout"]["nodes"], moved["layout"]["pp"], moved["from_step"], moved["in_place"]) == \
        (["node-0", "node-1"], 2, 4, True), moved
    for n in ("node-0", "node-1"):
        st = json.loads((runs[n] / "regroup-status.local0.json").read_text())
        assert (st["epoch"], st["state"], st["step"]) == (1, "resumed", 4), st
    # The losses: node-2 logged pp 3's steps 1-4, node-1 (the last stage now) pp 2's 5-10.
    last, mid = metrics(runs["node-2"]), metrics(runs["node-1"])
    assert sorted(last) == [1, 2, 3, 4] and sorted(mid) == list(range(5, STEPS + 1)) and mid[5]["layout"]["pp"] == 2
    ref = tmp_path / "by-hand"
    ck = ref / "checkpoints" / "step-4"
    ck.mkdir(parents=True)
    for n in NODES:
        for f in (runs[n] / "checkpoints" / "step-4").iterdir():
            if f.is_file() and not (ck / f.name).exists():
                shutil.copy2(f, ck / f.name)
    (ref / "checkpoints" / "latest").write_text("step-4\n")
    run_trainer(ref, "--config", CONFIG, *ARGS, "--checkpoint.replicas", "1", "--resume", "latest", "--parallel.pp",
                "2", "--parallel.dp", "1", "--train.batch_size", "16", nproc=2, env={"OMP_NUM_THREADS": "1"})
    want = metrics(ref)
    assert sorted(want) == list(range(5, STEPS + 1))
    diffs = {s: abs(mid[s]["loss"] - want[s]["loss"]) for s in want}
    assert max(diffs.values()) < 1e-5, diffs
    resumed = max(json.loads((runs[n] / "regroup-status.local0.json").read_text())["times"]["resumed"]
                  for n in ("node-0", "node-1"))
    print(f"in place on the sandbox: cut -> lost {events[1]['detected'] - t_cut:.1f} s, -> file "
          f"{moved['planned'] - t_cut:.1f} s, -> resumed {resumed - t_cut:.1f} s")
