"""Elastic runs on real links (issue 27): the reduced Pi pipeline (pp 3, one stage a node) on the
namespaced sandbox, `job.elastic` on.

A run held after step 4 (its checkpoint written, each node's files copied to the next node:
`--checkpoint.replicas 1`, which the runner adds) has node-2's link cut: the runner names it, stops
the others, and goes on by itself over node-0 and node-1 as pp 2 from step 4. Held again after
step 6, node-2's link comes back: the runner removes node-2's old container, stops the 2-node run
with its grace period (the trainer writes a preempt checkpoint after step 7) and resumes over all
three as pp 3 from step 7 to the end. Every loss equals the same sequence of layouts resumed by
hand on this machine (1e-5: another reduction order), the events name each layout, and `runner
status` prints them.

The master killed outright (container and sshd) is dropped the same way, the next node becoming
the master; one more loss, under min_nodes 2, stops the run in one line with nothing left running
and the last checkpoint whole.
The time from a cut to the first new step is bench/elastic.py's figure, not asserted here.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from tests import IMAGE, REPO
from tests.support.netns_sandbox import sandbox_cmd
from tests.support.runner_helpers import (
    node_docker,
    node_workdir,
    run_containers,
    runner,
    runner_cmd,
    signal_sshd,
    wait_for,
)
from tests.support.trainer_run import HOOKS_SYNC, held, hold_env, release, run_trainer

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]
NODES = ("node-0", "node-1", "node-2")
CONFIG = "configs/pi-qwen3-3stage-tiny.yaml"
STEPS = 10
# keep_last 0: every checkpoint stays, so the resume by hand starts from the run's own step 4
ARGS = ["--parallel.partition", "uniform_transformer", "--train.steps", str(STEPS), "--checkpoint.interval", "2",
        "--checkpoint.keep_last", "0", "--profile_batch", "none"]


def elastic_job(tmp_path: Path, hold: str, min_nodes: int = 2, rejoin: bool = True) -> Path:
    p = tmp_path / "elastic-job.yaml"
    p.write_text(yaml.safe_dump({"job": {
        "image": IMAGE, "config": str(REPO / CONFIG), "args": ARGS, "master_port": "auto", "grace_period": 60,
        "env": {"OMP_NUM_THREADS": "1", **hold_env(hold)}, "sync": [HOOKS_SYNC],
        "elastic": {"min_nodes": min_nodes, "rejoin": rejoin}}}))
    return p


def start(inv: Path, job: Path, logs: Path) -> subprocess.Popen:
    """`runner up` of the job, its stdout into logs/up.out (read with `output`; a pipe nobody reads
    while the run goes on would fill and stop it), its stderr a pipe the test reads line by line."""
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / "up.out").open("w") as out:
        return subprocess.Popen(runner_cmd("up", "-i", str(inv), "--job", str(job), "--logs-dir", str(logs),
                                           "--reclaim-timeout", "120"),
                                stdout=out, stderr=subprocess.PIPE, text=True, cwd=REPO)


def run_dirs(inv: Path, run_id: str) -> dict[str, Path]:
    return {n: node_workdir(inv, n) / "runs" / run_id for n in NODES}


def first_run_id(inv: Path, since: set[str]) -> str:
    """The run this test started: the one run dir on node-0 that was not there before."""
    new = set(p.name for p in (node_workdir(inv, "node-0") / "runs").iterdir()) - since if \
        (node_workdir(inv, "node-0") / "runs").is_dir() else set()
    return next(iter(new)) if len(new) == 1 else ""


def existing_runs(inv: Path) -> set[str]:
    d = node_workdir(inv, "node-0") / "runs"
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


def metrics(run_dir: Path) -> dict[int, dict]:
    f = run_dir / "metrics.jsonl"
    recs = [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.is_file() else []
    return {r["step"]: r for r in recs}


def test_a_cut_node_is_dropped_then_taken_back_and_the_losses_equal_a_resume_by_hand(netns_sandbox, tmp_path):
    state, inv = netns_sandbox["state"], netns_sandbox["inv"]
    before = existing_runs(inv)
    proc = start(inv, elastic_job(tmp_path, "step:4,step:6"), tmp_path / "logs")
    try:
        run_id = wait_for(lambda: first_run_id(inv, before), 300)
        runs = run_dirs(inv, run_id)
        wait_for(lambda: held(runs["node-0"], "step-4", [0]) and held(runs["node-2"], "step-4", [2]), 300)
        cut = sandbox_cmd(state, "link", "node-2", "down")
        assert cut.returncode == 0, cut.stderr
        # The 2-node layout runs steps 5 and 6 and holds: node-2 is still cut off, so this is node-0
        # and node-1 alone (pp 2: ranks 0 and 1).
        wait_for(lambda: held(runs["node-0"], "step-6", [0]) and held(runs["node-1"], "step-6", [1]), 300)
        assert not (runs["node-2"] / ".hold" / "step-6.held.rank2").exists()
        back = sandbox_cmd(state, "link", "node-2", "up")
        assert back.returncode == 0, back.stderr
        # node-2 answers: the runner stops the 2-node layout (SIGTERM, the trainer's preempt vote)
        wait_for(lambda: held(runs["node-0"], "step-6", [0], "signalled") and
                 held(runs["node-1"], "step-6", [1], "signalled"), 300)
        for n in ("node-0", "node-1"):
            release(runs[n], "step-6")
        _, err = proc.communicate(timeout=600)
        out = (tmp_path / "logs" / "up.out").read_text()
    finally:
        sandbox_cmd(state, "link", "node-2", "up")
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "runner: run " + run_id + ": lost node-2: going on with pp 2 x dp 1 x tp 1 on 2 node(s) (node-0, node-1) " \
        "(was pp 3 x dp 1 x tp 1)" in err, err[-3000:]
    assert "runner: node node-2 is reachable again: stopped and removed its container" in err, err[-3000:]
    assert f"runner: run {run_id}: node-2 back: going on with pp 3 x dp 1 x tp 1 on 3 node(s)" in err, err[-3000:]
    assert f"run {run_id} finished: all 3 node(s) exited 0" in out
    assert run_containers(inv, run_id) == {n: [] for n in NODES}

    # The history: three layouts, from step 4 and from step 7, on every node of the last one.
    events = [json.loads(x) for x in (runs["node-0"] / "elastic.jsonl").read_text().splitlines()]
    layouts = [(e["layout"]["nodes"], e["layout"]["pp"], e["from_step"], e["why"]) for e in events if e["event"] == "layout"]
    assert layouts == [(list(NODES), 3, None, "start"), (["node-0", "node-1"], 2, 4, "lost node-2"),
                       (list(NODES), 3, 7, "node-2 back")], events
    assert [e["event"] for e in events] == ["layout", "lost", "layout", "back", "layout"], events
    assert (runs["node-2"] / "elastic.jsonl").read_text() == (runs["node-0"] / "elastic.jsonl").read_text()
    assert (tmp_path / "logs" / run_id / "elastic.jsonl").read_text() == (runs["node-0"] / "elastic.jsonl").read_text()
    status = runner("status", run_id, "-i", str(inv), timeout=120)
    assert status.returncode == 0, status.stderr
    hist = status.stdout[status.stdout.index("layout history (elastic):"):].splitlines()[1:6]
    assert [re.sub(r"^\s*\S+\s+", "", ln) for ln in hist] == [
        "layout pp 3 x dp 1 x tp 1 on node-0, node-1, node-2, split uniform_transformer",
        f"lost node-2: {events[1]['why']}",
        "layout pp 2 x dp 1 x tp 1 on node-0, node-1 from step 4, split uniform_transformer",
        "node-2 reachable again",
        "layout pp 3 x dp 1 x tp 1 on node-0, node-1, node-2 from step 7 (0 step(s) redone), split "
        "uniform_transformer"], status.stdout
    assert events[1]["why"].startswith("node unreachable"), events[1]

    # The losses: node-2 logs pp 3 (steps 1-4, 8-10), node-1 pp 2 (steps 5-7); each start's first
    # record names its layout.
    last, mid = metrics(runs["node-2"]), metrics(runs["node-1"])
    got = {**{s: last[s] for s in (1, 2, 3, 4, 8, 9, 10)}, **{s: mid[s] for s in (5, 6, 7)}}
    assert (got[1]["layout"]["pp"], got[5]["layout"]["pp"], got[8]["layout"]["pp"]) == (3, 2, 3)
    assert "layout" not in got[2] and "layout" not in got[6]
    # By hand, from the same step-4 checkpoint (the nodes' copies together): resumed as pp 2 to
    # step 7, then as pp 3 to the end, on this machine.
    ref = tmp_path / "by-hand"
    ck = ref / "checkpoints" / "step-4"
    ck.mkdir(parents=True)
    assert all((runs[n] / "checkpoints" / "step-4" / ".metadata").is_file() for n in NODES)
    for n in NODES:
        for f in (runs[n] / "checkpoints" / "step-4").iterdir():
            if f.is_file() and not (ck / f.name).exists():
                shutil.copy2(f, ck / f.name)
    (ref / "checkpoints" / "latest").write_text("step-4\n")
    base = ["--config", CONFIG, *ARGS, "--checkpoint.replicas", "1", "--resume", "latest"]
    run_trainer(ref, *base, "--parallel.pp", "2", "--parallel.dp", "1", "--train.batch_size", "16",
                "--train.exit_interval", "7", nproc=2, env={"OMP_NUM_THREADS": "1"})
    run_trainer(ref, *base, nproc=3, env={"OMP_NUM_THREADS": "1"})
    want = metrics(ref)
    assert sorted(want) == list(range(5, STEPS + 1))
    diffs = {s: abs(got[s]["loss"] - want[s]["loss"]) for s in want}
    assert max(diffs.values()) < 1e-5, diffs


def test_the_master_killed_outright_is_dropped_then_one_more_loss_stops_below_min_nodes(netns_sandbox, tmp_path):
    """node-0, the master, killed outright (its container and its sshd: a host gone, not a link):
    the others' ranks fail at once on a reset connection, the runner finds node-0 not answering and
    goes on over node-1 (the master now) and node-2 as pp 2 from step 4, as for a cut link. node-0
    restarted meanwhile only has its dead container removed (rejoin off). Then node-2's link is cut:
    one node would be left, under min_nodes 2, so the run stops with one line; node-2's container
    is removed once its link is back (nothing orphaned), and the step-6 checkpoint node-1 and node-2
    hold together is kept."""
    state, inv = netns_sandbox["state"], netns_sandbox["inv"]
    restored = tmp_path / "restored.yaml"
    before = existing_runs(inv)
    proc = start(inv, elastic_job(tmp_path, "step:4,step:6", rejoin=False), tmp_path / "logs")
    seen: list[str] = []

    def said(text: str) -> bool:
        seen.append(proc.stderr.readline())
        return text in seen[-1]

    try:
        run_id = wait_for(lambda: first_run_id(inv, before), 300)
        runs = run_dirs(inv, run_id)
        wait_for(lambda: all(held(runs[n], "step-4", [r]) for r, n in enumerate(NODES)), 300)
        assert node_docker(inv, "node-0", "kill", f"runner-{run_id}-node-0").returncode == 0
        assert signal_sshd(inv, "node-0", signal.SIGKILL) >= 1
        for n in ("node-1", "node-2"):  # the ranks go on, into the dead stage
            release(runs[n], "step-4")
        wait_for(lambda: said(f"run {run_id}: lost node-0: going on with pp 2 x dp 1 x tp 1 on 2 node(s)"), 300,
                 interval=0)
        # node-1 is pipeline rank 0 now, node-2 rank 1
        wait_for(lambda: held(runs["node-1"], "step-6", [0]) and held(runs["node-2"], "step-6", [1]), 300)
        up = sandbox_cmd(state, "up", "--nodes", "3", "--netns", "--inventory", str(restored))
        assert up.returncode == 0, up.stderr
        wait_for(lambda: said("runner: node node-0 is reachable again: stopped and removed its container"), 120,
                 interval=0)
        assert sandbox_cmd(state, "link", "node-2", "down").returncode == 0
        wait_for(lambda: said("trying for 120s to reach it"), 300, interval=0)
        assert sandbox_cmd(state, "link", "node-2", "up").returncode == 0
        _, err = proc.communicate(timeout=300)
        out, err = (tmp_path / "logs" / "up.out").read_text(), "".join(seen) + err
    finally:
        sandbox_cmd(state, "link", "node-2", "up")
        sandbox_cmd(state, "up", "--nodes", "3", "--netns", "--inventory", str(restored))
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 4, err[-3000:]
    assert f"run {run_id} started on node-1, node-2\n" in out, out[-3000:]  # the 2-node layout, node-1 first
    errors = [ln for ln in err.splitlines() if ln.startswith("runner: error: ")]
    assert errors[-1] == (f"runner: error: run {run_id}: lost node-2: 1 node(s) left (node-1), fewer than "
                          f"job.elastic.min_nodes 2; the last checkpoint stays in the run dirs (`runner up --resume "
                          f"{run_id}` once the nodes are back)"), errors
    assert "runner: node node-2 is reachable again: stopped and removed its container" in err, err[-3000:]
    assert run_containers(inv, run_id) == {n: [] for n in NODES}
    events = [json.loads(x) for x in (tmp_path / "logs" / run_id / "elastic.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["layout", "lost", "layout", "back", "lost", "stop"], events
    assert [(e["layout"]["nodes"], e["from_step"]) for e in events if e["event"] == "layout"] == [
        (list(NODES), None), (["node-1", "node-2"], 4)]
    last = metrics(runs["node-2"])  # the last stage logs: pp 3's steps 1-4, then pp 2's 5 and 6
    assert sorted(last) == [1, 2, 3, 4, 5, 6] and (last[1]["layout"]["pp"], last[5]["layout"]["pp"]) == (3, 2)
    for n in ("node-1", "node-2"):  # step 6, written before the hold; the replicas make it whole
        ck = runs[n] / "checkpoints"
        assert (ck / "latest").read_text().strip() == "step-6", n
        assert {p.name for p in (ck / "step-6").glob("rank*.pt")} == {"rank0.pt", "rank1.pt"}, n
