"""`job.notify` webhooks written by someone who wants this machine's local services (issue 54, item
5). Before: `notify: http://127.0.0.1:PORT/...` in a `--job` or inventory file was accepted and
POSTed to when the run ended (a local engine's HTTP API, an admin port, a cloud metadata address),
and redirects were followed. Now a file's webhook goes only to a public https address: an IP
literal is checked when the file is read; a name is resolved when the run ends, every address it
resolves to must be public, and the connection goes to the address checked (a second lookup that
answers 127.0.0.1 is never made); no redirect is followed. A local webhook is the user's own:
`--notify` or RUNNER_NOTIFY. Nothing here leaves loopback: lookups are answered by the test."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from runner.backends import notify
from runner.core.errors import UserError
from runner.inventory import load_inventory


class _Hook(BaseHTTPRequestHandler):
    def do_POST(self):
        srv = self.server
        srv.got.append(self.path)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(srv.status)
        if srv.location:
            self.send_header("Location", srv.location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST

    def log_message(self, *a):
        pass


@pytest.fixture
def hook():
    made: list = []

    def make(status: int = 204, location: str | None = None):
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
        srv.got, srv.status, srv.location = [], status, location
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        made.append(srv)
        return srv, srv.server_address[1]
    yield make
    for srv in made:
        srv.shutdown()
        srv.server_close()


class _Args:
    notify, detach = None, False


def _outcome() -> notify.Outcome:
    return notify.Outcome("inv.yaml", "ssh", ["n0"], run_id="20260101-000000-abcd")


def _files(tmp_path: Path, url: str) -> tuple[Path, Path]:
    inv, job = tmp_path / "inv.yaml", tmp_path / "job.yaml"
    inv.write_text("nodes:\n  - {name: n0, host: 192.0.2.1, arch: amd64}\njob: {image: 'x:1'}\n")
    job.write_text(f"image: 'x:1'\nnotify: '{url}'\n")
    return inv, job


def _run_ends(inv: Path, job_file: Path) -> str | None:
    """Load as `runner up --job FILE` does and, if that is accepted, notify as the run's end does.
    The refusal's line, or None."""
    try:
        job = load_inventory(inv, job_path=str(job_file)).job
    except UserError as exc:
        return str(exc)
    notify.send(notify.from_args(_Args, job, str(inv)), _outcome())
    return None


def test_a_job_files_webhook_to_this_machine_is_never_posted(tmp_path, hook, monkeypatch):
    """The issue's reproduction: before, the loopback server got the POST."""
    monkeypatch.delenv("RUNNER_NOTIFY", raising=False)
    srv, port = hook()
    inv, job = _files(tmp_path, f"http://127.0.0.1:{port}/containers/create")
    refused = _run_ends(inv, job)
    assert srv.got == [], "a file's webhook reached a service on this machine"
    assert refused and refused.startswith(f"{job}:2: job.notify: ") and "\n" not in refused, refused
    assert "https" in refused and "--notify" in refused


@pytest.mark.parametrize("url", [
    "https://127.0.0.1/x", "https://[::1]/x", "https://10.0.0.5/x", "https://192.168.1.1/x", "https://172.16.0.1/x",
    "https://169.254.169.254/latest/meta-data", "https://0.0.0.0/x", "https://224.0.0.1/x", "https://100.64.0.1/x",
    "https://[::ffff:127.0.0.1]/x", "https://[fe80::1]/x", "https://[fd00::1]/x", "https://240.0.0.1/x",
    "https://localhost/x", "https://a.localhost/x", "https://[64:ff9b::7f00:1]/x", "https://[2002:7f00:1::]/x",
    "http://hooks.example.com/x",
])
def test_a_files_webhook_must_be_a_public_https_address(tmp_path, url, monkeypatch):
    monkeypatch.delenv("RUNNER_NOTIFY", raising=False)
    inv, job = _files(tmp_path, url)
    with pytest.raises(UserError) as exc:
        load_inventory(inv, job_path=str(job))
    msg = str(exc.value)
    assert msg.startswith(f"{job}:2: job.notify: ") and "\n" not in msg and "--notify" in msg, msg


class _Lookups:
    """getaddrinfo answered by the test: `answers` in turn (the last one repeated); every
    connection attempt recorded and refused, so nothing leaves this machine."""

    def __init__(self, monkeypatch, *answers: list[str]):
        self.answers, self.asked, self.connects = list(answers), 0, []
        monkeypatch.setattr(socket, "getaddrinfo", self.getaddrinfo)
        monkeypatch.setattr(socket, "create_connection", self.create_connection)

    def getaddrinfo(self, host, port, *a, **k):
        ips = self.answers[min(self.asked, len(self.answers) - 1)]
        self.asked += 1
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port or 443))
                for ip in ips]

    def create_connection(self, address, *a, **k):
        self.connects.append(address[0])
        raise ConnectionRefusedError(111, "Connection refused")


@pytest.mark.parametrize("answer", [["127.0.0.1"], ["93.184.215.14", "10.1.2.3"], ["::1"], ["169.254.169.254"]])
def test_a_name_that_resolves_to_a_private_address_is_not_posted_to(tmp_path, monkeypatch, capsys, answer):
    monkeypatch.delenv("RUNNER_NOTIFY", raising=False)
    inv, job = _files(tmp_path, "https://hooks.example.test/T0KEN")
    spec = load_inventory(inv, job_path=str(job)).job.notify
    look = _Lookups(monkeypatch, answer)
    assert not notify.send(spec, _outcome())
    assert look.connects == [], look.connects
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "not a public address" in err and "T0KEN" not in err, err


def test_the_connection_goes_to_the_address_that_was_checked(tmp_path, monkeypatch, capsys):
    """DNS rebinding: the name answers a public address when checked and 127.0.0.1 after. Only
    the checked address is ever connected to."""
    monkeypatch.delenv("RUNNER_NOTIFY", raising=False)
    inv, job = _files(tmp_path, "https://hooks.example.test/x")
    spec = load_inventory(inv, job_path=str(job)).job.notify
    look = _Lookups(monkeypatch, ["93.184.215.14"], ["127.0.0.1"])
    assert not notify.send(spec, _outcome())
    assert look.connects == ["93.184.215.14"] and look.asked == 1, (look.connects, look.asked)


def test_redirects_are_not_followed(hook, capsys):
    """Even your own webhook: a redirect is reported, not followed (before, urllib re-sent the POST)."""
    there, port2 = hook()
    here, port1 = hook(status=307, location=f"http://127.0.0.1:{port2}/elsewhere")
    assert not notify.send(notify.parse(f"http://127.0.0.1:{port1}/hook"), _outcome())
    assert here.got == ["/hook"] and there.got == [], there.got
    err = capsys.readouterr().err
    assert "HTTP 307" in err and "redirect" in err and len(err.splitlines()) == 1, err


def test_your_own_local_webhook_is_still_posted(hook, monkeypatch, tmp_path):
    """RUNNER_NOTIFY (or --notify) may name this machine: it is the user's own choice."""
    srv, port = hook()
    inv, job = _files(tmp_path, "https://hooks.example.test/x")
    monkeypatch.setenv("RUNNER_NOTIFY", f"http://127.0.0.1:{port}/mine")
    spec = notify.from_args(_Args, load_inventory(inv, job_path=str(job)).job, str(inv))
    assert notify.send(spec, _outcome())
    assert srv.got == ["/mine"]
    assert json.dumps(_outcome().document())
