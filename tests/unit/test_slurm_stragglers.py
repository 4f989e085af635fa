"""The straggler warning of an attached `runner up --scheduler slurm` (issue 57), without a cluster:
heartbeat files as the trainer writes them, in a tmp run dir, read by the Slurm watch
(runner/backends/slurm/hang.py) from this machine; it prints the SSH watch's one line
(runner/backends/stragglers.py), once per run, a requeue included. On the Slurm cluster:
tests/slurm/test_stragglers_slurm.py."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from runner.backends import beat_reader
from runner.backends.slurm import hang
from runner.backends.slurm.jobs import JobState
from runner.backends.slurm.plan import SlurmFacts, make_slurm_plan
from runner.backends.slurm.shell import LocalShell
from runner.backends.stragglers import StragglerLines
from runner.inventory.slurm import load_slurm_inventory
from tests.unit.test_hang_budget import _beat
from tests.unit.test_slurm_hang_watch import _write
from tests.unit.test_slurm_plan import write_inv

# The reduced Pi pipeline's stages (tests/unit/test_stage_work.py): FLOPs per token each.
WORK = [1256256, 837504, 1034496]


@pytest.fixture
def watch(tmp_path):
    inv = load_slurm_inventory(str(write_inv(tmp_path, {"workdir": str(tmp_path / "wd")}, {})))
    plan = make_slurm_plan(inv, "r1", SlurmFacts(home="/home/u"))
    Path(plan.run_dir).mkdir(parents=True)
    clock = [100.0]
    out = io.StringIO()
    w = hang.SlurmHangWatch(LocalShell(), inv, plan, "7", clock=lambda: clock[0], out=out)
    return w, Path(plan.run_dir), clock, out


def _step(w, rd: Path, clock: list[float], step: int, slow: bool = True) -> None:
    """One poll's round: every rank ended `step`, rank 2 computing 2.2x as long per FLOP when slow."""
    for r in range(3):
        busy = WORK[r] * 1e-7 * (2.2 if r == 2 and slow else 1.0)
        _write(rd, r, _beat(r, f"node-{r}", 3, step, step=step, phase="forward", alive_at=1000.0 + step,
                            step_s=0.6, wait_s=round(0.6 - busy, 6), work=WORK[r]))
    w.tick(JobState("7", "RUNNING", None))
    clock[0] += beat_reader.POLL_S


LINE = ("runner: warning: straggler: rank 2 (node-2) computes 2.2x slower than the other ranks' median per FLOP it "
        "computes (0.228 s busy of its 0.600 s step) for 5 steps in a row: it holds the others back")


def test_the_slurm_watch_prints_the_straggler_line_once(watch, monkeypatch):
    w, rd, clock, out = watch
    monkeypatch.setattr(w, "stop", lambda v: pytest.fail(f"no hang here: {v.line}"))
    for step in range(1, 6):  # the first round only marks the files as moving: 4 windows so far
        _step(w, rd, clock, step)
    assert out.getvalue() == ""
    _step(w, rd, clock, 6)
    assert out.getvalue().splitlines() == [LINE]
    for step in range(7, 20):  # it stays slow, catches up, lags again: still one line
        _step(w, rd, clock, step, slow=not 10 <= step < 14)
    assert out.getvalue().splitlines() == [LINE]
    # requeued: the job runs again, a new world whose steps count from 1; the run's one line stands
    w.tick(JobState("7", "PENDING", None))
    for step in range(1, 12):
        _step(w, rd, clock, step)
    assert out.getvalue().splitlines() == [LINE]
    assert w.straggle.warned == [LINE.removeprefix("runner: warning: ")]


def test_a_round_without_a_new_step_of_every_rank_counts_no_window(watch, monkeypatch):
    """Rank 2 still on its step: its figures are last step's, already counted; no window added."""
    w, rd, clock, out = watch
    monkeypatch.setattr(w, "stop", lambda v: pytest.fail(f"no hang here: {v.line}"))
    _step(w, rd, clock, 1)
    for _ in range(10):
        _step(w, rd, clock, 2)  # rounds go by, every rank's last step stays 2
    assert w.straggle.rule.runs == {0: 0, 1: 0, 2: 1} and out.getvalue() == ""


def test_the_line_is_the_ssh_watch_s():
    """One place builds it: the same beats give the SSH watch's line (the plan's node names) and
    the Slurm watch's (the beats' node names) word for word."""
    from contract import hang as rule
    from contract import heartbeat as fmt

    watch = rule.Watch()
    ssh, slurm = StragglerLines({0: "pi-0", 1: "pi-1", 2: "pi-2"}), StragglerLines()
    for step in range(1, 6):
        for r in range(3):
            busy = WORK[r] * 1e-7 * (3.0 if r == 1 else 1.0)
            watch.update(fmt.Heartbeat(**_beat(r, f"node-{r}", 3, step, step=step, step_s=0.6, wait_s=0.6 - busy,
                                               work=WORK[r])), float(step))
        a, b = ssh.lines(watch), slurm.lines(watch)
    assert a == [b[0].replace("(node-1)", "(pi-1)")]
    assert b == ["straggler: rank 1 (node-1) computes 3.0x slower than the other ranks' median per FLOP it computes "
                 "(0.251 s busy of its 0.600 s step) for 5 steps in a row: it holds the others back"]
