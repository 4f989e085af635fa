"""Host keys as OpenSSH users keep them (issue 15): the system-wide known_hosts, hashed entries, a
pinned fingerprint of any of the node's key types, and a ~/.ssh made private."""

from __future__ import annotations

import re
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.runner_helpers import runner

pytestmark = [pytest.mark.sandbox]


def _without_known_hosts(sandbox: Path, dest: Path, **node1) -> Path:
    doc = yaml.safe_load(Path(sandbox).read_text())
    doc["defaults"].pop("known_hosts", None)
    doc["nodes"][1].update(node1)
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest


def _sandbox_known_hosts(sandbox: Path) -> str:
    return Path(yaml.safe_load(Path(sandbox).read_text())["defaults"]["known_hosts"]).read_text()


def test_accept_new_host_keys_makes_a_private_ssh_dir(sandbox, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    inv = _without_known_hosts(sandbox, tmp_path / "inv.yaml")
    proc = runner("ls", "-i", str(inv), "--accept-new-host-keys", env={"HOME": str(home)})
    assert proc.returncode == 0, proc.stderr
    d = home / ".ssh"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE((d / "known_hosts").stat().st_mode) == 0o600
    assert len((d / "known_hosts").read_text().splitlines()) == 3
    again = runner("ls", "-i", str(inv), env={"HOME": str(home)})  # now known
    assert again.returncode == 0, again.stderr


def test_system_known_hosts_and_hashed_entries_are_honoured(sandbox, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    system = tmp_path / "ssh_known_hosts"
    system.write_text(_sandbox_known_hosts(sandbox))
    subprocess.run(["ssh-keygen", "-H", "-f", str(system)], capture_output=True, check=True)
    assert "|1|" in system.read_text()
    inv = _without_known_hosts(sandbox, tmp_path / "inv.yaml")
    refused = runner("ls", "-i", str(inv), env={"HOME": str(home), "RUNNER_SYSTEM_KNOWN_HOSTS": "/nonexistent"})
    assert refused.returncode == 2 and "unknown host key" in refused.stderr, refused.stderr
    proc = runner("ls", "-i", str(inv), env={"HOME": str(home), "RUNNER_SYSTEM_KNOWN_HOSTS": str(system)})
    assert proc.returncode == 0, proc.stderr
    assert not (home / ".ssh").exists()  # nothing written: every key was known


def test_a_pinned_fingerprint_of_any_key_type_is_accepted(sandbox, tmp_path):
    doc = yaml.safe_load(Path(sandbox).read_text())
    host, port = doc["nodes"][1]["host"], doc["defaults"]["port"]
    scan = subprocess.run(["ssh-keyscan", "-p", str(port), "-t", "ecdsa", host], capture_output=True, text=True,
                          timeout=30)
    assert scan.stdout.strip(), f"node-1 offers no ECDSA host key: {scan.stderr}"
    fp = subprocess.run(["ssh-keygen", "-lf", "-"], input=scan.stdout, capture_output=True, text=True).stdout.split()[1]
    assert fp.startswith("SHA256:")
    home = tmp_path / "home"
    home.mkdir()
    inv = _without_known_hosts(sandbox, tmp_path / "pinned.yaml", host_key=fp)
    kh = tmp_path / "kh"
    kh.write_text(_sandbox_known_hosts(sandbox))
    doc = yaml.safe_load(inv.read_text())
    doc["defaults"]["known_hosts"] = str(kh)
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = runner("down", "-i", str(inv), env={"HOME": str(home)})
    assert proc.returncode == 0 and "host key" not in proc.stderr, proc.stderr
    wrong = inv.read_text().replace(fp, "SHA256:" + "A" * 43)
    inv.write_text(wrong)
    bad = runner("down", "-i", str(inv), env={"HOME": str(home)})
    assert bad.returncode == 3 and "node node-1: host key mismatch" in bad.stderr, bad.stderr
    assert fp in bad.stderr  # the node's keys are named, the ECDSA one among them


def test_a_revoked_host_key_is_refused_wherever_it_is_marked(sandbox, tmp_path):
    """A `@revoked` line for node-1's key, against node-1's real sshd: the node is left out with one
    line saying so, even though the same file (or the user's, when the mark is in the system-wide
    file) lists the key as good, and even with --accept-new-host-keys, which writes nothing."""
    doc = yaml.safe_load(Path(sandbox).read_text())
    host, port = doc["nodes"][1]["host"], doc["defaults"]["port"]
    known = _sandbox_known_hosts(sandbox)
    node1 = [ln for ln in known.splitlines() if ln.split()[0] == f"[{host}]:{port}"]
    assert node1, known
    revoked = "".join(f"@revoked {ln}\n" for ln in node1)
    home = tmp_path / "home"
    home.mkdir()
    cases = {"same file": (known + revoked, "/nonexistent"),
             "system-wide file": (known, str(tmp_path / "ssh_known_hosts"))}
    (tmp_path / "ssh_known_hosts").write_text(revoked)
    for case, (user_file, system) in cases.items():
        kh = tmp_path / f"known_hosts-{case.split()[0]}"
        kh.write_text(user_file)
        doc["defaults"]["known_hosts"] = str(kh)
        inv = tmp_path / f"inv-{case.split()[0]}.yaml"
        inv.write_text(yaml.safe_dump(doc, sort_keys=False))
        for extra in ([], ["--accept-new-host-keys"]):
            proc = runner("ls", "-i", str(inv), "--json", *extra, env={"HOME": str(home), "RUNNER_SYSTEM_KNOWN_HOSTS": system})
            assert proc.returncode == 0, (case, extra, proc.stderr)
            assert re.fullmatch(rf"runner: warning: node node-1: host key ssh-\S+ SHA256:\S+ of {re.escape(host)}:{port} "
                                r"is marked @revoked in known_hosts; refusing to connect \(left out\)\n",
                                proc.stderr), (case, extra, proc.stderr)
            assert kh.read_text() == user_file and not (home / ".ssh").exists(), (case, extra)
