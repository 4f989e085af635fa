"""Hostile and mistaken inventories (issue 15): every value that would reach a shell, a bind mount or
the runner's own contract is refused when the inventory loads, so `up --dry-run` refuses it too,
in one line naming file:line, the field and the node, with nothing contacted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runner.core.errors import UserError
from runner.inventory import load_inventory
from tests import REPO
from tests.support.runner_helpers import no_socket_env

SECRET = "hf_do_not_print_me_7f3a"


def _inv(tmp_path: Path, node_extra: str = "", job: str = "", defaults: str = "") -> Path:
    key = tmp_path / "id_test"
    key.write_text("not a real key\n")
    p = tmp_path / "inv.yaml"
    p.write_text(f"defaults: {{identity_file: {key}{defaults}}}\n"
                 "nodes:\n"
                 "  - {name: a, host: 10.9.0.1, arch: amd64}\n"
                 f"  - {{name: b, host: 10.9.0.2, arch: amd64{node_extra}}}\n"
                 f"job:\n  image: t:1\n{job}")
    return p


# (id, node field text for node b (line 4), expected field) -- all refused at load, naming node b.
HOSTILE_NODE = [
    ("workdir_semicolon", ", workdir: '/tmp/x; touch /tmp/p; echo'", "nodes[1].workdir"),
    ("workdir_newline", ', workdir: "/tmp/x\\ntouch /tmp/p"', "nodes[1].workdir"),
    ("workdir_quote", ", workdir: \"/tmp/it's\"", "nodes[1].workdir"),
    ("workdir_dollar", ", workdir: '/tmp/$(id)'", "nodes[1].workdir"),
    ("workdir_relative", ", workdir: runs", "nodes[1].workdir"),
    ("workdir_colon", ", workdir: '/data/a:b'", "nodes[1].workdir"),
    ("workdir_other_home", ", workdir: '~bob/x'", "nodes[1].workdir"),
    ("user_shell", ", user: 'pi; rm -rf /'", "nodes[1].user"),
    ("env_reserved_node_rank", ", env: {NODE_RANK: '0'}", "nodes[1].env.NODE_RANK"),
    ("env_reserved_master_addr", ", env: {MASTER_ADDR: 10.0.0.9}", "nodes[1].env.MASTER_ADDR"),
]


@pytest.mark.parametrize("name,extra,field", HOSTILE_NODE, ids=[h[0] for h in HOSTILE_NODE])
def test_hostile_node_values_refused_at_load(tmp_path, name, extra, field):
    p = _inv(tmp_path, node_extra=extra)
    with pytest.raises(UserError) as ei:
        load_inventory(p, check_files=False)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{p}:4: {field}"), msg
    assert "node b" in msg, msg


# (id, job text, expected "line: field" fragment)
HOSTILE_JOB = [
    ("job_env_rank", "  env: {RANK: '3'}\n", ":7: job.env.RANK"),
    ("job_env_world_size", "  env:\n    OMP_NUM_THREADS: '1'\n    WORLD_SIZE: '9'\n", ":9: job.env.WORLD_SIZE"),
    ("job_env_master_port", "  env: {MASTER_PORT: '1'}\n", ":7: job.env.MASTER_PORT"),
    ("image_shell", "  config: null\n", ":6: job.image"),
]


@pytest.mark.parametrize("name,job,frag", HOSTILE_JOB, ids=[h[0] for h in HOSTILE_JOB])
def test_hostile_job_values_refused_at_load(tmp_path, name, job, frag):
    p = _inv(tmp_path, job=job if name != "image_shell" else "")
    if name == "image_shell":
        p.write_text(p.read_text().replace("image: t:1", "image: 't:1; touch /tmp/p'"))
    with pytest.raises(UserError) as ei:
        load_inventory(p, check_files=False)
    msg = str(ei.value)
    assert "\n" not in msg and frag in msg and msg.startswith(str(p)), msg


def test_reserved_env_points_to_the_field_that_sets_it(tmp_path):
    with pytest.raises(UserError) as ei:
        load_inventory(_inv(tmp_path, job="  env: {MASTER_PORT: '1'}\n"), check_files=False)
    assert "job.master_port" in str(ei.value)
    with pytest.raises(UserError) as ei:
        load_inventory(_inv(tmp_path, job="  env: {NODE_RANK: '1'}\n"), check_files=False)
    assert "role: master" in str(ei.value)


def test_reserved_name_in_env_file_names_its_line_never_its_value(tmp_path):
    envf = tmp_path / ".env"
    envf.write_text(f"HF_TOKEN={SECRET}\n# rank override\nNODE_RANK={SECRET}\n")
    p = _inv(tmp_path, job=f"  env_file: {envf}\n")
    with pytest.raises(UserError) as ei:
        load_inventory(p, check_files=False)
    msg = str(ei.value)
    assert f"{p}:7: job.env_file: {envf}:3: NODE_RANK" in msg and SECRET not in msg, msg


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=60)


@pytest.mark.parametrize("name,extra,field", HOSTILE_NODE[:7] + HOSTILE_NODE[8:9], ids=[h[0] for h in HOSTILE_NODE[:7] + HOSTILE_NODE[8:9]])
def test_dry_run_and_up_refuse_hostile_values_in_one_line(tmp_path, name, extra, field):
    p = _inv(tmp_path, node_extra=extra)
    env = no_socket_env(tmp_path)
    for cmd in (["up", "-i", str(p), "--dry-run"], ["up", "-i", str(p)], ["status", "-i", str(p)]):
        proc = _cli(env, *cmd)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (cmd, proc.stderr)
        assert lines[0].startswith(f"runner: error: {p}:4: {field}") and "node b" in lines[0], lines
        assert "SOCKET OPENED" not in proc.stdout + proc.stderr and proc.stdout == ""


def test_a_missing_key_file_is_refused_by_up_not_by_its_dry_run(tmp_path):
    """A dry-run needs no key (it connects nowhere: a laptop without the cluster's keys plans);
    `up` refuses the missing file in one line before any socket."""
    p = _inv(tmp_path)
    p.write_text(p.read_text().replace(str(tmp_path / "id_test"), str(tmp_path / "no-such-key")))
    plan = _cli(no_socket_env(tmp_path), "up", "-i", str(p), "--dry-run")
    assert plan.returncode == 0 and "[b/1] 10.9.0.2  arch=amd64" in plan.stdout, plan.stderr
    proc = _cli(no_socket_env(tmp_path), "up", "-i", str(p))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"{p}:1: defaults.identity_file: file not found: {tmp_path / 'no-such-key'}" in lines[0], lines


def test_dry_run_refuses_an_unknown_node_in_arch(tmp_path):
    p = _inv(tmp_path)
    p.write_text(p.read_text().replace(", arch: amd64}", "}"))
    proc = _cli(no_socket_env(tmp_path), "up", "-i", str(p), "--dry-run", "--arch", "pi-9=arm64")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "pi-9" in lines[0] and "--arch" in lines[0], proc.stderr
    ok = _cli(no_socket_env(tmp_path), "up", "-i", str(p), "--dry-run", "--arch", "b=arm64", "--arch", "amd64")
    assert ok.returncode == 0 and "[b/1] 10.9.0.2  arch=arm64" in ok.stdout, ok.stderr


def test_secret_looking_job_env_is_masked_and_warned_about(tmp_path):
    p = _inv(tmp_path, job=f"  env: {{HF_TOKEN: {SECRET}, OMP_NUM_THREADS: '2'}}\n",
             node_extra=f", env: {{DB_PASSWORD: {SECRET}x}}")
    proc = _cli(no_socket_env(tmp_path), "up", "-i", str(p), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    assert "HF_TOKEN=******" in proc.stdout and "DB_PASSWORD=******" in proc.stdout
    assert "OMP_NUM_THREADS=2" in proc.stdout
    warns = [ln for ln in proc.stderr.splitlines() if ln.startswith("runner: warning:")]
    assert any(f"{p}:7: job.env.HF_TOKEN" in w and "env_file" in w for w in warns), proc.stderr
    assert any("nodes[1].env.DB_PASSWORD" in w for w in warns), proc.stderr


def test_logs_tail_must_be_a_number(tmp_path):
    proc = _cli(no_socket_env(tmp_path), "logs", "--tail", "abc", "-i", str(_inv(tmp_path)))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "--tail" in lines[0] and "abc" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
