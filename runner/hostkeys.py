"""Host keys as OpenSSH keeps them: the user's known_hosts (the node's `known_hosts`, else
~/.ssh/known_hosts) and the system-wide /etc/ssh/ssh_known_hosts, plain or hashed (`|1|salt|hash`)
entries, `@revoked` markers; or a fingerprint pinned in the inventory.

Each file is read once per process and indexed by host name (paramiko's HostKeys re-checks every
earlier entry per line: a 1,000-line file read for each of 1,000 nodes cost ~98 s of CPU).
`--accept-new-host-keys` appends to the user file, creating ~/.ssh 0700 and the file 0600 as ssh does.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

SYSTEM_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"
ALL_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521",
             "rsa-sha2-512", "rsa-sha2-256", "ssh-rsa")
# A key type's family: OpenSSH lists an RSA key as ssh-rsa whatever signature it is used with.
FAMILY = {"ssh-rsa": ("rsa-sha2-512", "rsa-sha2-256", "ssh-rsa"), "rsa-sha2-512": ("rsa-sha2-512",),
          "rsa-sha2-256": ("rsa-sha2-256",)}


def system_known_hosts() -> str:
    """RUNNER_SYSTEM_KNOWN_HOSTS points elsewhere (a test, or a host keeping it elsewhere)."""
    return os.environ.get("RUNNER_SYSTEM_KNOWN_HOSTS", SYSTEM_KNOWN_HOSTS)


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style SHA256 fingerprint, as printed by `ssh-keygen -lf`."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


def known_hosts_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


def key_types(types: list[str]) -> list[str]:
    """Host-key algorithms to offer first for keys of these known_hosts types."""
    out: list[str] = []
    for t in types:
        for a in FAMILY.get(t, (t,)):
            if a not in out:
                out.append(a)
    return out


@dataclass
class _Entry:
    keytype: str
    blob: bytes
    revoked: bool = False


@dataclass
class KnownHostsFile:
    """One known_hosts file, indexed: plain names in a dict, hashed entries checked per lookup."""

    path: str
    plain: dict[str, list[_Entry]] = field(default_factory=dict)
    hashed: list[tuple[bytes, bytes, _Entry]] = field(default_factory=list)

    @classmethod
    def read(cls, path: str) -> KnownHostsFile:
        kh = cls(path)
        try:
            with open(path, errors="replace") as fh:
                text = fh.read()
        except OSError:
            return kh
        for line in text.splitlines():
            kh._parse(line)
        return kh

    def _parse(self, line: str) -> None:
        parts = line.split()
        if not parts or parts[0].startswith("#"):
            return
        revoked = False
        if parts[0].startswith("@"):
            if parts[0] != "@revoked":
                return  # @cert-authority: host certificates are not used here
            revoked, parts = True, parts[1:]
        if len(parts) < 3:
            return
        try:
            entry = _Entry(parts[1], base64.b64decode(parts[2]), revoked)
        except ValueError:
            return
        for name in parts[0].split(","):
            if name.startswith("|1|"):
                try:
                    salt, digest = (base64.b64decode(x) for x in name[3:].split("|", 1))
                except ValueError:
                    continue
                self.hashed.append((salt, digest, entry))
            else:
                self.plain.setdefault(name, []).append(entry)

    def lookup(self, name: str) -> list[_Entry]:
        found = list(self.plain.get(name, ()))
        for salt, digest, entry in self.hashed:
            if hmac.compare_digest(hmac.new(salt, name.encode(), hashlib.sha1).digest(), digest):
                found.append(entry)
        return found


_cache: dict[tuple[str, float], KnownHostsFile] = {}
_lock = threading.Lock()


def load(path: str) -> KnownHostsFile:
    """The file, parsed once per process (again only if it changed on disk)."""
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        mtime = -1.0
    with _lock:
        kh = _cache.get((path, mtime))
        if kh is None:
            kh = _cache[(path, mtime)] = KnownHostsFile.read(path)
        return kh


@dataclass
class Verdict:
    ok: bool
    known_types: list[str]        # types known for this host (to offer them first)
    changed: bool = False         # a known key of the presented type differs
    revoked: bool = False


def check(files: list[KnownHostsFile], name: str, key: paramiko.PKey) -> Verdict:
    entries = [e for f in files for e in f.lookup(name)]
    blob = key.asbytes()
    if any(e.revoked and e.blob == blob for e in entries):
        return Verdict(False, [], revoked=True)
    good = [e for e in entries if not e.revoked]
    types = list(dict.fromkeys(e.keytype for e in good))
    if any(e.blob == blob for e in good):
        return Verdict(True, types)
    same_type = [e for e in good if e.keytype == key.get_name() or key.get_name() in FAMILY.get(e.keytype, ())]
    return Verdict(False, types, changed=bool(same_type))


def known_types(files: list[KnownHostsFile], name: str) -> list[str]:
    return list(dict.fromkeys(e.keytype for f in files for e in f.lookup(name) if not e.revoked))


def append(path: str, name: str, key: paramiko.PKey) -> None:
    """Record a newly accepted key: ~/.ssh (or the file's folder) made 0700 if missing, file 0600."""
    d = Path(path).parent
    if not d.exists():
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(d, 0o700)  # mkdir's mode is filtered by the umask
    line = f"{name} {key.get_name()} {key.get_base64()}\n"
    with _lock:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        # Later nodes of this run see it without re-reading the file.
        for (p, _), kh in list(_cache.items()):
            if p == path:
                kh._parse(line)
                _cache[(path, os.stat(path).st_mtime)] = kh
