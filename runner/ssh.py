"""SSH to a node with a VERIFIED host key, plus commands, SFTP and a Docker client on top.

Host keys are checked against the node's pinned fingerprint (`host_key: SHA256:...`) or a
known_hosts file (the node's `known_hosts`, else ~/.ssh/known_hosts). Unknown keys are refused
unless the user opts in with --accept-new-host-keys, which records them. There is no
StrictHostKeyChecking=no anywhere.

The Docker client talks to the node's engine through the same verified SSH connection: a
private local unix socket whose every connection becomes an SSH channel running
`docker system dial-stdio` on the node (what `docker -H ssh://` does, minus its unchecked keys).
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import logging
import os
import shlex
import socket
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import paramiko

from runner.errors import UserError
from runner.inventory import Node

log = logging.getLogger(__name__)
# Its INFO lines are noise per node, and it logs a traceback at ERROR for every connection that
# fails (a dead node): we report those as one line ourselves. `runner -v` shows them.
logging.getLogger("paramiko").setLevel(logging.CRITICAL)
CONNECT_TIMEOUT = 10.0


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style SHA256 fingerprint, as printed by `ssh-keygen -lf`."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


def known_hosts_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


class _PinnedKey(paramiko.MissingHostKeyPolicy):
    def __init__(self, node: Node):
        self.node = node

    def missing_host_key(self, client, hostname, key):
        got = fingerprint(key)
        if got.rstrip("=") != (self.node.host_key or "").rstrip("="):
            raise UserError(f"node {self.node.name}: host key mismatch for {self.node.host}:{self.node.port}: "
                            f"pinned {self.node.host_key}, server presented {got}; if the node was "
                            "reinstalled, verify and update host_key in the inventory")


class _KnownHosts(paramiko.MissingHostKeyPolicy):
    def __init__(self, node: Node, path: str, accept_new: bool):
        self.node, self.path, self.accept_new = node, path, accept_new

    def missing_host_key(self, client, hostname, key):
        fp = fingerprint(key)
        if not self.accept_new:
            raise UserError(f"node {self.node.name}: unknown host key {key.get_name()} {fp} for "
                            f"{self.node.host}:{self.node.port} (not in {self.path}); verify it, then pin it as "
                            "host_key in the inventory or rerun with --accept-new-host-keys")
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as fh:
            fh.write(f"{known_hosts_name(self.node.host, self.node.port)} {key.get_name()} {key.get_base64()}\n")
        log.warning("node %s: accepted new host key %s (saved to %s)", self.node.name, fp, self.path)


@dataclass
class Result:
    rc: int
    out: str
    err: str


class Remote:
    """One verified SSH connection to one node (thread-safe for independent channels)."""

    def __init__(self, node: Node, accept_new_host_keys: bool = False):
        self.node = node
        self.accept_new = accept_new_host_keys
        self.client: paramiko.SSHClient | None = None
        self.host_key_fp: str | None = None
        self._docker = None
        self._forward: _DockerForward | None = None
        self._sftp: paramiko.SFTPClient | None = None
        self._lock = threading.Lock()

    # -- connection --------------------------------------------------------------------
    def connect(self) -> Remote:
        n = self.node
        client = paramiko.SSHClient()
        if n.host_key:
            client.set_missing_host_key_policy(_PinnedKey(n))  # pinned: known_hosts not consulted
        else:
            path = n.known_hosts or os.path.expanduser("~/.ssh/known_hosts")
            if os.path.exists(path):
                client.load_host_keys(path)
            client.set_missing_host_key_policy(_KnownHosts(n, path, self.accept_new))
        if n.identity_file and not os.path.isfile(n.identity_file):
            raise UserError(f"node {n.name}: identity_file not found: {n.identity_file}")
        try:
            client.connect(n.host, port=n.port, username=n.user, key_filename=n.identity_file,
                           look_for_keys=n.identity_file is None, allow_agent=n.identity_file is None,
                           timeout=CONNECT_TIMEOUT, banner_timeout=CONNECT_TIMEOUT, auth_timeout=CONNECT_TIMEOUT)
        except UserError:
            client.close()
            raise
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise UserError(f"node {n.name}: HOST KEY CHANGED for {n.host}:{n.port}: expected "
                            f"{fingerprint(exc.expected_key)}, got {fingerprint(exc.key)}; refusing to connect "
                            "(possible man-in-the-middle; fix known_hosts if the node was reinstalled)") from None
        except paramiko.AuthenticationException as exc:
            client.close()
            raise UserError(f"node {n.name}: SSH authentication failed for {n.user}@{n.host}:{n.port} ({exc}); "
                            "check user and identity_file") from None
        except (OSError, paramiko.SSHException) as exc:
            client.close()
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            if isinstance(exc, paramiko.SSHException) and ("banner" in why or "No existing session" in why):
                # TCP got through but sshd never spoke: a hung host or a partitioned network.
                why = f"no SSH answer within {CONNECT_TIMEOUT:.0f}s (node hung or network partitioned)"
            raise UserError(f"node {n.name}: cannot connect to {n.host}:{n.port}: {why}") from None
        transport = client.get_transport()
        assert transport is not None
        transport.set_keepalive(5)  # notice a node that vanished
        self.host_key_fp = fingerprint(transport.get_remote_server_key())
        self.client = client
        return self

    @property
    def alive(self) -> bool:
        t = self.client.get_transport() if self.client else None
        return bool(t and t.is_active())

    def abandon(self) -> None:
        """Drop a connection to a node that stopped answering: the socket is closed without the
        polite goodbyes (SFTP/channel close messages) that would block on a dead peer."""
        t = self.client.get_transport() if self.client else None
        if t is not None:
            try:
                t.sock.close()
            except OSError:
                pass
        self._docker = None
        self._sftp = None
        self.close()

    def close(self) -> None:
        if self._docker is not None:
            try:
                self._docker.close()
            except Exception:  # noqa: BLE001 - best effort on shutdown
                pass
            self._docker = None
        if self._forward:
            self._forward.close()
            self._forward = None
        if self._sftp:
            self._sftp.close()
            self._sftp = None
        if self.client:
            transport = self.client.get_transport()
            self.client.close()
            self.client = None
            # paramiko's close does not always wait for its reader thread; one still running at
            # interpreter exit prints "Exception in thread ..." over the CLI's last line.
            if transport is not None and transport.is_alive() and transport is not threading.current_thread():
                transport.join(2)
        if hasattr(self, "_kh_dir"):
            import shutil

            shutil.rmtree(self._kh_dir, ignore_errors=True)
            del self._kh_dir

    def __enter__(self) -> Remote:
        return self.connect() if self.client is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- commands ------------------------------------------------------------------------
    def run(self, command: str | list[str], timeout: float = 60.0, stdin: bytes | None = None,
            check: bool = False) -> Result:
        """Run a command (a list is shell-quoted). Never put secrets in it: argv is visible on the node."""
        if isinstance(command, list):
            command = shlex.join(command)
        assert self.client is not None, "not connected"
        chan = self.client.get_transport().open_session(timeout=CONNECT_TIMEOUT)
        chan.settimeout(timeout)
        chan.exec_command(command)
        if stdin is not None:
            chan.sendall(stdin)
            chan.shutdown_write()
        err = bytearray()

        def read_err() -> None:
            try:
                err.extend(chan.makefile_stderr("rb").read())
            except OSError:
                pass

        t = threading.Thread(target=read_err, daemon=True)
        t.start()
        try:
            out = chan.makefile("rb").read()
        except TimeoutError:
            chan.close()
            raise UserError(f"node {self.node.name}: command timed out after {timeout:.0f}s: {command[:80]}") from None
        t.join(timeout)
        rc = chan.recv_exit_status()
        chan.close()
        res = Result(rc, out.decode(errors="replace"), err.decode(errors="replace"))
        if check and rc != 0:
            raise UserError(f"node {self.node.name}: `{command[:80]}` failed (exit {rc}): "
                            f"{(res.err or res.out).strip().splitlines()[-1:] or ''}")
        return res

    def open_exec(self, command: str) -> paramiko.Channel:
        """A raw channel running command (for streaming stdin/stdout, e.g. docker load)."""
        chan = self.client.get_transport().open_session(timeout=CONNECT_TIMEOUT)
        chan.exec_command(command)
        return chan

    def openssh_argv(self, compress: bool = False, aes: bool = False) -> list[str]:
        """argv prefix for the OpenSSH client (bulk transfers: C speed, no GIL), pinned to the
        host key paramiko already verified on this connection, so it is just as strict.
        aes=True prefers AES-GCM (hardware AES on x86: ~12% faster image loads measured on
        loopback); otherwise OpenSSH's default, ChaCha20, the faster one on a Pi 4's CPU, which
        has no AES instructions."""
        n = self.node
        assert self.client is not None, "not connected"
        key = self.client.get_transport().get_remote_server_key()
        if not hasattr(self, "_kh_dir"):
            self._kh_dir = tempfile.mkdtemp(prefix="runner-kh-")
        kh = os.path.join(self._kh_dir, "known_hosts")
        with open(kh, "w") as fh:
            fh.write(f"{known_hosts_name(n.host, n.port)} {key.get_name()} {key.get_base64()}\n")
        argv = ["ssh", "-p", str(n.port), "-l", n.user, "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                "-o", f"UserKnownHostsFile={kh}", "-o", "GlobalKnownHostsFile=/dev/null",
                "-o", f"ConnectTimeout={int(CONNECT_TIMEOUT)}", "-o", "LogLevel=ERROR"]
        if n.identity_file:
            argv += ["-i", n.identity_file, "-o", "IdentitiesOnly=yes"]
        if compress:
            argv.append("-C")
        if aes:
            argv += ["-o", "Ciphers=aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com"]
        return argv + [n.host]

    # -- files ----------------------------------------------------------------------------
    @property
    def sftp(self) -> paramiko.SFTPClient:
        with self._lock:
            if self._sftp is None:
                self._sftp = self.client.open_sftp()
            return self._sftp

    def makedirs(self, path: str, mode: int = 0o755) -> None:
        """mkdir -p over SFTP (no shell: an exec costs a login shell on the node)."""
        missing = []
        p = path.rstrip("/")
        while p and self.stat(p) is None:
            missing.append(p)
            p = os.path.dirname(p)
        for d in reversed(missing):
            try:
                self.sftp.mkdir(d, mode)
                self.sftp.chmod(d, mode)  # mkdir's mode is filtered by the server's umask
            except OSError:
                if self.stat(d) is None:
                    raise UserError(f"node {self.node.name}: cannot create {d}") from None

    def read_text(self, path: str) -> str | None:
        try:
            with self.sftp.open(path, "r") as fh:
                return fh.read().decode(errors="replace")
        except OSError:
            return None

    def listening_ports(self) -> set[int]:
        """TCP ports in LISTEN state on the node, from /proc/net/tcp{,6} over SFTP (no shell)."""
        ports: set[int] = set()
        for f in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in (self.read_text(f) or "").splitlines()[1:]:
                parts = line.split()
                if len(parts) > 3 and parts[3] == "0A":
                    ports.add(int(parts[1].rsplit(":", 1)[1], 16))
        return ports

    def ping(self, timeout: float = 6.0) -> None:
        """Round trip over a dedicated SFTP session (cheap: no shell), raising if the node is gone."""
        if not hasattr(self, "_ping_sftp"):
            # Opened with the same timeout: open_sftp() would wait up to an hour on a hung node.
            chan = self.client.get_transport().open_session(timeout=timeout)
            chan.settimeout(timeout)
            chan.invoke_subsystem("sftp")
            self._ping_sftp = paramiko.SFTPClient(chan)
        self._ping_sftp.stat(".")

    def put_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write a file on the node; mode is set BEFORE data is written (secrets are never 0644)."""
        tmp = f"{path}.tmp-{os.getpid()}"
        with self.sftp.open(tmp, "wb") as fh:
            fh.chmod(mode)
            fh.write(data)
        self.sftp.posix_rename(tmp, path)

    def stat(self, path: str) -> paramiko.SFTPAttributes | None:
        try:
            return self.sftp.stat(path)
        except FileNotFoundError:
            return None

    def walk(self, root: str) -> list[tuple[str, paramiko.SFTPAttributes]]:
        """All regular files under root as (relative path, attrs), via SFTP listdir_attr."""
        out: list[tuple[str, paramiko.SFTPAttributes]] = []
        stack = [""]
        while stack:
            rel = stack.pop()
            try:
                entries = self.sftp.listdir_attr(f"{root}/{rel}" if rel else root)
            except FileNotFoundError:
                continue
            for e in entries:
                r = f"{rel}/{e.filename}" if rel else e.filename
                if stat.S_ISDIR(e.st_mode or 0):
                    stack.append(r)
                elif stat.S_ISREG(e.st_mode or 0):
                    out.append((r, e))
        return out

    # -- docker ---------------------------------------------------------------------------
    def docker(self, timeout: float = 60.0):
        """docker.DockerClient for this node's engine, tunnelled through this SSH connection."""
        with self._lock:
            if self._docker is None:
                import docker

                self._forward = _DockerForward(self)
                self._docker = docker.DockerClient(base_url=f"unix://{self._forward.path}", version="auto",
                                                   timeout=timeout)
            return self._docker


