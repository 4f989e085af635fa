"""The node's half of the relay push (runner/delivery/relay.py): standard library only, run on a node as
`python3 -u -c <this file's source>` over SSH, as the SSH user.

One agent per node of a chain host -> n0 -> n1 -> ... Each reads the image archive (the parts of
a `docker save` holding the layers some node of the chain lacks) from its source, checks every
part, hands its own `docker load` an archive it writes itself from the checked parts, and passes
the same archive on to the next node as it goes, so the host's uplink carries one copy however
long the chain, and the chain moves at the pace of its slowest link.

Protocol. The host's JSON lines on stdin (over SSH: trusted; at most LINE_MAX bytes each). The first:
  mode     "root": the archive follows the second line on stdin (from the host);
           "listen": bind a TCP port, print `PORT <n>`, accept the upstream node: it must
           first send `token` and a newline (others are dropped and the wait goes on);
  expect   the parts of the chain's archive, in this order: "manifest" {sha256, size}
           (manifest.json, which names the pushed tag alone, the config and the layer paths),
           "config" {sha256 (the image id), size}, "layers" [[index, size], ...] (indices into the
           manifest's Layers and the config's diff_ids); and "load": the layer indices this node
           lacks, the only ones its `docker load` is given.
The second, once every agent of the chain has its port (so all start at once):
  forward  {"host", "port", "token"} of the next node, or null at the chain's end;
  layers   the layer indices some node after it lacks: the only ones passed on.
This node's stream carries exactly the announced layers it loads or passes on, in order.
stdout lines report to the host: PORT n, PEER addr, BYTES n (received so far, ~2 per s),
LOADING (the whole archive is in and passed on),
FORWARD_ERROR msg (the next node is lost; this node's own load goes on), and last DONE rc
msg or ERROR msg. In listen mode, EOF on stdin means the host is gone: the agent kills its
load and exits.

Bytes from another node are not trusted, and nothing of them reaches `docker load` but layer
content: `TarCheck` reads each tar header only in the one canonical ustar form every tar reader
reads alike (`parse_header`) and only as the next part the host announced (name and size), then
hashes the part as it passes: manifest.json and the config against the host's digests, each
layer against the config's diff_ids. What this node loads and what it passes on is an archive
it writes itself (`member_header`) from those parts, and the last piece of each part is held
back until its digest is checked, so no engine ever gets a whole part that is not the host's; at
the first mismatch the agent kills its `docker load` mid-part (the engine loads nothing) and
cuts the next node's stream short (its agent refuses it).
"""

# long: sent to a node as one `python3 -c` source, which has no package to import a second file from.

import fcntl
import hashlib
import hmac
import json
import os
import re
import selectors
import socket
import subprocess
import sys
import threading
import time
from typing import Any

CHUNK = 1 << 20
BLOCK = 512
END = bytes(2 * BLOCK)      # a tar archive's end: two zero blocks
LINE_MAX = 64 << 10         # a line from the host
SMALL_MAX = 16 << 20        # manifest.json and the config are held in memory while checked
SIZE_MAX = 8 ** 11 - 1      # what an 11-digit octal size field holds: larger layers are not relayed
ACCEPT_S = 120.0   # listen: how long to wait for the upstream node to connect
TOKEN_S = 5.0      # a connection that has not sent the token by then is not our upstream
PENDING_MAX = 64   # connections waiting for their token at once (the oldest is dropped)
STALL_S = 300.0    # nothing received for this long: the upstream is stuck
LOAD_WAIT_S = 1800.0
TAIL = 4096        # bytes kept of `docker load`'s output

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)*")
OCTAL = re.compile(rb"([0-7]+)[ \0]+")     # digits, then only NUL/space to the field's end
OWNER = re.compile(rb"[A-Za-z0-9._-]*\0+")  # uname/gname: possibly empty, NUL-terminated
HEX64 = re.compile(r"[0-9a-f]{64}")
NUMERIC = (("mode", 100, 108), ("uid", 108, 116), ("gid", 116, 124), ("size", 124, 136),
           ("mtime", 136, 148), ("chksum", 148, 156))


