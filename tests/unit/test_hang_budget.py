"""The hang timeout as the runner plans it (runner/planning/hang_budget.py: `--hang-timeout`,
`job.hang_timeout`, the trainer's `--watch.hang_timeout_s`, the `--dry-run` line), the runner's
heartbeat reader on files it must not trust (runner/backends/ssh/hang_watch.py, through a local
SFTP stand-in), and the Perseus schedule wait sized like a collective, not the string "auto"."""

from __future__ import annotations

import json
import os
import stat
import types
from pathlib import Path

import paramiko
import pytest

from contract import hang as rule
from contract import heartbeat as fmt
from runner.backends import beat_reader
from runner.backends.ssh import hang_watch
from runner.core.errors import UserError
from runner.inventory.model import Job
from runner.planning import hang_budget


def test_perseus_schedule_wait_is_seconds_when_the_collective_timeout_is_auto(tmp_path):
    from trainer.config.schema import Config
    from trainer.profiling.perseus_rounds import PerseusRounds

    cfg = Config()
    cfg.profile.perseus_url = "http://127.0.0.1:9"
    assert cfg.parallel.timeout_s == "auto"
    trainer = types.SimpleNamespace(cfg=cfg, dims=None, output_dir=tmp_path)
    rounds = PerseusRounds(trainer, 0, 1, None, None, object(), None, None, False)
    t = rounds.client.schedule_timeout
    assert isinstance(t, float)
    assert t == rule.collective_timeout(rule.startup_budget())  # 900 s + 450 s
    cfg.parallel.timeout_s = 300
    assert PerseusRounds(trainer, 0, 1, None, None, object(), None, None, False).client.schedule_timeout == 300.0


def test_option_over_inventory_over_args_and_passed_to_the_trainer():
    job = Job(args=["--watch.hang_timeout_s", "77"])
    assert hang_budget.apply(job, None) == 77.0  # only the job's own args: the watch reads them
    assert job.args == ["--watch.hang_timeout_s", "77"]
    job = Job(args=["--train.steps", "5"], hang_timeout=200)
    assert hang_budget.apply(job, None) == 200
    assert job.args[-2:] == ["--watch.hang_timeout_s", "200"]
    job = Job(args=[], hang_timeout=200)
    assert hang_budget.apply(job, 30) == 30
    assert job.args == ["--watch.hang_timeout_s", "30"]
    job = Job(command=["sleep", "1"], hang_timeout=200)
    hang_budget.apply(job, None)
    assert job.args == []  # not the trainer: nothing appended
    with pytest.raises(UserError, match="--hang-timeout 3: give whole seconds in 10..86400"):
        hang_budget.apply(Job(), 3)


def test_arg_value_takes_the_last_and_leaves_bad_values_to_the_trainer():
    assert hang_budget.arg_value(["--x", "1", "--parallel.timeout_s=90", "--parallel.timeout_s", "120"],
                                 "--parallel.timeout_s") == 120.0
    assert hang_budget.arg_value(["--parallel.timeout_s", "auto"], "--parallel.timeout_s") is None
    assert hang_budget.arg_value(["--parallel.timeout_s", "soon"], "--parallel.timeout_s") is None
    assert hang_budget.arg_value(["--parallel.timeout_s", "nan"], "--parallel.timeout_s") is None


def test_dry_run_line_is_one_line_with_the_numbers():
    job = Job(args=[])
    hang_budget.apply(job, 45)
    line = hang_budget.dry_run_line(job)
    assert "\n" not in line
    assert line.startswith("hang watch: hang timeout 45 s (set)")
    assert "collectives give up after each budget + max(60 s, 50%)" in line
    assert hang_budget.dry_run_line(Job(command=["sleep", "1"])) is None  # not the trainer: nothing watched
    auto = hang_budget.dry_run_line(Job(args=["--parallel.timeout_s", "600"]))
    assert "auto = max(120 s, 10 x the median step)" in auto and "600 s (parallel.timeout_s)" in auto


