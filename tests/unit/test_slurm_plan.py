"""The Slurm plan without a cluster: the `slurm:` section's validation, and the generated sbatch
script, task script and OCI config checked field by field (bash parses every variant)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from runner.backends.slurm.plan import SIGNALLED_143, SlurmFacts, make_slurm_plan, oci_config, torchrun_argv
from runner.core.errors import UserError
from runner.inventory.slurm import load_slurm_inventory
from tests.support.runner_helpers import REPO, no_socket_env, runner, wait_for

CONFIG = str(REPO / "configs" / "pi-qwen3-3stage-tiny.yaml")


def write_inv(tmp: Path, slurm: dict | None = None, job: dict | None = None, text: str | None = None) -> Path:
    p = tmp / "slurm.yaml"
    if text is None:
        doc = {"slurm": {"partition": "debug", "nodes": 3, "container": "none", "workdir": "/shared/runner",
                         **(slurm or {})},
               "job": {"image": "runner-trainer:latest", "config": CONFIG, "args": ["--train_steps", "5"],
                       "env": {"OMP_NUM_THREADS": "1"}, "grace_period": 20, **(job or {})}}
        text = yaml.safe_dump(doc, sort_keys=False)
    p.write_text(text)
    return p


def plan_for(tmp: Path, slurm: dict | None = None, job: dict | None = None, **kw):
    inv = load_slurm_inventory(str(write_inv(tmp, slurm, job)))
    return inv, make_slurm_plan(inv, "20260101-000000-abcd", SlurmFacts(home="/home/u"), **kw)


def directives(script: str) -> list[str]:
    return [ln[len("#SBATCH "):] for ln in script.splitlines() if ln.startswith("#SBATCH ")]


def heredoc(script: str, marker: str) -> str:
    m = re.search(rf"<<'{marker}'\n(.*?)\n{marker}\n", script, re.S)
    assert m, marker
    return m[1]


def test_sbatch_directives_env_and_task_field_by_field(tmp_path):
    inv, plan = plan_for(tmp_path, {"account": "proj-1", "time": "01:30:00", "gpus_per_node": 2, "cpus_per_task": 8,
                                    "mem": "64G", "qos": "high", "sbatch": ["--constraint=a100", "--exclusive"]})
    rd = "/shared/runner/runs/20260101-000000-abcd"
    assert plan.run_dir == rd and plan.script_path == f"{rd}/slurm/submit-1.sbatch"
    assert directives(plan.script) == [
        "--constraint=a100", "--exclusive",  # the inventory's first: sbatch takes the later, the runner's
        "--job-name=runner-20260101-000000-abcd", "--nodes=3", "--ntasks-per-node=1", "--partition=debug",
        "--account=proj-1", "--qos=high", "--time=01:30:00", "--cpus-per-task=8", "--mem=64G", "--gpus-per-node=2",
        f"--output={rd}/slurm/%j.out", "--open-mode=append", f"--chdir={rd}",
        "--signal=USR1@80",              # grace 20 s + 60 before the time limit
        "--no-requeue"]
    # The contract env (docs/contract.md) and job.env, exported by the task script where the job runs;
    # per-node values come after. The batch step exports only the master's address.
    batch_part = plan.script.split("cat > ")[0]
    assert re.findall(r"^export .*$", batch_part, re.M) == ["export MASTER_ADDR MASTER_PORT"]
    task = heredoc(plan.script, "RUNNER_TASK")
    exports = dict(re.findall(r"^export ([A-Z_]+)=(.*)$", task.split("set -a;")[0], re.M))
    assert exports == {"NNODES": "3", "OMP_NUM_THREADS": "1", "OUTPUT_DIR": rd, "PET_SHUTDOWN_TIMEOUT": "18",
                       "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "PYTHONUNBUFFERED": "1",
                       "RUN_ID": "20260101-000000-abcd"}
    # torchrun: static rendezvous, 2 procs per node (gpus_per_node), rank and master from the allocation.
    assert plan.torchrun == ["torchrun", "--nnodes", "3", "--node-rank", "$rank", "--nproc-per-node", "2",
                             "--master-addr", "$MASTER_ADDR", "--master-port", "$MASTER_PORT",
                             "--rdzv-backend", "static", "--max-restarts", "0",
                             "-m", "trainer", "--config", f"{rd}/config.yaml", "--train_steps", "5"]
    task = heredoc(plan.script, "RUNNER_TASK")
    assert task.split("launch=torchrun", 1)[0].splitlines()[-2:] == [
        "got=", "trap 'got=1; cut=1' USR1 TERM  # set first: a signal from now on counts (the end)"]
    assert [ln for ln in task.splitlines() if ln.startswith(("launch=", "$launch "))] == [
        "launch=torchrun; python -c 'import runner.agents.torchrun' 2>/dev/null && launch='python -m runner.agents.torchrun'",
        '$launch --nnodes 3 --node-rank "$rank" --nproc-per-node 2 --master-addr "$MASTER_ADDR" '
        '--master-port "$MASTER_PORT" --rdzv-backend static --max-restarts 0 -m trainer '
        f'--config {rd}/config.yaml --train_steps 5 "$@" &']
    assert task.endswith(SIGNALLED_143.rstrip("\n"))
    assert 'set -a; . "$dir/node$rank.env"; set +a' in task and 'export NODE_RANK="$rank"' in task
    # Node rank 0 = the allocation's first node; its NodeAddr is MASTER_ADDR; one task per node.
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" > "$JOB_DIR/nodes"' in plan.script
    assert "MASTER_NODE=$(head -n 1 \"$JOB_DIR/nodes\")" in plan.script
    assert 'echo "* /bin/sh $JOB_DIR/task.sh %t $JOB_DIR $RESUME" > "$JOB_DIR/multi-prog.conf"' in plan.script
    assert re.search(r'^srun --ntasks-per-node=1 --kill-on-bad-exit=1 --output="\$JOB_DIR/node%n.out" '
                     r'--open-mode=append \\\n  --multi-prog "\$JOB_DIR/multi-prog.conf"$', plan.script, re.M)
    probe = heredoc(plan.script, "RUNNER_PROBE")
    assert "ip -o route get" in probe and "GLOO_SOCKET_IFNAME=%s" in probe and "NCCL_SOCKET_IFNAME=%s" in probe
    # master_port auto: the SSH runner's window for this run id, searched on the master's node.
    from runner.transport.rendezvous import AUTO_PORT_BASE, port_offset
    lo = AUTO_PORT_BASE + port_offset("20260101-000000-abcd")
    assert f"for p in $(seq {lo} {lo + 499}); do" in plan.script


@pytest.mark.parametrize("container", ["none", "pyxis", "oci"])
@pytest.mark.parametrize("requeue", [False, True])
def test_every_variant_parses_as_bash(tmp_path, container, requeue):
    inv, plan = plan_for(tmp_path, {"container": container, **({"venv": "/opt/v", "chdir": "/src"}
                                                                if container == "none" else {})},
                         {"env_file": str(_env_file(tmp_path))}, requeue=requeue, secret_keys=["HF_TOKEN"])
    script = tmp_path / "s.sbatch"
    script.write_text(plan.script)
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    task = tmp_path / "task.sh"
    task.write_text(heredoc(plan.script, "RUNNER_TASK"))
    assert subprocess.run(["sh", "-n", str(task)]).returncode == 0
    assert ("--requeue" in directives(plan.script)) == requeue
    assert ('scontrol requeue "$SLURM_JOB_ID"' in plan.script) == requeue
    assert ('RESUME="--resume latest"' in plan.script) == requeue


def _env_file(tmp: Path) -> Path:
    p = tmp / ".env"
    p.write_text("HF_TOKEN=hf_secret_value_123\n")
    return p


def test_secrets_only_by_file_never_in_the_script(tmp_path):
    inv, plan = plan_for(tmp_path, job={"env_file": str(_env_file(tmp_path)), "env": {"HF_TOKEN": "inline", "A": "1"}},
                         secret_keys=["HF_TOKEN"])
    assert "hf_secret_value_123" not in plan.script and "inline" not in plan.script
    assert plan.secrets_file == "/shared/runner/secrets/20260101-000000-abcd.env"
    assert "export RUNNER_SECRETS=/shared/runner/secrets/20260101-000000-abcd.env" in plan.script
    assert 'set -a; . "$RUNNER_SECRETS"; set +a' in heredoc(plan.script, "RUNNER_TASK")
    assert '[ "$rc" = 0 ] && rm -f /shared/runner/secrets/20260101-000000-abcd.env' in plan.script
    out = plan.render(inv, "this machine")
    assert "HF_TOKEN=******" in out and "hf_secret" not in out
    # A secret-looking name put in job.env instead: in the script (it must reach the job), masked on display.
    inv2, plan2 = plan_for(tmp_path, job={"env": {"WANDB_API_KEY": "k-123", "A": "1"}})
    assert "export WANDB_API_KEY=k-123" in plan2.script
    shown = plan2.render(inv2, "this machine")
    assert "k-123" not in shown and "export WANDB_API_KEY=******  # looks like a secret: use env_file" in shown
    assert "export A=1" in shown


def test_the_shown_plan_makes_an_inventorys_escapes_visible(tmp_path):
    """`--dry-run` printed the script raw: a job.env value's escape sequences reached the terminal."""
    inv, plan = plan_for(tmp_path, job={"env": {"MSG": "ok\x1b]0;owned\x07\x1b[2J"}, "args": ["\x1b[31mred"]})
    assert "export MSG='ok\x1b]0;owned\x07\x1b[2J'" in plan.script  # the job gets its value as written
    shown = plan.render(inv, "this machine")
    assert "\x1b" not in shown and "\x07" not in shown
    assert "export MSG='ok^[]0;owned^G^[[2J'" in shown and "'^[[31mred'" in shown
    assert shown.count("\n") == plan.script.count("\n") + shown.split("#!/bin/bash")[0].count("\n")


