"""Host keys as OpenSSH keeps and reads them: the user's known_hosts (the node's `known_hosts`,
else ~/.ssh/known_hosts) and the system-wide /etc/ssh/ssh_known_hosts, or a fingerprint pinned
in the inventory.

Every line form of sshd(8)'s SSH_KNOWN_HOSTS FILE FORMAT is read as OpenSSH's client reads it
(hostfile.c, match.c): comma-separated host patterns with `*` and `?` wildcards and `!`
negations (a line whose negated pattern matches is skipped), `[host]:port` names for ports other
than 22, hashed names (`|1|salt|hmac`), `@revoked` lines (the key is refused for every host the
line matches), and names compared lower-case. The verdict is OpenSSH's: the presented key on a
matching line is OK; else any other key on a matching line is a CHANGED host key (whatever its
type: OpenSSH refuses a host whose known key type it is not offered); else the host is NEW.
`@cert-authority` lines apply to host certificates only, which the runner never negotiates
(runner/transport/ssh.py offers plain key types only), so, as for OpenSSH with a plain key, they are not
matched. tests/unit/test_hostkeys_known_hosts.py checks each form against OpenSSH's client on one server.

Each file is read once per process; plain names are indexed (paramiko's HostKeys re-checks every
earlier entry per line: a 1,000-line file read for each of 1,000 nodes cost ~98 s of CPU), pattern
and hashed lines are checked per lookup.
`--accept-new-host-keys` appends to the user file, creating ~/.ssh 0700 and the file 0600 as ssh does.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from runner.core.errors import UserError

if TYPE_CHECKING:  # in annotations only: an inventory is read without paramiko (the CLI's start-up)
    import paramiko

SYSTEM_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"
KNOWN_HOSTS_MAX = 64 << 20  # a known_hosts of 64 MiB holds ~100,000 hosts' keys
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
    """The name OpenSSH looks a host up by (and records it under): lower-case, `[host]:port` off port 22."""
    host = host.lower()
    return host if port == 22 else f"[{host}]:{port}"


@functools.lru_cache(maxsize=4096)
def _glob(pattern: str) -> re.Pattern:
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern), re.S)


def match_pattern_list(name: str, patterns: str) -> int:
    """OpenSSH's match_pattern_list (match.c), case-insensitive: 1 when a pattern matches, -1 when
    a negated (`!`) one does (that wins), 0 when none does. Patterns: `*` and `?` only."""
    name, got = name.lower(), 0
    for pat in patterns.lower().split(","):
        neg = pat.startswith("!")
        if _glob(pat[1:] if neg else pat).fullmatch(name):
            if neg:
                return -1
            got = 1
    return got


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
    """One known_hosts file, indexed: plain names in a dict, pattern and hashed lines checked per lookup."""

    path: str
    plain: dict[str, list[_Entry]] = field(default_factory=dict)
    patterns: list[tuple[str, _Entry]] = field(default_factory=list)
    hashed: list[tuple[bytes, bytes, _Entry]] = field(default_factory=list)

    @classmethod
    def read(cls, path: str) -> KnownHostsFile:
        kh = cls(path)
        try:  # bounded, and without blocking on a FIFO: a file named as known_hosts may be anything
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as fh:
                data = fh.read(KNOWN_HOSTS_MAX + 1)
        except OSError:
            return kh
        if len(data) > KNOWN_HOSTS_MAX:
            raise UserError(f"{path}: known_hosts is over {KNOWN_HOSTS_MAX} bytes; name the file that holds the "
                            "nodes' keys")
        text = data.decode(errors="replace")
        for line in text.splitlines():
            kh._parse(line)
        return kh

    def _parse(self, line: str) -> None:
        parts = line.split()
        if not parts or parts[0].startswith("#"):
            return
        revoked = False
        if parts[0].startswith("@"):
            # @cert-authority: a CA for host certificates, which are never negotiated; any other
            # marker is an error OpenSSH skips the line for.
            if parts[0] != "@revoked":
                return
            revoked, parts = True, parts[1:]
        if len(parts) < 3:
            return
        try:
            entry = _Entry(parts[1], base64.b64decode(parts[2], validate=True), revoked)
        except ValueError:
            return
        names = parts[0]
        if names.startswith("|"):  # hashed: the whole field is one HMAC (OpenSSH's match_maybe_hashed)
            if not names.startswith("|1|"):
                return
            try:
                salt, digest = (base64.b64decode(x, validate=True) for x in names[3:].split("|", 1))
            except ValueError:
                return
            self.hashed.append((salt, digest, entry))
        elif any(c in names for c in "*?!"):
            self.patterns.append((names, entry))
        else:
            for name in names.lower().split(","):
                self.plain.setdefault(name, []).append(entry)

    def lookup(self, name: str) -> list[_Entry]:
        """Every entry of a line that matches `name` as OpenSSH matches it."""
        name = name.lower()
        found = list(self.plain.get(name, ()))
        found += [e for pats, e in self.patterns if match_pattern_list(name, pats) == 1]
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
    changed: bool = False         # the host has known keys, none of them the presented one
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
    # Any other known key is a changed host key for OpenSSH, whatever its type (hostfile.c).
    return Verdict(False, types, changed=bool(good))


def known_types(files: list[KnownHostsFile], name: str) -> list[str]:
    return list(dict.fromkeys(e.keytype for f in files for e in f.lookup(name) if not e.revoked))


def append(path: str, name: str, key: paramiko.PKey) -> None:
    """Record a newly accepted key: ~/.ssh (or the file's folder) made 0700 if missing, file 0600."""
    d = Path(path).parent
    if not d.exists():
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(d, 0o700)  # mkdir's mode is filtered by the umask
    line = f"{name.lower()} {key.get_name()} {key.get_base64()}\n"
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
