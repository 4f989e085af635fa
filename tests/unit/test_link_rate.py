"""`compress:` of a node and its `auto` rule (runner/transport/link_rate.py): the inventory field,
the rule, and the link probe against a node that answers it wrongly or never stops sending. The
rates themselves are measured on shaped and unshaped namespaced links in
tests/sandbox/test_sandbox_links.py."""

from __future__ import annotations

import logging
import math
import threading
import time

import pytest

from runner.core.errors import UserError
from runner.inventory import Node, load_inventory
from runner.transport import link_rate
from runner.transport.ssh import Remote
from tests.support.hostile_node import HostileNode


def _inv(tmp_path, body: str):
    p = tmp_path / "inv.yaml"
    p.write_text(body)
    return p


def test_compress_field_takes_true_false_or_auto_and_defaults_merge(tmp_path):
    inv = load_inventory(_inv(tmp_path, "defaults: {compress: false}\nnodes:\n"
                                        "  - {name: a, host: 10.9.0.1}\n"
                                        "  - {name: b, host: 10.9.0.2, compress: true}\n"
                                        "  - {name: c, host: 10.9.0.3, compress: auto}\n"), check_files=False)
    assert [n.compress for n in inv.nodes] == [False, True, None]
    plain = load_inventory(_inv(tmp_path, "nodes:\n  - {name: a, host: 10.9.0.1}\n"), check_files=False)
    assert plain.nodes[0].compress is None  # auto


@pytest.mark.parametrize("value", ["1", "0", "[true]", "null", "fast", "\"true\""])
def test_a_bad_compress_value_is_one_line_naming_file_line_and_field(tmp_path, value):
    p = _inv(tmp_path, f"nodes:\n  - {{name: a, host: 10.9.0.1}}\n  - {{name: b, host: 10.9.0.2, compress: {value}}}\n")
    with pytest.raises(UserError) as e:
        load_inventory(p, check_files=False)
    msg = str(e.value)
    assert "\n" not in msg and f"{p}:3" in msg and "nodes[1].compress" in msg, msg
    assert "must be true, false or auto" in msg, msg


def test_the_rule_compresses_only_a_link_slower_than_the_compressor():
    assert link_rate.decide(5e6, 20e6) is True       # Wi-Fi to a Pi: 5 MB/s under zlib's 20
    assert link_rate.decide(110e6, 20e6) is False    # gigabit
    assert link_rate.decide(20e6, 20e6) is False     # a tie gains nothing and costs a core


def test_zlib_rate_is_measured_on_machine_code_once_per_process(monkeypatch):
    monkeypatch.setattr(link_rate, "_zlib_rate", None)
    calls = []
    real = link_rate._measure_zlib
    monkeypatch.setattr(link_rate, "_measure_zlib", lambda: calls.append(1) or real())
    first = link_rate.zlib_rate()
    assert link_rate.zlib_rate() == first and calls == [1]
    # A measured zlib level 6 rate: not the fallback constant, and not an empty sample (no core
    # deflates 2 GB/s; a busy machine only makes the figure smaller, so no lower bound is asserted).
    assert 0 < first < 2e9 and first != link_rate.FALLBACK_ZLIB, first


def _remote(host: str, compress: bool | None) -> Remote:
    return Remote(Node(name="n", host=host, compress=compress))


def test_a_set_compress_or_a_loopback_node_is_never_probed(monkeypatch):
    def probe(*a, **k):
        raise AssertionError("probed")

    monkeypatch.setattr(link_rate, "measure_link", probe)
    assert link_rate.compress_stream(_remote("10.9.0.1", True), upload=True, aes=True) is True
    assert link_rate.compress_stream(_remote("10.9.0.1", False), upload=False, aes=False) is False
    assert link_rate.compress_stream(_remote("127.0.0.1", None), upload=True, aes=True) is False
    assert link_rate.compress_stream(_remote("localhost", None), upload=True, aes=True) is False


def test_a_stream_too_small_to_matter_is_not_probed_for(monkeypatch):
    def probe(*a, **k):
        raise AssertionError("probed")

    monkeypatch.setattr(link_rate, "measure_link", probe)
    r = _remote("10.9.0.1", None)
    # A re-push of one code layer: compressed as before, without a probe twice its size.
    assert link_rate.compress_stream(r, upload=True, aes=True, size=link_rate.WORTH - 1) is True
    assert "_compress_by" not in r.__dict__ or r._compress_by == {}