def test_pyxis_flags(tmp_path):
    inv, plan = plan_for(tmp_path, {"container": "pyxis", "image": "registry.example.org#team/trainer:1"},
                         {"env_file": str(_env_file(tmp_path))}, secret_keys=["HF_TOKEN"])
    rd = plan.run_dir
    line = next(ln for ln in plan.script.splitlines() if ln.strip().endswith('--multi-prog "$JOB_DIR/multi-prog.conf"'))
    flags = shlex.split(line)[:-2]
    assert flags == ["--container-image=registry.example.org#team/trainer:1",
                     f"--container-mounts={rd}:/out,/shared/runner/secrets/20260101-000000-abcd.env:/run/runner/secrets.env:ro",
                     "--no-container-mount-home",
                     "--container-env=MASTER_ADDR,MASTER_PORT"]  # the rest: set by the task, in the container
    assert "export OUTPUT_DIR=/out" in plan.script and "export RUNNER_SECRETS=/run/runner/secrets.env" in plan.script
    # Inside the container the task reads the job dir under /out; the config too.
    assert 'echo "* /bin/sh /out/slurm/$SLURM_JOB_ID/task.sh %t /out/slurm/$SLURM_JOB_ID $RESUME"' in plan.script
    assert "--config /out/config.yaml" in heredoc(plan.script, "RUNNER_TASK")
    # Without slurm.image: job.image's tag for slurm.arch.
    _, plain = plan_for(tmp_path, {"container": "pyxis"})
    assert "--container-image=runner-trainer:latest" in plain.script


