"""Relay push, the host's half: one `docker save` stream from this host feeds a chain of nodes of
one architecture, host -> n0 -> n1 -> ..., each node loading it while passing it on (the node's
half, its checks and its protocol: runner/agents/relay_agent.py). The host's uplink carries each layer
once whatever the node count; node <-> node links carry the rest, one copy per link.

Why a chain, not a tree: every node sends at most one copy and receives one, so no link carries
more than one copy and the chain moves at its slowest link's rate (a tree's inner nodes send two
or more). Its depth costs only buffering, since every node forwards as bytes arrive.

What can go wrong stays per node: a node whose agent does not start is left out of the chain
(the one before it forwards past it); a node that breaks mid-stream takes the nodes after it out
of this transfer; either way `RelayHop.error` says why (`cut_off` marks the nodes that failed only
because one before them did). push.verify relays to the cut-off ones once more, gives the rest a
direct push, and checks every node's image id.

Node <-> node bytes travel plain TCP on an ephemeral port of the receiving node (the ports torch's
own rendezvous and NCCL use are just as open between training nodes). They are authenticated by a
per-transfer token sent over SSH, and checked against the host's digests by the receiving agent,
which writes the archive its engine loads itself (docs/security.md, "Relay push").

What an agent says is not trusted either (the node runs it): its report lines are read at most
LINE_MAX bytes at a time, parsed strictly (parse_report), and a node whose line is too long or
malformed fails alone, like any other failing node; its ssh's stderr is kept to a bounded tail.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import re
import secrets
import shlex
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from runner.agents import relay_agent
from runner.agents.relay_agent import BLOCK, END, LINE_MAX, NAME, SIZE_MAX, SMALL_MAX, Tail, member_header
from runner.core.node_output import visible
from runner.delivery.images import Exported
from runner.transport.link_rate import compress_stream
from runner.transport.ssh import Remote
from runner.transport.stream import CHUNK

log = logging.getLogger("runner.relay")

AGENT = Path(relay_agent.__file__)  # sent to each node as source, run by its python3
START_S = 30.0        # an agent that has not bound its port by then is left out
STALL_S = 300.0       # a node whose received count has not moved for this long is stopped
LOAD_WAIT_S = 1800.0  # once a node has the whole archive, how long its `docker load` may take
NO_PYTHON = 97
REPORTS_QUEUED = 256  # an agent's parsed reports waiting for _watch (its reader waits when full)
TEXT_MAX = 300        # characters kept of a message in an agent's report


@dataclass
class RelayHop:
    node: str
    source: str = "host"          # what it received from: "host" or the node before it
    received: int = 0             # archive bytes it took in
    loaded: bool = False          # its agent checked the archive and its `docker load` exited 0
    error: str | None = None      # why not (push relays to it again or streams to it directly)
    cut_off: bool = False         # through no fault of its own: a node before it failed
    lines: queue.Queue = field(default_factory=lambda: queue.Queue(REPORTS_QUEUED), repr=False)  # parse_report's
    proc: subprocess.Popen | None = field(default=None, repr=False)
    err: Tail | None = field(default=None, repr=False)  # the last of its ssh's stderr
    stopped: bool = field(default=False, repr=False)    # _stop ran: its reader queues nothing more
    last_move: float = field(default_factory=time.monotonic, repr=False)
    loading_since: float | None = field(default=None, repr=False)  # all received; its own load runs


@dataclass
class RelayResult:
    hops: list[RelayHop]
    host_bytes: int = 0           # archive bytes this host sent (to the chain's first node only)
    seconds: float = 0.0


def agent_command() -> str:
    """The remote command: the agent's source as python3's -c argument, in `sh -c` whatever the
    user's login shell; a node without python3 says so (exit 97) and is left out of the chain."""
    inner = (f"command -v python3 >/dev/null 2>&1 || {{ echo 'ERROR no python3 on this node'; exit {NO_PYTHON}; }}; "
             f"exec python3 -u -c {shlex.quote(AGENT.read_text())}")
    return shlex.join(["sh", "-c", inner])