class Refused(Exception):
    """The archive is not the one the host described."""


class BadRequest(Exception):
    """A line from the host that does not say what the protocol says."""


def parse_header(block: bytes) -> tuple:
    """(name, size) of a tar header in the one form accepted: POSIX ustar (`ustar\\0` + `00`), a
    regular file (type '0'), ASCII only, every numeric field octal digits followed by NUL/space
    only, the exact unsigned checksum, a plain relative name of at most 99 bytes, and no link
    name, prefix or trailing bytes. Anything else (GNU or pax headers, base-256 or NUL-led
    numbers, links, a prefix) is refused: tar readers disagree on those, this one form they all
    read alike (tests/unit/test_relay_headers.py checks it against Python's, GNU's and Go's)."""
    if len(block) != BLOCK:
        raise Refused(f"header of {len(block)} bytes")
    if not block.isascii():
        raise Refused("header with a non-ASCII byte")
    if block[257:265] != b"ustar\x0000":
        raise Refused(f"not a POSIX ustar header (magic {block[257:265]!r})")
    if block[156:157] != b"0":
        raise Refused(f"entry is not a regular file (type {block[156:157]!r})")
    if any(block[157:257]) or any(block[345:BLOCK]):
        raise Refused("header with a link name, a prefix or trailing bytes")
    raw, nul, rest = block[:100].partition(b"\0")
    name = raw.decode()
    if not nul or any(rest) or not NAME.fullmatch(name):
        raise Refused(f"entry name {raw[:100]!r} is not a plain relative path")
    num = {}
    for field, a, b in NUMERIC:
        m = OCTAL.fullmatch(block[a:b])
        if m is None:
            raise Refused(f"{name}: {field} field {block[a:b]!r} is not octal")
        num[field] = int(m.group(1), 8)
    for a in (329, 337):  # devmajor, devminor: unset or zero
        if any(block[a:a + 8]) and (OCTAL.fullmatch(block[a:a + 8]) is None or int(block[a:a + 8].strip(b" \0"), 8)):
            raise Refused(f"{name}: device number {block[a:a + 8]!r} on a regular file")
    for a in (265, 297):  # uname, gname
        if OWNER.fullmatch(block[a:a + 32]) is None:
            raise Refused(f"{name}: owner name {block[a:a + 32]!r}")
    if num["chksum"] != sum(block[:148]) + 8 * 32 + sum(block[156:]):
        raise Refused(f"{name}: bad header checksum")
    if num["mode"] > 0o7777:
        raise Refused(f"{name}: mode {num['mode']:o}")
    return name, num["size"]


def member_header(name: str, size: int) -> bytes:
    """The header this relay writes for every part: ustar, a regular file, mode 0644, owner 0:0,
    mtime 0 (the host's sender and every agent write the same bytes for the same part)."""
    b = bytearray(BLOCK)
    raw = name.encode("ascii")
    b[:len(raw)] = raw
    b[100:108] = b"0000644\0"
    b[108:116] = b[116:124] = b[329:337] = b[337:345] = b"0000000\0"
    b[124:136] = b"%011o\0" % size
    b[136:148] = b"00000000000\0"
    b[148:156] = b" " * 8
    b[156:157] = b"0"
    b[257:265] = b"ustar\x0000"
    b[148:156] = b"%06o\0 " % sum(b)
    return bytes(b)


