"""The heartbeat contract without a training run: the file format and its validator (a job's file,
read by the runner), the hang rule (contract/hang.py), the reader's blame, the straggler rule, and
the trainer's writer (trainer/runtime/heartbeat.py) producing what the validator accepts."""

from __future__ import annotations

import json
import os
import time

import pytest

from contract import hang as rule
from contract import heartbeat as fmt
from trainer.runtime.heartbeat import HeartbeatWriter


def beat(rank: int = 0, **kw) -> fmt.Heartbeat:
    d = dict(v=1, rank=rank, world_size=3, local_rank=rank, node=f"node-{rank}", host="h", pid=100 + rank,
             pid_start=5, step=7, phase="forward", phase_since=1000.0, progress_at=1000.0, alive_at=1000.0, seq=1,
             median_step_s=1.0, max_step_s=5.0, steps_timed=6, heartbeat_s=1.0)
    d.update(kw)
    return fmt.from_dict(d)


# ------------------------------------------------------------------ the format

def test_writer_snapshot_round_trips_through_the_validator(tmp_path):
    w = HeartbeatWriter(tmp_path, rank=2, world_size=4, local_rank=2, interval_s=600)
    w.start()  # writes its first file (phase init) at once
    assert fmt.read(fmt.path_of(tmp_path, 2)).phase == "init"
    w.step_start(3)
    w.mark("recv", peer=1, detail="fwd_recv")
    w.write()
    b = fmt.read(fmt.path_of(tmp_path, 2))
    assert (b.rank, b.world_size, b.step, b.phase, b.peer, b.detail, b.pid) == (2, 4, 3, "recv", 1, "fwd_recv",
                                                                               os.getpid())
    assert b.pid_start > 0 and b.budget_s == rule.STARTUP_S  # step 3: still a first step
    assert b.alive_at >= b.progress_at and b.seq == 2
    assert b.where() == "step 3, recv from rank 1 (fwd_recv)"
    w.stop("failed", "RuntimeError: boom\nsecond line")
    b = fmt.read(fmt.path_of(tmp_path, 2))
    assert (b.phase, b.error, b.budget_s) == ("failed", "RuntimeError: boom second line", None)


def test_writer_record_holds_every_field_of_the_format():
    from dataclasses import fields

    w = HeartbeatWriter("/nonexistent", rank=0, world_size=1, interval_s=0)
    assert list(w.record()) == [f.name for f in fields(fmt.Heartbeat)]


def test_writer_counts_waits_per_step():
    w = HeartbeatWriter("/nonexistent", rank=0, world_size=1, interval_s=0)
    w.step_start(1)
    w.mark("forward")
    t = time.perf_counter()
    w.mark("recv", peer=1)
    while time.perf_counter() - t < 0.02:
        pass
    w.mark("backward")
    w.step_end()
    assert 0.02 <= w.wait_s < w.step_s


@pytest.mark.parametrize("field,value,message", [
    ("v", 2, "version"),
    ("rank", True, "'rank' is not a count"),
    ("step", -1, "'step' is not a count"),
    ("alive_at", float("nan"), "'alive_at' is out of range"),
    ("median_step_s", "1", "'median_step_s' is not a number"),
    ("node", "a\x1b[2Jb", "'node' is not one printable line"),
    ("node", "x" * 256, "'node' is not one printable line"),
    ("phase", "Forward; rm -rf", "'phase' is not a phase word"),
    ("detail", "a b", "'detail' holds"),
    ("first", 1, "'first' is not true/false"),
    ("rank", 3, "rank 3 is not below its world size 3"),
])
def test_validator_names_the_field(field, value, message):
    d = beat().to_dict()
    d[field] = value
    with pytest.raises(ValueError, match=message):
        fmt.from_dict(d, "f")


def test_validator_requires_fields_and_ignores_unknown_ones():
    d = beat().to_dict()
    d["a_newer_field"] = [1, 2]
    assert fmt.from_dict(d).rank == 0
    del d["pid"]
    with pytest.raises(ValueError, match="'pid' is missing"):
        fmt.from_dict(d)