def parts(exp: Exported, layers: list[int]) -> list[tuple[str, Path, int]]:
    """(name in the archive, file, size) of each part a chain's stream carries, in the order the
    agents expect them: manifest.json, the config, the given layers."""
    config = exp.dir / exp.config
    return [("manifest.json", exp.tag_manifest, exp.tag_manifest.stat().st_size),
            (exp.config, config, config.stat().st_size),
            *((exp.layers[i], exp.dir / exp.layers[i], exp.sizes[i]) for i in layers)]


def expectation(exp: Exported, layers: list[int], load: list[int]) -> dict:
    """What an agent checks the stream against: the digests and sizes of the two small files that
    decide what gets loaded under which name (the manifest names the layer paths, the config
    their digests), the layers the stream carries (index, size) in order, and those it loads."""
    manifest = exp.tag_manifest.read_bytes()
    return {"manifest": {"sha256": hashlib.sha256(manifest).hexdigest(), "size": len(manifest)},
            "config": {"sha256": exp.image_id.split(":", 1)[1], "size": (exp.dir / exp.config).stat().st_size},
            "layers": [[i, exp.sizes[i]] for i in layers], "load": list(load)}


def head_line(exp: Exported, layers: list[int], load: list[int], token: str | None) -> dict:
    """An agent's first line: the root's (token None: the stream comes on its stdin) or a
    listener's, which accepts the upstream that sends this token."""
    return {"mode": "root" if token is None else "listen", "expect": expectation(exp, layers, load),
            **({"token": token} if token is not None else {})}


def route_line(forward: tuple[str, int, str] | None, layers: list[int]) -> dict:
    """An agent's second line: the next node's (address, port, token), or None at the chain's
    end, and the layers it passes on."""
    nxt = None if forward is None else dict(zip(("host", "port", "token"), forward, strict=True))
    return {"forward": nxt, "layers": layers}


def chain_plan(missing: list[list[int]], started: list[int]) -> tuple[list[int], dict[int, tuple[int | None, list[int]]]]:
    """(the layers this host sends: those any started node lacks, {started node: (the next
    started node or None, the layers it passes on: those the started nodes after it lack)}). So
    each node receives exactly what it loads or passes on, which is what its agent expects
    (TarCheck: the announced layers less those it neither loads nor forwards)."""
    routes = {}
    for i, k in enumerate(started):
        later = started[i + 1:]
        routes[k] = (later[0] if later else None, sorted(set().union(*(missing[j] for j in later))))
    return sorted(set().union(*(missing[k] for k in started))), routes


def not_relayable(exp: Exported) -> str | None:
    """Why the agents could not check this export part by part (push then streams it to each
    node directly), or None."""
    if max(exp.sizes, default=0) > SIZE_MAX:
        return f"a layer over {SIZE_MAX} bytes (the relay's tar headers hold 11 octal digits)"
    if max(p.stat().st_size for p in (exp.tag_manifest, exp.dir / exp.config)) > SMALL_MAX:
        return f"its manifest or config is over {SMALL_MAX} bytes"
    for name, diff in zip(exp.layers, exp.diff_ids, strict=True):
        blob = re.fullmatch(r"blobs/sha256/([0-9a-f]{64})", name)
        if blob and f"sha256:{blob.group(1)}" != diff:  # the containerd image store saves layers compressed
            return "its layers are saved compressed (each is checked against its uncompressed diff_id)"
        if len(name) > 99 or not NAME.fullmatch(name):
            return f"layer path {name[:120]!r} does not fit the relay's tar headers"
    return None


