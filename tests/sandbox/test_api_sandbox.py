"""runner.api driven in this process (no `runner` subprocess) against the session's sandbox
cluster: check, push, plan, submit (detached and attached), describe, runs, logs, exec_argv,
cancel, wait, collect; every RunStatus validated against the one published schema (the Slurm
side: test_api_slurm.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jsonschema
import pytest

from runner import api
from runner.cli.main import main as runner_main
from tests import IMAGE
from tests.support.runner_helpers import finish_run, wait_for, write_job

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]
NODES = ["node-0", "node-1", "node-2"]


def valid(st: api.RunStatus) -> api.RunStatus:
    jsonschema.validate(json.loads(json.dumps(st.as_dict())), api.run_status_schema())
    assert st.backend == "ssh"
    return st


def cli_json(argv: list[str], capsys):
    """`runner ARGV --json` in this process: its document."""
    capsys.readouterr()
    assert runner_main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_detached_run_through_the_api(sandbox, pushed, tmp_path, capsys):
    backend = api.backend_for(api.load_inventory(sandbox, job=write_job(tmp_path, hold=True)))
    report = backend.check()
    assert report.ok and [c.node for c in report.items] == NODES, report.problems
    assert {r.action for r in backend.push()} == {"skipped"}  # the session's push brought every layer
    assert backend.sync() == []  # no job.sync
    plan = backend.plan({"no_push": True})
    assert plan.ranks == {n: i for i, n in enumerate(NODES)} and set(plan.images.values()) == {IMAGE}
    run = backend.submit(plan, detach=True)
    assert run.detached and run.exit_code == 0 and run.run_id
    try:
        def probed() -> list[str] | None:
            lines = [str(ln) for ln in backend.logs(run)]
            return lines if all(f"probe {n} rank {i} of 3" in " ".join(lines) for i, n in enumerate(NODES)) else None

        lines = wait_for(probed, 120)
        assert "[node-2/2] probe node-2 rank 2 of 3" in lines
        assert [str(ln) for ln in backend.logs(run, nodes=["node-1"])] == [ln for ln in lines if ln.startswith("[node-1/")]
        st = valid(backend.describe(run))
        assert (st.run_id, st.state, st.exit_code) == (run.run_id, "running", None)
        assert [(n.node, n.rank, n.state) for n in st.nodes] == [(n, i, "running") for i, n in enumerate(NODES)]
        doc = cli_json(["status", run.run_id, "-i", str(sandbox)], capsys)  # what the command prints: the same
        jsonschema.validate(doc, api.run_status_schema())
        assert (doc["state"], [n["state"] for n in doc["nodes"]]) == ("running", ["running"] * 3)
        for row in cli_json(["ls", "-i", str(sandbox)], capsys):
            jsonschema.validate(row, api.run_status_schema())
        listed = {r.run_id: r for r in map(valid, backend.runs())}
        assert listed[run.run_id].state == "running" and [n.node for n in listed[run.run_id].nodes] == NODES
        argv = backend.exec_argv(run, "node-1", ["sh", "-c", "echo $NODE_NAME $NODE_RANK"])
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert (out.returncode, out.stdout) == (0, "node-1 1\n"), out.stderr
        stop = backend.cancel(run, grace_s=5)
        assert (stop.run_id, stop.stopped, stop.errors, stop.exit_code) == (run.run_id, NODES, [], 0)
        assert stop.lines == [f"run {run.run_id}: stopped and removed on node-0, node-1, node-2"]
        st = valid(backend.describe(run.run_id))
        assert st.state == "stopped" and {n.state for n in st.nodes} == {"no container"}
        col = backend.collect(run, dest=str(tmp_path / "art"))
        assert col.ok and col.dest == tmp_path / "art" / run.run_id and [r.node for r in col.nodes] == NODES
        for n in NODES:
            assert json.loads((col.dest / n / f"probe-{n}.json").read_text())["env"]["NODE_NAME"] == n
    finally:
        finish_run(sandbox, run.run_id)
        # idempotent: nothing left of the run after it; keep_runs as large as this prunes no other test's run
        again = backend.cancel(run, grace_s=0, keep_runs=1_000_000)
    assert again.lines == [f"run {run.run_id}: nothing running (already down)"] + [
        f"{n}: no run dirs to remove (keeping the 1000000 newest)" for n in NODES]


FAILS_ON_RANK_1 = "import os, sys; print('rank', os.environ['NODE_RANK'], flush=True); sys.exit(3 * (os.environ['NODE_RANK'] == '1'))"


def test_an_attached_run_fails_then_resumes_through_the_api(sandbox, pushed, tmp_path, capsys):
    """Attached, a job whose rank 1 exits 3 (its torchrun, 1): exit 4 (the job failed), the run failed; then
    `resume` of that run, attached, with a job that ends well: the same run id, succeeded."""
    logs = tmp_path / "logs"
    failing = api.backend_for(api.load_inventory(sandbox, job=write_job(
        tmp_path, "fails.yaml", extra={"command": ["python", "-c", FAILS_ON_RANK_1]})))
    first = failing.submit(failing.plan(api.SshUpOptions(no_push=True, logs_dir=str(logs))))
    assert first.exit_code == api.EXIT_JOB_FAILED, capsys.readouterr()
    assert "node node-1 (rank 1) failed: container exited with code 1" in capsys.readouterr().err
    st = valid(failing.describe(first))
    assert st.state == "failed" and st.nodes[1].exit_code == 1
    assert st.exit_code == next(n.exit_code for n in st.nodes if n.exit_code)  # the first non-zero in rank order
    backend = api.backend_for(api.load_inventory(sandbox, job=write_job(tmp_path)))
    run = backend.submit(backend.plan(api.SshUpOptions(no_push=True, logs_dir=str(logs), resume=first.run_id)))
    assert (run.run_id, run.exit_code, run.detached) == (first.run_id, 0, False), capsys.readouterr()
    st = valid(backend.wait(run, timeout_s=60, poll_s=0.5))
    assert (st.state, st.exit_code) == ("succeeded", 0)
    assert [(n.node, n.rank, n.state, n.exit_code) for n in st.nodes] == [(n, i, "finished", 0) for i, n in enumerate(NODES)]
    # The containers are gone: what the attached run kept here is the log.
    kept = [str(ln) for ln in backend.logs(run, logs_dir=str(logs))]
    assert "[node-0/0] probe node-0 rank 0 of 3" in kept and "[node-2/2] done node-2" in kept
    assert Path(logs / run.run_id / "node-1" / "container.log").is_file()
