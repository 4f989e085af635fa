"""The hang watch's shared reader (runner/backends/beat_reader.py) and its Slurm side
(runner/backends/slurm/hang.py) without a cluster: the run dir read from this machine without
following a link or blocking on a FIFO, a file taken only once it moved, the rule judged only while
the job runs (from the start again when it starts running), the stacks step per container kind,
and the one line both backends announce a hang with."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest

from contract import heartbeat as fmt
from runner.backends import beat_reader
from runner.backends.slurm import hang
from runner.backends.slurm.jobs import JobState
from runner.backends.slurm.plan import SlurmFacts, make_slurm_plan
from runner.backends.slurm.shell import LocalShell
from runner.inventory.slurm import load_slurm_inventory
from tests.unit.test_hang_budget import _beat
from tests.unit.test_slurm_plan import write_inv


def _write(run_dir: Path, rank: int, d: dict | bytes) -> None:
    p = run_dir / fmt.DIR / f"rank{rank}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_bytes(d if isinstance(d, bytes) else json.dumps(d).encode())
    tmp.replace(p)


@pytest.fixture
def watch(tmp_path):
    inv = load_slurm_inventory(str(write_inv(tmp_path, {"workdir": str(tmp_path / "wd")}, {"hang_timeout": 20})))
    plan = make_slurm_plan(inv, "r1", SlurmFacts(home="/home/u"))
    Path(plan.run_dir).mkdir(parents=True)
    clock = [100.0]
    w = hang.SlurmHangWatch(LocalShell(), inv, plan, "7", clock=lambda: clock[0])
    return w, Path(plan.run_dir), clock


def _round(w, rd: Path, seq: int, clock: list[float], skip: int | None = None) -> None:
    for r in range(3):
        if r != skip:
            _write(rd, r, _beat(r, f"node-{r}", 3, seq, phase="recv" if r != 1 else "forward", alive_at=1000.0 + seq))
    w.tick(JobState("7", "RUNNING", None))
    clock[0] += beat_reader.POLL_S


def test_a_stopped_rank_is_named_and_the_job_stopped_once(watch, monkeypatch):
    w, rd, clock = watch
    stopped = []
    monkeypatch.setattr(w, "stop", lambda v: stopped.append(v) or setattr(w, "hung", v))
    _write(rd, 5, _beat(5, "node-2", 6, 1))  # an earlier, larger layout's file: never moves
    for seq in (1, 2, 3):
        _round(w, rd, seq, clock)
    assert sorted(w.watch.ranks) == [0, 1, 2] and w.world == 3
    for seq in range(4, 30):
        _round(w, rd, seq, clock, skip=1)  # rank 1's writer stops
        if stopped:
            break
    assert len(stopped) == 1 and stopped[0].culprits == [1] and stopped[0].budget_s == 20
    assert w.culprit(stopped[0], ["node-0", "node-1", "node-2"]) == ("node-1", 1)
    assert beat_reader.stopping_line(stopped[0].line).startswith(
        "runner: hang: rank 1 (node-1, pid 101) at step 9, forward: no progress for")
    _round(w, rd, 99, clock, skip=1)
    assert len(stopped) == 1


def test_nothing_is_judged_until_the_job_runs_and_it_starts_over_when_it_runs_again(watch, monkeypatch):
    w, rd, clock = watch
    monkeypatch.setattr(w, "stop", lambda v: pytest.fail(f"judged a job that does not run: {v.line}"))
    for seq in (1, 2):
        _round(w, rd, seq, clock)
    assert sorted(w.watch.ranks) == [0, 1, 2]
    for state in ("PENDING", "REQUEUED", "PENDING"):  # hours in the queue after a requeue: no verdict
        w.tick(JobState("7", state, None))
        clock[0] += 3600
    w.tick(JobState("7", "RUNNING", None))  # it runs again: the old files are an earlier world's
    assert w.watch.ranks == {} and w.watch.started == clock[0]
    assert w.verdict() is None


def test_links_fifos_and_hostile_files_in_the_run_dir_are_left_out(watch, caplog):
    w, rd, clock = watch
    d = rd / fmt.DIR
    d.mkdir()
    outside = rd.parent / "elsewhere.json"
    outside.write_text(json.dumps(_beat(0, "node-0", 3, 1)))
    os.symlink(outside, d / "rank0.json")
    os.mkfifo(d / "rank1.json")  # opened, it would block a reader without O_NONBLOCK
    _write(rd, 2, b"{" + b" " * (fmt.MAX_BYTES + 10) + b"}")
    for _ in range(3):
        assert w.read() == []
    assert not any("left out" in r.getMessage() for r in caplog.records)
    _write(rd, 2, _beat(1, "node-2", 3, 1))  # holds another rank: named once
    for _ in range(3):
        assert w.read() == []
    assert [r.getMessage() for r in caplog.records if "left out" in r.getMessage()] == [
        "hang watch: run dir: heartbeat/rank2.json holds rank 1; left out"]


def test_a_heartbeat_dir_that_is_a_link_is_not_followed(watch):
    w, rd, clock = watch
    real = rd.parent / "real"
    _write(real, 0, _beat(0, "node-0", 3, 1))
    os.symlink(real / fmt.DIR, rd / fmt.DIR)
    assert w.read() == [] and w.read() == []
    _write(real, 0, _beat(0, "node-0", 3, 2))  # it moves: still not read through the link
    assert w.read() == []


def test_a_dir_with_more_entries_than_the_limit_is_not_read(watch, monkeypatch):
    w, rd, clock = watch
    monkeypatch.setattr(hang, "MAX_FILES", 4)
    for r in range(3):
        _write(rd, r, _beat(r, f"node-{r}", 3, 1))
    w.read()
    for r in range(3):
        _write(rd, r, _beat(r, f"node-{r}", 3, 2))
    assert len(w.read()) == 3
    for r in range(3, 6):
        _write(rd, r, _beat(r, f"node-{r}", 6, 1))
    for r in range(3):
        _write(rd, r, _beat(r, f"node-{r}", 3, 3))
    assert w.read() == []


def test_the_stacks_step_per_container_kind(tmp_path):
    def argv(container: str, **slurm):
        d = tmp_path / container
        d.mkdir()
        inv = load_slurm_inventory(str(write_inv(d, {"container": container, **slurm})))
        plan = make_slurm_plan(inv, "r1", SlurmFacts(home="/home/u", bundle="/b"))
        return hang.stacks_argv(inv, plan, "42", 3, "/home/u"), plan

    none, plan = argv("none", venv="~/venv", chdir="~/src")
    assert none[:8] == ["srun", "--jobid=42", "--overlap", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1",
                        "--kill-on-bad-exit=0", "--label"]
    assert none[8:] == ["--chdir=/home/u/src", "/bin/sh", "-c", hang.HELPER_SH, "runner-stacks", "/home/u/venv/bin/python",
                        plan.run_dir]
    pyxis, plan = argv("pyxis")
    assert pyxis[-3:] == ["runner-stacks", "python", "/out"]
    assert "--container-image=runner-trainer:latest" in pyxis and f"--container-mounts={plan.run_dir}:/out" in pyxis
    assert argv("oci")[0] is None


def test_the_stacks_line_counts_the_ranks_the_helper_wrote(tmp_path, monkeypatch):
    inv = load_slurm_inventory(str(write_inv(tmp_path)))
    plan = make_slurm_plan(inv, "r1", SlurmFacts(home="/home/u"))
    out = ("0: rank 0 (pid 11, state S): 40 frame lines by faulthandler (SIGUSR2) -> /x/hang-rank0.txt\n"
           "1: rank 1 (pid 12, state T): no stacks (py-spy is not installed) -> /x/hang-rank1.txt\n"
           "2: rank 2 (pid 13, state S): 38 frame lines by faulthandler (SIGUSR2) -> /x/hang-rank2.txt\n")
    sh = types.SimpleNamespace(run=lambda argv, timeout: types.SimpleNamespace(rc=3, out=out, err=""),
                               home=lambda: "/home/u")
    line = hang.take_stacks(sh, inv, plan, "7", 3, 3)
    assert line.startswith("runner: stacks of 2/3 rank(s) in hang-rank<R>.txt in the run dir (`runner collect r1 -i ")
    assert line.endswith("srun exit 3: " + "; ".join(out.strip().splitlines()[-4:]))
