"""Two hangs the phase rule alone let through (issue 57), judged by contract/hang.py's Watch with a
reader clock, and wired into both backends' watches without a cluster:

- a rank whose process is frozen (SIGSTOP, D state: its heartbeat writer stopped while the others'
  still run) is a hang once it has been silent for the steady budget, whatever longer phase (a
  checkpoint: 600 s) the other ranks are in; a writer that is only starved, or a node the reader
  could not read, is not;
- a rank whose heartbeat said its last word (`done`) while its process (its container, its Slurm
  job) still runs TEARDOWN budget after every rank ended is a teardown hang: one line, the same
  failure path (runner/backends/ssh/watch.py, runner/backends/slurm/hang.py)."""

from __future__ import annotations

import threading
import time
import types

import pytest

from contract import hang as rule
from contract import heartbeat as fmt
from runner.backends.slurm.jobs import JobState
from runner.backends.ssh import hang_watch
from runner.backends.ssh.watch import Watcher
from tests.unit.test_hang_budget import _beat, _write
from tests.unit.test_hang_budget import reader as reader  # noqa: F401 - the fixture
from tests.unit.test_slurm_hang_watch import watch as slurm_watch  # noqa: F401 - the fixture


def beat(rank: int, **kw) -> fmt.Heartbeat:
    d = dict(v=1, rank=rank, world_size=3, local_rank=0, node=f"node-{rank}", host="h", pid=100 + rank,
             pid_start=5, step=7, phase="forward", phase_since=1000.0, progress_at=1000.0, alive_at=1000.0, seq=1,
             median_step_s=1.0, max_step_s=5.0, steps_timed=6, heartbeat_s=1.0)
    d.update(kw)
    return fmt.from_dict(d)