def test_reads_are_bounded_and_follow_no_link(tmp_path):
    d = tmp_path / fmt.DIR
    d.mkdir()
    (d / "rank0.json").write_text(" " * (fmt.MAX_BYTES + 1))
    (d / "rank1.json").write_text("[" * 100_000)
    (d / "rank2.json").symlink_to("/etc/passwd")
    os.mkfifo(d / "rank3.json")  # must not block the reader
    (d / "rank4.json").write_text(json.dumps(beat(rank=0).to_dict()))  # a file holding another rank
    (d / "rank5.json").write_text(json.dumps(beat(rank=1, world_size=9).to_dict() | {"rank": 5}))
    beats, errors = fmt.read_dir(tmp_path)
    assert list(beats) == [5] and len(errors) == 5
    assert any("over" in e for e in errors) and any("holds rank 0" in e for e in errors)
    assert any("regular file" in e for e in errors)  # the FIFO


# ------------------------------------------------------------------ the rule

def test_steady_budget_is_the_larger_of_120_s_and_10_median_steps():
    assert rule.steady_budget(None) == 120 and rule.steady_budget(3.0) == 120 and rule.steady_budget(30.0) == 300
    assert rule.steady_budget(30.0, hang_timeout_s=45) == 45


def test_first_steps_and_compile_get_the_startup_budget():
    # A first step 5x the later ones (compile): its phase and step keep it within the first steps' budget.
    for phase, step in (("init", 0), ("build", 0), ("compile", 1), ("forward", 1), ("recv", 3)):
        assert rule.phase_budget(phase, step, median_step_s=None) == rule.STARTUP_S
    assert rule.phase_budget("forward", 4, median_step_s=2.0) == 120
    assert rule.phase_budget("compile", 40, median_step_s=2.0, first=False) == rule.STARTUP_S  # a recompile
    assert rule.phase_budget("forward", 2, median_step_s=200.0, max_step_s=1000.0) == 10_000  # slow steps
    assert rule.phase_budget("done", 9) is None and rule.phase_budget("failed", 9) is None


def test_checkpoint_budget_grows_with_its_size_and_the_last_write():
    assert rule.phase_budget("checkpoint", 50, median_step_s=1.0) == rule.CHECKPOINT_MIN_S
    assert rule.phase_budget("checkpoint", 50, median_step_s=1.0, ckpt_bytes=100 * 10**9) == 10_000  # 100 GB
    assert rule.phase_budget("checkpoint", 50, median_step_s=1.0, last_ckpt_s=400) == 2000
    assert rule.phase_budget("checkpoint", 50, median_step_s=1.0, first=True) == rule.STARTUP_S
    assert rule.phase_budget("log", 50, median_step_s=20.0, phase_units=10) == 2000  # 10 steps' device work
    assert rule.phase_budget("eval", 50, median_step_s=1.0, phase_units=100) == 1000


def test_collective_timeout_leaves_the_watch_time_to_act():
    assert rule.collective_timeout(120) == 180 and rule.collective_timeout(900) == 1350
    assert rule.collective_timeout(120, steady_s=120, configured_s=20) == 20       # parallel.timeout_s 20
    assert rule.collective_timeout(900, steady_s=120, configured_s=20) == 900      # ... not in long phases
    assert rule.collective_timeout(900, steady_s=None, configured_s=1800) == 1800
    assert "max(120 s, 10 x the median step)" in rule.describe()


# ------------------------------------------------------------------ the reader

def feed(watch: rule.Watch, beats: list[fmt.Heartbeat], now: float) -> None:
    for b in beats:
        watch.update(b, now)


