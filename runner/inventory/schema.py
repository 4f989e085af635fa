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

import yaml

from runner.core.errors import UserError
from runner.core.redact import looks_secret
from runner.inventory.model import ENV_NAME_RE, HOSTNAME_RE, ZONE_RE, reserved_env_error

log = logging.getLogger("runner.inventory")


# --- YAML with line numbers --------------------------------------------------------------

class Val:
    """A plain value plus where it came from."""

    __slots__ = ("value", "line")

    def __init__(self, value: Any, line: int):
        self.value = value
        self.line = line


# libyaml's composer when PyYAML was built with it (10x faster on a 10,000-node inventory); the
# nodes it makes carry the same line marks.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
MAX_DEPTH = 32  # mappings and lists inside each other: an inventory needs 5; deeper is an attack


class _Scalars(yaml.constructor.SafeConstructor):
    """One constructor for every scalar of a file (a loader per scalar cost most of the parse)."""

    def scalar(self, node: yaml.ScalarNode) -> Any:
        try:
            return self.construct_object(node, deep=True)
        finally:
            self.constructed_objects.clear()


def _convert(node: yaml.Node, path: str, where: str = "", sc: _Scalars | None = None, depth: int = 0) -> Val:
    sc = sc or _Scalars()
    line = node.start_mark.line + 1
    if depth > MAX_DEPTH:
        raise UserError(f"{path}:{line}: {where}: nested more than {MAX_DEPTH} levels deep; not an inventory")
    if isinstance(node, yaml.MappingNode):
        out: dict[str, tuple[int, Val]] = {}
        for k, v in node.value:
            key = str(sc.scalar(k)) if isinstance(k, yaml.ScalarNode) else str(k)
            w = f"{where}.{key}" if where else key
            kline = k.start_mark.line + 1
            if key in out:
                # YAML says keys are unique; PyYAML silently keeps the last, hiding a typo'd edit.
                raise UserError(f"{path}:{kline}: {w}: duplicate key (first at line {out[key][0]}); keep one")
            out[key] = (kline, _convert(v, path, w, sc, depth + 1))
        return Val(out, line)
    if isinstance(node, yaml.SequenceNode):
        return Val([_convert(v, path, f"{where}[{i}]", sc, depth + 1) for i, v in enumerate(node.value)], line)
    return Val(sc.scalar(node), line)


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


def visible(where: str) -> str:
    """A field path built from the file's own keys, with any control character escaped: the
    message stays one line, and a key cannot write to the terminal."""
    return where if where.isprintable() else where.encode("unicode_escape").decode()


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
    return str(cand) if cand.exists() else p


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
    except OSError:
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
    unreadable file or bad YAML is one line naming it (`what`: inventory, job file)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        hint = "; name an inventory with -i FILE, or `runner sandbox up` writes a local one" if what == "inventory" else ""
        raise UserError(f"{path}: cannot read {what}: no such file{hint}") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read {what}: {exc.strerror}") from None
    return _compose(path, text), Checker(path)


def _no_aliases(path: str, text: str) -> None:
    """Anchors and aliases are refused before anything is built: nine lines of nested aliases
    (a 1 KB file) expand to 9^9 values while converting (killed at 26 s and 650 MB, growing).
    The events are only scanned when the text has an `&` or a `*` at all."""
    if "&" not in text and "*" not in text:
        return
    for ev in yaml.parse(text, Loader=_LOADER):
        if isinstance(ev, yaml.AliasEvent) or getattr(ev, "anchor", None) is not None:
            raise UserError(f"{path}:{ev.start_mark.line + 1}: YAML anchors and aliases (&name, *name, <<: *name) "
                            "are not accepted: write the values out (`defaults:` holds what every node shares)")


def _compose(path: str, text: str) -> Val | None:
    try:
        _no_aliases(path, text)
        node = yaml.compose(text, Loader=_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark else 1
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{path}:{line}: YAML syntax error: {problem}") from None
    if node is None:
        return None
    try:
        return _convert(node, path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise UserError(f"{path}:{mark.line + 1 if mark else 1}: YAML error: {getattr(exc, 'problem', exc)}") from None

