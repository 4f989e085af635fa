"""The user's OpenSSH client config (`~/.ssh/config`, or the inventory's `ssh_config:`) applied to
the inventory's nodes, so a node reachable as `ssh gpu-0` is reachable by the runner as `host: gpu-0`.

Why: paramiko reads no ssh config, and a cluster behind a bastion is usually described in one
(`Host gpu-*  ProxyJump bastion`). The file is parsed by paramiko's own `SSHConfig` (OpenSSH's
matching rules: first value wins, `Host` patterns), never by a parser of ours.

Reading runs nothing and asks nothing of the network. paramiko evaluates `Match exec "..."` by
running the command through a shell, and any file can be named as `ssh_config:` (the inventory
itself: a YAML line can be an ssh_config line too), so `Match` blocks are never handed to it:
only the global lines and the `Host` blocks are. A Match block that may set what the runner uses
(HostName, User, Port, IdentityFile, ProxyJump, ProxyCommand) for a node is named in one warning
(file:line, node) since `ssh` would apply it and the runner does not; one that cannot concern
the node (a `host`/`originalhost` criterion its name does not match), or that sets nothing the
runner uses, is skipped silently: a user's own Match blocks for other hosts do not break the
runner. paramiko's lookups that would ask DNS (`CanonicalizeHostname`, the `%l` token's FQDN)
are not made: the host is taken as written and `%l` stays unexpanded.

The rule: the node's `host` is looked up as a Host alias. Its HostName replaces `host` (what SSH
connects to, and the ranks' address unless `addr` is set); User, Port, IdentityFile and ProxyJump
fill `user`, `port`, `identity_file` and `proxy_jump` only where the inventory (the node, or
`defaults:`) does not set them: the inventory wins. Nothing else in the file is used: host keys are
still checked by the runner (a `StrictHostKeyChecking no` there changes nothing), and the OpenSSH
streams run with `-F /dev/null` so the file cannot redirect them (runner/transport/ssh.py).

One bastion hop only. A ProxyJump chain (`a,b`), a bastion that itself needs a jump, or a
ProxyCommand is refused in one line: the runner verifies the host key of every hop itself, which it
cannot do for a command's connection, and one hop is what it tests. Every value taken from the file
reaches an argv or a shell (the OpenSSH streams' ProxyCommand): host names, users and ports are
validated as strictly as the inventory's own fields, so `-oProxyCommand=...` as a HostName or a
user starting with `-` is refused, never passed on.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.inventory.hostkeys import match_pattern_list
from runner.inventory.model import USER_RE, Jump
from runner.inventory.safe_yaml import read_bytes
from runner.inventory.schema import Checker, canonical_host, expand, host_error, same_host

if TYPE_CHECKING:  # imported when an ssh config is read (_config_class): not to read an inventory
    import paramiko

log = logging.getLogger("runner.ssh_config")

DEFAULT_PATH = "~/.ssh/config"
SSH_CONFIG_MAX = 4 << 20  # host settings: read at most this much (a huge or endless file is one line)
NONE = "none"  # `ssh_config: none` / `proxy_jump: none`: turn it off (OpenSSH's own word for it)
# [ssh://][user@]host[:port], host maybe a [bracketed] IPv6 address: OpenSSH's ProxyJump forms.
JUMP_RE = re.compile(r"(?:ssh://)?(?:(?P<user>[^@/]*)@)?(?P<host>\[[^\]/]*\]|[^:@/\[\]]*)(?::(?P<port>[^/]*))?/?")
JUMP_FORM = "use one bastion as [user@]host[:port]"


# paramiko's own line syntax (SSHConfig.SETTINGS_REGEX): keyword, then `=` or blanks, then value.
_LINE_RE = re.compile(r"(\w+)(?:\s*=\s*|\s+)(.+)")
# What the runner takes from a Host block: a Match block setting one of these may matter.
KEY_NAMES = {"hostname": "HostName", "user": "User", "port": "Port", "identityfile": "IdentityFile",
             "proxyjump": "ProxyJump", "proxycommand": "ProxyCommand"}


@dataclass(frozen=True)
class MatchBlock:
    """A `Match` block left out of what paramiko reads: where it is and what it would set."""
    line: int
    criteria: str
    keys: tuple[str, ...]   # the KEY_NAMES it sets


def host_blocks(text: str) -> tuple[str, list[MatchBlock]]:
    """The config text with every Match block left out (their lines blanked), and those blocks."""
    out, blocks = [], []
    current: tuple[int, str, list[str]] | None = None
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        m = _LINE_RE.fullmatch(line) if line and not line.startswith("#") else None
        key = m[1].lower() if m else None
        if key in ("host", "match"):
            if current is not None:
                blocks.append(MatchBlock(current[0], current[1], tuple(current[2])))
            current = (i, m[2], []) if key == "match" else None
        if current is None:
            out.append(raw)
            continue
        out.append("")
        if key in KEY_NAMES and key not in current[2]:
            current[2].append(key)
    if current is not None:
        blocks.append(MatchBlock(current[0], current[1], tuple(current[2])))
    return "\n".join(out) + "\n", blocks


@functools.cache
def _config_class() -> type:
    """_Config, made when an ssh config is first read: paramiko is imported only then (an inventory
    whose nodes name no ssh config, a dry-run, does without it)."""
    import paramiko

    class _Config(paramiko.SSHConfig):
        """paramiko's parser and Host matching, kept off the network: no canonicalization (DNS
        queries) and no `%l` (socket.getfqdn, a reverse lookup). Match blocks never reach it
        (host_blocks); if one did, it would match nothing rather than run its exec."""

        def _allowed_tokens(self, key):
            return [t for t in super()._allowed_tokens(key) if t != "%l"]

        def canonicalize(self, hostname, options, domains):
            return hostname

        def _does_match(self, match_list, *args, **kwargs):
            return False

    return _Config


def _may_apply(block: MatchBlock, names: list[str]) -> bool:
    """Whether a Match block could apply to a host known by these names: False only when it sets
    nothing the runner uses, or a plain `host`/`originalhost` criterion (OpenSSH patterns)
    matches none of them. Nothing is evaluated that could run or resolve anything."""
    if not block.keys:
        return False
    try:
        words = shlex.split(block.criteria)
    except ValueError:
        return True
    while words:
        kind = words.pop(0).lower()
        if kind in ("all", "canonical", "final") or not words:
            continue
        param = words.pop(0)
        if kind in ("host", "originalhost") and not any(match_pattern_list(n, param) == 1 for n in names):
            return False
    return True


def parse_jump(text: str) -> tuple[str | None, str, int | None]:
    """'ubuntu@bastion:2222' -> ('ubuntu', 'bastion', 2222); ValueError with a one-line reason."""
    if "," in text:
        hops = len(text.split(","))
        raise ValueError(f"{text!r} is a chain of {hops} jump hosts; only one bastion is supported: "
                         "set proxy_jump to a bastion this machine reaches directly")
    m = JUMP_RE.fullmatch(text.strip())
    if not m or not m["host"]:
        raise ValueError(f"{text!r} is not a jump host: {JUMP_FORM}")
    user, host, port = m["user"], m["host"].strip("[]"), m["port"]
    if user is not None and not USER_RE.fullmatch(user):
        raise ValueError(f"{text!r}: {user!r} is not a user name (letters, digits, '.', '_', '-')")
    if why := host_error(host):
        raise ValueError(f"{text!r}: {why} ({JUMP_FORM})")
    if port is not None and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"{text!r}: port {port!r} is not in 1..65535")
    return user, canonical_host(host), int(port) if port is not None else None


def field_value(c: Checker, key: str, line: int, where: str, text: str, base: Path, check_files: bool) -> str:
    """An inventory `ssh_config:` or `proxy_jump:` value, checked where it is written."""
    if text.strip().lower() == NONE:
        return NONE
    if key == "ssh_config":
        p = expand(text, base)
        if check_files and not os.path.isfile(p):
            c.fail(line, where, f"file not found: {p} (or `ssh_config: none` to read no ssh config)")
        return p
    try:
        parse_jump(text)
    except ValueError as exc:
        c.fail(line, where, str(exc))
    return text.strip()


class Resolver:
    """Applies one inventory's ssh configs to its nodes; each file is parsed once per load."""

    def __init__(self, c: Checker, check_files: bool):
        self.c = c
        self.check_files = check_files
        self._parsed: dict[str, tuple[paramiko.SSHConfig, list[MatchBlock]]] = {}
        self._exists: dict[str, bool] = {}  # one stat per file per load, not one per node
        self._warned: set[object] = set()  # paths warned about Include, (path, line) about a Match

    def resolve(self, merged: dict[str, Any], line: int, where: str) -> dict[str, Any]:
        """The node's merged inventory fields with the ssh config's filled in and its proxy_jump
        resolved to a Jump (or None)."""
        out = dict(merged)
        path = self._path(out.pop("ssh_config", None))
        jump_text = out.pop("proxy_jump", None)
        pin = out.pop("proxy_jump_host_key", None)
        alias = out["host"]
        opts = self._lookup(path, alias, line, where) if path else {}
        if path:
            out["ssh_config"] = path
            what = f"{alias!r} in {path}"
            if "hostname" in opts:
                out["host"] = self._host(opts["hostname"], line, f"{where}.host", f"{what}: HostName")
            if "user" not in out and "user" in opts:
                out["user"] = self._user(opts["user"], line, f"{where}.user", f"{what}: User")
            if "port" not in out and "port" in opts:
                out["port"] = self._port(opts["port"], line, f"{where}.port", f"{what}: Port")
            if "identity_file" not in out:
                if (key := self._identity(opts, line, f"{where}.identity_file", f"{what}: IdentityFile")):
                    out["identity_file"] = key
            if jump_text is None:
                if opts.get("proxycommand"):
                    self.c.fail(line, f"{where}.host", f"{what}: ProxyCommand is not supported (the runner verifies "
                                "every hop's host key itself): use `ProxyJump user@bastion` there, or `proxy_jump:` "
                                "in the inventory, or `ssh_config: none`")
                if opts.get("proxyjump"):
                    jump_text = opts["proxyjump"]
                    try:
                        parse_jump(jump_text)
                    except ValueError as exc:
                        self.c.fail(line, f"{where}.proxy_jump", f"{what}: ProxyJump {exc}")
        out["proxy_jump"] = None
        if jump_text and jump_text.lower() != NONE:
            out["proxy_jump"] = self._jump(path, jump_text, out, pin, line, f"{where}.proxy_jump")
        return out

    # -- the file -------------------------------------------------------------------------
    def _path(self, value: str | None) -> str | None:
        if value == NONE:
            return None
        path = os.path.expanduser(DEFAULT_PATH) if value is None else value  # not set: OpenSSH's own default
        if path not in self._exists:
            self._exists[path] = os.path.isfile(path)
        return path if self._exists[path] else None  # an explicit missing one was refused unless check_files=False

    def _lookup(self, path: str, host: str, line: int, where: str) -> dict[str, Any]:
        try:
            if path not in self._parsed:
                text, matches = host_blocks(read_bytes(path, "ssh config", SSH_CONFIG_MAX).decode(errors="replace"))
                self._parsed[path] = (_config_class().from_text(text), matches)
            cfg, matches = self._parsed[path]
            opts = dict(cfg.lookup(host))
        # paramiko raises ConfigParseError for a bad line, OSError for an unreadable file: each
        # is one line here, not a traceback.
        except Exception as exc:  # noqa: BLE001
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            self.c.fail(line, where, f"cannot use ssh config {path}: {why}; fix it or set `ssh_config: none`")
        for m in matches:
            if (path, m.line) not in self._warned and _may_apply(m, [host, opts.get("hostname", host)]):
                self._warned.add((path, m.line))
                keys = ", ".join(KEY_NAMES[k] for k in m.keys)
                self.c.warn(line, where, f"{path}:{m.line}: `Match {m.criteria[:60]}` is not applied (the runner "
                            f"evaluates no Match block: `Match exec` runs a command); it may set {keys} for "
                            f"{host!r} under ssh: put them in a Host block or in the inventory")
        if "include" in opts and path not in self._warned:
            self._warned.add(path)
            self.c.warn(line, where, f"{path}: Include is not followed (paramiko's parser); put the Host blocks "
                        "the inventory needs in this file, or name the included file as ssh_config")
        return opts

    # -- values from it, checked as strictly as the inventory's own --------------------------
    def _host(self, value: str, line: int, where: str, what: str) -> str:
        if why := host_error(value):
            self.c.fail(line, where, f"{what} {why}; fix the ssh config or set host to the address in the inventory")
        return canonical_host(value)

    def _user(self, value: str, line: int, where: str, what: str) -> str:
        if not USER_RE.fullmatch(value):
            self.c.fail(line, where, f"{what} {value!r} is not a user name (letters, digits, '.', '_', '-'); fix "
                        "the ssh config or set user in the inventory")
        return value

    def _port(self, value: str, line: int, where: str, what: str) -> int:
        if not (str(value).isdigit() and 1 <= int(value) <= 65535):
            self.c.fail(line, where, f"{what} {value!r} is not a port in 1..65535; fix the ssh config or set "
                        "port in the inventory")
        return int(value)

    def _identity(self, opts: dict[str, Any], line: int, where: str, what: str) -> str | None:
        """The first IdentityFile that exists (OpenSSH skips missing ones too); None: none does.
        Unchecked (check_files=False), the first listed when none exists: the one a connection
        then refuses by name, while a plan still shows the node (runner.api loads unchecked)."""
        listed = []
        for p in opts.get("identityfile") or []:
            if any(ord(ch) < 32 or ord(ch) == 127 for ch in p):
                self.c.fail(line, where, f"{what} {p!r} has a control character; fix the ssh config")
            p = os.path.expanduser(p)
            if os.path.isfile(p):
                return p
            listed.append(p)
            log.debug("%s %s not found, skipped", what, p)
        return listed[0] if listed and not self.check_files else None

    def _jump(self, path: str | None, text: str, node: dict[str, Any], pin: str | None, line: int,
              where: str) -> Jump:
        """The bastion: its own Host block in the same file fills what `[user@]host[:port]` leaves
        out (as `ssh -J` does); then the node's user and identity_file, then port 22."""
        user, host, port = parse_jump(text)
        identity = None
        if path:
            opts = self._lookup(path, host, line, where)
            what = f"bastion {host!r} in {path}"
            hop = opts.get("proxyjump")
            if hop and hop.lower() != NONE and _same_host(hop, host, opts.get("hostname")):
                hop = None  # `Host *  ProxyJump bastion` reaching the bastion itself: ssh ignores it too
            if (hop and hop.lower() != NONE) or opts.get("proxycommand"):
                how = f"ProxyJump {hop!r}" if hop and hop.lower() != NONE else "a ProxyCommand"
                self.c.fail(line, where, f"{what} has {how} of its own: a chain of jump hosts; only one bastion is "
                            f"supported (if a `Host *` line gives it, exclude the bastion: `Host * !{host}`)")
            if "hostname" in opts:
                host = self._host(opts["hostname"], line, where, f"{what}: HostName")
            if user is None and "user" in opts:
                user = self._user(opts["user"], line, where, f"{what}: User")
            if port is None and "port" in opts:
                port = self._port(opts["port"], line, where, f"{what}: Port")
            identity = self._identity(opts, line, where, f"{what}: IdentityFile")
        return Jump(host=host, port=port or 22, user=user or node.get("user") or Jump.user,
                    identity_file=identity or node.get("identity_file"), host_key=pin)


def _same_host(hop: str, alias: str, hostname: str | None) -> bool:
    try:
        return same_host(parse_jump(hop)[1]) in {same_host(alias), same_host(hostname or alias)}
    except ValueError:
        return False
