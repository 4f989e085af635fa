"""Staging and submitting a Slurm run (runner/backends/slurm/submit.py: submit, stop_job, cancel)
through the runner's real LocalShell on a directory of this machine, with `sbatch`, `scontrol` and
`scancel` as stand-in scripts on PATH that record their calls (named as such: the Slurm cluster's
own tests, tests/slurm/, run the real ones in the sandbox, as `runner` subprocesses).

What is asserted is what the files say afterwards: the script and the 0600 secrets file staged with
their modes and bytes, the run's record naming the job, and after a refused submission nothing of
the run's values left behind."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import yaml

from runner.backends.slurm import submit as slurm_submit
from runner.backends.slurm.plan import DOWN_MARK, SlurmFacts, make_slurm_plan
from runner.backends.slurm.shell import LocalShell
from runner.core.errors import UserError
from runner.inventory.slurm import load_slurm_inventory

RUN = "20260101-000000-abcd"
SECRET = "hf_not_a_real_token_4242"


def _tools(tmp: Path, monkeypatch, sbatch: str, scontrol_state: str = "COMPLETED") -> Path:
    """Stand-ins for sbatch (its body given), scontrol (`show job` answers one state) and scancel,
    first on PATH; each appends its argv to calls.log. The log's path."""
    bin_dir, log = tmp / "bin", tmp / "calls.log"
    bin_dir.mkdir()
    bodies = {"sbatch": sbatch,
              "scontrol": f'echo "JobId=$4 JobName=runner JobState={scontrol_state} Reason=None ExitCode=0:0 '
                          f'RunTime=00:00:09 NodeList=n[0-1]"',
              "scancel": "exit 0"}
    for name, body in bodies.items():
        p = bin_dir / name
        p.write_text(f'#!/bin/sh\n# stand-in for Slurm\'s {name} (tests/unit/test_slurm_submit.py)\n'
                     f'echo "{name} $*" >> {log}\n{body}\n')
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def _plan(tmp: Path, secrets: dict[str, str] | None = None):
    """A Slurm inventory without a login node whose workdir is under tmp, and its plan."""
    inv_path = tmp / "slurm.yaml"
    inv_path.write_text(yaml.safe_dump({
        "slurm": {"partition": "debug", "nodes": 2, "container": "none", "workdir": str(tmp / "shared")},
        "job": {"image": "runner-trainer:latest", "command": ["python", "-c", "print(1)"],
                "env": {"OMP_NUM_THREADS": "1"}, "grace_period": 7}}))
    inv = load_slurm_inventory(str(inv_path))
    plan = make_slurm_plan(inv, RUN, SlurmFacts(home=str(tmp)), secret_keys=list(secrets or {}))
    return inv, plan


def test_a_submission_stages_the_script_and_secrets_with_their_modes_and_records_the_job(tmp_path, monkeypatch):
    log = _tools(tmp_path, monkeypatch, 'echo "4242;cluster"')
    inv, plan = _plan(tmp_path, {"HF_TOKEN": SECRET})
    job_id = slurm_submit.submit(LocalShell(), inv, plan, {"HF_TOKEN": SECRET})
    assert job_id == "4242"
    assert log.read_text().splitlines() == [f"sbatch --parsable {plan.script_path}"]
    script = Path(plan.script_path)
    assert script.read_text() == plan.script and stat.S_IMODE(script.stat().st_mode) == 0o700
    assert SECRET not in plan.script
    secrets = Path(plan.secrets_file)
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600 and SECRET in secrets.read_text()
    assert stat.S_IMODE(secrets.parent.stat().st_mode) & 0o077 == 0
    rec = json.loads((Path(plan.run_dir) / "slurm" / "run.json").read_text())
    assert (rec["run_id"], rec["grace_period"], rec["nodes"], rec["container"]) == (RUN, 7, 2, "none")
    assert [(s["job_id"], s["submission"], s["script"], s["resume"]) for s in rec["submissions"]] == [
        ("4242", 1, plan.script_path, False)]


