"""The validation kit every YAML the runner reads goes through (inventories, job files, the
Slurm section, ssh_config values): the document composed with each value's line kept (`Val`),
and a `Checker` whose errors are one line, ``file:line: field: problem``. Host spellings are
checked here too: a host is compared and recorded in one canonical form."""

from __future__ import annotations

import base64
import functools
import ipaddress
import logging
import os
import socket
from pathlib import Path
from typing import Any

from runner.core.errors import UserError
from runner.core.redact import looks_secret
from runner.inventory.model import ENV_NAME_RE, HOSTNAME_RE, ZONE_RE, reserved_env_error
from runner.inventory.safe_yaml import MAX_DEPTH, Val, compose, read_text, visible  # noqa: F401 - re-exported

log = logging.getLogger("runner.inventory")


# --- YAML with line numbers: runner/inventory/safe_yaml.py (bounded, UTF-8, no aliases) --------

class Checker:
    """Raises UserError("file:line: field: problem") for the first problem found."""

    def __init__(self, path: str):
        self.path = path
        self.scope: str | None = None  # "node pi-1" / "every node": named at the end of a message

    def fail(self, line: int, where: str, msg: str) -> None:
        suffix = f" ({self.scope})" if self.scope else ""
        raise UserError(f"{self.path}:{line}: {visible(where)}: {msg}{suffix}")

    def warn(self, line: int, where: str, msg: str) -> None:
        suffix = f" ({self.scope})" if self.scope else ""
        log.warning("runner: warning: %s:%d: %s: %s%s", self.path, line, visible(where), msg, suffix)

    def mapping(self, v: Val, where: str, allowed: set[str]) -> dict[str, tuple[int, Val]]:
        if not isinstance(v.value, dict):
            self.fail(v.line, where, f"must be a mapping, got {kind(v.value)}")
        for key, (kline, _) in v.value.items():
            if key not in allowed:
                from contract.suggest import did_you_mean

                hint = did_you_mean(str(key), allowed) or f" (allowed: {', '.join(sorted(allowed))})"
                self.fail(kline, f"{where}.{key}" if where else key, f"unknown field{hint}")
        return v.value

    def str_(self, v: Val, where: str) -> str:
        if not isinstance(v.value, str) or not v.value.strip():
            self.fail(v.line, where, f"must be a non-empty string, got {show(v.value)}")
        return v.value

    def int_(self, v: Val, where: str, lo: int, hi: int) -> int:
        if isinstance(v.value, bool) or not isinstance(v.value, int) or not lo <= v.value <= hi:
            self.fail(v.line, where, f"must be an integer in {lo}..{hi}, got {show(v.value)}")
        return v.value

    def str_map(self, v: Val, where: str, env: bool = False) -> dict[str, str]:
        """NAME: value pairs; env=True also refuses reserved names and warns about secret-looking ones."""
        if not isinstance(v.value, dict):
            self.fail(v.line, where, f"must be a mapping of NAME: value, got {kind(v.value)}")
        out = {}
        for key, (kline, x) in v.value.items():
            if not ENV_NAME_RE.fullmatch(key):
                self.fail(kline, f"{where}.{key}", "not a valid environment variable name")
            if env and (why := reserved_env_error(key)):
                self.fail(kline, f"{where}.{key}", why)
            if env and looks_secret(key):
                self.warn(kline, f"{where}.{key}", "looks like a secret: it is masked in output but lands in the "
                          "container's config (docker inspect); put it in job.env_file")
            if isinstance(x.value, (dict, list)) or x.value is None:
                self.fail(x.line, f"{where}.{key}", f"must be a string or number, got {kind(x.value)}")
            out[key] = str(x.value).lower() if isinstance(x.value, bool) else str(x.value)
        return out


def kind(x: Any) -> str:
    return {dict: "a mapping", list: "a list", type(None): "nothing"}.get(type(x), type(x).__name__)


def show(x: Any) -> str:
    return repr(x) if isinstance(x, (str, int, float, bool)) else kind(x)


def expand(p: str, base: Path) -> str:
    """~ and $VARS expanded; relative paths taken from the cwd if they exist there, else the
    inventory's folder (so `configs/x.yaml` works from the repo root and next to the file)."""
    p = os.path.expandvars(os.path.expanduser(p))
    if os.path.isabs(p) or os.path.exists(p):
        return p
    cand = base / p
    return str(cand) if os.path.exists(cand) else p  # os.path: a name too long is "not there", not an OSError


@functools.lru_cache(maxsize=1 << 16)
def _ip(h: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """h parsed as an IP address, or None: once per host however often it is checked or compared."""
    try:
        return ipaddress.ip_address(h)
    except ValueError:
        return None


def host_error(h: str) -> str | None:
    """Why h cannot be a host (what SSH connects to, or the ranks' address), or None. A spelling
    the system resolver reads as another address (inet_aton: 127.1, 0x7f.1, 017.0.0.1,
    2130706433) is refused: two nodes would be one machine under two names, and known_hosts would
    be looked up under a name OpenSSH never records. An IPv6 zone id is an interface name."""
    ip = _ip(h)
    if ip is not None:
        zone = getattr(ip, "scope_id", None)
        if zone is not None and not ZONE_RE.fullmatch(zone):
            return f"{h!r}: the zone id after '%' must be an interface name (letters, digits, '.', '_', '-')"
        return None
    try:
        as_ipv4 = socket.inet_ntoa(socket.inet_aton(h))  # a parse, no lookup
    except (OSError, ValueError):  # ValueError: a NUL in it
        as_ipv4 = None
    if as_ipv4 is not None:
        return f"{h!r} is read as the address {as_ipv4} by the system resolver: write {as_ipv4}"
    if not HOSTNAME_RE.fullmatch(h):
        return f"{h!r} is not an IP address or host name"
    return None


def digest_b64(text: str) -> bool:
    """Whether text is the unpadded base64 of a 32-byte digest exactly as OpenSSH prints it."""
    raw = text.rstrip("=")
    try:
        digest = base64.b64decode(raw + "=", validate=True)
    except ValueError:
        return False
    return len(digest) == 32 and base64.b64encode(digest).decode().rstrip("=") == raw


def canonical_host(h: str) -> str:
    """A valid host in its one spelling: an IP address as `ipaddress` writes it (IPv6 compressed,
    lower-case), a name as written (ssh_config Host patterns match it as written)."""
    ip = _ip(h)
    return h if ip is None else str(ip)


def same_host(h: str) -> str:
    """What two hosts are compared by: the canonical address (an IPv4-mapped IPv6 one as its
    IPv4), a name lower-case (DNS ignores case)."""
    ip = _ip(h)
    if ip is None:
        return h.lower()
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)



def read_yaml(path: str, what: str) -> tuple[Val | None, Checker]:
    """The file's YAML with line numbers kept, and a checker whose errors name the file; an
    unreadable file or bad YAML is one line naming it (`what`: inventory, job file). Through the
    one bounded loader (runner/inventory/safe_yaml.py)."""
    try:
        text = read_text(path, what)
    except UserError as exc:
        if what == "inventory" and str(exc).endswith(": no such file"):
            raise UserError(f"{exc}; name an inventory with -i FILE, or `runner sandbox up` writes a local one") \
                from None
        raise
    return compose(path, text), Checker(path)
