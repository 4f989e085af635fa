"""A clone works on any machine: nothing of the build machine is shipped (hosts/local.yaml is
written by `runner sandbox up`, never tracked), and the inventory a command uses without -i is
$RUNNER_INVENTORY, then the last `up` in this directory (said on stderr), then hosts/local.yaml;
a missing one is one line naming -i and `runner sandbox up`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runner.core.errors import UserError
from runner.inventory.choice import DEFAULT_INVENTORY, LAST_UP, default_inventory, remember_inventory
from tests import REPO
from tests.conftest import net_addr
from tests.support.runner_helpers import run_cli

NODES = "nodes:\n  - {name: a, host: 10.9.0.1, arch: amd64}\njob: {image: t, command: [python, -c, 'print(1)']}\n"


def test_the_default_inventory_order(tmp_path):
    (tmp_path / "hosts").mkdir()
    with pytest.raises(UserError) as ei:
        default_inventory({}, tmp_path)
    msg = str(ei.value)
    assert "\n" not in msg and "-i FILE" in msg and "`runner sandbox up`" in msg and DEFAULT_INVENTORY in msg
    (tmp_path / DEFAULT_INVENTORY).write_text(NODES)
    assert default_inventory({}, tmp_path) == (DEFAULT_INVENTORY, "default")
    (tmp_path / "pis.yaml").write_text(NODES)
    remember_inventory("pis.yaml", tmp_path, {})
    assert (tmp_path / LAST_UP).read_text() == "pis.yaml\n"
    assert default_inventory({}, tmp_path) == ("pis.yaml", "last up")
    assert default_inventory({"RUNNER_INVENTORY": "x.yaml"}, tmp_path) == ("x.yaml", "RUNNER_INVENTORY")
    # RUNNER_LAST_UP="" keeps no record and reads none; a record whose file is gone is passed over.
    assert default_inventory({"RUNNER_LAST_UP": ""}, tmp_path) == (DEFAULT_INVENTORY, "default")
    (tmp_path / "pis.yaml").unlink()
    assert default_inventory({}, tmp_path) == (DEFAULT_INVENTORY, "default")


def test_a_command_without_i_says_which_last_up_it_follows(tmp_path, monkeypatch, capsys, no_network):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RUNNER_LAST_UP")
    rc, _ = run_cli("up", "--dry-run")
    assert rc == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"runner: error: no inventory: {DEFAULT_INVENTORY} does not exist here; name one with -i FILE "
                   f"(or RUNNER_INVENTORY=FILE), or start the local sandbox cluster with `runner sandbox up`, "
                   f"which writes {DEFAULT_INVENTORY}"]
    (tmp_path / "mine.yaml").write_text(NODES)
    remember_inventory("mine.yaml")  # as `runner up -i mine.yaml` did
    rc, out = run_cli("up", "--dry-run")
    assert rc == 0 and "[a/0] 10.9.0.1  arch=amd64" in out
    assert capsys.readouterr().err == ("runner: inventory mine.yaml (from the last `runner up` or `runner sandbox up` "
                                       "here; -i FILE for another)\n")
    (tmp_path / "other.yaml").write_text(NODES)
    assert run_cli("up", "--dry-run", "-i", "other.yaml")[0] == 0
    assert (tmp_path / LAST_UP).read_text() == "mine.yaml\n"  # a dry-run records nothing


def test_nothing_of_a_machine_is_tracked():
    tracked = subprocess.run(["git", "ls-files", "hosts"], capture_output=True, text=True, cwd=REPO, check=True)
    assert DEFAULT_INVENTORY not in tracked.stdout.split()
    for name in tracked.stdout.split():  # shipped examples: keys and workdirs under ~, no absolute home
        text = (REPO / name).read_text()
        assert "/work/" not in text and "/root/" not in text and "/home/" not in text, name


@pytest.mark.sandbox
def test_a_fresh_clone_works_without_the_build_machine(tmp_path, have_sshd, host_docker):
    """Issue 25's newcomer: a clone elsewhere, a home without keys, no -i."""
    clone, home = tmp_path / "elsewhere" / "clone", tmp_path / "home"
    home.mkdir()
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{REPO}", str(clone)], check=True, timeout=120,
                   capture_output=True)
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(clone)}
    env.pop("RUNNER_LAST_UP", None)  # the newcomer's own behaviour: `up` leaves its record

    def runner(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, cwd=clone,
                              env=env, timeout=timeout)

    version = runner("--version")
    assert version.returncode == 0 and version.stdout.startswith("runner "), version.stderr
    assert not (clone / DEFAULT_INVENTORY).exists()
    plan = runner("up", "--dry-run", "-i", "hosts/pis.yaml")
    assert plan.returncode == 0 and "MASTER_ADDR=192.168.1.10" in plan.stdout, plan.stderr
    missing = runner("status")
    assert missing.returncode == 2 and len(missing.stderr.splitlines()) == 1, missing.stderr
    assert "-i FILE" in missing.stderr and "runner sandbox up" in missing.stderr
    up = runner("sandbox", "up", "--nodes", "1", "--light", "--base-addr", net_addr(25, 11), timeout=300)
    try:
        assert up.returncode == 0, up.stderr
        inv = yaml.safe_load((clone / DEFAULT_INVENTORY).read_text())
        assert Path(inv["defaults"]["identity_file"]).is_relative_to(clone)  # this clone's own sandbox
        status = runner("status")
        # Reached, searched, found nothing (an unreachable node would be named).
        assert (status.returncode, status.stderr) == (2, "runner: error: no runs found in the nodes' run dirs and "
                                                          "containers (no runner containers, no run dirs)\n")
    finally:
        runner("sandbox", "down", "--purge", timeout=300)