def test_oci_bundle_config(tmp_path):
    inv = load_slurm_inventory(str(write_inv(tmp_path, {"container": "oci"})))
    facts = SlurmFacts(home="/home/u", uid=1000, gid=100, bundle="/shared/runner/bundles/abc",
                       image_env=("PATH=/opt/venv/bin:/usr/bin:/bin", "VIRTUAL_ENV=/opt/venv"), image_workdir="/workspace")
    plan = make_slurm_plan(inv, "r1", facts, secret_keys=["HF_TOKEN"])
    assert "--container=/shared/runner/bundles/abc --multi-prog" in plan.script
    task = heredoc(plan.script, "RUNNER_TASK")
    assert "export PATH=/opt/venv/bin:/usr/bin:/bin" in task  # the image's, not the job's (Slurm passes the job's env)
    assert "cd /workspace  # the image's WorkingDir" in task
    # One bundle serves every run (Slurm 22.05 fixes the root to <bundle>/rootfs): the workdir's
    # runs/ and secrets/ are mounted under /runner, OUTPUT_DIR is this run's dir there.
    assert "export OUTPUT_DIR=/runner/runs/r1" in plan.script
    assert "export RUNNER_SECRETS=/runner/secrets/r1.env" in plan.script
    assert 'echo "* /bin/sh /runner/runs/r1/slurm/$SLURM_JOB_ID/task.sh %t /runner/runs/r1/slurm/$SLURM_JOB_ID' in plan.script
    c = plan.oci_config
    assert c == oci_config(inv, plan.workdir, facts)
    assert c["root"] == {"path": "rootfs", "readonly": True}
    assert c["process"]["user"] == {"uid": 1000, "gid": 100} and c["process"]["cwd"] == "/workspace"
    assert c["process"]["env"] == ["PATH=/opt/venv/bin:/usr/bin:/bin", "VIRTUAL_ENV=/opt/venv"]
    assert [n["type"] for n in c["linux"]["namespaces"]] == ["pid", "mount"]   # host network, ipc, uts
    mounts = {m["destination"]: m for m in c["mounts"]}
    assert mounts["/runner/runs"] == {"destination": "/runner/runs", "type": "bind", "source": "/shared/runner/runs",
                                      "options": ["rbind", "rw"]}
    assert mounts["/runner/secrets"]["source"] == "/shared/runner/secrets"
    assert mounts["/runner/secrets"]["options"] == ["rbind", "ro"]
    assert mounts["/dev/shm"]["source"] == "/dev/shm" and mounts["/tmp"]["type"] == "tmpfs"
    json.dumps(c)  # what is written as <bundle>/config.json


