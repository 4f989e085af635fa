"""The runner against a real Slurm cluster: slurmctld + 3 slurmd (multiple-slurmd) + munge + a
login sshd, started once for the session by `runner sandbox up --slurm` (the `slurm` fixture,
tests/conftest.py, shared with test_api_slurm.py) and stopped at its end (asserting nothing of it
is left running).

The reduced Pi pipeline (3 nodes, pp=3) runs through Slurm and as three local processes: the
per-step losses are equal, bit for bit (the SSH runner's sandbox equals three local processes in
test_partition_auto_sandbox.py). `runner down` of a Slurm run writes the preempt checkpoint on
every rank and `up --resume` continues it bitwise; the same job in the trainer image through Slurm's native OCI
support gives the same losses again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests import IMAGE
from tests.conftest import net_addr
from tests.support.runner_helpers import REPO, runner, runner_cmd, wait_for
from tests.support.trainer_run import held, hold_env, release, run_trainer

pytestmark = [pytest.mark.slurm, pytest.mark.sandbox]

CONFIG = str(REPO / "configs" / "pi-qwen3-3stage-tiny.yaml")
STEPS = 10
def job_file(tmp: Path, steps: int = STEPS, **extra) -> Path:
    job = {"image": IMAGE, "config": CONFIG,
           "args": ["--train_steps", str(steps), "--batch_size", "16", "--microbatch_num", "4"],
           "env": {"OMP_NUM_THREADS": "1"}, "master_port": "auto", "grace_period": 60, **extra}
    p = tmp / "job.yaml"
    p.write_text(yaml.safe_dump({"job": job}))
    return p


def losses(path: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in path.read_text().splitlines() if x.strip()]


def sctl(slurm, *args: str) -> str:
    res = subprocess.run(list(args), capture_output=True, text=True, env={**os.environ, **slurm.env}, timeout=60)
    return res.stdout


def job_ids(slurm) -> set[str]:
    return set(re.findall(r"JobId=(\d+)", sctl(slurm, "scontrol", "show", "job", "-o")))


@pytest.fixture(scope="module")
def straight(slurm, tmp_path_factory):
    """The job through Slurm, submitted on the login node over SSH, attached until it ends."""
    tmp = tmp_path_factory.mktemp("straight")
    proc = runner("up", "-i", str(slurm.inv), "--job", str(job_file(tmp)), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_id = re.search(r"^run (\S+) submitted: Slurm job (\d+)", proc.stdout, re.M)
    run_dir = slurm.shared / "runs" / run_id[1]
    return SimpleNamespace(run_id=run_id[1], job=run_id[2], proc=proc, run_dir=run_dir,
                           losses=losses(run_dir / "metrics.jsonl"))


def test_cluster_is_real_slurm(slurm):
    assert re.search(r"MULTIPLE_SLURMD\s+= Yes", sctl(slurm, "scontrol", "show", "config"))
    nodes = sctl(slurm, "sinfo", "-h", "-N", "-o", "%N %t")
    assert sorted(nodes.split("\n")[:-1]) == ["node-0 idle", "node-1 idle", "node-2 idle"]
    addrs = re.findall(r"NodeAddr=(\S+)", sctl(slurm, "scontrol", "show", "node"))
    assert addrs == [net_addr(9, 32), net_addr(9, 33), net_addr(9, 34)]
    st = runner("sandbox", "--dir", str(slurm.state / "s"), "status")
    assert st.returncode == 0 and f"slurm node-2  {net_addr(9, 34)}  idle" in st.stdout, st.stdout


def test_contract_prefixes_and_rank_order(slurm, straight):
    out, rd, job = straight.proc.stdout, straight.run_dir, straight.job
    assert len(straight.losses) == STEPS
    assert f"run {straight.run_id} finished: Slurm job {job} exited 0 on all 3 node(s)" in out
    # Rank 0 = the allocation's first node; its NodeAddr is MASTER_ADDR; a port from the run's window.
    m = re.search(rf"^\[slurm\] runner: master node-0 at {re.escape(net_addr(9, 32))}:(\d+)$", out, re.M)
    assert m and 29500 <= int(m[1]) < 30400
    assert (rd / "slurm" / job / "nodes").read_text().split() == ["node-0", "node-1", "node-2"]
    for k in range(3):
        env = dict(ln.split("=", 1) for ln in (rd / "slurm" / job / f"node{k}.env").read_text().split())
        assert env == {"NODE_NAME": f"node-{k}", "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert "[node-0/0] [rank0] " in out and "[node-2/2] [rank2] step 10 loss" in out
    assert (rd / "slurm" / "submit-1.sbatch").read_text().startswith("#!/bin/bash\n# runner: run ")
    assert (rd / "slurm" / job / "exit-code").read_text().strip() == "0"
    st = runner("status", "-i", str(slurm.inv), straight.run_id, "--json")
    doc = json.loads(st.stdout)
    assert doc["native_state"] == "COMPLETED" and doc["state"] == "succeeded" and doc["exit_code"] == 0
    assert [n["node"] for n in doc["nodes"]] == ["node-0", "node-1", "node-2"]
    logs = runner("logs", straight.run_id, "-i", str(slurm.inv))
    assert logs.returncode == 0 and "[node-2/2] [rank2] step 10 loss" in logs.stdout
    assert "[slurm] runner: job " in logs.stdout
    # --node: that node's lines and no other's. node-2 (the last stage) logs every step; node-1 (a
    # middle stage) may print nothing at all (what it printed was torchrun's exit-barrier noise,
    # pytorch/pytorch#69520, in some runs: never assert on it).
    one = runner("logs", straight.run_id, "-i", str(slurm.inv), "--node", "node-2").stdout.splitlines()
    assert one == [ln for ln in logs.stdout.splitlines() if ln.startswith("[node-2/2] ")]
    assert "[node-2/2] [rank2] step 10 loss" in "\n".join(one)
    ls = runner("ls", "-i", str(slurm.inv), "--json")
    row = next(r for r in json.loads(ls.stdout) if r["run_id"] == straight.run_id)
    assert {k: row[k] for k in ("job_id", "native_state", "state", "exit_code", "submissions")} == {
        "job_id": job, "native_state": "COMPLETED", "state": "succeeded", "exit_code": 0, "submissions": 1}


def test_same_losses_as_three_local_processes(slurm, straight, tmp_path):
    """The same job as three processes on this machine (torchrun, the project's virtualenv): equal
    losses, bit for bit. The SSH runner's containers equal three local processes for this config
    too (test_partition_auto_sandbox.py, pp=3), so the two backends give one run's numbers. Not the
    session sandbox itself: then no Slurm test needs the worker that holds it (tests/support/worker_share.py)."""
    local = tmp_path / "local"
    run_trainer(local, "--config", CONFIG, "--train_steps", str(STEPS), "--batch_size", "16", "--microbatch_num", "4",
                nproc=3)
    got = losses(local / "metrics.jsonl")
    assert len(got) == STEPS and got == straight.losses


def test_collect_returns_the_files(slurm, straight, tmp_path):
    rd = straight.run_dir
    want = sorted(str(p.relative_to(rd)) for p in rd.rglob("*") if p.is_file())
    for inv, env in ((slurm.inv, {}), (slurm.local, slurm.env)):  # over SSH from the login node; locally
        dest = tmp_path / inv.stem
        col = runner("collect", straight.run_id, "-i", str(inv), "--dest", str(dest), "--quiet", env=env)
        assert col.returncode == 0, col.stderr
        got = dest / straight.run_id / "slurm"
        files = sorted(str(p.relative_to(got)) for p in got.rglob("*") if p.is_file() and ".collect" not in p.name)
        assert [f for f in files if not f.endswith(".png")] == want
        for rel in ("metrics.jsonl", "logs/rank0.log", "logs/rank2.log", f"slurm/{straight.job}/node1.out",
                    "slurm/submit-1.sbatch"):
            assert (got / rel).read_bytes() == (rd / rel).read_bytes(), rel
        assert f"final loss {straight.losses[-1]:.4f} at step {STEPS}" in col.stdout
        again = runner("collect", straight.run_id, "-i", str(inv), "--dest", str(dest), "--quiet", env=env)
        assert ": 0 copied (0.00 MB" in again.stdout, again.stdout


HOLD = "step-2"  # every rank waits after step 2 (trainer/runtime/hold.py) until the test lets it go


def held_job(tmp: Path) -> Path:
    """The job, held after step 2 until the preemption signal has reached every rank: the run then
    stops after step 3 on any machine, however loaded. (Holding the ranks with SIGSTOP once step 1
    was logged raced the run: 10 steps take ~1.2 s, and on a loaded CI machine the run ended before
    the signal was sent, so no preempt checkpoint was written.) torchrun's shutdown timeout
    (grace - 2 s) runs from the signal: 180 s leaves the step and the checkpoint time whatever the load."""
    return job_file(tmp, grace_period=180, env={"OMP_NUM_THREADS": "1", **hold_env("step:2")})


def test_down_writes_preempt_checkpoint_and_resume_is_bitwise(slurm, straight, tmp_path):
    """Submitted from this machine (no login node), with --requeue. The ranks are held after step 2
    while `runner down` signals the job, and let go once USR1 has reached every rank: the run stops
    after step 3 whatever the machine's load. The batch script's requeue branch then
    sees `runner down`'s mark: the job ends, not requeued. Then `up --resume` finishes the run."""
    env = slurm.env
    up = runner("up", "-i", str(slurm.local), "--job", str(held_job(tmp_path)), "--detach", "--requeue", env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    run_id, job = re.search(r"^run (\S+) submitted: Slurm job (\d+)", up.stdout, re.M).groups()
    rd = slurm.shared / "runs" / run_id
    try:
        wait_for(lambda: held(rd, HOLD, range(3)), 300)
        busy = runner("up", "-i", str(slurm.local), "--job", str(job_file(tmp_path)), "--resume", run_id, env=env)
        assert busy.returncode != 0 and f"Slurm job {job} of the run is still RUNNING" in busy.stderr
        down = subprocess.Popen(runner_cmd("down", run_id, "-i", str(slurm.local)), cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **env})
        wait_for(lambda: held(rd, HOLD, range(3), "signalled"), 120)
    finally:
        release(rd, HOLD)
    out, err = down.communicate(timeout=300)
    assert down.returncode == 0, out + err
    assert f"run {run_id}: Slurm job {job} sent USR1; ended within the grace period" in out, out + err
    ckpts = rd / "checkpoints"
    name = (ckpts / "latest").read_text().strip()
    stopped = len(losses(rd / "metrics.jsonl"))
    assert name == "step-3.preempt" and stopped == 3, (name, stopped)
    assert f"latest checkpoint {name}" in out
    for r in range(3):  # every rank wrote its part: the shards, its manifest, its RNG/optimizer state
        assert (ckpts / name / f"rank{r}.pt").is_file() and (ckpts / name / f"manifest.rank{r}.json").is_file()
        assert list((ckpts / name).glob(f"__{r}_*.distcp"))
    assert (rd / "slurm" / job / "exit-code").read_text().strip() == "143"  # written just before the branch
    assert (rd / "slurm" / "down").exists()
    # The job ran its script to the end (exit-code above) and is over: not requeued (a requeue
    # leaves it PENDING with Restarts=1), and its output shows no second start.
    show = sctl(slurm, "scontrol", "show", "job", "-o", job)
    for _ in range(120):  # slurmctld reports COMPLETING until every node has cleaned up (CI saw it)
        if "JobState=COMPLETING" not in show:
            break
        time.sleep(0.5)
        show = sctl(slurm, "scontrol", "show", "job", "-o", job)
    assert "JobState=FAILED" in show and "Restarts=0" in show and "Requeue=1" in show, show
    assert "(restart 1)" not in (rd / "slurm" / f"{job}.out").read_text()
    assert losses(rd / "metrics.jsonl") == straight.losses[:stopped]
    st = json.loads(runner("status", run_id, "-i", str(slurm.local), "--json", env=env).stdout)
    assert st["native_state"] == "FAILED" and st["exit_code"] == 143 and st["state"] == "stopped"  # by `runner down`
    again = runner("down", run_id, "-i", str(slurm.local), env=env)
    assert again.returncode == 0 and "nothing running" in again.stdout

    res = runner("up", "-i", str(slurm.local), "--job", str(job_file(tmp_path)), "--resume", run_id, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert re.search(rf"^run {run_id} submitted: Slurm job \d+", res.stdout, re.M)
    assert f"resumed from {ckpts / name} at step {stopped}" in res.stdout
    assert losses(rd / "metrics.jsonl") == straight.losses  # bit for bit, the whole run
    assert "--resume latest" in (rd / "slurm" / "submit-2.sbatch").read_text()


def test_bad_slurm_section_is_one_line_and_nothing_submitted(slurm, tmp_path):
    doc = yaml.safe_load(slurm.local.read_text())
    before_jobs, before_runs = job_ids(slurm), set(os.listdir(slurm.shared / "runs"))
    bin_dir = tmp_path / "bin"  # a PATH with a shell but without Slurm's client tools
    bin_dir.mkdir()
    for tool in ("sh", "cat"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    cases = [({"partition": "nope"}, {}, "slurm.partition: 'nope' is not a partition of this cluster (partitions: debug)"),
             ({"nodes": 4}, {}, "slurm.nodes: 4 nodes, but partition debug has 3"),
             ({"gpus_per_node": 1}, {}, "slurm: the cluster refuses the job"),
             ({}, {"PATH": str(bin_dir)}, "sbatch, squeue, scancel, scontrol, sinfo not found on this machine")]
    for i, (change, env, msg) in enumerate(cases):
        inv = tmp_path / f"bad{i}.yaml"
        inv.write_text(yaml.safe_dump({**doc, "slurm": {**doc["slurm"], **change}}, sort_keys=False))
        res = runner("up", "-i", str(inv), "--job", str(job_file(tmp_path)), env={**slurm.env, **env})
        lines = res.stderr.strip().splitlines()
        assert res.returncode != 0 and len(lines) == 1 and msg in lines[0] and "nothing submitted" in lines[0], res.stderr
        assert lines[0].startswith(f"runner: error: {inv}")
    assert job_ids(slurm) == before_jobs and set(os.listdir(slurm.shared / "runs")) == before_runs


def test_oci_container_gives_the_same_losses(slurm, straight, trainer_image, tmp_path, capsys):
    """container: oci: the trainer image exported as a bundle, run by Slurm's native OCI support
    (oci.conf -> runc) on every node: the same losses as the virtualenv run."""
    doc = yaml.safe_load(slurm.inv.read_text())
    s = {k: v for k, v in doc["slurm"].items() if k not in ("venv", "chdir")}
    inv = tmp_path / "oci.yaml"
    inv.write_text(yaml.safe_dump({**doc, "slurm": {**s, "container": "oci"}}))
    res = runner("up", "-i", str(inv), "--job", str(job_file(tmp_path)), timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run_id, job = re.search(r"^run (\S+) submitted: Slurm job (\d+)", res.stdout, re.M).groups()
    assert losses(slurm.shared / "runs" / run_id / "metrics.jsonl") == straight.losses
    # The bundle is the host's image (by id), exported once; the output went to /runner/runs/<run>.
    import docker
    from tests.conftest import HOST_DOCKER
    image_id = docker.DockerClient(base_url=HOST_DOCKER, version="auto").images.get(trainer_image).id
    bundle = slurm.shared / "bundles" / image_id.split(":")[1][:16]
    assert json.loads((bundle / "image.json").read_text())["id"] == image_id
    assert (bundle / "rootfs" / "opt" / "venv" / "bin" / "torchrun").is_file()
    assert json.loads((bundle / "config.json").read_text())["root"] == {"path": "rootfs", "readonly": True}
    assert f"output_dir: /runner/runs/{run_id}" in (slurm.shared / "runs" / run_id / "config.yaml").read_text()
    assert f"--container={bundle}" in (slurm.shared / "runs" / run_id / "slurm" / "submit-1.sbatch").read_text()
    # The same image again: found by id, nothing exported (no "oci: exporting" line).
    from runner.backends.slurm.oci import ensure_bundle
    from runner.backends.slurm.shell import LocalShell
    from runner.inventory.slurm import load_slurm_inventory
    again = ensure_bundle(LocalShell(), load_slurm_inventory(str(inv), check_files=False), str(slurm.shared))
    assert again[0] == str(bundle) and again[2] == "/workspace"
    assert "oci: exporting" not in capsys.readouterr().out


@pytest.mark.parametrize("how", ["slurm_requeue", "time_limit_usr1"])
def test_requeue_resumes_from_the_preempt_checkpoint(slurm, straight, tmp_path, how):
    """`up --requeue`, preempted mid-run two ways: Slurm requeues the running job (what a preemption
    with PreemptMode=REQUEUE does: SIGTERM, KillWait, back to the queue), or USR1 reaches the job's
    tasks as the time limit's `--signal=USR1@N` sends it, and the batch script's own branch
    requeues it (no `runner down` mark). Either way the ranks write the preempt checkpoint and the
    job's second start resumes from it: the same losses as the straight run."""
    env = slurm.env
    up = runner("up", "-i", str(slurm.local), "--job", str(held_job(tmp_path)), "--detach", "--requeue", env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    run_id, job = re.search(r"^run (\S+) submitted: Slurm job (\d+)", up.stdout, re.M).groups()
    rd = slurm.shared / "runs" / run_id
    try:
        wait_for(lambda: held(rd, HOLD, range(3)), 300)
        if how == "slurm_requeue":  # SIGTERM to every task, then KillWait
            assert sctl(slurm, "scontrol", "requeue", job) == ""
        else:
            assert sctl(slurm, "scancel", "--signal=USR1", job) == ""
        wait_for(lambda: held(rd, HOLD, range(3), "signalled"), 120)
    finally:
        release(rd, HOLD)
    ended = r"JobState=(PENDING|COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY)"
    state = wait_for(lambda: re.search(ended, sctl(slurm, "scontrol", "show", "job", "-o", job)), 240)
    out = rd / "slurm" / f"{job}.out"
    assert state[1] == "PENDING", (state[0], out.read_text()[-2000:] if out.is_file() else "no batch output")
    stopped = len(losses(rd / "metrics.jsonl"))
    name = (rd / "checkpoints" / "latest").read_text().strip()
    assert name == "step-3.preempt" and stopped == 3, (name, stopped)
    # Slurm holds a requeued job back (BeginTime, ~2 min): let it start once its nodes are idle and
    # two seconds on. Not at once: each node revokes the job's old credential, and a credential made
    # in the same second counts as revoked (1 s resolution): a restart 0.4 s after the requeue was
    # killed "non-startable ... Job credential revoked" and the job ended FAILED (a reversed run).
    wait_for(lambda: set(sctl(slurm, "sinfo", "-h", "-N", "-o", "%t").split()) == {"idle"}, 120)
    sctl(slurm, "scontrol", "update", f"JobId={job}", "StartTime=now+2")
    ended = r"JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE)"
    state = wait_for(lambda: re.search(ended, sctl(slurm, "scontrol", "show", "job", "-o", job)), 600, interval=1)
    batch = (rd / "slurm" / f"{job}.out").read_text()
    assert state[1] == "COMPLETED", (state[0], batch[-2000:])
    assert f"runner: job {job} (restart 1) on node-[0-2]" in batch
    if how == "time_limit_usr1":  # the first start's script ran to its requeue branch
        assert f"runner: job {job}: torchrun exited 143 on the nodes" in batch
    assert f"resumed from {rd / 'checkpoints' / name} at step {stopped}" in (rd / "slurm" / job / "node0.out").read_text()
    assert losses(rd / "metrics.jsonl") == straight.losses
