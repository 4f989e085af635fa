"""`--notify` / RUNNER_NOTIFY / `job.notify` as written: a command (string or argv) or an http(s)
webhook, checked when the inventory loads. A command comes only from the user (the flag or the
environment): an inventory or job file may be anyone's, so its `notify` may only be a webhook.
Running it when a run ends is runner/backends/notify.py's."""

from __future__ import annotations

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