def test_resume_home_and_custom_command(tmp_path):
    inv, plan = plan_for(tmp_path, {"workdir": "~/runner"}, {"command": ["python", "train.py"], "args": ["--x", "1"]},
                         resume=True, submission=3)
    assert plan.run_dir == "/home/u/runner/runs/20260101-000000-abcd"
    assert plan.script_path.endswith("/slurm/submit-3.sbatch")
    assert plan.torchrun[plan.torchrun.index("--no-python"):] == ["--no-python", "python", "train.py", "--x", "1",
                                                                 "--resume", "latest"]
    assert torchrun_argv(inv, 1, None, [])[-3:] == ["--no-python", "python", "train.py"]
    assert 'RESUME=""' in plan.script  # an explicit resume: no second one on requeue


def test_fixed_master_port(tmp_path):
    _, plan = plan_for(tmp_path, job={"master_port": 29400})
    assert "\nMASTER_PORT=29400\n" in plan.script and "seq " not in plan.script


BAD = [
    ({"nodes": 0}, 3, "slurm.nodes: must be an integer in 1..100000, got 0"),
    ({"container": "docker"}, 4, "slurm.container: must be one of pyxis, oci, none, got 'docker'"),
    ({"partition": "de bug"}, 2, "slurm.partition: 'de bug': must be letters, digits"),
    ({"time": "4h"}, 6, "slurm.time: '4h': must be a Slurm time limit"),
    ({"workdir": "runs"}, 5, "slurm.workdir: 'runs': use an absolute path or ~/..."),
    ({"workdir": "/a b"}, 5, "slurm.workdir: '/a b': must be a path without blanks, quotes, $ or ':'"),
    ({"workdir": "/scratch/a:/usr/lib"}, 5, "slurm.workdir: '/scratch/a:/usr/lib': must be a path without blanks, quotes, $ or ':'"),
    ({"sbatch": ["-N 4"]}, 7, "slurm.sbatch[0]: '-N 4': use --option or --option=value"),
    ({"sbatch": ["--wrap=rm -rf /"]}, 7, "slurm.sbatch[0]: --wrap: set by the runner itself"),
    ({"container": "pyxis", "venv": "/v"}, 6, "slurm.venv: only for container: none (container is pyxis"),
    ({"login": {"port": 22}}, 7, "slurm.login.host: missing"),
    ({"partitoin": "x"}, 6, "slurm.partitoin: unknown field (did you mean partition?)"),
    ({"frobnicate": 1}, 6, "slurm.frobnicate: unknown field (allowed: "),
]


