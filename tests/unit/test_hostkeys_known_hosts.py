"""known_hosts read as OpenSSH reads it (issue 23): every line form OpenSSH honours (wildcards,
negations, `[host]:port`, hashed names, @revoked, @cert-authority) gives the runner the verdict
OpenSSH's own client gives, against the same real server, the same file and a real key mismatch.
An impostor that `ssh` refuses is refused, even with --accept-new-host-keys."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import shutil
import subprocess
from pathlib import Path

import paramiko
import pytest

from runner.core.errors import UserError
from runner.transport.ssh import Remote
from tests.support.hostile_node import HostileNode

pytestmark = [pytest.mark.timeout(180)]

ED25519 = "ssh-ed25519 " + base64.b64encode(b"\0\0\0\x0bssh-ed25519\0\0\0\x20" + bytes(range(32))).decode()


def _hashed(name: str) -> str:
    salt = os.urandom(20)
    digest = hmac.new(salt, name.encode(), hashlib.sha1).digest()
    return f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"


def _cases(node: HostileNode) -> dict[str, str]:
    """known_hosts contents by case; {name}: the lookup name `[addr]:port`, {good}/{other}: the
    server's key and another key of the same type (an impostor's, or the real one's after a
    reinstall)."""
    net = node.addr.rsplit(".", 1)[0]
    return {
        "exact, same key": "{name} {good}",
        "exact, other key": "{name} {other}",
        "wildcard, other key": f"[{net}.*]:* {{other}}",
        "single-char wildcard, same key": f"[{net}.?]:{node.port} {{good}}",
        "wildcard on another port": f"[{net}.*]:22 {{other}}",
        "negated entry skips the line": "*,!{name} {other}",
        "negation that does not apply": f"[{net.split('.')[0]}.*]:*,!nomatch {{other}}",
        "hashed, other key": "{hashed} {other}",
        "revoked by wildcard": f"@revoked [{net}.*]:* {{good}}\n{{name}} {{good}}",
        "revoked exact": "@revoked {name} {good}",
        "cert-authority only": f"@cert-authority [{net}.*]:* {{other}}",
        "only another key type known": "{name} " + ED25519,
        "empty": "",
    }


def _openssh(node: HostileNode, kh: Path) -> str:
    """OpenSSH's verdict: ok (connected, file unchanged), new (accepted and recorded), changed, revoked."""
    before = kh.read_text()
    proc = subprocess.run(["ssh", "-F", "/dev/null", "-p", str(node.port), "-l", "u", "-i", str(node.key_file),
                           "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
                           "-o", f"UserKnownHostsFile={kh}", "-o", "GlobalKnownHostsFile=/dev/null",
                           "-o", "ConnectTimeout=10", node.addr, "true"], capture_output=True, text=True, timeout=60)
    if proc.returncode == 0:
        return "ok" if kh.read_text() == before else "new"
    if "REVOKED" in proc.stderr:
        return "revoked"
    if "HOST IDENTIFICATION HAS CHANGED" in proc.stderr:
        return "changed"
    return f"error: {proc.stderr.strip()[-300:]}"


def _runner(node: HostileNode, kh: Path) -> str:
    before = kh.read_text()
    try:
        Remote(node.node(known_hosts=str(kh)), accept_new_host_keys=True).connect().close()
    except UserError as exc:
        msg = str(exc)
        return "revoked" if "@revoked" in msg else "changed" if "HOST KEY CHANGED" in msg else f"error: {msg}"
    return "ok" if kh.read_text() == before else "new"


def test_known_hosts_verdicts_equal_openssh_on_a_real_server(tmp_path, monkeypatch):
    assert shutil.which("ssh"), "the OpenSSH client is needed"
    monkeypatch.setenv("RUNNER_SYSTEM_KNOWN_HOSTS", str(tmp_path / "none"))
    with HostileNode(tmp_path / "node", fourth=5) as node:
        name = f"[{node.addr}]:{node.port}"
        good = f"{node.host_key.get_name()} {node.host_key.get_base64()}"
        impostor = paramiko.ECDSAKey.generate()
        other = f"{impostor.get_name()} {impostor.get_base64()}"
        got = {}
        for case, text in _cases(node).items():
            body = text.format(name=name, good=good, other=other, hashed=_hashed(name))
            files = {who: tmp_path / f"kh-{who}" for who in ("ssh", "runner")}
            for f in files.values():
                f.write_text(body + "\n" if body else "")
            got[case] = (_openssh(node, files["ssh"]), _runner(node, files["runner"]))
    differ = {c: v for c, v in got.items() if v[0] != v[1]}
    assert not differ, f"(OpenSSH, runner) verdicts differ: {differ}"
    # The cases mean what they say (OpenSSH's own answers, so a broken server cannot pass this).
    assert got["wildcard, other key"][0] == "changed" and got["revoked by wildcard"][0] == "revoked"
    assert got["exact, same key"][0] == "ok" and got["empty"][0] == "new"