class TarCheck:
    """Streaming check of the archive against `expect` (see the module doc) that also writes what
    passes: `feed` returns (the bytes for this node's `docker load`, the bytes for the next
    node), `finish` the archive's end for both. Each gets manifest.json, the config and only the
    layers named in expect["load"] / expect["forward"] (None: every layer), so a node loads just
    what it lacks and passes on just what the nodes after it lack. Both are archives written
    here: this relay's own headers, then content whose digest is checked before its last piece
    leaves (layers stream through in the chunks they arrive in; only the small manifest and
    config are held whole)."""

    def __init__(self, expect: dict):
        self.digests = {"manifest": expect["manifest"]["sha256"], "config": expect["config"]["sha256"]}
        self.load = None if expect.get("load") is None else set(expect["load"])
        self.forward = None if expect.get("forward") is None else set(expect["forward"])
        # What arrives: the announced layers, in order, less those this node neither loads nor
        # passes on (its upstream passes on just what it and the nodes after it lack).
        arrive = None if self.load is None or self.forward is None else self.load | self.forward
        self.plan: list[tuple[Any, ...]] = [
            ("manifest", expect["manifest"]["size"]), ("config", expect["config"]["size"]),
            *(("layer", s, i) for i, s in expect["layers"] if arrive is None or i in arrive)]
        self.names: list = []     # the manifest's Layers, once it is checked
        self.config_name: str | None = None
        self.diff_ids: list = []  # the config's rootfs.diff_ids, once it is checked
        self.k = 0                # the part being read (len(plan): the archive's end)
        self.buf = bytearray()    # a header, the end blocks, or a small part's content
        self.small = False        # the current part is held whole (manifest.json, the config)
        self.left = 0             # content bytes of the current part still to come
        self.pad = 0              # padding after it
        self.hash: Any = None     # hashlib.sha256 of the current part (None between parts)
        self.route = (True, True)
        self.ended = False        # the end blocks are in: nothing may follow
        self.pos = 0              # bytes consumed

    def feed(self, data) -> tuple:
        view = memoryview(data)
        if self.left > len(view) and not self.small:  # inside a layer (nearly every byte): no copy
            self.hash.update(view)
            self.left -= len(view)
            self.pos += len(view)
            return view if self.route[0] else b"", view if self.route[1] else b""
        load, nxt = bytearray(), bytearray()
        while view:
            if self.ended:
                raise Refused(f"data after the end of the archive (byte {self.pos})")
            if self.left:
                n = min(self.left, len(view))
                part = view[:n]
                self.hash.update(part)
                self.left -= n
                if self.small:
                    self.buf += part
                elif self.left:
                    self._emit(part, load, nxt)
                else:
                    self._check()  # the part's last piece leaves only once its digest is the host's
                    self._emit(part, load, nxt)
                if not self.left:
                    self._done(load, nxt)
            elif self.pad:
                n = min(self.pad, len(view))
                if any(view[:n]):
                    raise Refused(f"non-zero padding at byte {self.pos}")
                self.pad -= n
            else:
                need = (BLOCK if self.k < len(self.plan) else len(END)) - len(self.buf)
                n = min(need, len(view))
                self.buf += view[:n]
                if n == need:
                    block, self.buf = bytes(self.buf), bytearray()
                    self._header(block, load, nxt) if self.k < len(self.plan) else self._end(block)
            view = view[n:]
            self.pos += n
        return load, nxt

    def _emit(self, part, load: bytearray, nxt: bytearray) -> None:
        if self.route[0]:
            load += part
        if self.route[1]:
            nxt += part

    def _expected(self) -> tuple:
        kind, size, *index = self.plan[self.k]
        if kind == "manifest":
            return "manifest.json", size
        if kind == "config":
            return self.config_name, size
        return self.names[index[0]], size

    def _header(self, block: bytes, load: bytearray, nxt: bytearray) -> None:
        name, size = parse_header(block)
        want, want_size = self._expected()
        if (name, size) != (want, want_size):
            raise Refused(f"entry {name!r} ({size} bytes) where the host sent {want!r} ({want_size} bytes)")
        kind = self.plan[self.k][0]
        self.small, self.left, self.pad = kind != "layer", size, -size % BLOCK
        self.hash = hashlib.sha256()
        index = self.plan[self.k][2] if kind == "layer" else None
        self.route = (index is None or self.load is None or index in self.load,
                      index is None or self.forward is None or index in self.forward)
        if not self.small:
            self._emit(member_header(name, size), load, nxt)
        if not size:
            self._done(load, nxt)

    def _check(self) -> None:
        kind, _, *index = self.plan[self.k]
        got = self.hash.hexdigest()
        want = self.digests[kind] if kind != "layer" else self.diff_ids[index[0]]
        if not hmac.compare_digest(got, want):
            name = self._expected()[0]
            raise Refused(f"{name} is not the host's (sha256 {got[:12]}, want {want[:12]})")

    def _done(self, load: bytearray, nxt: bytearray) -> None:
        name, size = self._expected()
        kind = self.plan[self.k][0]
        if self.small:
            self._check()
            content, self.buf = bytes(self.buf), bytearray()
            self._read_small(kind, content)
            self._emit(member_header(name, size) + content, load, nxt)
        elif not size:
            self._check()
        self._emit(bytes(-size % BLOCK), load, nxt)
        self.small, self.hash, self.route = False, None, (True, True)
        self.k += 1

    def _read_small(self, kind: str, content: bytes) -> None:
        """The checked manifest names the config and the layer paths; the checked config gives
        each layer's digest (its diff_id: `docker save` writes layers uncompressed)."""
        try:
            doc = json.loads(content)
            if kind == "manifest":
                (m,) = doc
                config, names = m["Config"], m["Layers"]
                ok = [isinstance(n, str) and len(n) < 100 and NAME.fullmatch(n) for n in [config, *names]]
                if not all(ok) or len({config, "manifest.json", *names}) != len(names) + 2:
                    raise ValueError("names")
                self.config_name, self.names = config, names
                if any(p[2] >= len(names) for p in self.plan[2:]):
                    raise ValueError("layer index")
            else:
                diff_ids = doc["rootfs"]["diff_ids"]
                if len(diff_ids) != len(self.names) or not all(
                        isinstance(d, str) and d.startswith("sha256:") and HEX64.fullmatch(d[7:]) for d in diff_ids):
                    raise ValueError("diff_ids")
                self.diff_ids = [d[7:] for d in diff_ids]
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise Refused(f"the host's {kind} does not read as one ({e})") from None

    def _end(self, block: bytes) -> None:
        if any(block):
            raise Refused(f"data after the last part (byte {self.pos})")
        self.ended = True

    def finish(self) -> bytes:
        """The archive's end, for both ways, once the stream ended where it should."""
        if not self.ended:
            raise Refused(f"archive ended early ({self.pos} bytes)")
        return END


