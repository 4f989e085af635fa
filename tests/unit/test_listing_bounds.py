"""A node's listings and status files, read as hostile (runner/transport/sftp.py listdir_within,
walk; runner/backends/ssh/node_runs.py node_run_dirs, run_doc). A node's sftp-server that answered READDIR with
entries and never with EOF had paramiko's listdir_attr collect for ever (3M entries: 2.4 GB), the
walk's bound checked only once a directory was whole and node_run_dirs bounded by nothing; a
runner-status.json of 8 MiB of `{},` was parsed whole and kept per run dir (20 of them: 3.9 GB).

The node here is a fake sftp-server (SFTP v3, the few requests a listing makes) on a socketpair,
spoken to by paramiko's real client through a real Remote: it counts the entries it sent, so a
test sees where the listing stopped, not only that it did."""

from __future__ import annotations

import json
import socket
import stat
import struct
import threading
from collections.abc import Callable, Iterator

import paramiko
import pytest
from paramiko.message import Message

from runner.backends.ssh import node_runs
from runner.core.errors import UserError
from runner.inventory import Node
from runner.transport import sftp as node_sftp
from runner.transport.ssh import Remote
from tests.support.runner_helpers import wait_for

BOUND = 1000            # the bound each test sets (WALK_MAX_FILES, RUN_DIRS_MAX): small, for speed
PER_ANSWER = 100        # entries per READDIR answer, as OpenSSH's sftp-server sends
GIVE_UP = 50 * BOUND    # where the "endless" node stops after all: a listing that ignores the bound ends
MARGIN = 2 + PER_ANSWER  # what a listing stopped at the bound may have been sent past it: the dots, one answer

FILE, DIR = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755
# path opened -> the READDIR answers, each a list of (name, mode) or raw bytes of a NAME answer's body
Answers = Iterator["list[tuple[str, int]] | bytes"]


