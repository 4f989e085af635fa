"""ssh-agent is used as OpenSSH uses it, on both SSH paths (paramiko for commands and SFTP, the
OpenSSH client for bulk transfers): its keys are offered together with identity_file, so a
passphrase-protected key loaded into a real `ssh-agent` reaches the session sandbox's real sshd
nodes, and the OpenSSH client logs in with the key paramiko's login used. The key is the sandbox's own, re-encrypted with a passphrase in a copy (the nodes already
trust it: nothing of the shared cluster is changed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from runner.core.errors import UserError
from runner.inventory import load_inventory
from runner.transport.ssh import Remote

PASSPHRASE = "correct horse battery staple"
pytestmark = [pytest.mark.sandbox, pytest.mark.skipif(not shutil.which("ssh-agent"), reason="no ssh-agent")]


@pytest.fixture
def agent(tmp_path, monkeypatch):
    """A real ssh-agent of this test's own (its socket in tmp_path), exported as SSH_AUTH_SOCK."""
    sock = tmp_path / "agent.sock"
    # Without -D ssh-agent returns once its socket listens (then runs on in the background).
    out = subprocess.run(["ssh-agent", "-s", "-a", str(sock)], capture_output=True, text=True, check=True, timeout=30)
    pid = re.search(r"SSH_AGENT_PID=(\d+)", out.stdout)[1]
    monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
    try:
        yield sock
    finally:
        subprocess.run(["ssh-agent", "-k"], env={**os.environ, "SSH_AGENT_PID": pid}, capture_output=True, timeout=30)


def encrypted_copy(key: str, dest: Path) -> Path:
    shutil.copy(key, dest)
    dest.chmod(0o600)
    subprocess.run(["ssh-keygen", "-q", "-p", "-f", str(dest), "-P", "", "-N", PASSPHRASE], check=True, timeout=30,
                   capture_output=True)
    return dest


def ssh_add(key: Path, tmp_path: Path) -> None:
    """ssh-add as a user types the passphrase (through SSH_ASKPASS: no terminal here)."""
    askpass = tmp_path / "askpass"
    askpass.write_text(f"#!/bin/sh\necho '{PASSPHRASE}'\n")
    askpass.chmod(0o700)
    env = {**os.environ, "SSH_ASKPASS": str(askpass), "SSH_ASKPASS_REQUIRE": "force", "DISPLAY": ":0"}
    subprocess.run(["ssh-add", str(key)], env=env, check=True, capture_output=True, stdin=subprocess.DEVNULL,
                   timeout=30)


def node_with_key(sandbox: Path, tmp_path: Path, identity_file: Path):
    doc = yaml.safe_load(Path(sandbox).read_text())
    doc["defaults"]["identity_file"] = str(identity_file)
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump(doc))
    return load_inventory(inv, with_job=False).nodes[0]


def both_paths_log_in(node) -> None:
    with Remote(node).connect() as r:
        assert r.run("id -un").out.strip() == node.user  # paramiko
        bulk = subprocess.run([*r.openssh_argv(), "id -un"], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
        assert (bulk.returncode, bulk.stdout.strip()) == (0, node.user), bulk.stderr  # the OpenSSH client


def test_a_passphrase_key_held_by_ssh_agent(sandbox, tmp_path, agent):
    key = encrypted_copy(load_inventory(sandbox, with_job=False).nodes[0].identity_file, tmp_path / "id_pass")
    ssh_add(key, tmp_path)
    both_paths_log_in(node_with_key(sandbox, tmp_path, key))


def test_agent_keys_are_tried_besides_identity_file(sandbox, tmp_path, agent):
    """identity_file names a key the node does not know; the agent holds one it does (OpenSSH
    offers both, and so does the runner now on both paths)."""
    key = encrypted_copy(load_inventory(sandbox, with_job=False).nodes[0].identity_file, tmp_path / "id_pass")
    ssh_add(key, tmp_path)
    other = tmp_path / "id_other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True, timeout=30)
    both_paths_log_in(node_with_key(sandbox, tmp_path, other))


def test_many_agent_keys_do_not_crowd_out_identity_file(sandbox, tmp_path, agent):
    """An agent holding more keys than a node's MaxAuthTries (6), none of them the node's: both
    paths log in with identity_file, the OpenSSH client too (it is given the key paramiko's
    login used, not every key of the agent first)."""
    for i in range(7):
        k = tmp_path / f"id_other{i}"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(k)], check=True, timeout=30)
        subprocess.run(["ssh-add", "-q", str(k)], check=True, capture_output=True, timeout=30)
    both_paths_log_in(load_inventory(sandbox, with_job=False).nodes[0])


def test_a_passphrase_key_without_an_agent_is_one_line(sandbox, tmp_path, monkeypatch):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    key = encrypted_copy(load_inventory(sandbox, with_job=False).nodes[0].identity_file, tmp_path / "id_pass")
    node = node_with_key(sandbox, tmp_path, key)
    with pytest.raises(UserError) as ei:
        Remote(node).connect()
    msg = str(ei.value)
    assert "\n" not in msg and f"identity_file {key} is protected by a passphrase" in msg and f"`ssh-add {key}`" in msg
