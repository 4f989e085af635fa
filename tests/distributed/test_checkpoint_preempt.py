"""Preemption and crash safety with real 2-process gloo runs.

- SIGTERM to one worker: every rank stops after the same step, writes `step-N.preempt` (both
  ranks' shards), exits 143; `--resume latest` continues with the losses of a straight run
  (the interrupted run also writes async periodic checkpoints).
- SIGUSR1 (Slurm `--signal`, `docker kill -s USR1`) and SIGTERM (`docker stop`) to torchrun
  itself, with the signal list the images set (read from the Dockerfiles): torchrun forwards
  it, every rank writes its shards of `step-N.preempt`, and the run resumes exactly.
- kill -9 while a checkpoint is being written (held before the rename): `latest` still names the
  previous checkpoint, which loads and continues exactly.

Every signal lands at a known step: the ranks are held after step 3 (TRAINER_TEST_HOLD,
trainer/runtime/hold.py) until the signal has reached them, so the run stops after step 4 on any
machine, however loaded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support.runner_helpers import wait_for
from tests.support.trainer_run import (
    REPO,
    held,
    hold_env,
    losses,
    read_metrics,
    release,
    run_trainer,
    start_trainer,
)
from trainer.checkpoint.preempt import EXIT_PREEMPTED

pytestmark = pytest.mark.multiproc

TINY = ("configs/tiny.yaml", "--parallel.sharding", "ddp")


def _launch(out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return start_trainer(out, *args, nproc=2, env=env)


def _wait_for(cond, proc: subprocess.Popen, timeout: float = 300) -> None:
    """wait_for(cond), failing at once (with the run's output) if the trainer exits first."""
    try:
        wait_for(lambda: cond() or proc.poll() is not None, timeout, interval=0.05)
    except AssertionError:
        _kill_all(proc)
        raise
    if not cond():
        out, err = proc.communicate()
        raise AssertionError(f"trainer exited {proc.returncode} early\n{out[-3000:]}\n{err[-3000:]}")


def _worker(torchrun_pid: int, rank: int) -> int:
    """PID of torchrun's worker with RANK=rank (read from /proc)."""
    children = Path(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children").read_text().split()
    for pid in children:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no worker with RANK={rank} among {children}")


def _kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers (which live in sessions of their own)."""
    pids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split() if proc.poll() is None else []
    for pid in [*map(int, pids), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


HOLD = hold_env("step:3")


STEPS = ("--train.steps", "20")


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[float]:
    """Per-step losses of the uninterrupted 20-step run the preempted runs must reproduce."""
    out = tmp_path_factory.mktemp("straight")
    run_trainer(out, *TINY, *STEPS, nproc=2)
    return losses(out)


def _assert_preempt_checkpoint(out: Path, total: int) -> int:
    """`latest` names step-N.preempt holding every rank's files; returns N."""
    ckpts = out / "checkpoints"
    name = (ckpts / "latest").read_text().strip()
    stopped = len(read_metrics(out))
    assert name == f"step-{stopped}.preempt" and stopped == 4, (name, stopped)  # held after 3, signalled
    ck = ckpts / name
    for r in range(2):
        assert (ck / f"rank{r}.pt").is_file() and (ck / f"manifest.rank{r}.json").is_file()
        assert list(ck.glob(f"__{r}_*.distcp"))
    assert (ck / ".metadata").is_file()
    assert json.loads((ck / "trainer_state.json").read_text())["step"] == stopped
    return stopped


def test_sigterm_writes_preempt_checkpoint_and_resume_continues(tmp_path, straight):
    steps = STEPS
    expected = straight

    out = tmp_path / "run"
    # Periodic checkpoints written in the background (async_save) must not disturb the run either.
    steps = (*steps, "--checkpoint.interval", "2", "--checkpoint.async_save", "true")
    proc = _launch(out, *TINY, *steps, env=HOLD)
    _wait_for(lambda: held(out, "step-3", range(2)), proc)
    os.kill(_worker(proc.pid, 1), signal.SIGTERM)  # one rank only: the ranks must agree
    _wait_for(lambda: held(out, "step-3", [1], "signalled"), proc)
    release(out, "step-3")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert f"exitcode  : {EXIT_PREEMPTED}" in err  # torchrun's report of each worker

    stopped = _assert_preempt_checkpoint(out, 20)
    assert "SIGTERM received: stopped after step" in (out / "logs" / "rank1.log").read_text()
    assert losses(out) == expected[:stopped]

    run_trainer(out, *TINY, *steps, "--resume", "latest", nproc=2)
    assert losses(out) == expected  # steps 1..k from the first run, k+1..20 resumed


SIGNAL_VARS = ("PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE")


def _image_signal_env(dockerfile: str) -> dict[str, str]:
    text = (REPO / dockerfile).read_text()
    return dict(re.findall(rf"\b({'|'.join(SIGNAL_VARS)})=(\S+)", text))


def test_images_make_torchrun_forward_sigusr1():
    """Both images set the list (with SIGUSR1) after the torch and requirements layers and before
    the code, so changing it re-uses the heavy cached layers."""
    amd, arm = _image_signal_env("Dockerfile"), _image_signal_env("Dockerfile.arm64")
    assert amd == arm and set(amd) == set(SIGNAL_VARS)
    assert all("SIGUSR1" in v.split(",") and "SIGTERM" in v.split(",") for v in amd.values())
    for name in ("Dockerfile", "Dockerfile.arm64"):
        lines = (REPO / name).read_text().splitlines()
        where = next(i for i, line in enumerate(lines) if line.startswith("ENV PET_SIGNALS_TO_HANDLE"))
        reqs = next(i for i, line in enumerate(lines) if "pip install -r /tmp/requirements-trainer.txt" in line)
        code = next(i for i, line in enumerate(lines) if line.startswith("COPY trainer"))
        assert reqs < where < code, name


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_signal_to_torchrun_is_forwarded_and_resume_continues(tmp_path, straight, sig):
    """What Slurm `--signal` / `docker kill -s USR1` (SIGUSR1) and `docker stop` (SIGTERM) do to a
    container whose PID 1 is torchrun. Without SIGUSR1 in the list torchrun dies of it at once
    (exit 138) and its workers run on, orphaned, with no checkpoint."""
    out = tmp_path / "run"
    env = _image_signal_env("Dockerfile")
    proc = _launch(out, *TINY, *STEPS, env={**env, **HOLD})
    _wait_for(lambda: held(out, "step-3", range(2)), proc)
    os.kill(proc.pid, sig)
    _wait_for(lambda: held(out, "step-3", range(2), "signalled"), proc)  # torchrun forwarded it to both ranks
    release(out, "step-3")
    _, err = proc.communicate(timeout=300)
    # torchrun forwards the signal, waits for its workers, then re-raises its own SignalException
    # (exit 1); the workers exited 143 after the checkpoint, within torchrun's grace.
    assert proc.returncode == 1, err[-3000:]
    assert "Sending process" in err and f"closing signal {sig.name}" in err
    assert "forcefully exiting" not in err  # no SIGKILL after the grace time

    stopped = _assert_preempt_checkpoint(out, 20)
    for r in range(2):
        log_text = (out / "logs" / f"rank{r}.log").read_text()
        assert f"{sig.name} received: stopped after step {stopped}" in log_text
        assert f"exiting with {EXIT_PREEMPTED}" in log_text
    assert losses(out) == straight[:stopped]

    run_trainer(out, *TINY, *STEPS, "--resume", "latest", nproc=2)
    assert losses(out) == straight


def test_kill_during_save_keeps_previous_checkpoint(tmp_path, straight):
    out = tmp_path / "run"
    # The straight run's first 6 steps: its LR schedule (a cosine over 20 steps), stopped at 6.
    args = (*TINY, "--train.steps", "6", "--schedule.total_steps", "20", "--checkpoint.interval", "2")
    proc = _launch(out, *args, env=hold_env("save:4"))
    tmp4 = out / "checkpoints" / ".tmp-step-4"
    # Both ranks finished writing step 4 (their manifests exist) and are held before the rename.
    _wait_for(lambda: held(out, "save-4", range(2)), proc)
    assert all((tmp4 / f"manifest.rank{r}.json").is_file() for r in range(2))
    _kill_all(proc)
    proc.communicate(timeout=60)

    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-2"
    assert not (ckpts / "step-4").exists() and tmp4.is_dir()
    before = losses(out)
    assert len(before) == 4  # steps 1-4 ran before the kill

    run_trainer(out, *args, "--resume", "latest", nproc=2)
    after = losses(out)  # records of steps 3-4 from before the kill were dropped on resume ...
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert after[:4] == before  # ... and redone bit for bit
    assert after == straight[:6]  # the continued steps are the uninterrupted run's, bit for bit
    assert (ckpts / "latest").read_text().strip() == "step-6"
    assert not tmp4.exists()  # the next save of step 4 replaced the leftover