def _num(v, hi: int, what: str) -> int:
    if type(v) is not int or not 0 <= v <= hi:
        raise BadRequest(f"{what} {str(v)[:40]!r}")
    return v


def _indices(v, what: str) -> set:
    if not isinstance(v, list) or not all(type(i) is int for i in v) or len(set(v)) != len(v):
        raise BadRequest(what)
    return {_num(i, 4096, what) for i in v}


def check_head(head: dict) -> None:
    """The host's first line: every field of the type and range the protocol says (a bad one is
    one ERROR line, not a traceback)."""
    try:
        if head.get("mode") not in ("root", "listen"):
            raise BadRequest(f"mode {str(head.get('mode'))[:40]!r}")
        if head["mode"] == "listen" and not (isinstance(head.get("token"), str) and HEX64.fullmatch(head["token"])):
            raise BadRequest("token")
        e = head["expect"]
        for part in ("manifest", "config"):
            if not (isinstance(e[part]["sha256"], str) and HEX64.fullmatch(e[part]["sha256"])):
                raise BadRequest(f"{part} sha256")
            _num(e[part]["size"], SMALL_MAX, f"{part} size")
        if not isinstance(e["layers"], list) or not all(isinstance(x, list) and len(x) == 2 for x in e["layers"]):
            raise BadRequest("layers")
        carried = _indices([x[0] for x in e["layers"]], "layer index")
        for x in e["layers"]:
            _num(x[1], SIZE_MAX, "layer size")
        if not _indices(e["load"], "load") <= carried:
            raise BadRequest("load names a layer the archive does not carry")
    except (KeyError, TypeError, AttributeError) as exc:
        raise BadRequest(f"missing or malformed {str(exc)[:40]}") from None


