"""`--notify` / RUNNER_NOTIFY / `job.notify` as written: a command (string or argv) or an http(s)
webhook, checked when the inventory loads. A command comes only from the user (the flag or the
environment): an inventory or job file may be anyone's, so its `notify` may only be a webhook.
Running it when a run ends is runner/backends/notify.py's.

A file's webhook goes only to a public https address (`file_url_error` when the file is read: an
IP literal must be public, `localhost` is refused; `address_error` again for every address a
name resolves to when the run ends): else a file could have this machine POST to its own local
services (an engine's HTTP API, an admin port) or its network's (a cloud metadata address). A
local webhook is the user's own: `--notify` or RUNNER_NOTIFY."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

URL_LIKE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:/")
COMMAND_FROM_A_FILE = ("a command here would run on this machine when the run ends, from a file anyone can hand "
                       "you; give it yourself: `runner up --notify CMD`, or RUNNER_NOTIFY=CMD in your environment "
                       "(a file's notify may be an http(s):// webhook)")


@dataclass(frozen=True)
class NotifySpec:
    argv: tuple[str, ...] = ()   # a command (["sh", "-c", CMD] for a string)
    url: str | None = None       # or a webhook
    from_file: bool = False      # a file's webhook: public https addresses only, checked again at send

    @property
    def shown(self) -> str:
        if self.url:
            u = urlsplit(self.url)
            return f"POST {u.scheme}://{u.hostname}"
        return f"`{self.argv[-1] if self.argv[:2] == ('sh', '-c') else ' '.join(self.argv)}`"[:120]


def parse(value) -> NotifySpec:
    """A --notify value or job.notify: a string (a command line, or an http(s):// URL) or a list of
    strings (an argv). ValueError saying what is wrong, for the caller to name where it came from."""
    if isinstance(value, list):
        if not value or not all(isinstance(a, str) and a for a in value):
            raise ValueError("a list must be a command's non-empty words (an argv, run without a shell)")
        return NotifySpec(argv=tuple(value))
    if not isinstance(value, str) or not value.strip():
        raise ValueError("give a command line or an http(s):// URL")
    if URL_LIKE.match(value):
        why = url_error(value)
        if why:
            raise ValueError(why)
        return NotifySpec(url=value)
    return NotifySpec(argv=("sh", "-c", value))


def url_error(url: str) -> str | None:
    """Why url is not a webhook the runner can POST to (None when it is)."""
    u = urlsplit(url)
    shown = f"{u.scheme}://{u.hostname or ''}" if u.scheme else url[:40]
    if u.scheme.lower() not in ("http", "https") or not url.lower().startswith(("http://", "https://")):
        return f"{shown}...: only http:// and https:// URLs are posted to (anything else is taken as a command)"
    if any(c.isspace() or not c.isprintable() for c in url):
        return f"{shown}...: the URL holds a space or a control character (percent-encode it)"
    try:
        port = u.port
    except ValueError:
        return f"{shown}...: the URL's port is not a number in 0..65535"
    if not u.hostname or port == 0:
        return f"{url[:40]}...: not a URL with a host (like https://hooks.example.com/...)"
    return None


LOCAL_FILE_HOOK = ("a file's webhook goes only to a public https address; a webhook to this machine or its "
                   "network is your own: `runner up --notify URL`, or RUNNER_NOTIFY=URL in your environment")
NAT64 = ipaddress.ip_network("64:ff9b::/96")


def address_error(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why a file's webhook may not go to ip (None: a public address). An IPv6 address that carries
    an IPv4 one (mapped, 6to4, Teredo, NAT64) is judged by the IPv4 address it reaches."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None) or \
            (ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in NAT64 else None)
        if inner is not None:
            return address_error(inner)
    bad = [name for name, on in (("loopback", ip.is_loopback), ("private", ip.is_private),
                                 ("link-local", ip.is_link_local), ("multicast", ip.is_multicast),
                                 ("reserved", ip.is_reserved), ("unspecified", ip.is_unspecified),
                                 ("not global", not ip.is_global)) if on]
    return f"{ip} is {bad[0]}, not a public address" if bad else None


def file_url_error(url: str) -> str | None:
    """Why url (already a well-formed URL) cannot be a file's webhook, or None: https, to a name
    (checked when the run ends, each address it resolves to) or a public IP address."""
    u = urlsplit(url)
    if u.scheme.lower() != "https":
        return f"{u.scheme}://{u.hostname}...: {LOCAL_FILE_HOOK} (https:// only: the token travels in the URL)"
    host = (u.hostname or "").rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return f"https://{host}...: {host} is this machine; {LOCAL_FILE_HOOK}"
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None
    why = address_error(ip)
    return f"https://{u.hostname}...: {why}; {LOCAL_FILE_HOOK}" if why else None