class FakeSftpServer:
    """An sftp-server answering INIT, OPENDIR, READDIR and CLOSE from `listing` (anything else: a
    failure status). Counts what a test asserts on: entries sent, handles opened and closed."""

    def __init__(self, sock: socket.socket, listing: Callable[[str], Answers]):
        self.sock, self.listing = sock, listing
        self.sent = 0
        self.opened: list[bytes] = []
        self.closed: list[bytes] = []
        self._dirs: dict[bytes, Answers] = {}
        self.thread = threading.Thread(target=self._serve, daemon=True, name="fake-sftp-server")
        self.thread.start()

    def _recv(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            got = self.sock.recv(n - len(out))
            if not got:
                raise EOFError
            out += got
        return out

    def _send(self, t: int, body: bytes) -> None:
        self.sock.sendall(struct.pack(">IB", len(body) + 1, t) + body)

    def _status(self, rid: int, code: int) -> None:
        m = Message()
        m.add_int(rid)
        m.add_int(code)
        m.add_string("")
        m.add_string("")
        self._send(paramiko.sftp.CMD_STATUS, m.asbytes())

    def _serve(self) -> None:
        try:
            while True:
                size, t = struct.unpack(">IB", self._recv(5))
                msg = Message(self._recv(size - 1))
                if t == paramiko.sftp.CMD_INIT:
                    self._send(paramiko.sftp.CMD_VERSION, struct.pack(">I", 3))
                    continue
                rid = msg.get_int()
                if t == paramiko.sftp.CMD_OPENDIR:
                    handle = f"h{len(self.opened)}".encode()
                    self.opened.append(handle)
                    self._dirs[handle] = self.listing(msg.get_text())
                    m = Message()
                    m.add_int(rid)
                    m.add_string(handle)
                    self._send(paramiko.sftp.CMD_HANDLE, m.asbytes())
                elif t == paramiko.sftp.CMD_READDIR:
                    self._answer(rid, msg.get_binary())
                elif t == paramiko.sftp.CMD_CLOSE:
                    self.closed.append(msg.get_binary())
                    self._status(rid, paramiko.sftp.SFTP_OK)
                else:
                    self._status(rid, paramiko.sftp.SFTP_FAILURE)
        except (EOFError, OSError):
            return

    def _answer(self, rid: int, handle: bytes) -> None:
        batch = next(self._dirs[handle], None)
        if batch is None:
            self._status(rid, paramiko.sftp.SFTP_EOF)
            return
        if isinstance(batch, bytes):  # a body as the node forges it
            self._send(paramiko.sftp.CMD_NAME, struct.pack(">I", rid) + batch)
            return
        m = Message()
        m.add_int(rid)
        m.add_int(len(batch))
        for name, mode in batch:
            m.add_string(name)
            m.add_string(name)
            m.add_int(paramiko.SFTPAttributes.FLAG_PERMISSIONS)
            m.add_int(mode)
        self.sent += len(batch)
        self._send(paramiko.sftp.CMD_NAME, m.asbytes())


class _Sock:
    """The client's end as paramiko reads a channel: plain recv (paramiko polls a real socket with
    select every 0.1 s) and `closed`, which Remote.sftp checks."""

    def __init__(self, sock: socket.socket):
        self.sock, self.closed = sock, False

    def send(self, data: bytes) -> int:
        return self.sock.send(data)

    def recv(self, n: int) -> bytes:
        return self.sock.recv(n)

    def close(self) -> None:
        self.closed = True
        self.sock.close()

    def get_name(self) -> str:  # what paramiko's log lines name the channel by
        return "fake"


@pytest.fixture
def node(monkeypatch):
    """(Remote of node `evil`, workdir /wd, its SFTP session on a fake server; a setter for the
    server's listing)."""
    monkeypatch.setattr(node_sftp, "WALK_MAX_FILES", BOUND)
    monkeypatch.setattr(node_runs, "RUN_DIRS_MAX", BOUND, raising=False)
    ours, theirs = socket.socketpair()
    ours.settimeout(10)  # a listing that waits on an answer the server never sends fails, not hangs
    listings: dict[str, Callable[[str], Answers]] = {}
    server = FakeSftpServer(theirs, lambda path: listings["fn"](path))
    r = Remote(Node("evil", "127.0.0.1", workdir="/wd"))
    r._sftp, r._home = paramiko.SFTPClient(_Sock(ours)), "/home/u"

    def serve(fn: Callable[[str], Answers]) -> FakeSftpServer:
        listings["fn"] = fn
        return server

    yield r, serve
    r._sftp.close()
    theirs.close()
    server.thread.join(5)


def endless(mode: int, name: Callable[[int], str] = lambda i: f"f{i:07d}") -> Callable[[str], Answers]:
    """A directory that answers every READDIR with PER_ANSWER more entries (up to GIVE_UP)."""
    def answers(path: str) -> Answers:
        for start in range(0, GIVE_UP, PER_ANSWER):
            yield [(name(i), mode) for i in range(start, start + PER_ANSWER)]
    return answers


def tree(dirs: dict[str, list[tuple[str, int]]]) -> Callable[[str], Answers]:
    """Finite directories, each one answer with `.` and `..` first, then EOF."""
    def answers(path: str) -> Answers:
        yield [(".", DIR), ("..", DIR), *dirs[path]]
    return answers


def one_line_error(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


@pytest.mark.timeout(20)
def test_walk_stops_at_the_bound_as_entries_arrive(node):
    """The walk's bound is counted as the answers arrive: a node that never says EOF is refused
    after BOUND entries (and one answer), not after the whole of what it sends."""
    r, serve = node
    server = serve(endless(FILE))
    with pytest.raises(UserError) as err:
        r.walk("/run")
    assert one_line_error(err) == f"node evil: /run: more than {BOUND:,} entries listed; nothing taken from it"
    assert server.sent <= BOUND + MARGIN, f"the node sent {server.sent:,} entries before the walk stopped"
    # The handle left early is closed, and the session goes on: the close's answer is not taken for
    # the next request's.
    serve(tree({"/ok": [("a", FILE)]}))
    assert [p for p, _ in r.walk("/ok")] == ["a"]
    assert server.closed == server.opened


@pytest.mark.timeout(20)
def test_walk_bound_is_the_whole_trees(node):
    """Directories each under the bound, together over it: refused as the one too many arrives."""
    r, serve = node
    subdirs = [(f"d{i}", DIR) for i in range(10)]
    files = [(f"f{i}", FILE) for i in range(300)]
    server = serve(tree({"/run": subdirs, **{f"/run/d{i}": files for i in range(10)}}))
    with pytest.raises(UserError) as err:
        r.walk("/run")
    assert one_line_error(err).endswith(f"more than {BOUND:,} entries listed; nothing taken from it")
    assert server.sent <= BOUND + 300 + MARGIN
    # The close of the handle left early is sent without waiting for its answer: the server takes it
    # in its own time (asserted at once, this failed under a loaded full run).
    wait_for(lambda: server.closed == server.opened, 10, interval=0.02)


@pytest.mark.timeout(20)
def test_endless_dots_are_bounded_too(node):
    """`.` and `..` are not kept, but counted: a node repeating them without end is refused too."""
    r, serve = node
    server = serve(endless(FILE, lambda i: "." if i % 2 else ".."))
    with pytest.raises(UserError) as err:
        r.walk("/run")
    assert one_line_error(err).startswith("node evil: /run: more than")
    assert server.sent <= BOUND + MARGIN


@pytest.mark.timeout(20)
def test_an_answer_claiming_more_entries_than_it_holds_is_bounded(node):
    """An answer's count is the node's word: past the packet's end paramiko reads empty entries,
    which count against the bound like any others (4 billion claimed: no loop of 4 billion)."""
    r, serve = node
    one = Message()
    one.add_int(0xFFFFFFFF)
    one.add_string("a")
    one.add_string("a")
    one.add_int(paramiko.SFTPAttributes.FLAG_PERMISSIONS)
    one.add_int(FILE)
    serve(lambda path: iter([one.asbytes()]))
    with pytest.raises(UserError) as err:
        r.walk("/run")
    assert one_line_error(err).startswith("node evil: /run: more than")


@pytest.mark.timeout(20)
def test_a_name_not_utf8_closes_the_handle(node):
    r, serve = node
    bad = Message()
    bad.add_int(1)
    bad.add_string(b"\xff\xfe")
    bad.add_string(b"\xff\xfe")
    bad.add_int(paramiko.SFTPAttributes.FLAG_PERMISSIONS)
    bad.add_int(FILE)
    server = serve(lambda path: iter([bad.asbytes()]))
    with pytest.raises(UserError) as err:
        r.walk("/run")
    assert "not UTF-8" in one_line_error(err)
    serve(tree({"/ok": []}))
    assert r.walk("/ok") == []
    assert server.closed == server.opened


@pytest.mark.timeout(20)
def test_walk_of_a_finite_tree_is_whole(node):
    r, serve = node
    server = serve(tree({"/run": [("a", FILE), ("sub", DIR)], "/run/sub": [("b", FILE)]}))
    assert sorted(p for p, _ in r.walk("/run")) == ["a", "sub/b"]
    assert server.closed == server.opened and len(server.opened) == 2


@pytest.mark.timeout(20)
def test_node_run_dirs_stops_at_its_bound(node):
    """`status`, `ls`, `down` and `collect` list the workdir's runs/: bounded like the walk."""
    r, serve = node
    server = serve(endless(DIR, lambda i: f"run-{i:07d}"))
    with pytest.raises(UserError) as err:
        node_runs.node_run_dirs(r)
    assert one_line_error(err) == f"node evil: /wd/runs: more than {BOUND:,} entries listed; nothing taken from it"
    assert server.sent <= BOUND + MARGIN, f"the node sent {server.sent:,} entries before the listing stopped"
    serve(tree({"/wd/runs": []}))
    assert node_runs.node_run_dirs(r) == {}
    assert server.closed == server.opened


@pytest.mark.timeout(20)
def test_node_run_dirs_lists_the_run_dirs(node):
    r, serve = node
    rid = "20240101-120000-abcd"
    serve(tree({"/wd/runs": [(rid, DIR), ("mine", DIR), ("a-file", FILE), (".hidden", DIR)]}))
    assert node_runs.node_run_dirs(r) == {rid: None, "mine": None}


# --- run_doc: the job can rewrite runner-status.json ---

def status_reader(text: str):
    from types import SimpleNamespace

    return SimpleNamespace(node=Node("node-0", "127.0.0.1", workdir="/wd"), home="/home/u",
                           read_text=lambda path: text)


def test_run_doc_of_many_values_is_empty_without_parsing_it(monkeypatch):
    """8 MiB of `{},` parse to millions of dicts: such a file is refused before json sees it."""
    from runner.backends.ssh.node_runs import run_doc

    def parse(*a, **k):
        raise AssertionError("a status file of a million values was parsed")

    text = '{"rank": 0, "a": [' + "{}," * 1_000_000 + "{}]}"
    monkeypatch.setattr(json, "loads", parse)
    assert run_doc(status_reader(text), "r1") == {}


def test_run_doc_keeps_the_fields_the_verbs_read():
    """What `up` writes (runner/backends/ssh/run_end.py): rank, exit code, result and image kept."""
    from runner.backends.ssh.node_runs import run_doc

    doc = {"run_id": "r1", "node": "node-0", "rank": 1, "result": 0, "exit_code": None, "error": None,
           "finished": "2024-01-01T12:00:00+00:00", "image": "trainer:1", "command": "python -m train --a=1,2"}
    assert run_doc(status_reader(json.dumps(doc, indent=1)), "r1") == {
        "rank": 1, "result": 0, "exit_code": None, "image": "trainer:1"}


def test_run_doc_keeps_no_field_of_megabytes():
    """A field kept per run dir is a number, null or a short string: not a list, not a 1 MB string."""
    from runner.backends.ssh.node_runs import run_doc

    text = json.dumps({"rank": 0, "image": "x" * (1 << 20), "result": [1, 2], "exit_code": {"a": 1}})
    assert run_doc(status_reader(text), "r1") == {"rank": 0}