def run_frozen(w: rule.Watch, until: float, writes_every: dict[int, float], phases: dict[int, str],
               step: float = 2.0) -> tuple[float | None, rule.Verdict | None]:
    """Every `step` s of the reader's clock, every rank read; rank r's writer moves every
    writes_every[r] s (0: never again). The first verdict and when it came."""
    t = 0.0
    while t <= until:
        for r in range(3):
            every = writes_every.get(r, 1.0)
            n = int(t // every) if every else 0
            w.update(beat(r, phase=phases[r], alive_at=1000.0 + n * (every or 1.0), seq=1 + n,
                          ckpt_bytes=3 * 10**9 if phases[r] == "checkpoint" else None), t)
        v = w.verdict(t)
        if v is not None:
            return t, v
        t += step
    return None, None


# ------------------------------------------------------------------ a frozen rank

@pytest.mark.parametrize("own", ["checkpoint", "forward"])
def test_a_frozen_rank_is_a_hang_after_the_steady_budget_while_the_others_checkpoint(own):
    """Before: ranks 0 and 2 inside a 3 GB checkpoint (budget 600 s) covered rank 1's stopped process
    for 600 s; a stopped process writes no checkpoint, so it gets the steady budget (120 s)."""
    w = rule.Watch()
    phases = {0: "checkpoint", 1: own, 2: "checkpoint"}
    at, v = run_frozen(w, 700, {0: 1.0, 1: 0.0, 2: 1.0}, phases)
    assert v is not None and at is not None
    assert rule.MIN_HANG_S < at <= rule.MIN_HANG_S + 4  # within two reads of the steady budget
    assert v.culprits == [1] and v.budget_s == rule.MIN_HANG_S
    assert v.line.startswith(f"hang: rank 1 (node-1, pid 101) at step 7, {own}: no progress for ")
    assert f"(budget {rule.MIN_HANG_S:.0f} s); its process is stopped or frozen" in v.line
    assert "whatever phase the others are in" in v.line


def test_the_job_hang_timeout_is_the_frozen_budget_too():
    w = rule.Watch(hang_timeout_s=30)
    at, v = run_frozen(w, 700, {0: 1.0, 1: 0.0, 2: 1.0}, {0: "checkpoint", 1: "checkpoint", 2: "checkpoint"})
    assert v is not None and at is not None and 30 < at <= 34 and v.budget_s == 30 and v.culprits == [1]


def test_a_starved_writer_is_no_frozen_rank():
    """A writer that runs once in 20 s (a 0.2-CPU container, swap) is far from a silence of the
    steady budget: the others' checkpoint budget stands."""
    w = rule.Watch()
    at, v = run_frozen(w, 590, {0: 1.0, 1: 20.0, 2: 1.0}, {0: "checkpoint", 1: "checkpoint", 2: "checkpoint"})
    assert v is None, v.line if v else None


def test_silence_the_reader_did_not_see_is_no_frozen_rank():
    """Rank 1's node could not be read (its files not fed) while the others were: not a stopped
    process, only an unknown one; the others' budgets stand."""
    w = rule.Watch()
    for r in range(3):
        w.update(beat(r, phase="checkpoint", ckpt_bytes=3 * 10**9), 0.0)
    for t in range(2, 590, 2):
        for r in (0, 2):
            w.update(beat(r, phase="checkpoint", ckpt_bytes=3 * 10**9, alive_at=1000.0 + t, seq=1 + t), float(t))
        assert w.verdict(float(t)) is None, t


# ------------------------------------------------------------------ a rank stuck after `done`

def ended(w: rule.Watch, now: float, phases: tuple[str, ...] = ("done", "done", "done"), **kw) -> None:
    for r, phase in enumerate(phases):
        w.update(beat(r, step=10, phase=phase, alive_at=2000.0, seq=50, **kw), now)


def test_a_process_alive_past_the_teardown_budget_after_done_is_a_hang():
    w = rule.Watch()
    ended(w, 0.0)
    assert rule.teardown_budget(1.0) == max(rule.TEARDOWN_MIN_S, rule.MIN_HANG_S)
    budget = rule.teardown_budget(1.0)
    assert w.verdict(1e6) is None  # ended ranks are no stall: the phase rule stays quiet
    assert w.teardown(budget - 1, running=[1]) is None
    v = w.teardown(budget + 1, running=[1])
    assert v is not None and v.teardown and v.culprits == [1] and v.budget_s == budget
    assert v.line == (f"hang: rank 1 (node-1, pid 101) finished step 10 but its process has not exited for "
                      f"{budget + 1:.0f} s (teardown; budget {budget:.0f} s)")
    assert w.teardown(budget + 1, running=[]) is None  # every process gone: a finished run


def test_the_teardown_clock_starts_when_the_last_rank_ends():
    """Ranks that end first wait for the others (a final barrier, torchrun's exit barrier): the
    budget counts from the last rank's last word, and a rank still at work is the phase rule's."""
    w = rule.Watch(hang_timeout_s=10)
    budget = rule.teardown_budget(None, 10)
    assert budget == rule.TEARDOWN_MIN_S  # a short hang timeout: the floor (torchrun's exit barrier)
    ended(w, 0.0, ("done", "done", "checkpoint"))
    assert w.teardown(500.0, running=[0, 1, 2]) is None
    ended(w, 500.0)
    assert w.teardown(500.0 + budget - 1, running=[0]) is None
    v = w.teardown(500.0 + budget + 1, running=[0])
    assert v is not None and v.culprits == [0] and f"has not exited for {500 + budget + 1:.0f} s" in v.line


def test_failed_ranks_and_exited_ones_count_as_ended():
    w = rule.Watch()
    ended(w, 0.0, ("failed", "done", "forward"), error="RuntimeError: boom")
    w.exited([2])  # its node's container exited before its last word was read
    v = w.teardown(rule.teardown_budget(1.0) + 1, running=[0])
    assert v is not None and v.culprits == [0]
    assert v.line.startswith("hang: rank 0 (node-0, pid 100) failed at step 10 but its process has not exited for ")
    assert w.verdict(1e6) is None  # the exited rank's stale `forward` is no stall either


# ------------------------------------------------------------------ the SSH watch: a container still running

def test_ssh_watch_reports_a_teardown_hang_of_a_running_container(reader, monkeypatch):  # noqa: F811
    from runner.backends.ssh import teardown as ssh_teardown

    hw, dirs, clock = reader
    probed = []

    def alive(remote, container, beats):
        probed.append((container, sorted(b.rank for b in beats)))
        return {1}

    monkeypatch.setattr(ssh_teardown, "alive", alive)
    monkeypatch.setattr(hang_watch, "POLL_S", 0.01)
    w = Watcher({n: None for n in dirs}, hw.plan, None, watch_hangs=False)
    w.hang = hw
    monkeypatch.setattr(hw, "close", lambda: None)
    for seq in (1, 2):  # seen, then moved: this launch's files
        for r, n in enumerate(dirs):
            _write(dirs[n], r, _beat(r, n, 3, seq, phase="done", step=10))
        hw.poll()
    # node-0 and node-2 exited 0; node-1's container still runs (rank 1's process stuck in teardown)
    for n in ("node-0", "node-2"):
        w.done[n] = types.SimpleNamespace(exit_code=0)
    t = threading.Thread(target=w._watch_hangs, daemon=True)
    t.start()
    try:
        time.sleep(0.2)
        assert w.events.empty()  # within the budget
        clock[0] += rule.teardown_budget(0.1, 20) + 1
        ev = w.events.get(timeout=10)
    finally:
        w.stop.set()
        t.join(5)
    assert ev.hung and ev.teardown and (ev.node, ev.rank) == ("node-1", 1)
    assert ev.error.startswith("hang: rank 1 (node-1, pid 101) finished step 10 but its process has not exited for ")
    assert ev.error.endswith("(teardown; budget 60 s)")
    assert probed == [("c-node-1", [1])]  # only the running container asked, about its own ranks


def test_the_probe_names_the_ranks_whose_process_still_runs(tmp_path):
    """The snippet the SSH watch runs in a container (`python -c`), here on this machine's pids."""
    import subprocess
    import sys

    from runner.backends.ssh import teardown as ssh_teardown

    me = ssh_teardown.pid_start(subprocess.os.getpid())
    assert me is not None
    args = [f"0:{subprocess.os.getpid()}:{me}", f"1:{subprocess.os.getpid()}:{me + 1}", "2:999999999:1"]
    p = subprocess.run([sys.executable, "-c", ssh_teardown.PROBE, *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["0"]  # rank 1: the pid was reused by another process; rank 2: gone


# ------------------------------------------------------------------ Slurm: the job still RUNNING

def test_slurm_watch_reports_a_teardown_hang_while_the_job_runs(slurm_watch, monkeypatch):  # noqa: F811
    from tests.unit.test_slurm_hang_watch import _write as write

    w, rd, clock = slurm_watch
    stopped = []
    monkeypatch.setattr(w, "stop", lambda v: stopped.append(v) or setattr(w, "hung", v))
    for seq in (1, 2):
        for r in range(3):
            write(rd, r, _beat(r, f"node-{r}", 3, seq, phase="done", step=10))
        w.tick(JobState("7", "RUNNING", None))
        clock[0] += 2.5
    budget = rule.teardown_budget(0.1, 20)
    w.tick(JobState("7", "RUNNING", None))
    assert stopped == []
    clock[0] += budget
    w.tick(JobState("7", "RUNNING", None))
    assert len(stopped) == 1 and stopped[0].teardown and stopped[0].culprits == [0, 1, 2]
    assert stopped[0].line.startswith("hang: rank 0 (node-0, pid 100), rank 1 (node-1, pid 101), rank 2 (node-2, "
                                      "pid 102) finished step 10 but their processes have not exited for ")


def test_after_a_regroup_only_heartbeats_place_ranks(reader):
    """After an in-place regroup the ranks are numbered anew: the plan's rank -> node no longer
    holds, so an exited (lost) node's old rank numbers must not end the new world's ranks."""
    from runner.backends.ssh import teardown as ssh_teardown

    hw, dirs, clock = reader
    assert ssh_teardown.ranks_on(hw, {"node-1"}) == {1}  # the planned world: the plan places rank 1
    hw.start_over()
    assert ssh_teardown.ranks_on(hw, {"node-1"}) == set()  # nothing seen yet: nothing placed
    for seq in (1, 2):
        _write(dirs["node-2"], 1, _beat(1, "node-2", 2, seq))
        hw.poll()
    assert ssh_teardown.ranks_on(hw, {"node-1"}) == set() and ssh_teardown.ranks_on(hw, {"node-2"}) == {1}
