"""Whether a bulk stream over SSH is compressed: a node's `compress:` (`auto`, the default; `true`;
`false`), decided from two measured rates.

OpenSSH's compression (`-C`) is zlib at level 6 on one core of the sending end. On binary data
(an image's libraries, a checkpoint) it runs at 18-25 MB/s on a 2020s x86 core. A link faster
than that is slowed down by it: a push over a gigabit LAN would move at a fifth of the link's
rate. A slower link (Wi-Fi to a Pi, a home uplink to EC2) gains up to the data's ratio (2.6-3x for
an image).

`auto` measures, once per node, direction and command:
- **the link**: incompressible bytes (encrypted zeros, uncompressed) through the same ssh command
  the stream will use, over LINK_S (or SPAN_BYTES) once WARM_S (or WARM_BYTES) have passed since
  the first byte; upload and download are measured apart (a home uplink is often a tenth of its
  downlink);
- **this host's compressor**: zlib level 6 on SAMPLE_BYTES of a native library (paramiko's
  cryptography binding: machine code, like most of an image), once per process.

The stream is then compressed only when the link is slower than the compressor. Then, at any ratio
above 1, the compressed stream is the faster one: it moves min(compressor, link x ratio) bytes of
data per second, against the link's own rate. A download is compressed by the node, so for it the
compressor is the node's: its `gzip -6` (the same deflate at the same level) timed on
NODE_SAMPLE_BYTES of its own engine's binary (machine code again), in the same session as a plain
read of the same bytes, whose time is taken off; a Pi's core deflates at about half this host's
rate. A node without gzip or such a binary, or whose answer is not that, is taken to be as fast as
this host (one debug line). Loopback is never compressed: both ends share the cores.
A probe that fails (a node that answers no shell, a timeout) leaves the stream compressed, as it
was before this rule, and says so at debug level.

A probe moves at most PROBE_BYTES (32 MiB) each way, so that a fast link (a 10 Gbit/s cloud
network, its bytes billed) is not filled for a second; a stream known to carry less than WORTH
(64 MiB: a re-push after a code change) is not probed for. Nothing the node sends is kept: the
download probe counts its bytes and stops reading at PROBE_BYTES.
"""

from __future__ import annotations

import logging
import os
import select
import shlex
import subprocess
import threading
import time
import zlib

from runner.transport.sftp import close_quietly
from runner.transport.ssh import CONNECT_TIMEOUT, Remote, is_loopback

log = logging.getLogger("runner.link")

WARM_S = 0.25          # after the first byte moves: the local buffers fill (or drain) meanwhile
WARM_BYTES = 8 << 20   # ... or this much has moved, whichever comes first
LINK_S = 1.0           # the measured span ...
SPAN_BYTES = 24 << 20  # ... or this much more, whichever comes first: a probe moves at most
PROBE_BYTES = WARM_BYTES + SPAN_BYTES  # 32 MiB each way, also on a 10 Gbit/s link
WORTH = 64 << 20       # a stream known to be smaller is not probed for (it is compressed, as before)
SAMPLE_BYTES = 8 << 20
PIECE = 256 << 10
FALLBACK_ZLIB = 20e6   # bytes/s, should the sample library be missing
ANSWER_S = CONNECT_TIMEOUT + 5  # the probe's session must be up (its first byte in) by then
NODE_SAMPLE_BYTES = 8 << 20
NODE_ZLIB_S = 60.0     # the node's whole answer: 8 MiB deflated at 0.2 MB/s would be 40 s
# The node's deflate: the first readable engine binary; a plain read of the sample, then the same
# bytes through gzip -6, each pass's output counted by wc; "a", "b", "c" mark the passes' ends as
# they happen (echo is a builtin: written at once), timed on arrival here.
NODE_ZLIB_SH = r"""
for f in "$(command -v dockerd)" "$(command -v containerd)" "$(command -v docker)"; do
  [ -n "$f" ] && [ -r "$f" ] && break
done
[ -n "$f" ] && [ -r "$f" ] && command -v gzip >/dev/null 2>&1 || exit 3
echo a; head -c "$1" "$f" | wc -c; echo b; head -c "$1" "$f" | gzip -6 | wc -c; echo c
"""


