"""A stuck rank, found by its heartbeat, read by its stacks, ended by its sized collective timeout
(issue 57, trainer side), with real gloo runs:

- a 3-stage pipeline whose middle rank is SIGSTOPped while it computes: its heartbeat's writer
  stops (alive_at frozen) while the others' keeps going with their progress frozen in recv/send;
  the reader's rule (contract.hang.Watch) blames rank 1, by its stopped writer and by its phase;
  `python -m trainer.tools.stacks` writes hang-rank<R>.txt for every rank (the live ones through
  their faulthandler from inside the gloo wait, the stopped one through py-spy --nonblocking), each
  with the training loop's frames; then the others give up after parallel.timeout_s by
  themselves, each with one line, its own stacks and exit code 124;
- a run whose first step and checkpoint are held far past 10 median steps never looks stalled;
- a rank slowed to a tenth of its CPU is named as the straggler, once, and in metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from contract import hang as rule
from contract import heartbeat as fmt
from tests.support.runner_helpers import wait_for
from tests.support.trainer_run import REPO, held, hold_env, release, start_trainer, trainer_env

PIPE = ("configs/pi-qwen3-3stage-tiny.yaml",)
COMPUTE = ("forward", "backward")
LOOP_FRAMES = ("train_step", "_loop")


def beats(out: Path) -> dict[int, fmt.Heartbeat]:
    return fmt.read_dir(out)[0]


def until(cond, proc: subprocess.Popen, timeout: float = 300, interval: float = 0.02):
    """wait_for(cond), failing at once with the run's log if the run ends first."""
    found: list = []

    def check() -> bool:
        got = cond()
        if got:
            found.append(got)
        return bool(got) or proc.poll() is not None

    wait_for(check, timeout, interval)
    if not found:
        raise AssertionError(f"the run ended (exit {proc.returncode}) before the condition held")
    return found[0]


