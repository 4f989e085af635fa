"""The Docker API of a node over the runner's own, host-key-verified SSH connection.

Each HTTP connection of the docker SDK is one SSH channel running `docker system dial-stdio` on
the node (what `docker -H ssh://` does), opened on the paramiko transport the runner already
verified. No local socket, no forwarding threads: a watched node costs its SSH connection's one
reader thread, whatever the number of API calls in flight. The SDK's own ssh:// client is not
used: it makes a second connection with its own, unpinned, host-key policy.
"""

from __future__ import annotations

import http.client
import time

import docker.errors
import paramiko
from docker.transport.basehttpadapter import BaseHTTPAdapter
from docker.transport.sshconn import RecentlyUsedContainer, SSHConnection, SSHConnectionPool, SSHHTTPAdapter

from runner.core.errors import UserError

CHANNEL_OPEN_TIMEOUT = 10.0
HEADERS_S = 120.0  # an answer's status line and headers, beyond the request's read timeout
POOL_SIZE = 4  # concurrent API connections kept per node: far below a real sshd's MaxSessions (10)


class EngineAnswerError(docker.errors.DockerException, UserError):
    """The node's engine answered what no Docker engine sends: too large, too slow, malformed.
    Its message names the node: `node NAME: the engine's ...`."""

    def __init__(self, node: str, message: str):
        super().__init__(f"node {node}: {message}")


class NoAnswer(Exception):
    """A DeadlineFile's deadline passed: no answer within `seconds`."""

    def __init__(self, seconds: float):
        super().__init__(seconds)
        self.seconds = seconds


class DeadlineFile(paramiko.channel.ChannelFile):
    """A channel's reads, each refused once `deadline` (time.monotonic(); None: no deadline) has
    passed: an answer's headers here, its body in docker_answers.bound_answer."""

    def __init__(self, chan: paramiko.Channel, seconds: float):
        super().__init__(chan, "rb")
        self.seconds = seconds
        self.deadline: float | None = time.monotonic() + seconds

    def _read(self, size):
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise NoAnswer(self.seconds)
        return super()._read(size)


class _HeadersInTime(http.client.HTTPResponse):
    """An answer whose status line and headers arrive within HEADERS_S plus the request's read
    timeout (one read past it at most): the timeout bounds each read alone, and http.client skips
    interim `100 Continue` answers for as long as the engine sends them (one every few seconds, or
    headers a byte at a time, held a call for ever). No thread: the reads check the time. A request
    made to wait for ever (docker-py's `wait()`: no timeout) is not bounded; the body: docker_answers."""

    def __init__(self, sock, *args, **kwargs):
        super().__init__(sock, *args, **kwargs)
        wait = sock.gettimeout() if isinstance(sock, paramiko.Channel) else None
        if isinstance(wait, (int, float)):
            self.fp = DeadlineFile(sock, HEADERS_S + wait)

    def begin(self):
        try:
            super().begin()
        finally:
            if isinstance(self.fp, DeadlineFile):
                self.fp.deadline = None  # the body's reads: streams unbounded, the rest bounded by docker_answers


class _Channel(SSHConnection):
    response_class = _HeadersInTime

    def connect(self) -> None:
        # paramiko's default wait for a channel is an hour: a hung node must fail like a closed one.
        assert self.ssh_transport is not None  # get_connection made the pool from a live transport
        chan = self.ssh_transport.open_session(timeout=CHANNEL_OPEN_TIMEOUT)
        chan.settimeout(self.timeout)
        chan.exec_command("docker system dial-stdio")
        self.sock = chan  # type: ignore[assignment]  # a channel serves as the socket, as in docker-py's own

    def getresponse(self, *args, **kwargs):
        try:
            return super().getresponse(*args, **kwargs)
        except NoAnswer as exc:
            self.close()
            raise EngineAnswerError(self.ssh_host, f"the engine sent no answer within {exc.seconds:.0f}s "
                                    "(interim answers only, or a trickle)") from None


class _Pool(SSHConnectionPool):
    # docker-py's own pool makes its SSHConnection the same way (its stubs type neither).
    def _new_conn(self) -> _Channel:  # type: ignore[override]
        return _Channel(self.ssh_transport, self.timeout, self.ssh_host)  # type: ignore[arg-type]

    def _get_conn(self, timeout=None):
        """A kept connection whose channel the node closed (its `docker system dial-stdio` ended:
        killed, or the engine restarted) is replaced, not reused: urllib3's dropped-connection
        check cannot see a paramiko channel's close, and a reused one fails the call with
        "Socket is closed" (seen after a 5-minute push over a saturated link)."""
        conn = super()._get_conn(timeout)
        chan = getattr(conn, "sock", None)
        if chan is not None and (chan.closed or chan.eof_received or chan.exit_status_ready()):
            conn.close()
            conn = self._new_conn()
        return conn


class VerifiedSSHAdapter(SSHHTTPAdapter):
    """SSHHTTPAdapter on a connected paramiko client it does not own (never reconnects, never closes it)."""

    # What __init__ sets, narrower than docker-py's stubs say of its adapter (pools: an int there).
    ssh_client: paramiko.SSHClient
    timeout: float  # type: ignore[assignment]  # seconds, as docker-py's own takes them
    pools: RecentlyUsedContainer[str, _Pool]  # type: ignore[assignment]

    def __init__(self, client: paramiko.SSHClient, timeout: float, node: str = "?"):
        self.ssh_client = client
        self.ssh_params: dict = {}
        self.ssh_host = node  # docker-py keeps it only: named in EngineAnswerError
        self.timeout = timeout
        self.max_pool_size = POOL_SIZE
        self.pools = RecentlyUsedContainer(1, dispose_func=lambda p: p.close())
        BaseHTTPAdapter.__init__(self)

    def _connect(self) -> None:
        raise ConnectionError("the SSH connection to the node is closed")

    def get_connection(self, url, proxies=None) -> _Pool:
        with self.pools.lock:
            pool = self.pools.get(url)
            if pool:
                return pool
            if not self.ssh_client.get_transport():
                self._connect()
            pool = _Pool(ssh_client=self.ssh_client, timeout=self.timeout,  # type: ignore[arg-type]  # seconds
                         maxsize=self.max_pool_size, host=self.ssh_host)
            self.pools[url] = pool
        return pool

    def close(self) -> None:
        BaseHTTPAdapter.close(self)