def test_inventory_field_is_checked_with_its_line(tmp_path):
    from runner.inventory import load_inventory

    base = ("nodes:\n- {name: a, host: 10.0.0.1, arch: amd64, role: master}\njob:\n  image: x\n")
    good = tmp_path / "good.yaml"
    good.write_text(base + "  hang_timeout: 300\n")
    assert load_inventory(str(good), check_files=False).job.hang_timeout == 300
    auto = tmp_path / "auto.yaml"
    auto.write_text(base + "  hang_timeout: auto\n")
    assert load_inventory(str(auto), check_files=False).job.hang_timeout is None
    for bad, why in (("5", "must be an integer in 10..86400, got 5"), ("soon", "must be 'auto' or whole seconds")):
        p = tmp_path / "bad.yaml"
        p.write_text(base + f"  hang_timeout: {bad}\n")
        with pytest.raises(UserError, match=rf"bad.yaml:5: job.hang_timeout: {why}"):
            load_inventory(str(p), check_files=False)


# ------------------------------------------------------------------ the reader, on local files


class LocalSFTP:
    """What hang_watch reads through (listdir_within's requests are stubbed by `entries`)."""

    def __init__(self):
        self.sock = types.SimpleNamespace(closed=False)

    def open(self, path: str, mode: str):
        return open(path, "rb")  # noqa: SIM115 - the caller's `with`


def _entries(d: str, limit: int):
    out = []
    for name in sorted(os.listdir(d)):
        st = os.lstat(os.path.join(d, name))
        a = paramiko.SFTPAttributes.from_stat(st, name)
        out.append(a)
    return out


def _plan(run_dirs: dict[str, Path], nproc: int = 1):
    nodes = [types.SimpleNamespace(node=n, rank=k, run_dir=str(d), container=f"c-{n}")
             for k, (n, d) in enumerate(run_dirs.items())]
    return types.SimpleNamespace(nodes=nodes, nproc_per_node={n: nproc for n in run_dirs}, run_id="r1",
                                 node=lambda name: next(x for x in nodes if x.node == name))


def _beat(rank: int, node: str, world: int, seq: int, **kw) -> dict:
    d = {"v": 1, "rank": rank, "world_size": world, "local_rank": 0, "node": node, "host": node, "pid": 100 + rank,
         "pid_start": 5, "step": 9, "phase": "forward", "phase_since": 1000.0, "progress_at": 1000.0,
         "alive_at": 1000.0 + seq, "seq": seq, "median_step_s": 0.1, "max_step_s": 0.5, "steps_timed": 5,
         "step_s": 0.1, "wait_s": 0.0}
    d.update(kw)
    return d


def _write(run_dir: Path, rank: int, d: dict | bytes) -> None:
    p = run_dir / fmt.DIR / f"rank{rank}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(d if isinstance(d, bytes) else json.dumps(d).encode())


@pytest.fixture
def reader(tmp_path, monkeypatch):
    dirs = {f"node-{k}": tmp_path / f"n{k}" for k in range(3)}
    clock = [0.0]
    hw = hang_watch.HangWatch({}, _plan(dirs), hang_timeout_s=20, clock=lambda: clock[0])
    monkeypatch.setattr(hw, "_session", lambda node: LocalSFTP())
    monkeypatch.setattr(beat_reader, "listdir_within", lambda sftp, d, limit: _entries(d, limit))
    return hw, dirs, clock


