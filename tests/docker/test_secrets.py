"""Secrets (job.env_file's values, job.env's secret-looking ones, the registry login) masked in
every printed form, files holding them created 0600, and nothing of them left behind when a step
fails (issue 23). Each failure path is taken for real: a failing `sbatch` (a local executable on
PATH standing in for Slurm's client: the Slurm sandbox would cost minutes for the same code path),
a node's SSH connection dropped in the middle of a registry pull (the sandbox's sshd, its engine,
and a registry address that accepts and never answers).
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from pathlib import Path

import pytest
import yaml

from tests.conftest import net_addr
from tests.support.runner_helpers import REPO, remotes, runner, wait_for

FILE_SECRET = "hf_file_secret_7c41d9"      # job.env_file
INLINE_SECRET = "wandb_inline_secret_93ab"  # job.env, a secret-looking name


def ssh_inventory(tmp: Path, env_file: bool = True) -> Path:
    env = tmp / "secrets.env"
    env.write_text(f"HF_TOKEN={FILE_SECRET}\n")
    inv = tmp / "inv.yaml"
    inv.write_text(yaml.safe_dump({
        "nodes": [{"name": "a0", "host": "10.9.0.1", "arch": "amd64", "role": "master"}],
        "job": {"image": "reg.example.org/trainer:1", "env": {"WANDB_API_KEY": INLINE_SECRET, "OMP_NUM_THREADS": "1"},
                **({"env_file": str(env)} if env_file else {})}}))
    return inv


def errors(res) -> list[str]:
    """stderr's lines but the inventory's warning about the inline secret (its value is not in it)."""
    return [ln for ln in res.stderr.splitlines() if not ln.startswith("runner: warning:")]


def test_export_to_stdout_masks_env_file_and_inline_secrets(tmp_path):
    """`runner export -o -` printed job.env's WANDB_API_KEY in clear in the pod spec."""
    res = runner("export", "--to", "kubernetes", "-i", str(ssh_inventory(tmp_path)), "-o", "-", "--run-id", "r1")
    assert res.returncode == 0, res.stderr
    assert FILE_SECRET not in res.stdout + res.stderr and INLINE_SECRET not in res.stdout + res.stderr
    docs = list(yaml.safe_load_all(res.stdout))
    env = {e["name"]: e.get("value") for e in
           docs[-1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["WANDB_API_KEY"] == "******" and env["OMP_NUM_THREADS"] == "1"
    assert docs[0]["kind"] == "Secret" and docs[0]["data"] == {"HF_TOKEN": "******"}


def test_export_file_holding_an_inline_secret_is_0600_and_replaces_an_older_one(tmp_path):
    """Without an env_file the manifest was written 0644, WANDB_API_KEY's value inside."""
    out = tmp_path / "m.yaml"
    out.write_text("an older, world-readable manifest\n")
    os.chmod(out, 0o644)
    res = runner("export", "--to", "kubernetes", "-i", str(ssh_inventory(tmp_path, env_file=False)), "-o", str(out),
                 "--run-id", "r1")
    assert res.returncode == 0, res.stderr
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600 and INLINE_SECRET in out.read_text()
    assert "mode 0600" in res.stdout and INLINE_SECRET not in res.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inv.yaml", "m.yaml", "secrets.env"]  # no temporary one


def test_export_that_cannot_write_says_so_in_one_line_and_leaves_nothing(tmp_path):
    target = tmp_path / "taken"
    target.mkdir()  # -o names a directory: the write fails after the temporary file was made
    res = runner("export", "--to", "kubernetes", "-i", str(ssh_inventory(tmp_path)), "-o", str(target), "--run-id", "r1")
    assert res.returncode == 2, res.stderr
    assert errors(res) == [f"runner: error: -o {target}: cannot write it: Is a directory; nothing written"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inv.yaml", "secrets.env", "taken"]
    assert list(target.iterdir()) == []


def test_dry_run_plans_show_no_secret_value(tmp_path):
    ssh = runner("up", "-i", str(ssh_inventory(tmp_path)), "--dry-run")
    assert ssh.returncode == 0, ssh.stderr
    slurm = runner("up", "-i", str(slurm_inventory(tmp_path)), "--dry-run")
    assert slurm.returncode == 0, slurm.stderr
    for res in (ssh, slurm):
        assert FILE_SECRET not in res.stdout + res.stderr and INLINE_SECRET not in res.stdout + res.stderr
        assert "HF_TOKEN" in res.stdout and "WANDB_API_KEY=******" in res.stdout


# ---- Slurm: a failed sbatch ------------------------------------------------------------------

FAKE_SLURM = {
    "scontrol": 'case "$*" in "show partition -o") echo "PartitionName=debug TotalNodes=2 Default=YES State=UP";; '
                '*) exit 1;; esac',
    # --test-only accepts; the real submission fails, quoting a value it was given (as a tool's
    # message may: the runner prints it masked).
    "sbatch": 'if [ "$1" = --test-only ]; then cat >/dev/null; exit 0; fi\n'
              'echo "sbatch: error: Batch job submission failed: invalid account $FAKE_SBATCH_ECHO" >&2; exit 1',
    "squeue": "exit 0", "scancel": "exit 0", "sinfo": "exit 0",
}


def slurm_inventory(tmp: Path) -> Path:
    env = tmp / "slurm-secrets.env"
    env.write_text(f"HF_TOKEN={FILE_SECRET}\n")
    inv = tmp / "slurm.yaml"
    inv.write_text(yaml.safe_dump({
        "slurm": {"partition": "debug", "nodes": 2, "container": "none", "workdir": str(tmp / "shared")},
        "job": {"image": "runner-trainer:latest", "config": str(REPO / "configs" / "pi-qwen3-3stage-tiny.yaml"),
                "env_file": str(env), "env": {"WANDB_API_KEY": INLINE_SECRET}}}))
    return inv


def test_failed_sbatch_leaves_no_secrets_file_and_its_message_is_masked(tmp_path):
    """The secrets file (0600) and the script (job.env's values) were left on the shared
    filesystem when sbatch refused the job; sbatch's message, quoting a value, was printed as is."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    res = runner("up", "-i", str(slurm_inventory(tmp_path)),
                 env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SBATCH_ECHO": FILE_SECRET})
    assert res.returncode == 2, res.stdout + res.stderr
    assert errors(res) == ["runner: error: sbatch failed on this machine: sbatch: error: Batch job submission failed: "
                           "invalid account ******; nothing submitted"]
    shared = tmp_path / "shared"
    left = sorted(str(p.relative_to(shared)) for p in shared.rglob("*") if p.is_file())
    assert all(p.endswith("config.yaml") for p in left), left  # no secrets/<run>.env, no submit-1.sbatch
    assert not any(FILE_SECRET in p.read_text() or INLINE_SECRET in p.read_text()
                   for p in shared.rglob("*") if p.is_file())


# ---- SSH nodes: files created 0600, a registry login gone with the connection --------------------

def test_a_secrets_file_on_a_node_is_0600_from_its_creation(sandbox, tmp_path):
    """put_bytes opened the file with paramiko's open() (no permissions sent: the node made it
    0644) and chmod-ed it after; a reader that opened it in between read what came later. The
    file is now created 0600 by the SFTP open itself: stat it before a byte is written."""
    r = remotes(sandbox)["node-0"]
    path = str(tmp_path / "secrets.env")
    with r:
        fh = r.create(path, 0o600)
        try:
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and os.path.getsize(path) == 0
        finally:
            fh.close()
        with pytest.raises(OSError):
            r.create(path, 0o600)  # never through a file (or link) already there
        r.put_bytes(path, b"HF_TOKEN=x\n", 0o600)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and Path(path).read_bytes() == b"HF_TOKEN=x\n"


def test_registry_login_is_removed_when_the_connection_drops_mid_pull(sandbox, tmp_path):
    """The 0600 login for job.registry was removed by a command sent after the pull, over the
    same connection: when that connection was lost, the login stayed on the node for good."""
    from runner.core.errors import UserError
    from runner.delivery.registry import pull_one

    addr = net_addr(5, 3)  # a registry that accepts and never answers: the pull hangs in it
    srv = socket.create_server((addr, 5000))
    accepted = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        held.append(conn)
        accepted.set()

    threading.Thread(target=accept, daemon=True).start()
    home = tmp_path / "home"
    home.mkdir()
    r = remotes(sandbox)["node-1"]
    failed: list[BaseException] = []

    def pull() -> None:
        try:
            pull_one(r, f"{addr}:5000", "runner-test-reg:never", ("bot", "pw-dropped-5e2"), str(home))
        except (UserError, Exception) as exc:  # noqa: BLE001 - the connection is dropped under it
            failed.append(exc)

    t = threading.Thread(target=pull, daemon=True)
    t.start()
    try:
        assert accepted.wait(120), "the node's engine never reached the registry"
        (login,) = list(home.glob(".runner-registry-*"))
        assert stat.S_IMODE(login.stat().st_mode) == 0o700
        assert stat.S_IMODE((login / "config.json").stat().st_mode) == 0o600
        r.abandon()  # the runner's connection is gone (a laptop's Wi-Fi, a killed runner)
        t.join(60)
        assert failed, "the pull did not end with its connection"
        wait_for(lambda: not login.exists(), 60)
    finally:
        srv.close()
        for c in held:
            c.close()
        r.close()
    assert list(home.iterdir()) == []
