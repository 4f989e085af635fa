"""runner.api driven in this process (no `runner` subprocess) against the session's Slurm sandbox
cluster (tests/conftest.py `slurm`): check, plan, submit (detached over the login node, attached
from this machine), describe, runs, logs, exec_argv, cancel, collect; every RunStatus validated
against the same schema as the SSH runs' (test_api_sandbox.py)."""

from __future__ import annotations

import json
import re
import subprocess
import threading

import jsonschema
import pytest

from runner import api
from runner.cli.main import main as runner_main
from tests.slurm.test_slurm_cluster import HOLD, STEPS, held_job, job_file, losses
from tests.support.runner_helpers import wait_for
from tests.support.trainer_run import held, release

pytestmark = [pytest.mark.slurm, pytest.mark.sandbox]
NODES = ["node-0", "node-1", "node-2"]


def valid(st: api.RunStatus) -> api.RunStatus:
    jsonschema.validate(json.loads(json.dumps(st.as_dict())), api.run_status_schema())
    assert st.backend == "slurm"
    return st


def test_slurm_runs_through_the_api(slurm, tmp_path, monkeypatch, capsys):
    """A held run submitted on the login node, looked at while it runs, stopped by cancel (the
    preempt checkpoint), then resumed from this machine, attached, to the end."""
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))  # the local shell's sbatch, scontrol, srun
    backend = api.backend_for(api.load_inventory(slurm.inv, job=held_job(tmp_path)))
    report = backend.check()
    c = report.items[0]
    assert report.ok and (c.login, c.tools_missing, c.partition, c.partition_nodes, c.partition_state) == (
        "ok", [], "debug", 3, "UP"), report.problems
    plan = backend.plan(api.SlurmUpOptions(requeue=True))
    assert plan.ranks == {n: i for i, n in enumerate(NODES)} and "#SBATCH --requeue" in plan.detail.script
    run = backend.submit(plan, detach=True)
    assert run.detached and run.exit_code == 0 and run.job_id and run.job_id.isdigit()
    rd = slurm.shared / "runs" / run.run_id
    stopped: list = []
    try:
        wait_for(lambda: held(rd, HOLD, range(3)), 300)
        st = valid(backend.describe(run))
        assert (st.state, st.native_state, st.job_id, st.submissions) == ("running", "RUNNING", run.job_id, 1)
        assert [(n.node, n.rank) for n in st.nodes] == [(n, i) for i, n in enumerate(NODES)]
        capsys.readouterr()
        assert runner_main(["status", run.run_id, "-i", str(slurm.inv), "--json"]) == 0  # what the command prints
        doc = json.loads(capsys.readouterr().out)
        jsonschema.validate(doc, api.run_status_schema())
        assert (doc["backend"], doc["state"], doc["native_state"]) == ("slurm", "running", "RUNNING")
        lines = [str(ln) for ln in backend.logs(run)]
        assert any(ln.startswith(f"[slurm] runner: job {run.job_id} ") for ln in lines), lines[:20]
        assert any(ln.startswith("[node-2/2] [rank2] step 2 loss") for ln in lines), lines[-20:]
        assert [str(ln) for ln in backend.logs(run, nodes=["node-2"])] == [ln for ln in lines if ln.startswith("[node-2/2] ")]
        argv = backend.exec_argv(run, "node-1", ["sh", "-c", "echo $SLURMD_NODENAME $SLURM_JOB_ID"])
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert (out.returncode, out.stdout.split()) == (0, ["node-1", run.job_id]), out.stderr
        cancel = threading.Thread(target=lambda: stopped.append(backend.cancel(run)), daemon=True)
        cancel.start()
        wait_for(lambda: held(rd, HOLD, range(3), "signalled"), 120)
    finally:
        release(rd, HOLD)
    cancel.join(300)
    assert stopped and stopped[0].lines[0].startswith(f"run {run.run_id}: Slurm job {run.job_id} sent USR1; ended "
                                                      "within the grace period"), stopped
    # the job's steps have ended; Slurm may still show it COMPLETING for a moment (its epilog)
    st = valid(backend.wait(run.run_id, timeout_s=120, poll_s=1.0))
    assert (st.state, st.native_state, st.exit_code) == ("stopped", "FAILED", 143)
    col = backend.collect(run, dest=str(tmp_path / "art"))
    assert col.ok and len(losses(col.dest / "slurm" / "metrics.jsonl")) == 3

    local = api.backend_for(api.load_inventory(slurm.local, job=job_file(tmp_path)))
    done = local.submit(local.plan({"resume": run.run_id}))
    assert (done.run_id, done.exit_code, done.detached) == (run.run_id, 0, False)
    st = valid(local.describe(run.run_id))
    assert (st.state, st.native_state, st.exit_code, st.submissions) == ("succeeded", "COMPLETED", 0, 2)
    rows = {r.run_id: r for r in map(valid, local.runs())}
    assert (rows[run.run_id].state, rows[run.run_id].job_id) == ("succeeded", st.job_id)
    col = local.collect(run.run_id, dest=str(tmp_path / "art2"), plots=False)
    assert col.ok and len(losses(col.dest / "slurm" / "metrics.jsonl")) == STEPS
    # Nothing left to stop, by id and as the latest run (none of the session's runs is still queued).
    again = local.cancel(run.run_id)
    assert (again.exit_code, again.stopped) == (0, [])
    assert re.fullmatch(rf"run {run.run_id}: nothing running \(Slurm job {st.job_id} (COMPLETED|GONE)\)", again.lines[0])
    assert re.fullmatch(r"run \S+: nothing (running \(Slurm job \d+ \w+\)|submitted)", local.cancel().lines[0])
