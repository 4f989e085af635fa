"""`job.perseus`: the runner starts a Perseus server (Zeus 0.16, in the trainer image's /opt/perseus)
beside the job on the master, gives every rank its URL, stops it on `down`, and collects its dump
with the run. Plan files are checked when the inventory loads (`up --dry-run` refuses them)."""

from __future__ import annotations

import csv
import json
import re
import time
from pathlib import Path

import pytest

from runner.core.errors import UserError
from runner.inventory import load_inventory
from tests import IMAGE
from tests.support.perseus_helpers import write_plan
from tests.support.runner_helpers import (
    container_events,
    node_docker,
    run_cli,
    run_containers,
    runner,
    up_detached,
)

NODES = ("nodes:\n"
         "  - {name: m, host: 10.9.0.1, arch: amd64, role: master, slots: 2}\n"
         "  - {name: w, host: 10.9.0.2, arch: amd64}\n")  # 3 ranks
F = [("forward", 1410), ("backward", 1410)]


def inventory(tmp_path: Path, perseus: str) -> Path:
    p = tmp_path / "inv.yaml"
    p.write_text(f"{NODES}job:\n  image: t:1\n  args: [--num_prof_steps, '2']\n  perseus:\n{perseus}")
    return p


def test_dry_run_shows_the_server_and_every_ranks_url(tmp_path, no_network):
    write_plan(tmp_path / "plan.py", [F] * 3)
    inv = inventory(tmp_path, f"    plan: {tmp_path / 'plan.py'}\n")
    rc, out = run_cli("up", "-i", str(inv), "--dry-run")
    assert rc == 0, out
    assert "[m/perseus] Perseus server (PointSolution) beside the job: container runner-<new run id>-m-perseus" in out
    assert out.count("env       PERSEUS_URL=http://10.9.0.1:<auto>") == 2  # both nodes' containers
    assert "--scheduler PointSolution --plan /out/perseus/plans/00-plan.py" in out
    job = load_inventory(inv).job
    assert job.perseus.scheduler == "PointSolution" and job.perseus.plans[0][1] == (tmp_path / "plan.py").read_bytes()
    write_plan(tmp_path / "b.py", [F] * 3)
    seq = load_inventory(inventory(tmp_path, f"    plan: [{tmp_path / 'plan.py'}, {tmp_path / 'b.py'}]\n")).job
    assert seq.perseus.scheduler == "PlanSequence" and len(seq.perseus.plans) == 2


