"""The host's side of the relay protocol (runner/delivery/relay.py) against agents that do not keep to it: a
node runs its agent itself, so what it reports is read bounded, parsed strictly, and a node whose
report is too long or malformed fails alone (push relays to the nodes it cut off again, or streams
to them directly). The agents here are real processes writing real pipes, as ssh's stdout is."""

from __future__ import annotations

import subprocess
import threading
import tracemalloc

import pytest

from runner.agents.relay_agent import Tail
from runner.delivery import relay
from runner.delivery.relay import RelayHop, parse_report
from tests.support.runner_helpers import wait_for


def hop(name: str, script: str) -> RelayHop:
    """A node whose 'agent' is this shell script, with its report reader running as relay's own."""
    h = RelayHop(name)
    h.proc = subprocess.Popen(["sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    h.err = Tail(h.proc.stderr)
    threading.Thread(target=relay._read_lines, args=(h,), daemon=True).start()
    return h


def end(h: RelayHop) -> None:
    h.proc.kill()
    relay._stop(h)


@pytest.mark.parametrize("line, want", [
    (b"PORT 40000\n", ("PORT", 40000)),
    (b"BYTES 1048576\n", ("BYTES", 1048576)),
    (b"LOADING\n", ("LOADING",)),
    (b"DONE 0 Loaded image: app:1\n", ("DONE", 0, "Loaded image: app:1")),
    # no escape reaches a terminal: controls shown as everything else from a node (node_output.visible)
    (b"DONE 1 \x1b]52;c;cm0gLXJmIH4=\x07pwned\r\n", ("DONE", 1, "^[]52;c;cm0gLXJmIH4=^Gpwned^M")),
    (b"ERROR \xc2\x9b2J\ttab\n", ("ERROR", "M-^[2J\ttab")),
    (b"ERROR refused: " + b"x" * 5000 + b"\n", ("ERROR", "refused: " + "x" * (relay.TEXT_MAX - 9))),
    (b"hello from .bashrc\n", None),  # not a report: ignored
])
def test_reports_are_parsed_and_bounded(line, want):
    assert parse_report(line) == want


@pytest.mark.parametrize("line", [b"PORT 99999999\n", b"PORT 0\n", b"PORT -1\n", b"PORT abc\n", b"PORT\n",
                                  b"PORT 4_000\n", b"PORT \xd9\xa4\xd9\xa0\n", b"BYTES 1e9999\n", b"BYTES -5\n",
                                  b"BYTES " + b"9" * 40 + b"\n", b"DONE x ok\n", b"DONE 99999 ok\n"])
def test_malformed_reports_are_refused(line):
    with pytest.raises(ValueError):
        parse_report(line)


def test_a_300_mib_line_costs_the_host_one_bounded_read():
    """An agent writes one 300 MiB line (it took the host from 44 to 901 MiB): the host reads at
    most LINE_MAX + 1 bytes of it, then fails that node in one line and stops its agent."""
    tracemalloc.start()
    try:
        h = hop("node-1", "head -c 300M /dev/zero | tr '\\0' x")
        bad = h.lines.get(timeout=120)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    end(h)
    assert (bad if isinstance(bad, tuple) else f"a line of {len(bad)} bytes") == ("BAD", "a line over 64 KiB")
    assert peak < 4 * relay.LINE_MAX, peak
    assert h.proc.poll() is not None


def test_a_malformed_report_fails_only_that_node():
    """node-1 reports nonsense mid-stream; node-0 still loads, node-1 fails alone with the reason
    and is stopped, node-2 (after it, nothing received yet) is cut off, which push.verify relays
    to again; nothing raises out of the chain."""
    h0 = hop("node-0", "echo BYTES 10; echo LOADING; echo 'DONE 0 Loaded image: app:1'")
    h1 = hop("node-1", "echo BYTES 10; echo 'BYTES 1e9999'; exec sleep 600")
    h2 = hop("node-2", "echo 'hello from .bashrc'; exec sleep 600")
    wait_for(lambda: h0.lines.qsize() == 4 and h1.lines.qsize() == 2, 60, interval=0.05)
    try:
        relay._watch([h0, h1, h2], {}, None, stall_s=600)
        assert h1.proc.poll() is not None and h2.proc.poll() is not None  # _watch stopped them
    finally:
        for h in (h0, h1, h2):
            end(h)
    assert (h0.loaded, h0.error) == (True, None)
    assert (h1.loaded, h1.error, h1.cut_off) == (False, "relay agent sent a malformed report (BYTES '1e9999'); "
                                                 "stopped it", False)
    assert not h2.loaded and h2.cut_off and h2.error.startswith("cut off: node-1 failed before passing the archive on"), h2


def test_a_bad_port_leaves_only_that_node_out():
    """Listeners report their ports: one says PORT 99999999, one PORT abc; both are left out of
    the chain (the node before them forwards past them) and the good one is used."""
    good = hop("node-1", "echo PORT 40000; exec sleep 600")
    huge = hop("node-2", "echo PORT 99999999; exec sleep 600")
    text = hop("node-3", "echo PORT abc; exec sleep 600")
    try:
        ports = relay._await_ports([good, huge, text])
    finally:
        for h in (good, huge, text):
            end(h)
    assert ports == {"node-1": 40000}
    assert huge.error == "relay agent sent a malformed report (PORT '99999999'); left it out"
    assert text.error == "relay agent sent a malformed report (PORT 'abc'); left it out"
    assert good.error is None


def test_an_agents_stderr_is_kept_to_a_bounded_tail():
    """ssh's stderr (the node's shell, the agent's traceback) is read by a thread that keeps its
    last bytes, however much the node writes."""
    h = hop("node-1", "head -c 50M /dev/zero | tr '\\0' e >&2; echo 'the reason' >&2")
    assert h.lines.get(timeout=120) is None  # it printed no report and exited
    assert relay._tail(h) == ": " + ("e" * 200 + "the reason")[-200:]
    assert len(h.err.data) <= 4096
    end(h)
