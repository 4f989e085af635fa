"""`elastic.in_place` (issue 58) for a node coming back: a pp 2 job grows to pp 3 at a step boundary in
its own processes, the newcomer (started with no group and no weights) receiving its stage from the
running ranks, with the losses of a run resumed by hand as pp 3 from the same step.

The runner's part is played by tests/support/regroup_rejoin.py (real gloo processes, one "node" each).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.distributed.test_regroup import ARGS, CONFIG, harness
from trainer.parallel.stage_relayout import BoundaryCallback, RegroupNow


class _Watcher:
    def __init__(self, spec, epoch: int = 0):
        self.pending, self.epoch = spec, epoch


class _Trainer:
    step, total_steps, stop_requested, env, callbacks = 3, 10, False, None, []


class _Vote:
    def __init__(self) -> None:
        self.riders: list = []
        self.rode: list[int] = []


def test_a_planned_switch_rides_the_preemption_vote_and_waits_for_whole_replicas():
    from contract.regroup import NewLayout, Regroup

    spec = Regroup(epoch=2, token="t", master_addr="h", master_port=2000, world_size=1, ranks={"a": [0]},
                   layout=NewLayout(1, 1, 1, 16, "p"), at_step=0)
    vote, t = _Vote(), _Trainer()
    t.callbacks = [type("Ck", (), {"preemption": vote})()]
    cb = BoundaryCallback(_Watcher(spec, epoch=1), every=2)  # type: ignore[arg-type]
    cb.bind(t)
    assert [r() for r in vote.riders] == [2]  # this rank's word: epoch 2 is due
    vote.rode = [0]  # ... but the vote says no rank has it yet (a rank acting alone would hang the others)
    cb.on_step_end(t, None)
    vote.rode = [2]
    cb.on_step_end(t, None)  # step 3: replicas are refreshed every 2 steps, not whole here
    t.step = 4
    with pytest.raises(RegroupNow, match="epoch 2 after step 4"):
        cb.on_step_end(t, None)
    t.stop_requested = True  # a preemption agreed in the same vote goes first
    cb.on_step_end(t, None)


@pytest.mark.multiproc
def test_a_node_coming_back_joins_in_place_and_the_losses_equal_a_hand_resumed_pp3_run(tmp_path: Path):
    from tests.support.trainer_run import read_metrics, run_trainer

    ctl = tmp_path / "ctl"
    out = harness(tmp_path, "rejoin", str(ctl), "x", CONFIG, *ARGS)
    assert out["exitcodes"] == [0, 0, 0], out
    for node in ("node-0", "node-1", "node-2"):
        st = out["status"][node]
        assert (st["epoch"], st["state"], st["step"]) == (1, "resumed", 4), st  # no step abandoned, none redone
    # the newcomer said `ready` (what the runner waits for before it writes the file) before it read it
    assert out["status"]["node-2"]["times"]["ready"] <= out["status"]["node-2"]["times"]["seen"]
    assert "ready" not in out["status"]["node-0"]["times"]  # a running rank has no start-up to announce
    flags = out["flags"]
    # the running ranks: steps 1-4 as pp 2, 5-6 as pp 3, in the processes they started in
    for r, node in enumerate(("node-0", "node-1")):
        assert [flags[f"end{s}.{node}"]["pp"] for s in range(1, 7)] == [2, 2, 2, 2, 3, 3]
        assert {flags[f"end{s}.{node}"]["pid"] for s in range(1, 7)} == {out["pids"][node]}
        assert flags[f"end6.{node}"]["rank"] == r
    # the newcomer: only steps 5-6, as the pp 3 run's last stage
    assert [s for s in range(1, 7) if f"end{s}.node-2" in flags] == [5, 6]
    assert flags["end5.node-2"]["rank"] == 2 and flags["end5.node-2"]["pid"] == out["pids"]["node-2"]
    got = {m["step"]: m for m in read_metrics(ctl / "node-1")}  # the pp 2 run's last stage logged 1-4
    got.update({m["step"]: m for m in read_metrics(ctl / "node-2")})  # the pp 3 run's, 5-6
    assert sorted(got) == [1, 2, 3, 4, 5, 6] and got[5]["layout"]["pp"] == 3 and got[1]["layout"]["pp"] == 2
    # By hand: the step-4 checkpoint the pp 2 run wrote (both nodes' parts), resumed as pp 3.
    ref = tmp_path / "by-hand"
    ck = ref / "checkpoints" / "step-4"
    ck.mkdir(parents=True)
    for n in range(2):
        for f in (ctl / f"node-{n}" / "checkpoints" / "step-4").iterdir():
            if f.is_file() and not (ck / f.name).exists():
                shutil.copy2(f, ck / f.name)
    (ref / "checkpoints" / "latest").write_text("step-4\n")
    run_trainer(ref, "--config", CONFIG, *ARGS, "--parallel.pp", "3", "--parallel.dp", "1", "--train.batch_size", "16",
                "--resume", "latest", nproc=3, env={"OMP_NUM_THREADS": "1"})
    want = {m["step"]: m for m in read_metrics(ref)}
    assert sorted(want) == [5, 6]
    diffs = {s: abs(got[s]["loss"] - want[s]["loss"]) for s in want}
    assert max(diffs.values()) < 1e-5, diffs  # tests/distributed/test_elastic_in_place.py's tolerance
    assert all(abs(got[s]["grad_norm"] - want[s]["grad_norm"]) < 1e-5 for s in want)
    print(f"rejoin in place: file written -> newcomer's first step {flags['end5.node-2']['t'] - out['t_write']:.2f} s; "
          f"losses {[round(got[s]['loss'], 6) for s in (5, 6)]} vs {[round(want[s]['loss'], 6) for s in (5, 6)]}")


def test_the_trainer_cli_lets_a_joining_process_start_before_it_knows_its_layout(monkeypatch):
    """A node coming back runs one process (world 1) with the job's args (pp 2 or 3): its layout comes
    with regroup.json, so the CLI's world-size check must not refuse it (seen on the sandbox)."""
    from trainer import cli, train
    from trainer.config import ConfigError

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ELASTIC_JOIN_EPOCH"):
        monkeypatch.delenv(k, raising=False)
    ran: list = []
    monkeypatch.setattr(train, "run", lambda cfg, env: ran.append((cfg.parallel.pp, env.world_size)) or 0)
    argv = ["--config", CONFIG, *ARGS, "--parallel.pp", "2", "--elastic.in_place", "true"]
    with pytest.raises(ConfigError):
        cli.train_main(argv)  # not joining: pp 2 on one process is refused, as ever
    monkeypatch.setenv("ELASTIC_JOIN_EPOCH", "2")
    assert cli.train_main(argv) == 0 and ran == [(2, 1)]