@pytest.mark.parametrize("plan_text, perseus, why", [
    (None, "    scheduler: PointSolution\n", r"inv.yaml:8: job.perseus.plan: missing: a plan file"),
    (None, "    plan: nowhere.py\n", r"inv.yaml:8: job.perseus.plan: plan file not found: nowhere.py"),
    ("open('/etc/passwd')", "    plan: {p}\n", r"inv.yaml:8: job.perseus.plan: plan .*: not a Python literal"),
    ("{'forward': 1410}", "    plan: {p}\n", r"inv.yaml:8: job.perseus.plan: plan .*: must be a list with one list"),
    ("[[('forward', 1410)], 1410, []]", "    plan: {p}\n", r"rank 1's entry is a int, not a list of pairs"),
    ("[[('forward', 1410)]] * 2", "    plan: {p}\n", r"not a Python literal"),
    ("[[('forward', 1410)], [], []][:2]", "    plan: {p}\n", r"not a Python literal"),
    ("[[('forward', 1410)], [], []]", "    plan: [{p}, {p}]\n    scheduler: PointSolution\n",
     r"inv.yaml:9: job.perseus.scheduler: PointSolution serves one plan file, got 2; use PlanSequence for a list"),
    ("[[('forward', 1410)], []]", "    plan: {p}\n",
     r"inv.yaml:8: job.perseus.plan: .*plan.py holds 2 ranks' plans but the job has 3 ranks"),
    ("[[], [], []]", "    plan: {p}\n    scheduler: Profiler\n", r"job.perseus.scheduler: 'Profiler': one of"),
])
def test_bad_plans_refused_at_dry_run(tmp_path, no_network, capsys, plan_text, perseus, why):
    p = tmp_path / "plan.py"
    if plan_text is not None:
        p.write_text(plan_text)
    inv = inventory(tmp_path, perseus.format(p=p))
    with pytest.raises(UserError, match=why):
        load_inventory(inv)
    rc, out = run_cli("up", "-i", str(inv), "--dry-run")
    err = capsys.readouterr().err
    assert rc != 0 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_job_perseus_on_the_sandbox(sandbox, pushed, tmp_path):
    """(c) Three nodes, one pipeline stage each (GPipe, 2 microbatches), PlanSequence over two plans,
    one step per plan: the server starts on the master before any rank, every rank gets its URL, the
    ranks run warm-up + 2 plans and exit 0 on [profiling-done]; the server keeps running on the master
    until `runner down`, and collect brings its dump."""
    order = [("forward", 1410), ("forward", 1410), ("backward", 1410), ("backward", 1410)]
    plans = [write_plan(tmp_path / f"p{i}.py", [[(n, mhz - 100 * i - 10 * r) for n, mhz in order] for r in range(3)])
             for i in range(2)]
    job = tmp_path / "job.yaml"
    job.write_text(
        f"job:\n  image: {IMAGE}\n  env: {{OMP_NUM_THREADS: '1'}}\n  master_port: auto\n  grace_period: 5\n"
        "  args: [--model.preset, tiny-llama, --model.num_hidden_layers, '3', --data.seq_len, '16',\n"
        "         --train.batch_size, '4', --train.microbatch_num, '2', --parallel.pp, '3',\n"
        "         --parallel.pp_schedule, gpipe, --train_steps, '40', --num_prof_steps, '1', --profile_batch, none]\n"
        f"  perseus:\n    plan: [{plans[0]}, {plans[1]}]\n")
    since = time.time()
    run_id = up_detached(sandbox, job)
    ranks = {f"node-{i}": f"runner-{run_id}-node-{i}" for i in range(3)}
    server = f"runner-{run_id}-node-0-perseus"
    for node, name in ranks.items():  # `docker wait`: returns when the rank's container has exited
        code = node_docker(sandbox, node, "wait", name, timeout=600)
        assert code.stdout.strip() == "0", runner("logs", run_id, "-i", str(sandbox)).stdout[-3000:]
    running = run_containers(sandbox, run_id, running_only=True)
    assert running == {"node-0": [server], "node-1": [], "node-2": []}  # the server is still up
    cmd = json.loads(node_docker(sandbox, "node-0", "inspect", "--format", "{{json .Config.Cmd}}", server).stdout)
    host, port = cmd[cmd.index("--host") + 1], cmd[cmd.index("--port") + 1]
    master = load_inventory(sandbox, with_job=False).node("node-0").rank_addr
    assert host == master and int(port) > 0
    for node, name in ranks.items():
        env = json.loads(node_docker(sandbox, node, "inspect", "--format", "{{json .Config.Env}}", name).stdout)
        assert [e for e in env if e.startswith("PERSEUS_URL=")] == [f"PERSEUS_URL=http://{master}:{port}"]
    started = {name: [t for t, action, attrs in container_events(sandbox, node, name, since)  # name= is a prefix
                      if action == "start" and attrs.get("name") == name]
               for node, name in [("node-0", server), *ranks.items()]}
    assert all(len(ts) == 1 for ts in started.values()), started
    assert all(started[server][0] < started[name][0] for name in ranks.values()), started  # one host clock
    down = runner("down", run_id, "-i", str(sandbox))
    assert down.returncode == 0, down.stderr
    assert not any(run_containers(sandbox, run_id).values())  # server and ranks: nothing left
    art = tmp_path / "art"
    col = runner("collect", run_id, "-i", str(sandbox), "--dest", str(art), "--quiet", "--no-plots")
    assert col.returncode == 0, col.stderr
    dump = art / run_id / "node-0" / "perseus" / "dump"
    jobs = [d for d in dump.iterdir() if d.is_dir()]
    assert len(jobs) == 1 and re.fullmatch(r"[\d-]+\+dp1\+pp3\+tp1\+PlanSequence\+" + re.escape(run_id), jobs[0].name)
    reg = json.loads((jobs[0] / "ranks.json").read_text())
    assert [(r["rank"], r["pp_rank"]) for r in reg] == [(0, 0), (1, 1), (2, 2)]
    for i in range(2):
        results = json.loads((jobs[0] / f"{i}.prof.json").read_text())
        assert [(r["rank"], len(r["iter_time"]), [len(x) for x in r["time_breakdown"]["forward"]])
                for r in results] == [(0, 1, [2]), (1, 1, [2]), (2, 1, [2])]
    assert not (jobs[0] / "2.prof.json").exists()
    assert "[profiling-done] all 2 plans ran" in (dump / "server.log").read_text()
    for r in range(3):
        with (art / run_id / f"node-{r}" / f"plans-{r}.csv").open() as f:
            rows = list(csv.DictReader(f))
        assert [(row["plan"], row["window"], row["frequency"]) for row in rows] == \
            [(str(i), f"{i + 1}-{i + 1}", str(mhz - 100 * i - 10 * r)) for i in range(2) for _, mhz in order]
    metrics = art / run_id / "node-2" / "metrics.jsonl"  # the last stage's losses
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2, 3]