def test_a_stopped_rank_is_blamed_while_the_others_wait():
    w = rule.Watch()
    t0 = 1000.0
    feed(w, [beat(0, phase="recv", peer=1), beat(1, phase="forward"), beat(2, phase="recv", peer=1)], t0)
    for i in range(1, 200):  # ranks 0 and 2 keep writing (alive), rank 1's writer is stopped
        now = t0 + i
        feed(w, [beat(0, phase="recv", peer=1, alive_at=1000.0 + i, seq=1 + i),
                 beat(2, phase="recv", peer=1, alive_at=1000.0 + i, seq=1 + i)], now)
        v = w.verdict(now)
        if i <= 120:
            assert v is None, i
    assert v is not None and v.culprits == [1] and v.waiting == [0, 2]
    assert "rank 1 (node-1, pid 101) at step 7, forward" in v.line and "stopped or frozen" in v.line
    assert v.stall_s > v.budget_s == 120


def test_blame_by_phase_when_every_writer_moves():
    # An SD card read that never returns: rank 2's writer runs, it is in `data`, the others wait.
    w = rule.Watch()
    for i in range(0, 300, 10):
        feed(w, [beat(0, phase="recv", peer=1, alive_at=1000.0 + i, seq=i + 1),
                 beat(1, phase="collective", alive_at=1000.0 + i, seq=i + 1),
                 beat(2, step=7, phase="data", alive_at=1000.0 + i, seq=i + 1)], 1000.0 + i)
    v = w.verdict(1290.0)
    assert v is not None and v.culprits == [2] and "the others wait for it" in v.line


def test_one_rank_in_a_long_phase_covers_the_others_waits():
    # rank 1 writes a big checkpoint (its own budget); ranks 0 and 2 wait in the barrier: no hang.
    w = rule.Watch()
    for i in range(0, 500, 10):
        feed(w, [beat(0, phase="collective", alive_at=1000.0 + i, seq=i + 1),
                 beat(1, phase="checkpoint", alive_at=1000.0 + i, seq=i + 1, ckpt_bytes=3 * 10**9),
                 beat(2, phase="collective", alive_at=1000.0 + i, seq=i + 1)], 1000.0 + i)
        assert w.verdict(1000.0 + i) is None
    assert w.verdict(1000.0 + rule.CHECKPOINT_MIN_S + 1) is not None  # ... until its budget is spent


def test_a_rank_that_never_wrote_is_blamed_after_the_startup_budget():
    w = rule.Watch(world_size=3, started=0.0)
    feed(w, [beat(0, step=0, phase="init", alive_at=10.0 * i, progress_at=0.0, seq=i + 1) for i in range(2)], 5.0)
    assert w.verdict(rule.STARTUP_S - 1) is None
    v = w.verdict(rule.STARTUP_S + 1)
    assert v is not None and v.culprits == [1, 2] and "never wrote a heartbeat" in v.line


def test_ended_ranks_are_no_hang():
    w = rule.Watch()
    feed(w, [beat(r, phase="done") for r in range(3)], 0.0)
    assert w.verdict(1e6) is None


# ------------------------------------------------------------------ stragglers

def test_a_rank_slower_for_five_log_steps_is_reported_once():
    s = rule.Stragglers(1.5, 5)
    reports = []
    for i in range(12):
        busy = [1.0, 1.0, 1.6 if i < 3 or i > 4 else 1.2]  # slow, then a pause, then slow for good
        reports += [(i, r) for r, _ in s.update(busy)]
    assert reports == [(9, 2)] and s.current() == [2]


def test_stages_of_different_sizes_are_compared_per_unit_of_work():
    # The Pi guide's 7:14:7 split: the middle stage computes twice as long, with twice the layers.
    assert max(rule.slowness([1.0, 2.0, 1.0], work=[7, 14, 7])) == pytest.approx(1.0)
    assert rule.slowness([1.0, 6.0, 1.0], work=[7, 14, 7])[1] == pytest.approx(3.0)
    assert rule.slowness([3.0, 1.0]) == [3.0, 1 / 3]  # two ranks: each against the other