def kill_all(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    for pid in [*map(int, kids), proc.pid]:
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def stop_while_computing(out: Path, rank: int, tries: int = 200) -> fmt.Heartbeat:
    """SIGSTOP `rank` at a moment its heartbeat says forward/backward; its file read after the stop
    (the writer can no longer move it) must still say so, else SIGCONT and try again."""
    for _ in range(tries):
        b = beats(out).get(rank)
        if b is None or b.phase not in COMPUTE:
            time.sleep(0.005)
            continue
        os.kill(b.pid, signal.SIGSTOP)
        time.sleep(3 * b.heartbeat_s)  # a write in flight lands (or never will)
        after = beats(out)[rank]
        if after.phase in COMPUTE:
            return after
        os.kill(b.pid, signal.SIGCONT)
    raise AssertionError(f"rank {rank} was never stopped inside a compute phase in {tries} tries")


@pytest.mark.multiproc
def test_stopped_rank_named_stacked_and_timed_out(tmp_path):
    out = tmp_path / "run"
    timeout_s = 20
    proc = start_trainer(out, *PIPE, "--train.steps", "3000", "--parallel.timeout_s", str(timeout_s),
                         "--watch.heartbeat_s", "0.05", nproc=3, log=tmp_path / "torchrun.log")
    stopped = None
    try:
        # Past the first steps every rank's groups wait parallel.timeout_s (heartbeat: collective_timeout_s).
        phases: set[str] = set()
        steps: dict[int, set[int]] = {0: set(), 1: set(), 2: set()}

        def steady() -> bool:
            bs = beats(out)
            phases.update(b.phase for b in bs.values())
            for r, b in bs.items():
                steps[r].add(b.step)
            return len(bs) == 3 and all(b.collective_timeout_s == timeout_s and b.step >= 6 for b in bs.values())

        until(steady, proc)
        assert len(phases & {"data", "forward", "backward", "recv", "send", "grad_norm", "optimizer", "log",
                             "collective"}) >= 3, phases
        assert all(len(s) >= 3 for s in steps.values()), steps  # every rank's step seen advancing
        assert all(b.budget_s == rule.MIN_HANG_S for b in beats(out).values())  # steady: the 120-s floor

        before = stop_while_computing(out, 1)
        stopped = before.pid
        watch = rule.Watch(hang_timeout_s=4.0)  # the reader's own timeout, short for the test
        first = beats(out)
        verdict = until(lambda: (feed_all(watch, out), watch.verdict(time.monotonic()))[1], proc, timeout=60)
        last = beats(out)
        # rank 1: its writer stopped in a compute phase; the others wait on it, alive, making no progress.
        assert last[1].seq == first[1].seq == before.seq and last[1].phase in COMPUTE
        for r in (0, 2):
            assert last[r].seq > first[r].seq and last[r].alive_at > first[r].alive_at
            assert last[r].progress_at == first[r].progress_at and last[r].phase in fmt.WAITING, last[r]
        assert last[0].step >= last[1].step >= last[2].step  # 1F1B: the first stage runs ahead
        assert verdict.culprits == [1] and verdict.waiting == [0, 2]
        assert f"rank 1 ({last[1].node}, pid {stopped}) at step {last[1].step}, {last[1].phase}" in verdict.line
        assert "stopped or frozen" in verdict.line and verdict.line.endswith("(waiting: ranks 0,2)")
        # Had its writer kept going, its phase alone names it: compute while the others wait.
        by_phase = rule.Watch(hang_timeout_s=1.0)
        for b in last.values():
            by_phase.update(b, 0.0)
        for b in last.values():
            by_phase.update(fmt.from_dict(b.to_dict() | {"seq": b.seq + 1, "alive_at": b.alive_at + 5}), 5.0)
        v = by_phase.verdict(5.0)
        assert v is not None and v.culprits == [1] and "the others wait for it" in v.line

        take_stacks(out, stopped)

        # The live ranks give up by themselves after parallel.timeout_s: one line each, exit 124.
        until(lambda: all(b.phase == "failed" for r, b in beats(out).items() if r != 1), proc, timeout=240)
        for r in (0, 2):
            b = beats(out)[r]
            assert b.error.startswith(f"collective timeout after {timeout_s} s at step"), b.error
            assert b.phase == "failed" and ("recv" in b.error or "send" in b.error), b.error  # where it waited
            log = (out / "logs" / f"rank{r}.log").read_text()
            lines = [ln for ln in log.splitlines() if "a collective gave up" in ln]
            assert len(lines) == 1 and f"after {timeout_s} s" in lines[0] and "exit 124" in lines[0]
            own = (out / f"hang-rank{r}.txt").read_text()
            assert "after a collective timed out" in own and "Timed out waiting" in own
            assert all(f in own for f in LOOP_FRAMES)
        # The first to exit ends the job: torchrun stops the others (a stopped one only by SIGKILL).
        proc.wait(timeout=120)
        report = (tmp_path / "torchrun.log").read_text()
        assert "exitcode  : 124" in report.split("Root Cause")[-1], report[-3000:]
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        kill_all(proc)


def feed_all(watch: rule.Watch, out: Path) -> None:
    now = time.monotonic()
    for b in beats(out).values():
        watch.update(b, now)


def stacks_tool(out: Path) -> subprocess.CompletedProcess:
    """`python -m trainer.tools.stacks --out OUT` as the runner execs it in a container (skips
    without py-spy); asserts it exited 0."""
    if shutil.which("py-spy", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("py-spy is not installed (pip install -e '.[dev]')")
    env = trainer_env({"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"})
    env.pop("NODE_NAME", None)
    p = subprocess.run([sys.executable, "-m", "trainer.tools.stacks", "--out", str(out)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def take_stacks(out: Path, stopped: int) -> None:
    """The helper, as the runner execs it in a container: every rank's stacks, the stopped one too."""
    p = stacks_tool(out)
    assert len(p.stdout.splitlines()) == 3, p.stdout
    for r in range(3):
        text = (out / f"hang-rank{r}.txt").read_text()
        head = text.splitlines()[0]
        if r == 1:
            assert "process state T" in head and "py-spy dump --nonblocking" in head, head
        else:
            assert "faulthandler (SIGUSR2)" in head, head
            assert "most recent call first" in text  # faulthandler's own header, from inside the gloo wait
        assert all(f in text for f in LOOP_FRAMES), text[:3000]
        assert "# heartbeat: node " in text
    assert Path(f"/proc/{stopped}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"  # still stopped


def test_long_first_step_and_checkpoint_never_look_stalled(tmp_path):
    """The first step held longer than 10 later ones, a checkpoint held 3x the steady budget: with the rule's
    floor lowered to 0 (so 10 median steps is all a steady phase gets), neither is a hang, because
    their phases bring their own budgets; the same stalls in a steady phase would have been."""
    out = tmp_path / "run"
    proc = start_trainer(out, "configs/tiny.yaml", "--train.steps", "10", "--checkpoint.interval", "6",
                         "--watch.heartbeat_s", "0.05", env=hold_env("step:1", "save:6"), log=tmp_path / "log")
    watch = rule.Watch(min_hang_s=0.0)
    stalls: dict[tuple[int, str], float] = {}
    verdicts = []

    def sample() -> fmt.Heartbeat | None:
        b = beats(out).get(0)
        if b is not None:
            now = time.monotonic()
            watch.update(b, now)
            key = (b.step, b.phase)
            stalls[key] = max(stalls.get(key, 0.0), watch.stall_s(0, now))
            if (v := watch.verdict(now)) is not None:
                verdicts.append(v.line)
        return b

    try:
        until(lambda: sample() and held(out, "step-1", [0]), proc)
        t = time.monotonic()
        while time.monotonic() - t < 3.0:  # the first step goes on (a compile, say)
            sample()
            time.sleep(0.02)
        release(out, "step-1")
        until(lambda: sample() and held(out, "save-6", [0]), proc)
        steady = rule.steady_budget(beats(out)[0].median_step_s, min_hang_s=0.0)
        until(lambda: (b := sample()) is not None and watch.stall_s(0, time.monotonic()) > 3 * steady
              and b.phase == "checkpoint", proc, timeout=120)
        release(out, "save-6")
        until(lambda: (b := sample()) is not None and b.phase == "done", proc)
        assert proc.wait(timeout=60) == 0
    finally:
        kill_all(proc)
    final = beats(out)[0]
    steady = rule.steady_budget(final.median_step_s, min_hang_s=0.0)
    first = max(s for (step, _), s in stalls.items() if step == 1)
    ckpt = max(s for (_, phase), s in stalls.items() if phase == "checkpoint")
    assert first >= 5 * final.median_step_s and first > steady  # the first step: past 10 later ones
    assert ckpt > steady  # the checkpoint: past 10 median steps
    assert verdicts == []


@pytest.mark.multiproc
@pytest.mark.alone  # relative speeds: the other test worker's load must not blur them
def test_straggler_named_once_and_in_metrics(tmp_path):
    out = tmp_path / "run"
    proc = start_trainer(out, "configs/tiny.yaml", "--train.steps", "60", "--data.seq_len", "128",
                         "--train.batch_size", "8", "--watch.heartbeat_s", "0.05", nproc=2, log=tmp_path / "log")
    stop = threading.Event()
    try:
        until(lambda: (bs := beats(out)).get(1) is not None and bs[1].step >= 4, proc)
        pid = beats(out)[1].pid

        def throttle() -> None:  # a tenth of its CPU: stopped 45 ms of every 50
            while not stop.is_set():
                try:
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(0.045)
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    return
                time.sleep(0.005)

        th = threading.Thread(target=throttle, daemon=True)
        th.start()
        until(lambda: "straggler: rank 1" in (out / "logs" / "rank0.log").read_text(), proc, timeout=300)
        stop.set()
        th.join()
        os.kill(pid, signal.SIGCONT)
        assert proc.wait(timeout=600) == 0
    finally:
        stop.set()
        kill_all(proc)
    lines = [ln for ln in (out / "logs" / "rank0.log").read_text().splitlines() if "straggler:" in ln]
    assert len(lines) == 1 and "rank 1 computes" in lines[0], lines
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    flagged = [r for r in records if r.get("stragglers")]
    assert flagged and all(r["stragglers"] == [1] for r in flagged)
    assert all(len(r["rank_step_s"]) == len(r["rank_wait_s"]) == 2 for r in records)
    busy = rule.busy_times(flagged[0]["rank_step_s"], flagged[0]["rank_wait_s"])
    assert busy[1] >= 1.5 * busy[0]


def test_every_process_group_takes_the_sized_timeout():
    """A group made by new_group (the checkpointer's gloo group, tied weights') waits torch's default
    30 minutes whatever init_process_group was given; set_collective_timeout reaches it too."""
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        from datetime import timedelta
        from trainer.runtime.dist_env import set_collective_timeout, p2p_timeout
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
        late = dist.new_group([0])
        def timeout(g): return g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        before = timeout(late)
        n = set_collective_timeout(7)
        print(before, n, timeout(late), timeout(dist.distributed_c10d._get_default_group()), p2p_timeout().total_seconds())
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=trainer_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["1800.0", "2", "7.0", "7.0", "7.0"]
