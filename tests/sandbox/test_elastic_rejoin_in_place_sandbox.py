"""`elastic.in_place` end to end for a node coming back (issue 58): the reduced Pi pipeline (pp 3, one
stage a node) on the namespaced sandbox, `job.elastic` with rejoin on, `--elastic.in_place true`.

node-2's link is cut after step 4: node-0 and node-1 regroup in place as pp 2 (as in
test_elastic_in_place_sandbox.py). Held after step 7, node-2's link comes back: the runner removes its
old container, starts one new container there whose trainer waits to join (no group, no weights), and
writes regroup.json for pp 3 over the three nodes with `at_step` 0 once that trainer says `ready`. Let go, the running ranks see it
through their step-8 preemption vote, finish step 8 and regroup; node-2 receives its stage (parameters
and optimizer state) from them. Steps 9-10 run as pp 3 within the same `runner up`, in the running
ranks' same processes (the pids of their heartbeats), with the losses of a pp 3 run resumed by hand
from the pp 2 run's step-8 checkpoint (1e-5).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.sandbox.test_elastic_in_place_sandbox import in_place_job
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
from tests.support.trainer_run import held, release, run_trainer

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]


def pids(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Each heartbeat file's (pid, step): the processes that ran in this run dir."""
    out = {}
    for f in sorted((run_dir / "heartbeat").glob("rank*.json")):
        doc = json.loads(f.read_text())
        out[f.name] = (doc["pid"], doc["step"])
    return out


def epoch_written(run_dir: Path, epoch: int) -> bool:
    f = run_dir / "regroup.json"
    return f.is_file() and json.loads(f.read_text() or "{}").get("epoch") == epoch


def test_a_node_back_joins_the_running_ranks_in_place_with_the_hand_resumed_losses(netns_sandbox, tmp_path):
    state, inv = netns_sandbox["state"], netns_sandbox["inv"]
    before = existing_runs(inv)
    proc = start(inv, in_place_job(tmp_path, "step:4,step:7", rejoin=True), tmp_path / "logs")
    seen: list[str] = []

    def said(text: str) -> bool:
        seen.append(proc.stderr.readline())
        return text in seen[-1]

    try:
        run_id = wait_for(lambda: first_run_id(inv, before), 300)
        runs = run_dirs(inv, run_id)
        wait_for(lambda: all(held(runs[n], "step-4", [r]) for r, n in enumerate(NODES)), 300)
        time.sleep(1.0)  # the step-4 replicas' exchange has ended
        assert sandbox_cmd(state, "link", "node-2", "down").returncode == 0
        for n in ("node-0", "node-1"):
            release(runs[n], "step-4")
        wait_for(lambda: said(f"run {run_id}: lost node-2: regrouped in place as pp 2"), 300, interval=0)
        wait_for(lambda: held(runs["node-0"], "step-7", [0]) and held(runs["node-1"], "step-7", [1]), 300)
        running = {n: pids(runs[n]) for n in ("node-0", "node-1")}
        t_back = time.time()
        assert sandbox_cmd(state, "link", "node-2", "up").returncode == 0
        wait_for(lambda: all(epoch_written(runs[n], 2) for n in NODES), 180)
        time.sleep(0.5)  # each rank's watcher (100 ms) has read it: step 8's vote carries it
        t_go = time.time()
        for n in ("node-0", "node-1"):
            release(runs[n], "step-7")
        wait_for(lambda: said(f"run {run_id}: node-2 back: joined in place as pp 3"), 180, interval=0)
        _, err = proc.communicate(timeout=300)
        out, err = (tmp_path / "logs" / "up.out").read_text(), "".join(seen) + err
    finally:
        sandbox_cmd(state, "link", "node-2", "up")
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert out.count(f"run {run_id} started") == 1  # one `up`, one launch: no restart
    assert run_containers(inv, run_id) == {n: [] for n in NODES}
    events = [json.loads(x) for x in (tmp_path / "logs" / run_id / "elastic.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["layout", "lost", "layout", "back", "layout"], events
    grown = events[4]
    assert (grown["layout"]["pp"], grown["from_step"], grown["in_place"], grown["epoch"]) == (3, 8, True, 2), grown
    for n in NODES:
        st = json.loads((runs[n] / "regroup-status.local0.json").read_text())
        assert (st["epoch"], st["state"], st["step"]) == (2, "resumed", 8), (n, st)
    # the file was written only once node-2's new trainer said it waits (torch imported): the running
    # ranks train through its start-up (runner/backends/ssh/elastic_loop.py wait_ready)
    ready = json.loads((runs["node-2"] / "regroup-status.local0.json").read_text())["times"]
    assert ready["ready"] < grown["planned"] <= ready["seen"], (ready, grown)
    # no container waited out a DNS resolver for the name of a store connection's address: the sealed
    # sandbox has none in reach, and each such lookup cost 10 s (runner/planning/plan.py hosts_of)
    for n in NODES:
        log = (tmp_path / "logs" / run_id / n / "container.log").read_text()
        assert "hostname of the client socket cannot be retrieved" not in log, (n, log[-2000:])
    # node-0 and node-1: the processes that started the run ran it to its end
    after = {n: pids(runs[n]) for n in ("node-0", "node-1")}
    for n in ("node-0", "node-1"):
        assert {p for p, _ in after[n].values()} == {p for p, _ in running[n].values()}, (n, running, after)
        assert max(s for _, s in after[n].values()) == STEPS
    # node-2 logged pp 3's steps 1-4, then (its new container) pp 3's 9-10; node-1 pp 2's 5-8
    last, mid = metrics(runs["node-2"]), metrics(runs["node-1"])
    assert sorted(last) == [1, 2, 3, 4, 9, 10] and last[9]["layout"]["pp"] == 3, sorted(last)
    assert sorted(mid) == [5, 6, 7, 8] and mid[5]["layout"]["pp"] == 2
    ref = tmp_path / "by-hand"
    ck = ref / "checkpoints" / "step-8"
    ck.mkdir(parents=True)
    for n in ("node-0", "node-1"):
        for f in (runs[n] / "checkpoints" / "step-8").iterdir():
            if f.is_file() and not (ck / f.name).exists():
                shutil.copy2(f, ck / f.name)
    (ref / "checkpoints" / "latest").write_text("step-8\n")
    run_trainer(ref, "--config", CONFIG, *ARGS, "--checkpoint.replicas", "1", "--resume", "latest", "--parallel.pp",
                "3", "--parallel.dp", "1", "--train.batch_size", "16", nproc=3, env={"OMP_NUM_THREADS": "1"})
    want = metrics(ref)
    assert sorted(want) == [9, 10]
    diffs = {s: abs(last[s]["loss"] - want[s]["loss"]) for s in want}
    assert max(diffs.values()) < 1e-5, diffs
    resumed = max(json.loads((runs[n] / "regroup-status.local0.json").read_text())["times"]["resumed"] for n in NODES)
    print(f"rejoin in place on the sandbox: link up -> file {grown['planned'] - t_back:.1f} s, released -> "
          f"resumed {resumed - t_go:.1f} s; pids {running}; losses {[last[s]['loss'] for s in (9, 10)]} vs "
          f"{[want[s]['loss'] for s in (9, 10)]}")