@pytest.mark.parametrize("extra,line,msg", BAD, ids=[b[2].split(":")[0] + str(i) for i, b in enumerate(BAD)])
def test_bad_slurm_section_is_one_line(tmp_path, extra, line, msg):
    p = write_inv(tmp_path, extra)
    with pytest.raises(UserError) as ei:
        load_slurm_inventory(str(p), check_files=False)
    text = str(ei.value)
    assert "\n" not in text and msg in text, text
    assert text.startswith(f"{p}:{line}: "), (text, p.read_text().splitlines()[line - 1])


def test_cli_dry_run_contacts_nothing_and_routes(tmp_path):
    """Every socket is fatal in the runner here (no_socket_env): a dry-run, or a refusal, opens none."""
    guard = no_socket_env(tmp_path)
    p = write_inv(tmp_path, {"login": {"host": "login.hpc.example.org", "user": "me"}})
    res = runner("up", "-i", str(p), "--dry-run", env=guard)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("run <new run id>: 3 node(s) via Slurm (partition debug, container none), "
                                 "submitted with sbatch on login node login.hpc.example.org")
    assert "#SBATCH --nodes=3" in res.stdout
    # A Slurm inventory has no nodes: the SSH commands are not what `auto` picks; `--scheduler ssh` says why.
    bad = runner("up", "-i", str(p), "--dry-run", "--scheduler", "ssh", env=guard)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1 and "nodes" in bad.stderr
    req = runner("up", "-i", str(REPO / "hosts" / "pis.yaml"), "--dry-run", "--requeue", "--arch", "arm64", env=guard)
    assert req.returncode != 0 and "--requeue is for Slurm runs" in req.stderr
    missing = runner("up", "-i", str(REPO / "hosts" / "pis.yaml"), "--dry-run", "--scheduler", "slurm", env=guard)
    assert missing.returncode != 0 and "needs a `slurm:` section" in missing.stderr


def test_example_inventory_dry_run(tmp_path):
    """hosts/slurm.yaml, the example a site copies, stays valid: its dry-run contacts nothing (every
    socket fatal: no_socket_env)."""
    guard = no_socket_env(tmp_path)
    res = runner("up", "-i", str(REPO / "hosts" / "slurm.yaml"), "--dry-run", env=guard)
    assert res.returncode == 0, res.stderr
    d = directives(res.stdout)
    assert d[:9] == ["--job-name=runner-<new run id>", "--nodes=4", "--ntasks-per-node=1", "--partition=gpu",
                     "--account=proj-123", "--time=04:00:00", "--cpus-per-task=64", "--gpus-per-node=8",
                     "--output=~/runner/runs/<new run id>/slurm/%j.out"]
    assert "--container-image=ghcr.io#example/runner-trainer:latest" in res.stdout
    assert "(~ is the submit host's home, resolved at submission" in res.stdout


