"""`runner up --notify CMD|URL` / `job.notify`: a command on this machine with the run's facts in its
environment when the run ends, or a JSON POST to a webhook (a local http.server here); failures
are one warning line and never change the run's exit code; malformed values are one line."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from runner.backends import notify
from runner.backends.notify import NotifySpec, Outcome
from runner.core.errors import UserError
from runner.inventory import load_inventory
from tests.support.runner_helpers import run_cli, runner, write_job

DUMP_ENV = ("import json, os, sys; json.dump({k: v for k, v in os.environ.items() if k.startswith('RUNNER_')}, "
            "open(sys.argv[1], 'w'))")


@pytest.mark.sandbox
@pytest.mark.docker
def test_a_failed_run_runs_the_command_with_its_facts(sandbox, pushed, tmp_path):
    """A one-node run on the session sandbox whose job writes a metrics record and exits 3: the
    notify command runs once the run has ended, with its id, state, exit code, summary and last
    metrics record in its environment; `up` still exits 4 (the job failed)."""
    doc = yaml.safe_load(Path(sandbox).read_text())
    doc["nodes"] = doc["nodes"][:1]
    inv = tmp_path / "one.yaml"
    inv.write_text(yaml.safe_dump(doc))
    job = write_job(tmp_path, extra={"command": ["sh", "-c", """echo '{"step": 3, "loss": 1.25}' > "$OUTPUT_DIR/metrics.jsonl"; exit 3"""]})
    got = tmp_path / "env.json"
    p = runner("up", "-i", str(inv), "--job", str(job), "--logs-dir", str(tmp_path / "logs"),
               "--notify", shlex.join([sys.executable, "-c", DUMP_ENV, str(got)]))
    assert p.returncode == 4, p.stdout + p.stderr
    run_id = re.search(r"run (\S+) started", p.stdout)[1]
    env = {k: v for k, v in json.loads(got.read_text()).items() if os.environ.get(k) != v}  # not the test's own
    assert float(env.pop("RUNNER_DURATION_S")) > 0
    summary = env.pop("RUNNER_SUMMARY")
    assert re.fullmatch(rf"run {run_id}: node node-0 \(rank 0\) failed: container exited with code \d+", summary)
    assert f"runner: error: {summary}; stopped the run on every node" in p.stderr
    assert env == {"RUNNER_RUN_ID": run_id, "RUNNER_STATE": "failed", "RUNNER_EXIT": "4", "RUNNER_INVENTORY": str(inv),
                   "RUNNER_SCHEDULER": "ssh", "RUNNER_NODES": "node-0",
                   "RUNNER_LAST_METRICS": '{"step": 3, "loss": 1.25}'}


class _Hook(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        srv = self.server
        body = self.rfile.read(int(self.headers["Content-Length"]))
        srv.got.append((self.path, self.headers["Content-Type"], json.loads(body)))
        if srv.hold is not None:
            srv.hold.wait()  # never answers until the test is done
        self.send_response(srv.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass


@pytest.fixture
def hook():
    def make(status: int = 204, hold: bool = False):
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
        srv.got, srv.status, srv.hold = [], status, threading.Event() if hold else None
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        made.append(srv)
        return srv, f"http://127.0.0.1:{srv.server_address[1]}/hook/T0KEN-abc"
    made: list = []
    yield make
    for srv in made:
        if srv.hold is not None:
            srv.hold.set()
        srv.shutdown()
        srv.server_close()


def _outcome() -> Outcome:
    o = Outcome("hosts/x.yaml", "ssh", ["node-0", "node-1"], run_id="20260101-000000-abcd",
                summary="run 20260101-000000-abcd finished: all 2 node(s) exited 0",
                last_metrics='{"step": 5, "loss": 2.5}')
    o.exit_code = 0
    return o


def test_webhook_gets_the_json(hook, capsys):
    srv, url = hook()
    assert notify.send(notify.parse(url), _outcome())
    [(path, ctype, doc)] = srv.got
    assert (path, ctype) == ("/hook/T0KEN-abc", "application/json")
    assert doc.pop("duration_s") >= 0
    assert doc == {"run_id": "20260101-000000-abcd", "state": "succeeded", "exit_code": 0,
                   "summary": "run 20260101-000000-abcd finished: all 2 node(s) exited 0", "inventory": "hosts/x.yaml",
                   "scheduler": "ssh", "nodes": ["node-0", "node-1"], "last_metrics": {"step": 5, "loss": 2.5}}
    assert capsys.readouterr().err == ""


def test_webhook_failures_are_one_line_without_the_token(hook, capsys, monkeypatch):
    srv, url = hook(status=500)
    assert not notify.send(notify.parse(url), _outcome())
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/hook/T0KEN-abc"
    assert not notify.send(notify.parse(closed), _outcome())
    monkeypatch.setattr(notify, "NOTIFY_TIMEOUT_S", 0.5)
    held, url = hook(hold=True)
    assert not notify.send(notify.parse(url), _outcome())
    assert len(held.got) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and "T0KEN" not in "".join(err)
    tail = " (the run's result is unchanged)"
    assert err[0] == f"runner: warning: notify POST http://127.0.0.1: HTTP 500 Internal Server Error{tail}"
    assert err[1].startswith("runner: warning: notify POST http://127.0.0.1: [Errno 111] Connection refused")
    assert err[2] in (f"runner: warning: notify POST http://127.0.0.1: no answer within 0.5s{tail}",
                      f"runner: warning: notify POST http://127.0.0.1: timed out{tail}")


def test_command_failure_is_one_line(capsys):
    assert not notify.send(NotifySpec(argv=("sh", "-c", "exit 9")), _outcome())
    assert not notify.send(NotifySpec(argv=("/nonexistent/notify-me",)), _outcome())
    err = capsys.readouterr().err.splitlines()
    assert err == ["runner: warning: notify `exit 9`: exited 9 (the run's result is unchanged)",
                   "runner: warning: notify `/nonexistent/notify-me`: cannot run it: No such file or directory "
                   "(the run's result is unchanged)"]


@pytest.mark.parametrize("bad, why", [
    ("http://", "not a URL with a host"),
    ("https://hooks.example.com/a b", "holds a space or a control character"),
    ("ftp://example.com/x", "only http:// and https:// URLs are posted to"),
    ("http://example.com:99999/x", "port is not a number"),
    ("", "give a command line or an http(s):// URL"),
])
def test_malformed_notify_is_one_line_nothing_started(tmp_path, capsys, bad, why):
    inv = tmp_path / "inv.yaml"
    inv.write_text("nodes:\n  - {name: n0, host: 192.0.2.1, arch: amd64, role: master}\njob: {image: 'x:1'}\n")
    rc, out = run_cli("up", "-i", str(inv), "--dry-run", "--notify", bad)
    err = capsys.readouterr().err
    assert rc == 2 and out == "" and len(err.splitlines()) == 1 and why in err, err
    assert err.startswith("runner: error: --notify: ")
    # The same value as job.notify names the inventory's line.
    inv.write_text(inv.read_text().replace("job: {image: 'x:1'}", f"job:\n  image: 'x:1'\n  notify: {json.dumps(bad)}"))
    with pytest.raises(UserError, match=rf"^{re.escape(str(inv))}:5: job\.notify: .*{re.escape(why)}"):
        load_inventory(inv)


def test_job_notify_forms_and_detach(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RUNNER_NOTIFY", raising=False)
    inv = tmp_path / "inv.yaml"
    inv.write_text("nodes:\n  - {name: n0, host: 192.0.2.1, arch: amd64, role: master}\n"
                   "job: {image: 'x:1', notify: 'https://h.example/x?a=1'}\n")
    job = load_inventory(inv).job
    assert job.notify == NotifySpec(url="https://h.example/x?a=1", from_file=True)  # public addresses only
    assert notify.parse("echo $RUNNER_RUN_ID") == NotifySpec(argv=("sh", "-c", "echo $RUNNER_RUN_ID"))
    assert notify.parse(["notify-send", "run ended"]) == NotifySpec(argv=("notify-send", "run ended"))  # no shell

    class Args:
        notify, detach = None, True
    assert notify.from_args(Args, job, str(inv)) is None  # job.notify: skipped for a detached run, said so
    assert capsys.readouterr().err == (f"runner: note: {inv}: job.notify is not run for a detached run "
                                       "(nothing on this machine follows it)\n")
    rc, _ = run_cli("up", "-i", str(inv), "--detach", "--notify", "true")
    assert rc == 2 and capsys.readouterr().err.startswith("runner: error: --notify needs `runner up` to follow the run")


@pytest.mark.parametrize("value", ["touch /tmp/notify-owned", "[sh, -c, 'touch /tmp/notify-owned']"])
def test_a_command_in_a_files_notify_is_refused_and_yours_is_taken_from_the_flag_or_environment(
        tmp_path, capsys, monkeypatch, value):
    """Found by an audit: job.notify's command ran on this machine (`sh -c`) when the run ended, so an
    inventory or job file someone handed you ran their command here, as ssh_config's Match exec would
    (refused for that reason). A file's notify may be a webhook; a command is the user's own, from
    --notify or RUNNER_NOTIFY, and --notify wins."""
    monkeypatch.delenv("RUNNER_NOTIFY", raising=False)
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"nodes:\n  - {{name: n0, host: 192.0.2.1, arch: amd64, role: master}}\njob:\n  image: 'x:1'\n"
                   f"  notify: {value}\n")
    with pytest.raises(UserError, match=rf"^{re.escape(str(inv))}:5: job\.notify: a command here would run on "
                                        r"this machine .* `runner up --notify CMD`, or RUNNER_NOTIFY=CMD"):
        load_inventory(inv)
    rc, out = run_cli("up", "-i", str(inv), "--dry-run")
    err = capsys.readouterr().err
    assert rc == 2 and out == "" and len(err.splitlines()) == 1 and ":5: job.notify: a command here" in err, err
    job = write_job(tmp_path, extra={"notify": "touch /tmp/notify-owned"})  # a --job file: the same rule
    with pytest.raises(UserError, match=r"job\.notify: a command here would run on this machine"):
        load_inventory(_plain(tmp_path), job_path=str(job))

    class Args:
        notify, detach = None, False
    plain = load_inventory(_plain(tmp_path)).job
    assert notify.from_args(Args, plain, "inv.yaml") is None
    monkeypatch.setenv("RUNNER_NOTIFY", "notify-send done")
    assert notify.from_args(Args, plain, "inv.yaml") == NotifySpec(argv=("sh", "-c", "notify-send done"))
    Args.notify = "https://h.example/x"
    assert notify.from_args(Args, plain, "inv.yaml") == NotifySpec(url="https://h.example/x")  # the flag wins
    Args.notify, Args.detach = None, True
    assert notify.from_args(Args, plain, "inv.yaml") is None
    assert capsys.readouterr().err == ("runner: note: RUNNER_NOTIFY is not run for a detached run (nothing on "
                                       "this machine follows it)\n")
    monkeypatch.setenv("RUNNER_NOTIFY", "ftp://x.example/y")
    Args.detach = False
    with pytest.raises(UserError, match=r"^RUNNER_NOTIFY \(in your environment\): ftp://x.example\.\.\.: only http"):
        notify.from_args(Args, plain, "inv.yaml")


def _plain(tmp: Path) -> Path:
    p = tmp / "plain.yaml"
    p.write_text("nodes:\n  - {name: n0, host: 192.0.2.1, arch: amd64, role: master}\njob: {image: 'x:1'}\n")
    return p