def test_stale_and_foreign_files_are_left_out_and_a_stopped_rank_is_named(reader):
    hw, dirs, clock = reader
    _write(dirs["node-2"], 5, _beat(5, "node-2", 6, 1))  # an earlier, larger layout's file: never moves
    for seq in (1, 2):
        for r, n in enumerate(dirs):
            _write(dirs[n], r, _beat(r, n, 3, seq, phase="recv" if r != 1 else "forward"))
        hw.poll()
        clock[0] += 2
    assert sorted(hw.watch.ranks) == [0, 1, 2]  # rank 5 of the old layout never read as this launch's
    # rank 1's writer stops (SIGSTOP); the others keep writing, their progress frozen in recv
    for seq in range(3, 20):
        for r, n in enumerate(dirs):
            if r != 1:
                _write(dirs[n], r, _beat(r, n, 3, seq, phase="recv", alive_at=1000.0 + seq))
        hw.poll()
        clock[0] += 2
        if hw.verdict() is not None:
            break
    v = hw.verdict()
    assert v is not None and v.culprits == [1]
    assert v.budget_s == 20
    assert hw.culprit(v) == ("node-1", 1)
    assert v.line.startswith("hang: rank 1 (node-1, pid 101) at step 9, forward: no progress for")


def test_files_it_must_not_trust_are_refused_once_and_left_out(reader, caplog):
    hw, dirs, clock = reader
    big = dirs["node-0"] / fmt.DIR / "rank0.json"
    _write(dirs["node-0"], 0, b"{" + b" " * (fmt.MAX_BYTES + 10) + b"}")
    _write(dirs["node-1"], 1, _beat(2, "node-1", 3, 1))  # holds another rank
    (dirs["node-2"] / fmt.DIR).mkdir(parents=True)
    os.symlink("/etc/passwd", dirs["node-2"] / fmt.DIR / "rank2.json")
    for _ in range(3):
        hw.poll()
    assert hw.watch.ranks == {}
    refused = [r.getMessage() for r in caplog.records if "hang watch" in r.getMessage()]
    assert len(refused) == 1 and "holds rank 2" in refused[0], refused
    assert stat.S_ISREG(os.lstat(big).st_mode)


def test_straggler_named_once_per_node(reader):
    hw, dirs, clock = reader
    lines = []
    for step in range(1, 12):
        for r, n in enumerate(dirs):
            busy = 0.3 if r == 2 else 0.1
            _write(dirs[n], r, _beat(r, n, 3, step, step=step, step_s=0.35, wait_s=0.35 - busy, work=1000))
        hw.poll()
        lines += hw.stragglers()
    assert len(lines) == 1, lines
    assert lines[0].startswith("straggler: rank 2 (node-2) computes 3.0x slower than the other ranks' median")


@pytest.mark.parametrize("inventory", ["hosts/pis.yaml", "hosts/slurm.yaml"])
def test_dry_run_prints_the_rule_once_and_hands_the_trainer_the_timeout(no_network, inventory):
    from tests.support.runner_helpers import run_cli

    rc, out = run_cli("up", "-i", inventory, "--dry-run", "--hang-timeout", "300")
    assert rc == 0
    lines = [ln for ln in out.splitlines() if ln.startswith("hang watch: ")]
    assert lines == [hang_budget.dry_run_line(Job(args=[], hang_timeout=300))], lines
    assert "--watch.hang_timeout_s 300" in out
    rc, out = run_cli("up", "-i", inventory, "--dry-run")
    assert "hang watch: hang timeout auto = max(120 s, 10 x the median step)" in out
    assert "--watch.hang_timeout_s" not in out


def test_a_straggler_that_lags_again_is_not_named_twice(reader):
    """Seen on the sandbox: a rank at a third of a CPU that caught up for a few steps was named a
    second time when it lagged again; the run's warning is one line per straggler."""
    hw, dirs, clock = reader
    lines = []
    for step in range(1, 40):
        lagging = step <= 11 or step > 22
        for r, n in enumerate(dirs):
            busy = 0.3 if r == 2 and lagging else 0.1
            _write(dirs[n], r, _beat(r, n, 3, step, step=step, step_s=0.35, wait_s=0.35 - busy, work=1000))
        hw.poll()
        lines += hw.stragglers()
    assert len(lines) == 1, lines
