"""`slurm.sbatch` written by someone who wants the job's files or its environment (issue 54, item
3). The options are written after the runner's own `#SBATCH` lines and sbatch takes the later
one: `--output=/home/%u/.bashrc` appended the job's output to the user's shell start-up file,
`--export=ALL,PATH=...` set the batch step's PATH. Now a closed allow-list (runner/inventory/
sbatch_options.py), each value's form checked where the inventory is read, and none of the options
the runner sets itself; a refusal is one line naming file:line, the option and what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.core.errors import UserError
from runner.inventory.slurm import load_slurm_inventory


def _inv(tmp_path: Path, option: str) -> Path:
    p = tmp_path / "slurm.yaml"
    p.write_text(f"slurm:\n  nodes: 2\n  sbatch:\n    - '--constraint=a100'\n    - '{option}'\njob:\n  image: t:1\n")
    return p


def _refused(tmp_path: Path, option: str, why: str = "") -> str:
    p = _inv(tmp_path, option)
    with pytest.raises(UserError) as exc:
        load_slurm_inventory(str(p), check_files=False)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{p}:5: slurm.sbatch[1]: ") and why in msg, msg
    return msg


@pytest.mark.parametrize("option", [
    "--output=/home/%u/.bashrc", "--error=/home/%u/.profile", "--input=/etc/shadow", "--out=/home/%u/.bashrc",
    "--export=ALL,PATH=/tmp/evil", "--export-file=/tmp/env", "--chdir=/home/u", "--job-name=other",
    "--nodes=1", "--ntasks=64", "--ntasks-per-node=8", "--open-mode=truncate", "--signal=KILL@1", "--requeue",
    "--no-requeue", "--array=0-999", "--wrap=id", "--get-user-env", "--uid=0", "--container=/x", "--parsable",
    "--wait", "--kill-on-invalid-dep=no", "--propagate=ALL", "--batch=x", "--clusters=other", "--hold",
])
def test_options_that_move_the_jobs_files_or_set_its_environment_are_refused(tmp_path, option):
    """Before: each loaded and was written as the last `#SBATCH` line, after the runner's own."""
    msg = _refused(tmp_path, option)
    assert option.split("=")[0] in msg


@pytest.mark.parametrize("option, field", [
    ("--time=1", "slurm.time"), ("--mem=1G", "slurm.mem"), ("--partition=x", "slurm.partition"),
    ("--account=a", "slurm.account"), ("--qos=q", "slurm.qos"), ("--cpus-per-task=2", "slurm.cpus_per_task"),
    ("--gpus-per-node=1", "slurm.gpus_per_node"),
])
def test_an_option_the_inventory_has_a_field_for_points_to_the_field(tmp_path, option, field):
    """sbatch would take the later one: slurm.time's preempt signal and slurm.mem's sizing would read
    a value the job does not get."""
    assert f"use {field}" in _refused(tmp_path, option)


@pytest.mark.parametrize("option", [
    "--constraint=a100&ib", "--gres=gpu:a100:2", "--exclusive", "--exclusive=user", "--mail-type=END,FAIL",
    "--mail-user=me@example.org", "--reservation=maint-1", "--comment=run-42", "--licenses=matlab:2",
    "--nice=100", "--mem-per-gpu=40G", "--tmp=100G", "--exclude=node[01-04]", "--nodelist=gpu01,gpu02",
    "--hint=nomultithread", "--begin=now+1hour", "--dependency=afterok:123:456", "--wckey=proj", "--prefer=a100",
    "--switches=1@10:00", "--gpus-per-task=1", "--time-min=30", "--contiguous", "--oversubscribe",
])
def test_allowed_options_keep_their_value(tmp_path, option):
    inv = load_slurm_inventory(str(_inv(tmp_path, option)), check_files=False)
    assert inv.slurm.sbatch == ["--constraint=a100", option]


@pytest.mark.parametrize("option, why", [
    ("--mail-type=END,RM", "mail-type"), ("--nice=-1000", "nice"), ("--gres=gpu:a100:2%u", "gres"),
    ("--mem-per-gpu=lots", "mem-per-gpu"), ("--exclusive=everything", "exclusive"), ("--hint=fast", "hint"),
    ("--comment=" + "x" * 300, "comment"), ("--gpus-per-task=0", "gpus-per-task"),
    ("--mail-user=me@%h", "mail-user"), ("--tmp=99999999999999999999G", "tmp"), ("--contiguous=yes", "contiguous"),
])
def test_an_allowed_option_with_a_value_of_the_wrong_form_is_refused(tmp_path, option, why):
    _refused(tmp_path, option, why)


def test_many_options_are_refused(tmp_path):
    p = tmp_path / "slurm.yaml"
    p.write_text("slurm:\n  nodes: 2\n  sbatch: [" + ", ".join(["--contiguous"] * 200) + "]\njob:\n  image: t:1\n")
    with pytest.raises(UserError, match=r"slurm.yaml:3: slurm.sbatch: 200 options; at most 64"):
        load_slurm_inventory(str(p), check_files=False)


def test_the_runners_own_directives_come_last(tmp_path):
    """Whatever the list holds, the runner's own directives are written after it: sbatch takes the
    later one, so an option slipped past the list still could not move the job's files."""
    from runner.backends.slurm.plan import SlurmFacts, make_slurm_plan

    inv = load_slurm_inventory(str(_inv(tmp_path, "--exclusive")), check_files=False)
    plan = make_slurm_plan(inv, "20260101-000000-abcd", SlurmFacts(home="/home/u"))
    lines = [ln[len("#SBATCH "):] for ln in plan.script.splitlines() if ln.startswith("#SBATCH ")]
    assert lines[:2] == ["--constraint=a100", "--exclusive"], lines
    assert any(ln.startswith("--output=") for ln in lines[2:])
