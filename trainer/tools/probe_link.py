"""Latency and bandwidth of the link between two pipeline neighbours, over plain TCP (what gloo's
point-to-point sends ride on). Torch-free: the probe runs it before importing anything heavy.

The later node serves, the earlier one connects (`trainer probe --serve PORT` / `--peer HOST:PORT`):
ping-pongs of one byte give the round trip (latency = half the median), then a few bulk transfers
acknowledged by one byte give the bandwidth (bytes / (time - one round trip)). The server serves
exactly one client, the neighbour before it, then stops.
"""

from __future__ import annotations

import socket
import statistics
import struct
import threading
import time

PINGS = 20
ROUNDS = 3


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def _drain(sock: socket.socket, n: int) -> None:
    view = bytearray(1 << 20)
    while n > 0:
        got = sock.recv_into(view, min(n, len(view)))
        if not got:
            raise ConnectionError("peer closed the connection")
        n -= got


class LinkServer:
    """Accepts one client on 0.0.0.0:port in a thread; `wait()` until that client is done."""

    def __init__(self, port: int, timeout: float):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", port))
        self.sock.listen(1)
        self.sock.settimeout(timeout)
        self.error: str | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="link-server", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.settimeout(self.sock.gettimeout())
                while True:
                    op = _recv_exact(conn, 1)
                    if op == b"p":
                        conn.sendall(b"p")
                    elif op == b"b":
                        (n,) = struct.unpack("!Q", _recv_exact(conn, 8))
                        _drain(conn, n)
                        conn.sendall(b"k")
                    else:
                        break
        except (OSError, ConnectionError) as e:
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.sock.close()
            self.done.set()

    def wait(self, timeout: float) -> bool:
        return self.done.wait(timeout)


def measure(host: str, port: int, nbytes: int, timeout: float) -> dict:
    """Connect (retrying until `timeout`: the neighbour's probe may still be starting), then
    measure. Returns {latency_s, bandwidth_Bps, bytes, rtts_s}."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise ConnectionError(f"no link probe answered on {host}:{port} within {timeout:.0f}s") from None
            time.sleep(0.2)
    try:
        return _exchange(sock, nbytes, timeout)
    except OSError as e:  # TimeoutError included: something accepted on the port but is no link probe
        raise ConnectionError(f"{host}:{port} accepted but answered no link probe within {timeout:.0f}s "
                              f"({e.__class__.__name__}: {e}); is another service on that port?") from None


def _exchange(sock: socket.socket, nbytes: int, timeout: float) -> dict:
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout)
        rtts = []
        for _ in range(PINGS):
            t0 = time.perf_counter()
            sock.sendall(b"p")
            _recv_exact(sock, 1)
            rtts.append(time.perf_counter() - t0)
        rtt = statistics.median(rtts)
        payload = bytes(min(nbytes, 1 << 22))
        rates = []
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            sock.sendall(b"b" + struct.pack("!Q", nbytes))
            left = nbytes
            while left > 0:
                k = min(left, len(payload))
                sock.sendall(payload[:k] if k < len(payload) else payload)
                left -= k
            _recv_exact(sock, 1)
            dt = max(time.perf_counter() - t0 - rtt, 1e-9)
            rates.append(nbytes / dt)
        sock.sendall(b"q")
    return {"latency_s": rtt / 2, "bandwidth_Bps": statistics.median(rates), "bytes": nbytes,
            "rtts_s": [round(x, 9) for x in rtts]}