def check_route(route: dict, head: dict) -> None:
    """The host's second line, as check_head."""
    try:
        if not _indices(route["layers"], "forward layers") <= {x[0] for x in head["expect"]["layers"]}:
            raise BadRequest("forward names a layer the archive does not carry")
        fwd = route["forward"]
        if fwd is not None:
            if not (isinstance(fwd["host"], str) and re.fullmatch(r"[A-Za-z0-9.:-]{1,253}", fwd["host"])):
                raise BadRequest(f"forward host {str(fwd['host'])[:80]!r}")
            if _num(fwd["port"], 65535, "forward port") == 0:
                raise BadRequest("forward port 0")
            if not (isinstance(fwd["token"], str) and HEX64.fullmatch(fwd["token"])):
                raise BadRequest("forward token")
    except (KeyError, TypeError, AttributeError) as exc:
        raise BadRequest(f"missing or malformed {str(exc)[:40]}") from None


def say(*words) -> None:
    sys.stdout.write(" ".join(str(w) for w in words).replace("\n", " ") + "\n")
    sys.stdout.flush()


def read_line(stdin) -> "dict | None":
    line = stdin.readline(LINE_MAX + 1)
    if len(line) > LINE_MAX:
        raise BadRequest(f"a line from the host over {LINE_MAX} bytes")
    if not line:
        return None
    try:
        doc = json.loads(line)
    except ValueError:
        raise BadRequest("a line from the host that is not JSON") from None
    if doc is not None and not isinstance(doc, dict):
        raise BadRequest("a line from the host that is not an object")
    return doc


def accept_upstream(srv: socket.socket, token: str) -> socket.socket:
    """The first connection that sends the token and a newline. Connections are read side by side
    (a stranger that connects and says nothing holds none of the others up), each for at most
    TOKEN_S and len(token) + 1 bytes; the rest are closed."""
    want = token.encode() + b"\n"
    sel = selectors.DefaultSelector()
    srv.setblocking(False)
    sel.register(srv, selectors.EVENT_READ)
    pending: dict = {}  # socket -> [bytes so far, deadline]
    deadline = time.monotonic() + ACCEPT_S

    def drop(c: socket.socket) -> None:
        sel.unregister(c)
        pending.pop(c)
        c.close()

    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise Refused(f"no upstream node connected within {ACCEPT_S:.0f}s")
            for c, (_, until) in list(pending.items()):
                if now >= until:
                    drop(c)
            soonest = min([deadline, *(until for _, until in pending.values())])
            for key, _ in sel.select(max(0.0, soonest - now)):
                if key.fileobj is srv:
                    try:
                        conn, _peer = srv.accept()
                    except OSError:
                        continue
                    if len(pending) >= PENDING_MAX:
                        drop(next(iter(pending)))
                    conn.setblocking(False)
                    pending[conn] = [b"", time.monotonic() + TOKEN_S]
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                c = key.fileobj
                assert isinstance(c, socket.socket)  # only the listener and its connections are registered
                got = pending[c][0]
                try:
                    part = c.recv(len(want) - len(got))
                except BlockingIOError:
                    continue
                except OSError:
                    part = b""
                got += part
                if not part:
                    drop(c)
                elif len(got) < len(want) and not got.endswith(b"\n"):
                    pending[c][0] = got  # compared only whole: a wrong byte must not show early
                elif hmac.compare_digest(got, want):
                    sel.unregister(c)
                    pending.pop(c)
                    c.setblocking(True)
                    c.settimeout(STALL_S)
                    say("PEER", c.getpeername()[0])
                    return c
                else:
                    drop(c)  # not our upstream: keep waiting for it
    finally:
        for c in list(pending):
            drop(c)
        sel.close()


class Tail:
    """The last TAIL bytes a child writes to a pipe, read by a thread (bounded however much it writes)."""

    def __init__(self, pipe):
        self.data = b""
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe) -> None:
        while True:
            chunk = pipe.read1(65536) if hasattr(pipe, "read1") else pipe.read(65536)
            if not chunk:
                break
            self.data = (self.data + chunk)[-TAIL:]
        pipe.close()

    def text(self, wait: float = 10) -> str:
        self.thread.join(timeout=wait)
        return self.data.decode("utf-8", "replace").strip()[-300:]


