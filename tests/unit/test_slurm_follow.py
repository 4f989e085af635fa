"""`runner up` on Slurm follows the job until it has ended. A job whose tasks have exited sits in
COMPLETING while its nodes run the epilog; only then does the controller name its final state
(COMPLETED, FAILED, CANCELLED, ...). CI once failed a run whose torchrun exited 0 on every node
because the follower stopped at COMPLETING ("Slurm job 8 ended COMPLETING (exit 0)").

The sandbox's Slurm has no epilog, so how long a job stays COMPLETING there is a race. Here
`scontrol` is a stand-in script on PATH (named as such: it plays the controller during an
epilog), run through the runner's real LocalShell."""

from __future__ import annotations

import io
import os
import stat

import pytest

from runner.backends.slurm import status
from runner.backends.slurm.shell import LocalShell


def _fake_scontrol(tmp_path, monkeypatch, states: list[str]) -> None:
    """`scontrol show job -o 7` answers states[k] on its k-th call, then the last one for ever."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "answers").write_text("\n".join(states) + "\n")
    script = bin_dir / "scontrol"
    script.write_text(f"""#!/bin/sh
# stand-in for Slurm's scontrol (tests/unit/test_slurm_follow.py)
n=$(cat {tmp_path}/calls 2>/dev/null || echo 0); echo $((n + 1)) > {tmp_path}/calls
total=$(wc -l < {tmp_path}/answers)
k=$((n + 1)); [ "$k" -gt "$total" ] && k=$total
state=$(sed -n "${{k}}p" {tmp_path}/answers)
echo "JobId=7 JobName=runner JobState=$state Reason=None ExitCode=0:0 RunTime=00:00:09 NodeList=n[0-1]"
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "run" / "slurm" / "7").mkdir(parents=True)


def _follow(tmp_path):
    return status.Follower(LocalShell(), str(tmp_path / "run"), "7", nodes=["n0"], out=io.StringIO()).follow()


def test_the_follower_waits_out_completing_for_the_final_state(tmp_path, monkeypatch):
    _fake_scontrol(tmp_path, monkeypatch, ["RUNNING", "COMPLETING", "COMPLETING", "COMPLETED"])
    st = _follow(tmp_path)
    assert (st.state, st.exit_code) == ("COMPLETED", 0)
    assert int((tmp_path / "calls").read_text()) == 4


@pytest.mark.parametrize("final", ["FAILED", "CANCELLED"])
def test_a_job_that_fails_after_completing_is_reported_as_such(tmp_path, monkeypatch, final):
    _fake_scontrol(tmp_path, monkeypatch, ["COMPLETING", final])
    assert _follow(tmp_path).state == final


def test_a_job_stuck_in_completing_ends_the_follow_after_the_bound(tmp_path, monkeypatch):
    """An epilog that never ends must not hold `runner up` for ever: after COMPLETING_WAIT_S the
    follow returns COMPLETING, which `runner up` reports as not a success."""
    monkeypatch.setattr(status, "COMPLETING_WAIT_S", 2.0)
    _fake_scontrol(tmp_path, monkeypatch, ["COMPLETING"])
    assert _follow(tmp_path).state == "COMPLETING"
    assert 3 <= int((tmp_path / "calls").read_text()) <= 6