def decide(link: float, zlib_rate: float) -> bool:
    """Compress iff the link (bytes/s) is slower than the compressor (bytes/s of input)."""
    return link < zlib_rate


_zlib_rate: float | None = None
_zlib_lock = threading.Lock()


def zlib_rate() -> float:
    """This host's zlib level 6 on SAMPLE_BYTES of machine code, in input bytes/s (once per process)."""
    global _zlib_rate
    with _zlib_lock:
        if _zlib_rate is None:
            _zlib_rate = _measure_zlib()
        return _zlib_rate


def _measure_zlib() -> float:
    try:
        from cryptography.hazmat.bindings import _rust

        with open(_rust.__file__, "rb") as fh:
            data = fh.read(SAMPLE_BYTES)
    except (ImportError, OSError):
        return FALLBACK_ZLIB
    if len(data) < (1 << 20):
        return FALLBACK_ZLIB
    t0 = time.perf_counter()
    zlib.compress(data, 6)
    return len(data) / max(time.perf_counter() - t0, 1e-6)


def compress_stream(remote: Remote, upload: bool, aes: bool, size: int | None = None) -> bool:
    """Whether the bulk stream to (upload) or from this node goes over `ssh -C`: the node's
    `compress:` when set, else the measured rule above (cached on the Remote). size: the bytes the
    stream is expected to carry, when known; under WORTH it is not worth a probe."""
    n = remote.node
    setting = getattr(n, "compress", None)
    if setting is not None:
        return bool(setting)
    if is_loopback(n.host):
        return False
    cache = remote.__dict__.setdefault("_compress_by", {})
    key = (upload, aes)
    if key in cache:
        return cache[key]
    if size is not None and size < WORTH:
        return True
    way = "up" if upload else "down"
    try:
        link = measure_link(remote, upload, aes)
    except (OSError, TimeoutError, subprocess.SubprocessError) as exc:
        log.debug("node %s: link probe (%s) failed (%s): stream compressed", n.name, way, exc)
        cache[key] = True
        return True
    z, where = zlib_rate(), "here"
    if not upload:  # the node compresses what it sends
        nz = node_zlib_rate(remote)
        if nz is not None:
            z, where = nz, "on the node"
    remote.__dict__.setdefault("link_rates", {})[way] = link
    cache[key] = decide(link, z)
    log.info("node %s: link %s %.1f MB/s, zlib %s %.1f MB/s: %s", n.name, way, link / 1e6, where, z / 1e6,
             "compressed (ssh -C)" if cache[key] else "uncompressed")
    return cache[key]


def node_zlib_rate(remote: Remote) -> float | None:
    """The node's deflate level 6 (gzip -6) in input bytes/s (NODE_ZLIB_SH), or None when it cannot
    say (no gzip, no engine binary, an answer that is not the script's, NODE_ZLIB_S passed)."""
    name = remote.node.name
    try:
        marks = _node_zlib_marks(remote)
    except (OSError, TimeoutError, EOFError) as exc:
        log.debug("node %s: its zlib rate is not known (%s); this host's is used", name, exc)
        return None
    (ta, tb, tc), (plain, packed) = marks
    if plain < (1 << 20) or not 0 < packed <= plain + (plain >> 6) + 4096:
        log.debug("node %s: its zlib rate is not known (%d bytes read, %d deflated); this host's is used",
                  name, plain, packed)
        return None
    return plain / max((tc - tb) - (tb - ta), 1e-3)


def _node_zlib_marks(remote: Remote) -> tuple[tuple[float, float, float], tuple[int, int]]:
    """((arrival times of a, b, c), (bytes read, bytes deflated)) of NODE_ZLIB_SH on the node."""
    chan = remote.open_exec(shlex.join(["sh", "-c", NODE_ZLIB_SH, "zlib", str(NODE_SAMPLE_BYTES)]))
    # The whole answer's bound, however it trickles; from the timer's thread, so quietly: the
    # connection may have gone meanwhile (paramiko's close then raises EOFError).
    timer = threading.Timer(NODE_ZLIB_S, close_quietly, (chan,))
    timer.start()
    try:
        chan.settimeout(NODE_ZLIB_S)
        out = chan.makefile("rb")
        lines, times = [], []
        for want in ("a", None, "b", None, "c"):
            line = out.readline(64).decode(errors="replace").strip()
            if not line:
                raise OSError("no answer: no gzip or engine binary there, or not in time")
            if (want is not None and line != want) or (want is None and not (line.isdigit() and len(line) <= 15)):
                raise OSError(f"answered {line[:40]!r}")
            lines.append(line)
            times.append(time.monotonic())
        return (times[0], times[2], times[4]), (int(lines[1]), int(lines[3]))
    finally:
        timer.cancel()
        close_quietly(chan)