def test_a_second_submission_of_the_run_is_appended_to_its_record(tmp_path, monkeypatch):
    _tools(tmp_path, monkeypatch, 'echo "$(( $(grep -c sbatch ' + str(tmp_path / "calls.log") + ') + 10 ))"')
    inv, plan = _plan(tmp_path)
    assert slurm_submit.submit(LocalShell(), inv, plan, {}) == "11"
    again = make_slurm_plan(inv, RUN, SlurmFacts(home=str(tmp_path)), submission=2, resume=True)
    assert slurm_submit.submit(LocalShell(), inv, again, {}) == "12"
    rec = json.loads((Path(plan.run_dir) / "slurm" / "run.json").read_text())
    assert [(s["job_id"], s["submission"], s["resume"]) for s in rec["submissions"]] == [
        ("11", 1, False), ("12", 2, True)]
    assert Path(again.script_path).name == "submit-2.sbatch" and Path(plan.script_path).exists()


@pytest.mark.parametrize("sbatch, shown", [
    ('echo "sbatch: error: Batch job submission failed: Invalid partition name specified" >&2; exit 1',
     "sbatch: error: Batch job submission failed: Invalid partition name specified"),
    ('echo "Submitted batch job"', "Submitted batch job"),   # exit 0 but no job id: not a submission
    ("exit 3", "exit 3"),
])
def test_a_refused_submission_is_one_line_and_leaves_no_script_nor_secret(tmp_path, monkeypatch, sbatch, shown):
    _tools(tmp_path, monkeypatch, sbatch)
    inv, plan = _plan(tmp_path, {"HF_TOKEN": SECRET})
    with pytest.raises(UserError) as exc:
        slurm_submit.submit(LocalShell(), inv, plan, {"HF_TOKEN": SECRET})
    assert str(exc.value) == f"sbatch failed on this machine: {shown}; nothing submitted"
    assert not Path(plan.script_path).exists() and not Path(plan.secrets_file).exists()
    assert not (Path(plan.run_dir) / "slurm" / "run.json").exists()
    left = [p for p in (tmp_path / "shared").rglob("*") if p.is_file()]
    assert not [p for p in left if SECRET in p.read_text(errors="replace")], left


def test_stop_job_of_an_ended_job_marks_the_run_down_and_signals_nothing(tmp_path, monkeypatch):
    log = _tools(tmp_path, monkeypatch, "exit 1", scontrol_state="COMPLETED")
    run_dir = tmp_path / "shared" / "runs" / RUN
    (run_dir / "slurm").mkdir(parents=True)
    st, how = slurm_submit.stop_job(LocalShell(), str(run_dir), "77", grace=5)
    assert (st.state, how) == ("COMPLETED", "not running")
    assert (run_dir / "slurm" / DOWN_MARK).exists()  # a --requeue job must not come back after a down
    assert "scancel" not in log.read_text()


def test_stop_job_of_a_pending_job_cancels_it_without_usr1(tmp_path, monkeypatch):
    """A job that has not started has no steps to checkpoint: scancel at once, no USR1 and no grace."""
    log = _tools(tmp_path, monkeypatch, "exit 1", scontrol_state="PENDING")
    # scancel ends it: from then on scontrol says CANCELLED
    (tmp_path / "bin" / "scancel").write_text(
        f'#!/bin/sh\necho "scancel $*" >> {log}\n'
        f"sed -i s/PENDING/CANCELLED/ {tmp_path / 'bin' / 'scontrol'}\n")
    run_dir = tmp_path / "shared" / "runs" / RUN
    (run_dir / "slurm").mkdir(parents=True)
    st, how = slurm_submit.stop_job(LocalShell(), str(run_dir), "78", grace=600)
    assert (st.state, how) == ("CANCELLED", "cancelled")
    assert [ln for ln in log.read_text().splitlines() if ln.startswith("scancel")] == ["scancel 78"]