def test_dry_run_sizes_each_node_against_slurm_mem_and_up_refuses_before_submitting(tmp_path):
    """A Slurm job is sized as the SSH runner sizes its nodes: slurm.nodes alike, slurm.mem each (no
    unit: megabytes, as sbatch reads it). The Pi config's full Qwen3-0.6B split 7/14/7 needs 5.68 GiB
    on its first stage: 4G is refused in one line naming node, stage and slurm.mem, before anything
    is contacted; 8G fits; --ignore-sizing goes on."""
    pi = str(REPO / "configs" / "pi-qwen3-3stage.yaml")
    job = {"config": pi, "args": ["--train_steps", "5", "--batch_size", "16", "--microbatch_num", "4"]}
    guard = no_socket_env(tmp_path)
    small = runner("up", "-i", str(write_inv(tmp_path, {"mem": "4G"}, job)), "--dry-run", env=guard)
    assert small.returncode == 2, small.stdout + small.stderr
    assert "node-0: stage 0 (embeddings + layers 0-6): needs 5.68 GiB" in small.stdout
    assert "has 4.00 GiB (slurm.mem: 4g): DOES NOT FIT" in small.stdout
    err = small.stderr.strip().splitlines()
    assert len(err) == 1 and "node node-0 cannot hold pipeline stage 0" in err[0] and "(slurm.mem: 4g)" in err[0], err
    real = runner("up", "-i", str(write_inv(tmp_path, {"mem": "4096"}, job)), env=guard)  # megabytes: 4 GiB
    assert real.returncode == 2 and "has 4.00 GiB (slurm.mem: 4096m)" in real.stderr, real.stderr
    assert "socket" not in real.stderr  # refused before any connection
    fits = runner("up", "-i", str(write_inv(tmp_path, {"mem": "8G"}, job)), "--dry-run", env=guard)
    assert fits.returncode == 0 and fits.stdout.count(": fits") == 3, fits.stdout[-2000:] + fits.stderr
    anyway = runner("up", "-i", str(write_inv(tmp_path, {"mem": "4G"}, job)), "--dry-run", "--ignore-sizing", env=guard)
    assert anyway.returncode == 0 and "DOES NOT FIT" in anyway.stdout


FAKE_TORCHRUN = """#!/usr/bin/env python3
# Stands in for torchrun here: on USR1/TERM it stops and exits 1 (SignalException), as torchrun does
# once its ranks have written the preempt checkpoint; otherwise it exits with FAKE_RC.
import os, signal, sys, time
for s in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(s, lambda *_: sys.exit(1))
open(os.environ["FAKE_READY"], "w").close()
if os.environ.get("FAKE_RC"):
    sys.exit(int(os.environ["FAKE_RC"]))
time.sleep(60)
sys.exit(5)
"""


