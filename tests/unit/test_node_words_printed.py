"""Words a node chose (its `id -un`, the home its sftp-server reports) reach the terminal only as
printable() makes them: an escape sequence is shown, never acted on (OSC 52 writes the clipboard,
`\\r` + erase-line repaints a line as another). Found by an audit: two messages printed them raw."""

from __future__ import annotations

import contextlib
import io
import threading
from types import SimpleNamespace as NS

from runner.backends.ssh import resume, status
from runner.inventory import Node
from runner.transport import probe
from runner.transport.sftp import NodeFiles

EVIL = "pi\x1b]52;c;ZWNobyBwd25lZA==\x07\x1b[2K\rrun ok"


def test_the_probe_keeps_no_user_name_with_a_control_character(monkeypatch):
    def answer(user):
        return lambda remote, script, clock: (["uid=1000", "gid=1000", f"user={user}", "arch=x86_64",
                                               "home=/home/pi", "docker_rc=0", "docker=24.0.7"], None)
    remote = NS(node=NS(name="n1", user="pi", workdir=None), home="/home/pi", listening_ports=lambda: set())
    monkeypatch.setattr(probe, "node_paths", lambda node, home: NS(workdir="/home/pi/runner"))
    monkeypatch.setattr(probe, "_probe_session", answer(EVIL))
    assert probe.probe(remote, "10.0.0.1", clock=False).user is None
    monkeypatch.setattr(probe, "_probe_session", answer("pi"))
    assert probe.probe(remote, "10.0.0.1", clock=False).user == "pi"


def test_hand_back_names_the_nodes_user_visibly(monkeypatch, capsys):
    import runner.backends.ssh.run_owner as run_owner

    monkeypatch.setattr(run_owner, "hand_back", lambda *a: "out/logs/rank0.log")

    class Cl:
        def __getitem__(self, k):
            return None

        def map(self, items, fn):
            return [(i, fn(i), None) for i in items]

    plan = NS(run_id="r1", nodes=[NS(node="n1", run_dir="/x", image="img")])
    resume.hand_back_runs(Cl(), plan, {"n1": NS(uid=1000, gid=1000, user=EVIL)})
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "\x07" not in out
    assert out == ("run r1: n1: files not owned by pi^[]52;c;ZWNobyBwd25lZA==^G^[[2K^Mrun ok handed back to it "
                   "(first: out/logs/rank0.log)\n")


def test_an_oversized_history_warning_shows_the_nodes_home_visibly(capsys):
    class Evil(NodeFiles):
        def __init__(self, node):
            self.node, self._lock, self._sftp = node, threading.Lock(), None
            self._home = "/home/pi\x1b]0;owned-title\x07\x1b[2K\r"  # what the node's sftp-server says `.` is

        @property
        def sftp(self):
            return NS(open=lambda path, mode: contextlib.nullcontext(io.BytesIO(b"x" * (status.EVENTS_MAX + 10))))

    node = Node(name="n1", host="10.0.0.5", user="pi")
    files = Evil(node)

    class Cl:
        inv = NS(ordered=lambda: [node])

        def __getitem__(self, k):
            return files

    assert status.elastic_history(Cl(), {"n1": (None, {"r1": None})}, "r1") == []
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\r" not in err and err.count("\n") == 1
    assert err.startswith("runner: warning: node n1: /home/pi^[]0;owned-title^G^[[2K^M/runner/runs/r1/elastic.jsonl")