def relay_chain(chain: list[Remote], exp: Exported, missing: list[list[int]], progress=None,
                stall_s: float = STALL_S) -> RelayResult:
    """Stream host -> chain[0] -> chain[1] ... the layers (indices into exp.layers) any node lacks;
    node k loads missing[k] and passes on what the nodes after it lack. Returns per node whether
    it loaded; never raises for a node's failure."""
    t0 = time.monotonic()
    hops = [RelayHop(r.node.name) for r in chain]
    layers = sorted(set().union(*missing))
    tasks: dict[str, int] = {}
    sender = None
    try:
        # Every agent at once: the listeners bind and report their ports; then each started one
        # learns where the next started one listens and what the nodes after it lack (a node
        # whose agent did not start is passed over).
        tokens = [secrets.token_hex(32) for _ in chain]
        for k, (r, hop) in enumerate(zip(chain, hops, strict=True)):
            _spawn(r, hop, head_line(exp, layers, missing[k], tokens[k] if k else None), bulk=k == 0,
                   size=sum(exp.sizes[i] for i in layers))
        ports = _await_ports(hops[1:])
        started = [k for k, h in enumerate(hops) if h.error is None]
        sent, routes = chain_plan(missing, started)
        for i, k in enumerate(started):
            later, after = routes[k]
            nxt = None if later is None else (chain[later].node.rank_addr, ports[hops[later].node], tokens[later])
            _write(hops[k], route_line(nxt, after))
            if i:
                hops[k].source = hops[started[i - 1]].node
            if progress is not None:  # a bar per node: the bytes reaching it (for itself and those after it)
                comes = set(missing[k]).union(after)
                tasks[hops[k].node] = progress.add_task(
                    f"{hops[k].node}: {len(missing[k])}/{len(exp.layers)} layers, relay from {hops[k].source}",
                    total=sum(exp.sizes[i] for i in comes) or 1)
        host_bytes = [0]
        for k in started:  # the stall clock starts with the stream, not with the agents' start-up
            hops[k].last_move = time.monotonic()
        if hops[0].error is None:
            sender = threading.Thread(target=_send, args=(exp, sent, hops[0], host_bytes), daemon=True)
            sender.start()
        _watch([hops[k] for k in started], tasks, progress, stall_s)
        return RelayResult(hops, host_bytes[0], time.monotonic() - t0)
    finally:
        for h in hops:
            _stop(h)
        if sender is not None:
            sender.join(timeout=10)  # the root's stdin is closed: its last write fails at once
        for t in tasks.values():
            progress.remove_task(t)


def _spawn(r: Remote, hop: RelayHop, header: dict, bulk: bool, size: int | None = None) -> None:
    """Start the node's agent over OpenSSH and hand it the first line. Only the first node's
    stream is bulk over SSH (AES; compressed where the link is slower than this host's zlib:
    runner/transport/link_rate.py)."""
    compress = bulk and compress_stream(r, upload=True, aes=True, size=size)
    argv = [*r.openssh_argv(compress=compress, aes=bulk), agent_command()]
    hop.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    hop.err = Tail(hop.proc.stderr)
    threading.Thread(target=_read_lines, args=(hop,), daemon=True, name=f"relay-{hop.node}").start()
    _write(hop, header)


def _write(hop: RelayHop, line: dict) -> None:
    assert hop.proc is not None and hop.proc.stdin is not None  # started by _spawn, its stdin a PIPE
    try:
        hop.proc.stdin.write(json.dumps(line).encode() + b"\n")
        hop.proc.stdin.flush()
    except OSError:
        pass  # it died already: its exit says why


def _await_ports(hops: list[RelayHop]) -> dict[str, int]:
    """{node: port} of every listener that reported one within START_S; the rest get an error."""
    ports: dict[str, int] = {}
    deadline = time.monotonic() + START_S
    waiting = list(hops)
    while waiting and time.monotonic() < deadline:
        time.sleep(0.02)
        for h in waiting[:]:
            try:
                report = h.lines.get_nowait()
            except queue.Empty:
                continue
            if report is not None and report[0] == "PORT":
                ports[h.node] = report[1]
            elif report is None:
                h.error = f"relay agent did not start{_tail(h)}"
            elif report[0] == "ERROR":
                h.error = f"relay agent: {report[1]}"
            elif report[0] == "BAD":
                h.error = f"relay agent sent a malformed report ({report[1]}); left it out"
            else:
                continue
            waiting.remove(h)
    for h in waiting:
        h.error = f"relay agent did not report a port within {START_S:.0f}s"
    for h in hops:
        if h.error is not None:
            _stop(h)
    return ports


