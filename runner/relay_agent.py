"""The node's half of the relay push (runner/relay.py): standard library only, run on a node as
`python3 -u -c <this file's source>` over SSH, as the SSH user.

One agent per node of a chain host -> n0 -> n1 -> ... Each reads the image archive (a `docker
save` tar holding the layers some node of the chain lacks) from its source, feeds it to its own
`docker load` and passes every byte on to the next node as it arrives, so the host's uplink
carries one copy however long the chain, and the chain moves at the pace of its slowest link.

Protocol. The host's JSON lines on stdin (over SSH: trusted). The first:
  mode     "root": the archive follows the second line on stdin (from the host);
           "listen": bind a TCP port, print `PORT <n>`, accept the upstream node: it must
           first send `token` and a newline (others are dropped and the wait goes on);
  expect   what the archive must hold: "manifest" (sha256 of manifest.json, which names the
           pushed tag alone), "config" (its path; its sha256 is the image id) and "layers" (the
           layer paths that may appear); and "load": the layers this node lacks, the only ones
           its `docker load` is given.
The second, once every agent of the chain has its port (so all start at once):
  forward  {"host", "port", "token"} of the next node, or null at the chain's end;
  layers   the layers some node after it lacks: the only ones passed on.
stdout lines report to the host: PORT n, PEER addr, BYTES n (received so far, ~2 per s),
LOADING (the whole archive is in and passed on),
FORWARD_ERROR msg (the next node is lost; this node's own load goes on), and last DONE rc
msg or ERROR msg. In listen mode, EOF on stdin means the host is gone: the agent kills its
load and exits.

Bytes from another node are not trusted: `TarCheck` parses the archive as it passes and kills
`docker load` (before the archive ends, so the engine loads nothing) at the first entry that is
not expected, a manifest or config whose digest is not the host's, or an archive that ends early.
Layers are checked by the engine itself (each against the config's diff_ids), so the stream can
load the host's image under the pushed tag and nothing else; the host then checks the image id.
"""

import fcntl
import hashlib
import hmac
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

CHUNK = 1 << 20
BLOCK = 512
ACCEPT_S = 120.0   # listen: how long to wait for the upstream node to connect
STALL_S = 300.0    # nothing received for this long: the upstream is stuck
LOAD_WAIT_S = 1800.0


class Refused(Exception):
    """The archive is not the one the host described."""