def measure_link(remote: Remote, upload: bool, aes: bool) -> float:
    """Bytes/s that move through `ssh` (uncompressed, this cipher choice) to (upload) or from the
    node: over LINK_S or SPAN_BYTES, once WARM_S or WARM_BYTES have passed since the first byte.
    At most PROBE_BYTES move. Raises TimeoutError, OSError."""
    cmd = "echo ready && exec cat >/dev/null" if upload else f"exec head -c {PROBE_BYTES} /dev/zero"
    argv = [*remote.openssh_argv(compress=False, aes=aes), cmd]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    stdin, stdout = proc.stdin, proc.stdout
    assert stdin is not None and stdout is not None  # both PIPE
    try:
        return _upload_rate(proc) if upload else _download_rate(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for f in (stdin, stdout):
            try:
                f.close()
            except OSError:
                pass


class _Span:
    """The measured span of a count that grows from the first byte: it opens at WARM_S or
    WARM_BYTES and closes LINK_S or SPAN_BYTES later (or when the count stops at `end`)."""

    def __init__(self, end: int):
        self.end = end
        self.start = time.monotonic()
        self.t0: float | None = None
        self.c0 = 0

    def done(self, count: int) -> bool:
        now = time.monotonic()
        if self.t0 is None and (count >= WARM_BYTES or now - self.start >= WARM_S):
            self.t0, self.c0 = now, count
        if self.t0 is not None and (count >= self.end or count - self.c0 >= SPAN_BYTES or now - self.t0 >= LINK_S):
            self.rate = (count - self.c0) / max(now - self.t0, 1e-6)
            return True
        return False


def _ready(fd: int, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([fd], [], [], left)[0]:
        raise TimeoutError("no answer from the node")


def _upload_rate(proc: subprocess.Popen[bytes]) -> float:
    stdin, stdout = proc.stdin, proc.stdout
    assert stdin is not None and stdout is not None  # both PIPE (measure_link)
    fd = stdout.fileno()
    _ready(fd, time.monotonic() + ANSWER_S)
    if os.read(fd, 64) != b"ready\n":
        raise OSError("the node's shell did not answer as expected")
    sent = [0]
    stop = threading.Event()

    def write() -> None:  # blocks once the pipe, ssh's channel window and the socket buffer are full
        piece = bytes(PIECE)
        try:
            while not stop.is_set() and sent[0] < PROBE_BYTES:
                stdin.write(piece)
                stdin.flush()
                sent[0] += PIECE
        except (OSError, ValueError):
            pass

    writer = threading.Thread(target=write, daemon=True, name="link-probe")
    writer.start()
    span = _Span(PROBE_BYTES)
    try:
        while not span.done(sent[0]):
            if not writer.is_alive() and sent[0] < PROBE_BYTES:
                raise OSError(f"ssh ended the probe (exit {proc.poll()})")
            time.sleep(0.005)
    finally:
        stop.set()
        proc.kill()
        writer.join(timeout=10)
    return span.rate


def _download_rate(proc: subprocess.Popen[bytes]) -> float:
    assert proc.stdout is not None  # PIPE (measure_link)
    fd = proc.stdout.fileno()
    _ready(fd, time.monotonic() + ANSWER_S)
    span = _Span(PROBE_BYTES)
    got = 0
    while not span.done(got):
        if not select.select([fd], [], [], 0.005)[0]:
            continue
        piece = os.read(fd, PIECE)
        if not piece:  # the node stopped before PROBE_BYTES: what it sent in the time it took
            if span.t0 is None or got == span.c0:
                raise OSError("the node stopped sending")
            span.end = got
            continue
        got += len(piece)
    return span.rate