def _tail(h: RelayHop) -> str:
    """': ' + the last of its ssh's stderr (why a connection or the node's shell failed), or ''."""
    if h.err is None:
        return ""
    text = visible(" ".join(h.err.text(wait=2).split())[-200:])
    return f": {text}" if text else ""


_INT = re.compile(r"-?[0-9]{1,19}")


def parse_report(raw: bytes) -> tuple | None:
    """One line of an agent's report as (word, value...), each value checked (a port 1..65535, a
    count, an exit status, a message of at most TEXT_MAX characters with its controls visible);
    None for a line that is no report (a node's login script may print some: ignored). ValueError
    for a report with a bad value."""
    word, _, rest = raw.decode("utf-8", "replace").rstrip("\n").partition(" ")

    def number(s: str, lo: int, hi: int) -> int:
        if not _INT.fullmatch(s) or not lo <= int(s) <= hi:
            raise ValueError(f"{word} {visible(s[:40])!r}")
        return int(s)

    if word == "PORT":
        return word, number(rest, 1, 65535)
    if word == "BYTES":
        return word, number(rest, 0, 1 << 62)
    if word == "LOADING":
        return (word,)
    if word == "DONE":
        rc, _, msg = rest.partition(" ")
        return word, number(rc, -255, 255), visible(msg[:TEXT_MAX])
    if word in ("PEER", "FORWARD_ERROR", "ERROR"):
        return word, visible(rest[:TEXT_MAX])
    return None


def _read_lines(hop: RelayHop) -> None:
    """The agent's stdout, a line of at most LINE_MAX bytes at a time, as parse_report's tuples
    on hop.lines, then None at its end; a line too long or malformed is queued as ("BAD", why)
    and ends the reading (the node is failed and stopped)."""
    assert hop.proc is not None and hop.proc.stdout is not None  # started by _spawn, its stdout a PIPE
    while True:
        raw = hop.proc.stdout.readline(LINE_MAX + 1)
        if not raw:
            report = None
        elif len(raw) > LINE_MAX:
            report = ("BAD", f"a line over {LINE_MAX // 1024} KiB")
        else:
            try:
                report = parse_report(raw)
            except ValueError as e:
                report = ("BAD", str(e))
            if report is None:
                continue
        while not hop.stopped:  # a full queue waits for _watch, unless the node is done with
            try:
                hop.lines.put(report, timeout=0.5)
                break
            except queue.Full:
                continue
        if report is None or report[0] == "BAD" or hop.stopped:
            return


def chain_stream(exp: Exported, layers: list[int]):
    """The chain's archive as the root agent reads it: each part (parts()) under the header every
    agent writes for it (member_header), then the end blocks; yields it in chunks of at most
    CHUNK bytes (a memoryview into one buffer: use each before asking for the next)."""
    buf = memoryview(bytearray(CHUNK))
    for name, path, size in parts(exp, layers):
        yield member_header(name, size)
        with open(path, "rb") as f:
            left = size
            while left:
                n = f.readinto(buf[:min(CHUNK, left)])
                if not n:
                    raise OSError(f"{path} is shorter than {size} bytes")
                yield buf[:n]
                left -= n
        yield bytes(-size % BLOCK)
    yield END


def _send(exp: Exported, layers: list[int], root: RelayHop, sent: list[int]) -> None:
    """chain_stream -> the root agent's stdin; counts what this host sends."""
    assert root.proc is not None and root.proc.stdin is not None  # started by _spawn, its stdin a PIPE
    out = root.proc.stdin
    try:
        for chunk in chain_stream(exp, layers):
            out.write(chunk)
            sent[0] += len(chunk)
    except (BrokenPipeError, ValueError):
        pass  # the root went away (or was stopped): its agent's last line, or its exit, says why
    except OSError as e:  # reading the export
        log.warning("relay %s: sending to %s: %s", exp.tag, root.node, e)
    finally:
        try:
            out.close()  # the end of the stream: the agent checks it is complete
        except (OSError, ValueError):
            pass


