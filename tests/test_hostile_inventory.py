"""Inventories and the files they name, read as an attacker would write them (issue 23): reading
runs nothing and asks nothing of the network (ssh configs with `Match exec`, an inventory that is
its own ssh_config), YAML that explodes while it is built, values with a trailing newline or a
spelling that hides what they are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runner.errors import UserError
from runner.inventory import load_inventory
from tests import REPO
from tests.runner_helpers import no_socket_env


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Path:
    h = tmp_path / "home"
    (h / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(h))
    return h


def _cli(tmp_path: Path, *args: str, home: Path | None = None) -> subprocess.CompletedProcess:
    """The CLI in a child where opening a socket or looking a name up is fatal."""
    env = no_socket_env(tmp_path)
    with open(tmp_path / "guard" / "sitecustomize.py", "a") as fh:
        fh.write("def _no_dns(*a, **k):\n    raise SystemExit('NAME LOOKUP')\n"
                 "for _f in ('getaddrinfo', 'gethostbyname', 'gethostbyname_ex', 'gethostbyaddr', 'getfqdn'):\n"
                 "    setattr(socket, _f, _no_dns)\n")
    if home is not None:
        env["HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)


MATCH_EXEC = """\
Match exec "touch {marker}"
    User mallory
Host gpu-0
    HostName 10.9.0.10
    User admin
    IdentityFile ~/.ssh/id_gpu
"""


def test_an_inventory_ssh_config_with_match_exec_runs_nothing(tmp_path, home, no_network):
    marker = tmp_path / "pwned"
    cfg = tmp_path / "ssh_config"
    cfg.write_text(MATCH_EXEC.format(marker=marker))
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"defaults: {{ssh_config: {cfg}}}\nnodes:\n  - {{name: a, host: gpu-0, arch: amd64}}\n")
    node = load_inventory(inv, check_files=False).nodes[0]
    assert not marker.exists(), "reading the inventory ran the ssh config's Match exec"
    assert (node.host, node.user) == ("10.9.0.10", "admin")  # the Host block still applies


def test_home_ssh_config_match_exec_runs_nothing_in_a_dry_run(tmp_path, home):
    marker = tmp_path / "pwned"
    (home / ".ssh" / "config").write_text(MATCH_EXEC.format(marker=marker))
    inv = tmp_path / "inv.yaml"
    inv.write_text("nodes:\n  - {name: a, host: gpu-0, arch: amd64}\njob:\n  image: t:1\n")
    proc = _cli(tmp_path, "up", "-i", str(inv), "--dry-run", home=home)
    assert not marker.exists(), "runner up --dry-run ran ~/.ssh/config's Match exec"
    assert proc.returncode == 0, proc.stderr
    assert "10.9.0.10" in proc.stdout


def test_an_inventory_that_is_its_own_ssh_config_runs_nothing(tmp_path, home):
    """Every line is both YAML and an ssh_config line; the last one hides `Match exec` in a job arg."""
    marker = tmp_path / "pwned"
    inv = tmp_path / "inv.yaml"
    inv.write_text("defaults : {ssh_config: ./inv.yaml}\n"
                   "nodes : [{name: a, host: gpu-0, arch: amd64}]\n"
                   "job : {image: t-1, args: [x,\n"
                   f'  Match exec "touch {marker}" host "*" user "q"]}}\n')
    for cmd in (("up", "-i", str(inv), "--dry-run"), ("export", "-i", str(inv), "--to", "kubernetes", "-o", str(tmp_path / "out.yaml"))):
        proc = _cli(tmp_path, *cmd, home=home)
        assert not marker.exists(), f"runner {cmd[0]} ran the inventory's own Match exec"
        assert proc.returncode == 0, proc.stderr


def test_a_match_block_for_other_hosts_is_silent_one_for_a_node_is_named(tmp_path, home, no_network, caplog):
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Match host *.corp.example exec \"true\"\n    User worker\n"  # not for these nodes
                   "Match originalhost gpu-*\n    ProxyJump jump\n"           # for them: not applied, named
                   "Match all\n    ForwardAgent yes\n"                         # nothing the runner uses
                   "Host gpu-0\n    HostName 10.9.0.10\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"defaults: {{ssh_config: {cfg}}}\nnodes:\n  - {{name: a, host: gpu-0, arch: amd64}}\n"
                   "  - {name: b, host: gpu-1, arch: amd64}\n")
    with caplog.at_level("WARNING"):
        nodes = load_inventory(inv, check_files=False).nodes
    assert [n.proxy_jump for n in nodes] == [None, None]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and f"{cfg}:3:" in warned[0] and "ProxyJump" in warned[0], warned
    assert "worker" not in warned[0]


# --- YAML built from a few bytes into millions of values -----------------------------------------

ALIAS_BOMB = "".join(f"{k}: &{k} [{', '.join([f'*{p}' if p else 'x'] * 9)}]\n"
                     for p, k in zip(["", *"abcdefgh"], "abcdefghi", strict=True))


@pytest.mark.timeout(60)  # before: still expanding 9^9 values (26 s and 650 MB when killed)
@pytest.mark.parametrize("where", ["inventory", "job file", "slurm inventory"])
def test_a_yaml_alias_bomb_is_refused_before_it_is_built(tmp_path, where):
    from runner.slurm_inventory import load_slurm_inventory

    assert len(ALIAS_BOMB) < 1024
    bomb = tmp_path / "bomb.yaml"
    plain = tmp_path / "inv.yaml"
    plain.write_text("nodes:\n  - {name: a, host: 10.9.0.1, arch: amd64}\n")
    with pytest.raises(UserError) as exc:
        if where == "inventory":
            bomb.write_text(ALIAS_BOMB.replace("a: &a", "nodes: [{name: a, host: 10.9.0.1}]\na: &a"))
            load_inventory(bomb)
        elif where == "job file":
            bomb.write_text("job:\n  image: t:1\n" + ALIAS_BOMB)
            load_inventory(plain, job_path=str(bomb))
        else:
            bomb.write_text("slurm: {nodes: 1}\n" + ALIAS_BOMB)
            load_slurm_inventory(str(bomb))
    msg = str(exc.value)
    first = next(i for i, ln in enumerate(bomb.read_text().splitlines(), 1) if "&a" in ln)
    assert msg.startswith(f"{bomb}:{first}: YAML anchors and aliases") and "\n" not in msg, msg


def test_a_merge_key_is_an_alias_too(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("base: &base {arch: amd64}\nnodes:\n  - {<<: *base, name: a, host: 10.9.0.1}\n")
    with pytest.raises(UserError, match=rf"^{inv}:1: YAML anchors and aliases"):
        load_inventory(inv)


def test_yaml_nested_past_any_inventory_is_one_line(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("nodes: [{name: a, host: 10.9.0.1}]\njob: {args: " + "[" * 900 + "]" * 900 + "}\n")
    with pytest.raises(UserError) as exc:  # a RecursionError traceback before
        load_inventory(inv)
    assert str(exc.value).startswith(f"{inv}:2: job.args") and "nested more than 32 levels" in str(exc.value)