class TarCheck:
    """Streaming check of a ustar/GNU archive against `expect` (see the module doc), which also
    routes it: `feed` returns (the bytes for this node's `docker load`, the bytes for the next
    node). Each gets manifest.json, the config, the end of the archive and only the layers named
    in expect["load"] / expect["forward"] (None: every layer), so a node loads just what it lacks
    and passes on just what the nodes after it lack."""

    def __init__(self, expect: dict):
        self.want_manifest = expect["manifest"]
        self.config = expect["config"]
        self.want_config = expect["config_sha256"]
        self.allowed = {"manifest.json", self.config, *expect["layers"]}
        always = {"manifest.json", self.config}
        self.for_load = None if expect.get("load") is None else always | set(expect["load"])
        self.for_next = None if expect.get("forward") is None else always | set(expect["forward"])
        self.seen: set = set()
        self.buf = b""
        self.left = 0         # content bytes of the current entry still to come
        self.pad = 0          # padding after it
        self.name = None
        self.hash = None
        self.route = (True, True)
        self.zeros = 0        # consecutive all-zero header blocks (2 = end of archive)
        self.pos = 0          # bytes consumed

    def feed(self, data: bytes) -> tuple:
        view = memoryview(data)
        if self.left > len(view) and self.hash is None:  # inside a layer (nearly every byte): no copy
            self.left -= len(view)
            self.pos += len(view)
            return view if self.route[0] else b"", view if self.route[1] else b""
        load, nxt = bytearray(), bytearray()
        while view:
            if self.left or self.pad:
                n = min(self.left or self.pad, len(view))
                part = view[:n]
                if self.left:
                    if self.hash is not None:
                        self.hash.update(part)
                    self.left -= n
                else:
                    if any(part):
                        raise Refused(f"non-zero padding after {self.name!r}")
                    self.pad -= n
                self._emit(part, load, nxt)
                view = view[n:]
                self.pos += n
                if self.left == 0 and self.hash is not None and not self.pad:
                    self._entry_done()
                continue
            need = BLOCK - len(self.buf)
            self.buf += bytes(view[:need])
            view = view[need:]
            if len(self.buf) == BLOCK:
                block, self.buf = self.buf, b""
                self._header(block)
                self._emit(block, load, nxt)
                self.pos += BLOCK
                if self.left == 0 and self.hash is not None:
                    self._entry_done()
        return load, nxt

    def _emit(self, part, load: bytearray, nxt: bytearray) -> None:
        if self.route[0]:
            load += part
        if self.route[1]:
            nxt += part

    def _header(self, block: bytes) -> None:
        if not any(block):
            self.zeros += 1
            self.route = (True, True)
            return
        if self.zeros:
            raise Refused("data after the end of the archive")
        chk = sum(block[:148]) + 8 * 32 + sum(block[156:])
        if int(block[148:156].split(b"\0", 1)[0].strip() or b"0", 8) != chk:
            raise Refused(f"bad header checksum at byte {self.pos}")
        name = block[:100].split(b"\0", 1)[0].decode("utf-8", "replace")
        if block[257:262] == b"ustar" and block[345]:
            name = block[345:500].split(b"\0", 1)[0].decode("utf-8", "replace") + "/" + name
        kind = block[156:157]
        if kind not in (b"0", b"\0"):
            raise Refused(f"entry {name!r} is not a regular file (type {kind!r})")
        if name not in self.allowed or name in self.seen:
            raise Refused(f"unexpected entry {name!r}")
        size = int(block[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
        self.seen.add(name)
        self.name, self.left, self.pad = name, size, -size % BLOCK
        self.hash = hashlib.sha256() if name in ("manifest.json", self.config) else None
        self.route = (self.for_load is None or name in self.for_load, self.for_next is None or name in self.for_next)

    def _entry_done(self) -> None:
        want = self.want_manifest if self.name == "manifest.json" else self.want_config
        if not hmac.compare_digest(self.hash.hexdigest(), want):
            raise Refused(f"{self.name} is not the host's (sha256 {self.hash.hexdigest()[:12]})")
        self.hash = None

    def finish(self) -> None:
        if self.left or self.pad or self.zeros < 2 or {"manifest.json", self.config} - self.seen:
            raise Refused(f"archive ended early ({self.pos} bytes)")


def say(*words) -> None:
    sys.stdout.write(" ".join(str(w) for w in words).replace("\n", " ") + "\n")
    sys.stdout.flush()


def accept_upstream(srv: socket.socket, token: str) -> socket.socket:
    deadline = time.monotonic() + ACCEPT_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Refused(f"no upstream node connected within {ACCEPT_S:.0f}s")
        srv.settimeout(left)
        try:
            conn, peer = srv.accept()
        except socket.timeout:  # noqa: UP041 - not yet TimeoutError on Python 3.9 (Raspberry Pi OS 11)
            continue
        conn.settimeout(5)  # a connection that does not send the token at once is not our upstream
        got = b""
        try:
            while not got.endswith(b"\n") and len(got) <= len(token):
                part = conn.recv(len(token) + 1 - len(got))
                if not part:
                    break
                got += part
        except OSError:
            got = b""
        if hmac.compare_digest(got, token.encode() + b"\n"):
            conn.settimeout(STALL_S)
            say("PEER", peer[0])
            return conn
        conn.close()  # not our upstream: keep waiting for it


def main() -> int:
    stdin = sys.stdin.buffer
    head = json.loads(stdin.readline())
    srv = src = nxt = None
    if head["mode"] == "listen":
        srv = socket.create_server(("", 0), family=socket.AF_INET)
        say("PORT", srv.getsockname()[1])
    route = json.loads(stdin.readline() or "null")  # once the host knows the next node's port
    if route is None:
        return 3  # the host went away before the transfer began
    fwd = route["forward"]
    err = tempfile.TemporaryFile()
    load = None
    check = TarCheck({**head["expect"], "forward": route["layers"]})
    try:
        if srv is not None:
            watch_host(stdin, lambda: load)
            src = accept_upstream(srv, head["token"])
            srv.close()
        if fwd:
            try:
                nxt = socket.create_connection((fwd["host"], int(fwd["port"])), timeout=30)
                nxt.settimeout(STALL_S)
                nxt.sendall(fwd["token"].encode() + b"\n")
            except OSError as e:
                say("FORWARD_ERROR", f"connect {fwd['host']}:{fwd['port']}: {e}")
                nxt = None
        load = subprocess.Popen(["docker", "load", "-q"], stdin=subprocess.PIPE, stdout=err, stderr=err)
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
            if nxt is not None and theirs:
                try:
                    nxt.sendall(theirs)
                except OSError as e:
                    say("FORWARD_ERROR", f"sending: {e}")
                    nxt.close()
                    nxt = None
            if load.stdin is not None and mine:
                try:
                    load.stdin.write(mine)
                except OSError:  # this node's load died: the next node still gets every byte
                    load.stdin = None
            if time.monotonic() - last > 0.5:
                say("BYTES", got)
                last = time.monotonic()
        check.finish()
        if nxt is not None:
            nxt.shutdown(socket.SHUT_WR)  # the next node sees the end of the archive
        say("BYTES", got)
        say("LOADING")  # every byte is in: what is left is this node's own `docker load`
        if load.stdin is not None:
            load.stdin.close()
        rc = load.wait(timeout=LOAD_WAIT_S)
        err.seek(0)
        say("DONE", rc, err.read().decode("utf-8", "replace").strip()[-300:])
        return 0
    except (Refused, OSError, ValueError, subprocess.TimeoutExpired) as e:
        if load is not None and load.poll() is None:
            load.kill()  # mid-archive: the engine loads nothing
        say("ERROR", f"{type(e).__name__}: {e}" if not isinstance(e, Refused) else f"refused: {e}")
        return 1
    finally:
        for s in (src, nxt):
            if s is not None:
                s.close()


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