def test_auto_measures_each_direction_once_and_follows_the_rule(monkeypatch):
    seen = []
    rates = {True: 4e6, False: 90e6}  # a home uplink: slow up, fast down

    def probe(remote, upload, aes):
        seen.append((upload, aes))
        return rates[upload]

    monkeypatch.setattr(link_rate, "measure_link", probe)
    monkeypatch.setattr(link_rate, "_zlib_rate", 20e6)
    monkeypatch.setattr(link_rate, "node_zlib_rate", lambda remote: None)  # as fast as this host
    r = _remote("10.9.0.1", None)
    assert [link_rate.compress_stream(r, upload=u, aes=True) for u in (True, False, True, False)] == [
        True, False, True, False]
    assert seen == [(True, True), (False, True)]
    assert r.link_rates == {"up": 4e6, "down": 90e6}


def _returns(fn, limit: float):
    """fn()'s result (or exception) in a thread; a failure once `limit` passed. The node commands
    below end by themselves only after more than `limit` (or never), so a call that returns was
    ended by the bound under test: no test compares how long it took with a constant."""
    box: list = []

    def go() -> None:
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box.append(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        pytest.fail(f"still running after {limit:.0f} s: the bound never fired")
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


@pytest.fixture
def node(tmp_path):
    with HostileNode(tmp_path / "node", fourth=61) as n:
        yield n


def _connected(node: HostileNode, monkeypatch) -> Remote:
    r = Remote(node.node()).connect()
    monkeypatch.setattr(link_rate, "is_loopback", lambda host: False)  # treat this node as remote
    return r


def test_the_probe_measures_a_real_stream_both_ways(node, monkeypatch):
    r = _connected(node, monkeypatch)
    try:
        up = link_rate.measure_link(r, upload=True, aes=True)
        down = link_rate.measure_link(r, upload=False, aes=True)
    finally:
        r.close()
    # The node's server is paramiko in this process: a measured rate, never nothing.
    assert 0 < up < math.inf and 0 < down < math.inf, (up, down)
    assert any(c.startswith("echo ready") for c in node.commands), node.commands
    assert any(c.startswith(f"exec head -c {link_rate.PROBE_BYTES} /dev/zero") for c in node.commands), node.commands


def test_the_upload_probe_sends_at_most_its_bound(node, monkeypatch, tmp_path):
    count = tmp_path / "received"
    node.rewrite = lambda cmd: f"echo ready && exec wc -c > {count}" if cmd.startswith("echo ready") else cmd
    r = _connected(node, monkeypatch)
    try:
        link_rate.measure_link(r, upload=True, aes=True)
    finally:
        r.close()
    deadline = time.monotonic() + 20
    while not (count.exists() and count.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)  # wc prints once the channel closes
    got = int(count.read_text())
    assert 0 < got <= link_rate.PROBE_BYTES, got


def test_a_node_answering_the_probe_wrongly_gets_the_stream_compressed(node, monkeypatch, caplog):
    node.rewrite = lambda cmd: "echo hello; cat >/dev/null" if cmd.startswith("echo ready") else cmd
    r = _connected(node, monkeypatch)
    try:
        with caplog.at_level(logging.DEBUG, logger="runner.link"):
            assert link_rate.compress_stream(r, upload=True, aes=True) is True
    finally:
        r.close()
    assert "link probe (up) failed (the node's shell did not answer as expected): stream compressed" in caplog.text


def test_a_node_that_never_answers_the_probe_is_given_up_in_bounded_time(node, monkeypatch, caplog):
    node.rewrite = lambda cmd: "sleep 60"
    monkeypatch.setattr(link_rate, "ANSWER_S", 2.0)
    r = _connected(node, monkeypatch)
    try:
        with caplog.at_level(logging.DEBUG, logger="runner.link"):
            # Bounded by ANSWER_S, not by the node: waiting out its 60 s sleep fails at 45 s.
            assert _returns(lambda: link_rate.compress_stream(r, upload=False, aes=True), 45) is True
    finally:
        r.close()
    assert "link probe (down) failed (no answer from the node)" in caplog.text


def test_a_node_that_sends_without_end_is_cut_at_the_probes_span(node, monkeypatch):
    node.rewrite = lambda cmd: "exec cat /dev/zero" if "/dev/zero" in cmd else cmd
    r = _connected(node, monkeypatch)
    try:
        # The node never stops: the probe returning at all is its own bound (PROBE_BYTES or
        # WARM_S + LINK_S, whatever the node sends).
        rate = _returns(lambda: link_rate.measure_link(r, upload=False, aes=True), 120)
    finally:
        r.close()
    assert 0 < rate < math.inf, rate


def test_the_nodes_own_deflate_is_timed_on_its_engine_binary(node, monkeypatch):
    r = _connected(node, monkeypatch)
    try:
        rate = link_rate.node_zlib_rate(r)
    finally:
        r.close()
    # This machine's gzip -6 behind a real shell: a measured deflate rate, not an empty sample's
    # (as zlib_rate's bound: a busy machine only makes it smaller).
    assert rate is not None and 0 < rate < 2e9, rate
    assert any("gzip -6" in c and str(link_rate.NODE_SAMPLE_BYTES) in c for c in node.commands), node.commands


def test_a_download_follows_the_nodes_deflate_and_an_upload_this_hosts(node, monkeypatch, caplog):
    """A node whose deflate is slower than its link sends uncompressed, though this host's zlib is
    faster than that link (the rule before compressed it); the upload over the same link is
    compressed. Its gzip is slowed by 2 s here, so its rate (logged) is under the link's 10 MB/s."""
    node.rewrite = lambda cmd: cmd.replace("gzip -6", "gzip -6 | (sleep 2; cat)")
    monkeypatch.setattr(link_rate, "measure_link", lambda remote, upload, aes: 10e6)
    monkeypatch.setattr(link_rate, "_zlib_rate", 20e6)
    r = _connected(node, monkeypatch)
    try:
        with caplog.at_level(logging.INFO, logger="runner.link"):
            assert link_rate.compress_stream(r, upload=False, aes=True) is False
            assert link_rate.compress_stream(r, upload=True, aes=True) is True
    finally:
        r.close()
    down = next(m for m in caplog.messages if "link down" in m)
    got = float(down.split("zlib on the node ")[1].split(" MB/s")[0])
    # What the rule compared: the node's measured deflate under the link's (mocked) 10 MB/s.
    assert 0 < got < 10.0 and down.endswith(": uncompressed"), down
    assert any(m.endswith("link up 10.0 MB/s, zlib here 20.0 MB/s: compressed (ssh -C)") for m in caplog.messages)


@pytest.mark.parametrize("answer, why", [
    ("exit 3", "no answer: no gzip or engine binary there, or not in time"),
    ("echo a; echo hello", "answered 'hello'"),
    ("echo a; echo 4096; echo b; echo 10; echo c", "4096 bytes read, 10 deflated"),       # a sample too small
    ("echo a; echo 9000000; echo b; echo 99000000; echo c", "9000000 bytes read, 99000000 deflated"),
])
def test_a_node_that_cannot_say_its_deflate_is_taken_as_fast_as_this_host(node, monkeypatch, caplog, answer, why):
    node.rewrite = lambda cmd: answer if "gzip -6" in cmd else cmd
    monkeypatch.setattr(link_rate, "measure_link", lambda remote, upload, aes: 10e6)
    monkeypatch.setattr(link_rate, "_zlib_rate", 20e6)
    r = _connected(node, monkeypatch)
    try:
        with caplog.at_level(logging.DEBUG, logger="runner.link"):
            assert link_rate.compress_stream(r, upload=False, aes=True) is True  # 10 MB/s under this host's 20
    finally:
        r.close()
    assert f"its zlib rate is not known ({why}); this host's is used" in caplog.text, caplog.text
    assert "link down 10.0 MB/s, zlib here 20.0 MB/s: compressed (ssh -C)" in caplog.text


def test_a_node_that_trickles_its_deflate_answer_is_cut_at_its_bound(node, monkeypatch):
    node.rewrite = lambda cmd: "echo a; sleep 60" if "gzip -6" in cmd else cmd
    monkeypatch.setattr(link_rate, "NODE_ZLIB_S", 2.0)
    r = _connected(node, monkeypatch)
    try:
        # Cut at NODE_ZLIB_S: waiting out the node's 60 s sleep fails at 45 s.
        assert _returns(lambda: link_rate.node_zlib_rate(r), 45) is None
    finally:
        r.close()


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_bound_closing_a_channel_whose_connection_went_is_no_traceback(node, monkeypatch):
    """The bound on the deflate answer closes its channel from a timer's thread: where the
    connection went meanwhile (paramiko's close then raises EOFError, seen in CI) that is no
    thread's traceback on the user's terminal, and the rate is simply not known."""
    import paramiko

    # A byte every 0.3 s and no newline: the reads never time out, so the bound is what ends it.
    node.rewrite = lambda cmd: "echo a; while :; do printf 1; sleep 0.3; done" if "gzip -6" in cmd else cmd
    monkeypatch.setattr(link_rate, "NODE_ZLIB_S", 1.0)
    r = _connected(node, monkeypatch)
    close = paramiko.Channel.close

    def close_on_a_gone_connection(chan):
        close(chan)
        raise EOFError()

    try:
        with monkeypatch.context() as m:
            m.setattr(paramiko.Channel, "close", close_on_a_gone_connection)
            assert link_rate.node_zlib_rate(r) is None
            time.sleep(0.2)  # the timer's thread has ended
    finally:
        r.close()