class _DockerForward:
    """Local unix socket -> SSH channel `docker system dial-stdio` per connection."""

    def __init__(self, remote: Remote):
        self.remote = remote
        self.dir = tempfile.mkdtemp(prefix="runner-docker-")
        os.chmod(self.dir, 0o700)
        self.path = os.path.join(self.dir, "docker.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(64)
        self.closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"docker-fwd-{remote.node.name}").start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                chan = self.remote.open_exec("docker system dial-stdio")
            except Exception as exc:  # noqa: BLE001 - node gone: the client sees a closed socket
                log.debug("node %s: dial-stdio failed: %s", self.remote.node.name, exc)
                conn.close()
                continue
            threading.Thread(target=_pump, args=(conn, chan, True), daemon=True).start()
            threading.Thread(target=_pump, args=(conn, chan, False), daemon=True).start()

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        finally:
            try:
                os.unlink(self.path)
                os.rmdir(self.dir)
            except OSError:
                pass


def is_loopback(host: str) -> bool:
    """Bulk streams to such a node skip compression: it only burns the CPU both ends share."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _pump(conn: socket.socket, chan: paramiko.Channel, up: bool) -> None:
    try:
        if up:
            while True:
                data = conn.recv(65536)
                if not data:
                    chan.shutdown_write()
                    return
                chan.sendall(data)
        else:
            while True:
                data = chan.recv(65536)
                if not data:
                    conn.shutdown(socket.SHUT_WR)
                    return
                conn.sendall(data)
    except Exception:  # noqa: BLE001 - either side closing ends the pump
        pass
    finally:
        if not up:
            conn.close()
            try:
                chan.close()
            except (EOFError, OSError, paramiko.SSHException):
                pass  # the transport went first (the runner is closing): nothing left to tell the node


def connect_each(nodes: list[Node], accept_new_host_keys: bool = False) -> tuple[dict[str, Remote], dict[str, str]]:
    """Connect to every node in parallel: (connected remotes, {node: one-line reason} for the rest)."""
    from concurrent.futures import ThreadPoolExecutor

    remotes: dict[str, Remote] = {}
    failed: dict[str, str] = {}

    def one(n: Node):
        return Remote(n, accept_new_host_keys).connect()

    with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as ex:
        futs = {n.name: ex.submit(one, n) for n in nodes}
        for name, fut in futs.items():
            try:
                remotes[name] = fut.result()
            except UserError as exc:
                failed[name] = str(exc)
            except Exception as exc:  # noqa: BLE001 - any other connect failure is this node's problem
                failed[name] = f"node {name}: cannot connect: {exc}"
    return remotes, failed


def connect_all(nodes: list[Node], accept_new_host_keys: bool = False) -> dict[str, Remote]:
    """Connect to every node in parallel; one UserError naming every node that failed."""
    remotes, failed = connect_each(nodes, accept_new_host_keys)
    if failed:
        for r in remotes.values():
            r.close()
        raise UserError("; ".join(failed.values()))
    return remotes
