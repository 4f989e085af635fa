"""`runner up --notify CMD|URL` (or RUNNER_NOTIFY=CMD|URL in your environment, or a webhook in
`job.notify:`): told on this machine when a run ends.

- CMD, a string: your own command line, run as `sh -c CMD` on this machine (as you would type it;
  `--notify 'notify-send "run $RUNNER_RUN_ID: $RUNNER_STATE"'`). Only from you: an inventory or
  job file may be anyone's, so a command in its job.notify is refused when it loads. Nothing of
  the run is ever pasted into it: the run's facts are in its environment (ENV below), where no
  shell reads them unless the command asks it to.
- URL, `http://` or `https://`: a POST of the same facts as a JSON object (ENV's names, lower case,
  without RUNNER_; exit_code and duration_s numbers, nodes a list, last_metrics an object or null).

Either is bounded by NOTIFY_TIMEOUT_S; whatever goes wrong is one warning line and the run's exit
code stays the run's. It runs when `up` ends however it ends (finished, failed, interrupted,
refused); a detached run (`--detach`) has nothing following it on this machine, so `--notify`
is refused with it and RUNNER_NOTIFY or job.notify is skipped with a note.

A webhook URL often holds its token in its path (Slack, Discord): only its scheme and host are ever
printed.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from runner.core.errors import (
    EXIT_HUNG,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_OK,
    EXIT_TERMINATED,
    UserError,
    interrupt_code,
)
from runner.core.redact import printable
from runner.inventory.notify_spec import LOCAL_FILE_HOOK, NotifySpec, address_error, parse, url_error  # noqa: F401

ENV_NAME = "RUNNER_NOTIFY"  # the user's standing --notify, from their own environment

NOTIFY_TIMEOUT_S = 30.0
SUMMARY_MAX = 1000        # characters of the summary line in the environment / JSON
METRICS_MAX = 4096        # bytes of the last metrics record passed on
STATES = {EXIT_OK: "succeeded", EXIT_JOB_FAILED: "failed", EXIT_HUNG: "failed", EXIT_INTERRUPTED: "interrupted",
          EXIT_TERMINATED: "terminated"}


@dataclass
class Outcome:
    """What the notification says; `up` fills it in as the run goes."""

    inventory: str
    scheduler: str
    nodes: list[str] = field(default_factory=list)
    run_id: str | None = None
    summary: str | None = None
    last_metrics: str | None = None   # the last metrics.jsonl line (a JSON object), as the node wrote it
    exit_code: int = 1
    started: float = field(default_factory=time.time)

    def document(self) -> dict:
        try:
            metrics = json.loads(self.last_metrics) if self.last_metrics else None
        except ValueError:
            metrics = None
        state = STATES.get(self.exit_code, "error")
        summary = self.summary or f"run {self.run_id or '-'}: {state} (exit {self.exit_code})"
        return {"run_id": self.run_id, "state": state, "exit_code": self.exit_code,
                "summary": printable(summary)[:SUMMARY_MAX], "inventory": self.inventory,
                "scheduler": self.scheduler, "nodes": self.nodes,
                "duration_s": round(time.time() - self.started, 1),
                "last_metrics": metrics if isinstance(metrics, dict) else None}

    def environment(self) -> dict[str, str]:
        d = self.document()
        return {"RUNNER_RUN_ID": d["run_id"] or "", "RUNNER_STATE": d["state"], "RUNNER_EXIT": str(d["exit_code"]),
                "RUNNER_SUMMARY": d["summary"], "RUNNER_INVENTORY": d["inventory"], "RUNNER_SCHEDULER": d["scheduler"],
                "RUNNER_NODES": ",".join(d["nodes"]), "RUNNER_DURATION_S": str(d["duration_s"]),
                "RUNNER_LAST_METRICS": json.dumps(d["last_metrics"]) if d["last_metrics"] else ""}


def from_args(args, job, inventory_path: str) -> NotifySpec | None:
    """--notify wins over RUNNER_NOTIFY (the user's standing choice), which wins over job.notify (a
    webhook); --notify with --detach is refused (nothing would follow the run), the other two are
    skipped for it with a note."""
    given = getattr(args, "notify", None)
    detach = getattr(args, "detach", False)
    if given is not None and detach:
        raise UserError("--notify needs `runner up` to follow the run; drop --detach (nothing on this machine "
                        "follows a detached run)")
    if given is not None:
        try:
            return parse(given)
        except ValueError as exc:
            raise UserError(f"--notify: {exc}") from None
    standing = os.environ.get(ENV_NAME, "")
    spec, where = getattr(job, "notify", None), f"{inventory_path}: job.notify"
    if standing.strip():
        try:
            spec, where = parse(standing), ENV_NAME
        except ValueError as exc:
            raise UserError(f"{ENV_NAME} (in your environment): {exc}") from None
    if spec is not None and detach:
        sys.stderr.write(f"runner: note: {where} is not run for a detached run (nothing on this machine follows it)\n")
        return None
    return spec


class notifying:
    """`with notifying(spec, outcome): outcome.exit_code = ...`: sends the notification when the
    block ends, however it ends (an exception passes on; its exit code is what the CLI will return)."""

    def __init__(self, spec: NotifySpec | None, outcome: Outcome):
        self.spec, self.outcome = spec, outcome

    def __enter__(self) -> Outcome:
        return self.outcome

    def __exit__(self, typ, exc, tb) -> None:
        o = self.outcome
        if isinstance(exc, UserError):
            o.exit_code = exc.exit_code
            o.summary = o.summary or str(exc)
        elif isinstance(exc, KeyboardInterrupt):
            o.exit_code = interrupt_code(exc)
            o.summary = o.summary or STATES[o.exit_code]
        elif exc is not None:
            o.exit_code = 1
            o.summary = o.summary or f"internal error: {type(exc).__name__}: {exc}"
        if self.spec is not None:
            send(self.spec, o)


def send(spec: NotifySpec, outcome: Outcome) -> bool:
    """Run the command or POST to the URL; a failure is one warning line (False)."""
    try:
        why = _post(spec.url, outcome.document(), spec.from_file) if spec.url else \
            _run(spec.argv, outcome.environment())
    except Exception as exc:  # noqa: BLE001 - a notification never changes the run's result
        why = f"{type(exc).__name__}: {exc}"
    if why:
        sys.stderr.write(f"runner: warning: notify {spec.shown}: {printable(why)[:300]} (the run's result is "
                         "unchanged)\n")
    return why is None


def _run(argv: tuple[str, ...], env: dict[str, str]) -> str | None:
    try:
        # Its own session: a command that outlives the timeout is ended with all it started.
        p = subprocess.Popen(list(argv), env={**os.environ, **env}, stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        return f"cannot run it: {exc.strerror or exc}"
    try:
        code = p.wait(NOTIFY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        return f"still running after {NOTIFY_TIMEOUT_S:g}s; killed"
    return None if code == 0 else f"exited {code}"


def _post(url: str, doc: dict, from_file: bool = False) -> str | None:
    """POST doc to url, no redirect followed. The name is resolved once; a file's webhook
    (from_file) goes on only when every address is public (runner/inventory/notify_spec.py
    `address_error`), and the connection is made to those addresses, never to a second lookup's
    (a name that answers a public address, then 127.0.0.1, must not reach this machine). https is
    verified against the name."""
    u = urlsplit(url)
    https = u.scheme.lower() == "https"
    host, port = u.hostname or "", u.port or (443 if https else 80)
    try:
        ips = list(dict.fromkeys(info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)))
    except OSError as exc:
        return f"cannot resolve {host}: {exc.strerror or exc}"
    if from_file:
        for ip in ips:
            if why := address_error(ipaddress.ip_address(ip.split("%")[0])):
                return f"{host} resolves to {why}; {LOCAL_FILE_HOOK}"
    conn = (http.client.HTTPSConnection(host, port, timeout=NOTIFY_TIMEOUT_S, context=ssl.create_default_context())
            if https else http.client.HTTPConnection(host, port, timeout=NOTIFY_TIMEOUT_S))
    conn._create_connection = lambda _addr, timeout, _src=None: _connect(ips, port, timeout)  # the checked ones
    try:
        conn.request("POST", (u.path or "/") + (f"?{u.query}" if u.query else ""), json.dumps(doc).encode(),
                     {"Content-Type": "application/json", "User-Agent": "runner-notify"})
        resp = conn.getresponse()
        resp.read(65536)  # the answer is not used; a little of it is read so the server sees it taken
    except TimeoutError:
        return f"no answer within {NOTIFY_TIMEOUT_S:g}s"
    except (OSError, http.client.HTTPException) as exc:
        return str(exc) or type(exc).__name__
    finally:
        conn.close()
    if 300 <= resp.status < 400:
        return f"HTTP {resp.status} {resp.reason}: redirects are not followed (give the URL it points to)"
    return f"HTTP {resp.status} {resp.reason}" if resp.status >= 400 else None


def _connect(ips: list[str], port: int, timeout: float) -> socket.socket:
    """A connection to the first of ips that answers (the addresses already resolved and checked)."""
    last: OSError = OSError("no address")
    for ip in ips:
        try:
            return socket.create_connection((ip, port), timeout)
        except TimeoutError:
            raise
        except OSError as exc:
            last = exc
    raise last


def add_notify_option(p) -> None:
    """`--notify` on `up` (every backend reads it through from_args)."""
    p.add_argument("--notify", metavar="CMD|URL",
                   help="when the run ends: run CMD here with `sh -c` (RUNNER_RUN_ID, RUNNER_STATE, RUNNER_EXIT, "
                        "RUNNER_SUMMARY ... in its env), or POST JSON to an http(s):// URL (default: $RUNNER_NOTIFY, then job.notify, a URL)")
