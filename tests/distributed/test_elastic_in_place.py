"""`elastic.in_place` (issue 58) in the training loop itself: train.run, told only by the regroup file
the runner writes, survives a lost node in its own process, its stages rebuilt from memory, with the
losses of a run resumed by hand from the same step in the new layout.

The runner's part is played by tests/support/regroup_in_place.py (real gloo processes, one "node" each).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from contract.regroup import NewLayout, Regroup
from tests.distributed.test_regroup import ARGS, CONFIG, harness
from trainer.config import Config
from trainer.parallel.stage_relayout import BoundaryCallback, RegroupNow, new_config


def test_in_place_is_off_by_default_and_the_new_config_never_resumes_from_disk():
    cfg = Config()
    assert (cfg.elastic.in_place, cfg.elastic.wait_s, cfg.elastic.replica_every) == (False, 30.0, 1)
    cfg.checkpoint.resume, cfg.parallel.pp, cfg.train.batch_size = "latest", 3, 8
    spec = Regroup(epoch=1, token="t", master_addr="127.0.0.1", master_port=2000, world_size=4,
                   ranks={"a": [0, 1], "b": [2, 3]}, layout=NewLayout(2, 2, 1, 16, "custom:0,3"))
    new = new_config(cfg, spec)
    assert (new.parallel.pp, new.parallel.dp, new.parallel.tp, new.train.batch_size, new.parallel.partition,
            new.checkpoint.resume) == (2, 2, 1, 16, "custom:0,3", None)
    assert (cfg.parallel.pp, cfg.checkpoint.resume) == (3, "latest")  # the old one untouched


def test_a_planned_switch_ends_the_loop_after_its_step_only():
    class W:
        pending = Regroup(epoch=2, token="t", master_addr="h", master_port=2000, world_size=1, ranks={"a": [0]},
                          layout=NewLayout(1, 1, 1, 16, "p"), at_step=5)
        epoch = 0

    class T:
        step, stop_requested = 4, False

    cb = BoundaryCallback(W())  # type: ignore[arg-type]
    cb.on_step_end(T(), None)  # step 4: trains on
    T.step = 5
    with pytest.raises(RegroupNow, match="epoch 2 after step 5"):
        cb.on_step_end(T(), None)


def test_a_failed_step_without_a_regroup_file_within_wait_s_goes_on_as_an_error(tmp_path, monkeypatch):
    from trainer.parallel.stage_relayout import InPlace
    from trainer.runtime.dist_env import DistEnv

    monkeypatch.setenv("NODE_NAME", "node-1")
    cfg = Config()
    cfg.output_dir, cfg.elastic.wait_s = str(tmp_path), 0.2
    ip = InPlace(cfg, DistEnv(1, 2, 0, 1, "127.0.0.1", 29500, "torchrun"))
    built: list = []
    try:
        assert ip.recover(RuntimeError("Connection closed by peer"), object(), lambda c, e: built.append(c)) is None
    finally:
        ip.close()
    assert built == [] and not list(tmp_path.glob("regroup-status*"))  # nothing built, nothing told the runner


@pytest.mark.multiproc
def test_train_run_survives_a_lost_node_in_place_with_the_hand_resumed_losses(tmp_path: Path):
    from tests.support.trainer_run import read_metrics, run_trainer

    ctl = tmp_path / "ctl"
    out = harness(tmp_path, "in_place", str(ctl), "stop", "0", CONFIG, *ARGS)
    assert out["exitcodes"][1:] == [0, 0], out  # the survivors finished the run, in their first processes
    for node in ("node-1", "node-2"):
        st = out["status"][node]
        assert (st["epoch"], st["state"], st["step"]) == (1, "resumed", 4), st  # nothing redone but step 5
        assert st["times"]["left"] >= out["t_write"]  # the step in flight was abandoned on the file's word
    flags = out["flags"]
    # node-2 (the last stage: the loss) ran steps 1-4 as pp 3 and 5-6 as pp 2, in one process
    assert [flags[f"end{s}.node-2"]["pp"] for s in range(1, 7)] == [3, 3, 3, 3, 2, 2]
    got = {m["step"]: m for m in read_metrics(ctl / "node-2")}
    assert sorted(got) == [1, 2, 3, 4, 5, 6] and got[5]["layout"]["pp"] == 2 and got[1]["layout"]["pp"] == 3
    # By hand: the step-4 checkpoint the pp 3 run wrote (every node's part), resumed as pp 2.
    ref = tmp_path / "by-hand"
    ck = ref / "checkpoints" / "step-4"
    ck.mkdir(parents=True)
    for n in range(3):
        for f in (ctl / f"node-{n}" / "checkpoints" / "step-4").iterdir():
            if f.is_file() and not (ck / f.name).exists():
                shutil.copy2(f, ck / f.name)
    (ref / "checkpoints" / "latest").write_text("step-4\n")
    run_trainer(ref, "--config", CONFIG, *ARGS, "--parallel.pp", "2", "--parallel.dp", "1", "--train.batch_size", "16",
                "--resume", "latest", nproc=2, env={"OMP_NUM_THREADS": "1"})
    want = {m["step"]: m for m in read_metrics(ref)}
    assert sorted(want) == [5, 6]
    diffs = {s: abs(got[s]["loss"] - want[s]["loss"]) for s in want}
    assert max(diffs.values()) < 1e-5, diffs  # tests/sandbox/test_elastic_sandbox.py's tolerance
    assert all(abs(got[s]["grad_norm"] - want[s]["grad_norm"]) < 1e-5 for s in want)
    recovery = flags["end5.node-2"]["t"] - out["t_lost"]
    print(f"in place: cut -> first new step logged {recovery:.2f} s")