@pytest.mark.parametrize("case", ["exits 0", "exits 3", "USR1", "TERM"])
def test_a_signalled_task_ends_143_whatever_torchrun_exits(tmp_path, case):
    """torchrun ends with 1 when USR1/TERM stops it (its ranks end 143 after the preempt checkpoint),
    so srun's code was 143 only when --kill-on-bad-exit terminated another node's task first: under
    load all three ended 1 together and the requeue branch (rc 143) was skipped (seen in a full run).
    The task script itself now reports a signalled, failed torchrun as 143."""
    _, plan = plan_for(tmp_path)
    task = tmp_path / "task.sh"
    task.write_text(heredoc(plan.script, "RUNNER_TASK"))
    (tmp_path / "node0.env").write_text("NODE_NAME=n0\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(FAKE_TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)
    ready = tmp_path / "ready"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_READY": str(ready), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}
    if case.startswith("exits"):
        env["FAKE_RC"] = case.split()[1]
    proc = subprocess.Popen(["sh", str(task), "0", str(tmp_path)], env=env, start_new_session=True)
    if case in ("USR1", "TERM"):
        wait_for(lambda: ready.exists() or proc.poll() is not None, 30, interval=0.05)
        assert ready.exists(), proc.poll()
        os.killpg(proc.pid, getattr(signal, f"SIG{case}"))  # Slurm signals every process of the step
    rc = proc.wait(timeout=60)
    assert rc == {"exits 0": 0, "exits 3": 3, "USR1": 143, "TERM": 143}[case]


def test_an_inventory_path_with_a_newline_stays_in_its_comment(tmp_path):
    """The path went raw into the script's header comment: a newline in it began a shell command,
    and ended sbatch's reading of the #SBATCH lines after it."""
    d = tmp_path / "x\ntouch PWNED\n"
    d.mkdir()
    inv = load_slurm_inventory(str(write_inv(d)))
    plan = make_slurm_plan(inv, "20260101-000000-abcd", SlurmFacts(home="/home/u"))
    lines = plan.script.splitlines()
    assert "touch PWNED" not in lines and lines[1].startswith("# runner: run ") and "x^Jtouch PWNED^J" in lines[1]
    assert all(ln.startswith("#") for ln in lines[:4]) and any(ln.startswith("#SBATCH --nodes") for ln in lines)


def test_a_users_argument_spelled_like_a_placeholder_stays_literal(tmp_path):
    """`job.args: [--tag, $rank]` went to torchrun expanded under Slurm (the placeholders were told by
    value) but literally over SSH. Only torchrun's own --node-rank/--master-addr/--master-port values
    are shell variables; the user's arguments are quoted whatever they say."""
    inv, plan = plan_for(tmp_path, job={"args": ["--tag", "$rank", "--host", "$MASTER_ADDR", "$MASTER_PORT"]})
    (line,) = [ln for ln in heredoc(plan.script, "RUNNER_TASK").splitlines() if ln.startswith("$launch ")]
    assert line.startswith('$launch --nnodes 3 --node-rank "$rank" --nproc-per-node 1 --master-addr "$MASTER_ADDR" '
                           '--master-port "$MASTER_PORT" '), line
    assert line.endswith(" --tag '$rank' --host '$MASTER_ADDR' '$MASTER_PORT' \"$@\" &"), line
    argv = subprocess.run(["sh", "-c", "rank=7 MASTER_ADDR=m MASTER_PORT=9; set -- ; printf '%s\\n' "
                           + line.removeprefix("$launch ").removesuffix(" &")], capture_output=True, text=True)
    got = argv.stdout.splitlines()
    assert got[got.index("--node-rank") + 1] == "7" and got[-5:] == ["--tag", "$rank", "--host", "$MASTER_ADDR",
                                                                      "$MASTER_PORT"], got


def test_the_task_runs_the_mended_torchrun_where_its_environment_has_it(tmp_path):
    """The task's chooser, in a real shell: a python that imports runner.agents.torchrun (this
    project's image, or a virtualenv with this project) launches it; one without it (the
    interpreter this virtualenv was made from), or no python at all, the torchrun on PATH."""
    import sys

    from runner.planning.jobspec import CHOOSE_TORCHRUN

    def launch(python: str | None) -> str:
        bin_dir = tmp_path / f"bin-{abs(hash(python))}"
        bin_dir.mkdir()
        if python:
            (bin_dir / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(python)} "$@"\n')
            (bin_dir / "python").chmod(0o755)
        out = subprocess.run(["/bin/sh", "-c", f'set -eu; {CHOOSE_TORCHRUN}; printf "%s|" $launch'],
                             capture_output=True, text=True, env={"PATH": str(bin_dir)}, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        return out.stdout

    base = Path(sys.base_prefix) / "bin" / "python3"
    assert launch(sys.executable) == "python|-m|runner.agents.torchrun|"
    assert launch(str(base)) == "torchrun|"  # a python without this project
    assert launch(None) == "torchrun|"       # none at all


STUB_SRUN = '#!/bin/sh\nprintf "%s\\n" "$*" >> "$STUB_CALLS"\n'
STUB_SCONTROL = """#!/bin/sh
case "$1 $2" in
  "show hostnames") printf 'n0\\nn1\\n' ;;
  "show node") echo "NodeName=$3 NodeAddr=127.0.0.1 State=IDLE" ;;
  *) printf 'scontrol %s\\n' "$*" >> "$STUB_CALLS" ;;
esac
"""
MARKED = '#!/bin/sh\ntouch "$(dirname "$0")/../RAN-$(basename "$0")"\n'
FAKE_ARGV = '#!/usr/bin/env python3\nimport json, os, sys\njson.dump({"argv": sys.argv[1:], "env": dict(os.environ)}, open(os.environ["ARGV_OUT"], "w"))\n'


def test_the_batch_step_runs_none_of_the_jobs_values(tmp_path):
    """Found by an audit: (1) a job.args value holding a newline and RUNNER_TASK on a line of its own
    ended task.sh's here-document early (quoting keeps a newline in the word; bash ends the document
    at the line anyway), and the lines after it ran in the batch step, outside any container; (2)
    job.env was exported in the batch step, so its PATH chose the `cat` the step ran and its JOB_DIR
    moved the step's files. The batch script here runs in bash with srun/scontrol/ss stubbed; the task
    it wrote then runs, as srun would run it, with a fake torchrun that records its argv and env."""
    jobbin = tmp_path / "jobbin"
    jobbin.mkdir()
    for name in ("cat", "mkdir", "head", "sed", "echo"):
        (jobbin / name).write_text(MARKED)
    (jobbin / "torchrun").write_text(FAKE_ARGV)
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "srun").write_text(STUB_SRUN)
    (stubs / "scontrol").write_text(STUB_SCONTROL)
    (stubs / "ss").write_text("#!/bin/sh\n")
    for f in [*jobbin.iterdir(), *stubs.iterdir()]:
        f.chmod(0o755)
    evil = "0.1\nRUNNER_TASK\ntouch PWNED\n: <<\\RUNNER_TASK\n"
    workdir = tmp_path / "wd"
    inv, plan = plan_for(tmp_path, {"workdir": str(workdir)},
                         {"args": ["--lr", evil], "env": {"PATH": f"{jobbin}:/usr/bin:/bin",
                                                          "JOB_DIR": str(tmp_path / "elsewhere")}}, requeue=True)
    script = tmp_path / "s.sbatch"
    script.write_text(plan.script)
    calls = tmp_path / "calls"
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[0-1]",
           "STUB_CALLS": str(calls)}
    res = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not (tmp_path / "PWNED").exists() and not list(tmp_path.glob("RAN-*"))
    assert not (tmp_path / "elsewhere").exists()
    job_dir = Path(plan.run_dir) / "slurm" / "7"
    # The task script arrives whole: its here-document's end line is one no line of it reads.
    assert "<<'RUNNER_TASK_'\n" in plan.script
    assert (job_dir / "task.sh").read_text() == heredoc(plan.script, "RUNNER_TASK_") + "\n"
    assert calls.read_text().splitlines()[0] == f"--ntasks-per-node=1 --kill-on-bad-exit=1 /bin/sh {job_dir}/probe.sh {job_dir}"
    # srun runs the task: the job's env and argument reach torchrun as written.
    (job_dir / "node0.env").write_text("NODE_NAME=n0\n")
    out = tmp_path / "argv.json"
    task = subprocess.run(["sh", str(job_dir / "task.sh"), "0", str(job_dir)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "MASTER_ADDR": "127.0.0.1",
                                                      "MASTER_PORT": "29500", "ARGV_OUT": str(out)})
    assert task.returncode == 0, task.stdout + task.stderr
    got = json.loads(out.read_text())
    assert got["argv"][-2:] == ["--lr", evil] and got["argv"][got["argv"].index("--node-rank") + 1] == "0"
    assert got["env"]["PATH"] == f"{jobbin}:/usr/bin:/bin" and got["env"]["JOB_DIR"] == str(tmp_path / "elsewhere")
    assert got["env"]["NODE_NAME"] == "n0" and got["env"]["OUTPUT_DIR"] == plan.run_dir
    assert not (tmp_path / "PWNED").exists()