def _watch(hops: list[RelayHop], tasks: dict, progress, stall_s: float) -> None:
    """Follow every agent's report until each has said DONE or ERROR (or died); stop a node that
    moves nothing for stall_s before it has the whole archive, or that is still loading
    LOAD_WAIT_S after that.
    A node that fails takes the nodes after it that have received nothing yet out at once (they
    would wait for a connection that is not coming)."""
    pending = {h.node: h for h in hops}

    def cut_after(h: RelayHop, why: str, idle_only: bool) -> None:
        for later in hops[hops.index(h) + 1:]:
            if later.node in pending and (later.received == 0 or not idle_only):
                later.error, later.cut_off = f"cut off: {why}", True
                pending.pop(later.node)
                _stop(later)

    def fail(h: RelayHop, why: str) -> None:
        h.error = h.error or why
        h.cut_off = h.cut_off or any(x.error for x in hops[:hops.index(h)])  # its upstream broke first
        pending.pop(h.node, None)
        _stop(h)
        cut_after(h, f"{h.node} failed before passing the archive on ({h.error})", idle_only=True)

    while pending:
        now = time.monotonic()
        for name, h in list(pending.items()):
            while name in pending:
                try:
                    report = h.lines.get_nowait()
                except queue.Empty:
                    break
                if report is None:
                    fail(h, f"relay agent exited ({_rc(h)}) before it finished{_tail(h)}")
                    break
                word, rest = report[0], report[1:]
                if word == "BYTES":
                    h.received, h.last_move = rest[0], now
                    if name in tasks:
                        progress.update(tasks[name], completed=h.received)
                elif word == "LOADING":
                    h.loading_since = now
                elif word == "FORWARD_ERROR":  # the nodes after it get nothing more: stop them now
                    log.warning("node %s: relay to the next node failed: %s", name, rest[0])
                    cut_after(h, f"{name} could not pass the archive on ({rest[0]})", idle_only=False)
                elif word == "DONE":
                    rc, msg = rest
                    h.loaded = rc == 0
                    pending.pop(name)
                    if not h.loaded:
                        h.error = f"docker load failed (exit {rc}): {msg or 'no output'}"
                elif word == "ERROR":
                    fail(h, rest[0])
                elif word == "BAD":  # its agent does not speak the protocol: this node alone fails
                    fail(h, f"relay agent sent a malformed report ({rest[0]}); stopped it")
            if name in pending:
                # Until a node has the whole archive, a stall anywhere before or after it (a
                # full pipe backs up the chain) shows as nothing received; after, only its load runs.
                if h.loading_since is None and now - h.last_move > stall_s:
                    fail(h, f"relay stalled (nothing received for {stall_s:.0f}s); stopped it")
                elif h.loading_since is not None and now - h.loading_since > LOAD_WAIT_S:
                    fail(h, f"still loading {LOAD_WAIT_S:.0f}s after the last byte; gave up")
        time.sleep(0.1)


def _rc(h: RelayHop) -> str:
    try:
        rc = h.proc.wait(timeout=2) if h.proc is not None else None
    except subprocess.TimeoutExpired:
        rc = None
    return "no python3" if rc == NO_PYTHON else f"exit {rc}"


def _stop(h: RelayHop) -> None:
    """Reap the node's agent: a failed one is killed first (the host's sender may be blocked
    writing into its stdin, and closing that would wait for the write); a finished one has its
    stdin closed (in listen mode: the host is done with it) and a moment to exit."""
    p = h.proc
    h.stopped = True
    if p is None:
        return
    if h.error is not None and p.poll() is None:
        p.kill()
    assert p.stdin is not None  # a PIPE (_spawn)
    try:
        p.stdin.close()
    except OSError:
        pass
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        p.kill()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