def main() -> int:
    stdin = sys.stdin.buffer
    try:
        head = read_line(stdin)
        if head is None:
            return 3
        check_head(head)
        srv = None
        if head["mode"] == "listen":
            srv = socket.create_server(("", 0), family=socket.AF_INET)
            say("PORT", srv.getsockname()[1])
        route = read_line(stdin)  # once the host knows the next node's port
        if route is None:
            return 3  # the host went away before the transfer began
        check_route(route, head)
    except BadRequest as e:
        say("ERROR", f"bad request: {e}")
        return 2
    return relay(stdin, head, route, srv)


def relay(stdin, head: dict, route: dict, srv) -> int:
    fwd = route["forward"]
    src = nxt = load = None
    check = TarCheck({**head["expect"], "forward": route["layers"]})
    try:
        if srv is not None:
            watch_host(stdin, lambda: load)
            src = accept_upstream(srv, head["token"])
            srv.close()
        if fwd:
            try:
                nxt = socket.create_connection((fwd["host"], fwd["port"]), timeout=30)
                nxt.settimeout(STALL_S)
                nxt.sendall(fwd["token"].encode() + b"\n")
            except OSError as e:
                say("FORWARD_ERROR", f"connect {fwd['host']}:{fwd['port']}: {e}")
                nxt = None
        load = subprocess.Popen(["docker", "load", "-q"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        assert load.stdin is not None and load.stdout is not None  # both PIPE
        out = Tail(load.stdout)
        try:  # a 1 MiB pipe to it, not 64 KiB: fewer wake-ups per chunk (Linux; else the default)
            fcntl.fcntl(load.stdin.fileno(), 1031, CHUNK)  # F_SETPIPE_SZ
        except OSError:
            pass
        got, last = 0, 0.0
        while True:
            buf = src.recv(CHUNK) if src is not None else stdin.read1(CHUNK)
            if not buf:
                break
            mine, theirs = check.feed(buf)
            got += len(buf)
            nxt = pass_on(nxt, theirs)
            if load.stdin is not None and mine:
                try:
                    load.stdin.write(mine)
                except OSError:  # this node's load died: the next node still gets every byte
                    load.stdin = None
            if time.monotonic() - last > 0.5:
                say("BYTES", got)
                last = time.monotonic()
        end = check.finish()
        nxt = pass_on(nxt, end)
        if nxt is not None:
            nxt.shutdown(socket.SHUT_WR)  # the next node sees the end of the archive
        say("BYTES", got)
        say("LOADING")  # every byte is in: what is left is this node's own `docker load`
        if load.stdin is not None:
            try:
                load.stdin.write(end)
                load.stdin.close()
            except OSError:
                pass
        rc = load.wait(timeout=LOAD_WAIT_S)
        say("DONE", rc, out.text())
        return 0
    except (Refused, OSError, ValueError, subprocess.TimeoutExpired) as e:
        if load is not None and load.poll() is None:
            load.kill()  # mid-part: the engine loads nothing
        say("ERROR", f"{type(e).__name__}: {e}" if not isinstance(e, Refused) else f"refused: {e}")
        return 1
    finally:
        for s in (src, nxt):
            if s is not None:
                s.close()


def pass_on(nxt, data):
    """Send to the next node; the socket, or None once it is lost (this node's own load goes on)."""
    if nxt is not None and data:
        try:
            nxt.sendall(data)
        except OSError as e:
            say("FORWARD_ERROR", f"sending: {e}")
            nxt.close()
            return None
    return nxt


def watch_host(stdin, get_load) -> None:
    """listen mode: stdin stays open while the host wants this transfer; EOF means it is gone."""
    def run():
        while stdin.read1(CHUNK):
            pass
        p = get_load()
        if p is not None and p.poll() is None:
            p.kill()
        os._exit(3)
    threading.Thread(target=run, daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
