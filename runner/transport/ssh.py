"""SSH to a node with a VERIFIED host key, plus commands, SFTP and a Docker client on top.

Host keys are checked against the node's pinned fingerprint (`host_key: SHA256:...`, any of the
node's key types) or the known_hosts files OpenSSH would read (runner/inventory/hostkeys.py). Unknown keys
are refused unless the user opts in with --accept-new-host-keys, which records them. There is no
StrictHostKeyChecking=no anywhere.

The Docker client talks to the node's engine through the same verified SSH connection
(runner/transport/docker_api.py: one `docker system dial-stdio` channel per API connection).

A node with a `proxy_jump` (a bastion, from the inventory or the user's ssh config: runner/inventory/ssh_config.py)
is reached over a `direct-tcpip` channel of one connection to the bastion, shared by every node
behind it (runner/transport/jump.py); the bastion's host key is verified exactly as a node's is, then
the node's over that channel.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shlex
import socket
import tempfile
import threading
import time
from dataclasses import dataclass

import paramiko

from runner.core.errors import UserError
from runner.core.fanout import DEFAULT_PARALLEL, parallel
from runner.core.node_output import read_capped, visible
from runner.inventory import Node, hostkeys
from runner.inventory.hostkeys import fingerprint, known_hosts_name
from runner.transport.jump import BASTIONS, proxy_command
from runner.transport.sftp import MAX_OUTPUT, NodeFiles, WatchedSFTP, close_quietly

log = logging.getLogger(__name__)
# Its INFO lines are noise per node, and it logs a traceback at ERROR for every connection that
# fails (a dead node): we report those as one line ourselves. `runner -v` shows them.
logging.getLogger("paramiko").setLevel(logging.CRITICAL)
CONNECT_TIMEOUT = 10.0
# OpenSSH bulk streams (push, collect): a peer that stops answering at the SSH level (a hung
# node, a frozen sshd) ends the stream after ALIVE_S x ALIVE_COUNT seconds.
ALIVE_S, ALIVE_COUNT = 10, 3


class _PinMismatch(Exception):
    def __init__(self, presented: paramiko.PKey):
        self.presented = presented


class _Verify(paramiko.MissingHostKeyPolicy):
    """Called for every connection (the client holds no keys of its own): checks the presented key
    against the pin or the known_hosts files."""

    def __init__(self, node: Node, user_file: str, files: list[hostkeys.KnownHostsFile], accept_new: bool,
                 who: str):
        self.node, self.user_file, self.files, self.accept_new, self.who = node, user_file, files, accept_new, who

    def missing_host_key(self, client, hostname, key):
        n, who = self.node, self.who
        if n.host_key:
            if fingerprint(key).rstrip("=") != n.host_key.rstrip("="):
                raise _PinMismatch(key)
            return
        v = hostkeys.check(self.files, hostname, key)
        if v.ok:
            return
        fp = fingerprint(key)
        if v.revoked:
            raise UserError(f"{who}: host key {key.get_name()} {fp} of {n.host}:{n.port} is marked "
                            "@revoked in known_hosts; refusing to connect")
        if v.changed:
            raise UserError(f"{who}: HOST KEY CHANGED for {n.host}:{n.port}: got {key.get_name()} {fp}, "
                            f"known_hosts has another ({', '.join(v.known_types)}); refusing to connect (possible "
                            "man-in-the-middle; fix known_hosts if the node was reinstalled)")
        if not self.accept_new:
            raise UserError(f"{who}: unknown host key {key.get_name()} {fp} for {n.host}:{n.port} (not in "
                            f"{self.user_file} or {hostkeys.system_known_hosts()}); verify it, then pin it as "
                            "host_key in the inventory or rerun with --accept-new-host-keys")
        hostkeys.append(self.user_file, hostname, key)
        log.warning("%s: accepted new host key %s (saved to %s)", who, fp, self.user_file)


def _preferring(types: list[str]):
    """A paramiko transport factory offering these host-key algorithms first (OpenSSH orders its
    HostKeyAlgorithms by the keys it knows for the host; paramiko only by its own preference)."""
    def factory(*args, **kwargs) -> paramiko.Transport:
        t = paramiko.Transport(*args, **kwargs)
        opts = t.get_security_options()
        # Plain host keys only: a certificate's trust comes from @cert-authority lines, which are
        # not used (runner/inventory/hostkeys.py), so it would be checked as a key it is not.
        plain = [a for a in opts.key_types if "-cert-v01@" not in a]
        want = [a for a in hostkeys.key_types(types) if a in plain]
        opts.key_types = want + [a for a in plain if a not in want]
        return t
    return factory


@dataclass
class Result:
    rc: int
    out: str
    err: str


class Remote(NodeFiles):
    """One verified SSH connection to one node (thread-safe for independent channels)."""

    def __init__(self, node: Node, accept_new_host_keys: bool = False, who: str | None = None):
        self.node = node
        self.accept_new = accept_new_host_keys
        self.who = who or f"node {node.name}"  # how messages name it ("bastion USER@HOST:PORT" for one)
        self.bastion: Remote | None = None      # the shared connection this node's SSH rides, if any
        self._lease = None
        self.client: paramiko.SSHClient | None = None
        self.host_key: paramiko.PKey | None = None  # the key verified on connect
        self.auth_key: paramiko.PKey | None = None  # the user key the node accepted
        self.host_key_fp: str | None = None
        self._docker = None
        self._sftp: paramiko.SFTPClient | None = None
        self._home: str | None = None
        self._lock = threading.Lock()

    # -- connection --------------------------------------------------------------------
    def connect(self) -> Remote:
        n = self.node
        if n.identity_file and not os.path.isfile(n.identity_file):
            raise UserError(f"{self.who}: identity_file not found: {n.identity_file}")
        if n.proxy_jump is not None and self.bastion is None:
            self._open_bastion()
        try:
            return self._connect()
        except BaseException:
            self._release_bastion()
            raise

    def _connect(self) -> Remote:
        n = self.node
        user_file = n.known_hosts or os.path.expanduser("~/.ssh/known_hosts")
        files = [] if n.host_key else [hostkeys.load(user_file), hostkeys.load(hostkeys.system_known_hosts())]
        name = known_hosts_name(n.host, n.port)
        types = hostkeys.known_types(files, name)
        seen: dict[str, str] = {}  # key type -> fingerprint the node presented
        while True:
            try:
                self.client = self._handshake(_Verify(n, user_file, files, self.accept_new, self.who), types)
                break
            except _PinMismatch as exc:
                # A pin may be of any of the node's key types (`ssh-keyscan` prints them all); the
                # server shows one per connection: ask again preferring the types not seen yet.
                got = exc.presented.get_name()
                again = got in seen
                seen[got] = fingerprint(exc.presented)
                tried = hostkeys.key_types(list(seen))
                types = [t for t in hostkeys.ALL_TYPES if t not in tried]
                if again or not types:
                    keys = ", ".join(f"{t} {fp}" for t, fp in seen.items())
                    raise UserError(f"{self.who}: host key mismatch for {n.host}:{n.port}: pinned {n.host_key}, "
                                    f"the node's keys are {keys}; if the node was reinstalled, verify and update "
                                    "host_key in the inventory") from None
        transport = self.client.get_transport()
        assert transport is not None
        transport.set_keepalive(5)  # notice a node that vanished
        self.host_key = transport.get_remote_server_key()
        self.host_key_fp = fingerprint(self.host_key)
        # The key the node accepted (identity_file's, or one of ssh-agent's): the OpenSSH client
        # of the bulk streams is given the same one (identity_args).
        self.auth_key = getattr(transport.auth_handler, "private_key", None)
        return self

    def identity_args(self, tmp_dir: str) -> list[str]:
        """OpenSSH's identity options for the key this connection authenticated with, so both SSH
        stacks use one key: an agent's key as its public half (OpenSSH signs with the agent),
        else identity_file; IdentitiesOnly, so no other agent key is offered first (a node's
        MaxAuthTries counts them). [] where paramiko found the key itself (~/.ssh/id_*)."""
        if isinstance(self.auth_key, paramiko.AgentKey):
            pub = os.path.join(tmp_dir, f"identity-{id(self)}.pub")
            with open(pub, "w") as fh:
                fh.write(f"{self.auth_key.get_name()} {self.auth_key.get_base64()}\n")
            return ["-i", pub, "-o", "IdentitiesOnly=yes"]
        if self.node.identity_file:
            return ["-i", self.node.identity_file, "-o", "IdentitiesOnly=yes"]
        return []

    def _open_bastion(self) -> None:
        """Hold the shared, verified connection to this node's bastion (connected by the first
        node that needs it). Its failure is this node's, named with the bastion."""
        n, j = self.node, self.node.proxy_jump
        via = Node(name=n.name, host=j.host, port=j.port, user=j.user, identity_file=j.identity_file,
                   known_hosts=n.known_hosts, host_key=j.host_key)
        key = (j, n.known_hosts, self.accept_new)
        try:
            self.bastion, self._lease = BASTIONS.acquire(
                key, lambda: Remote(via, self.accept_new, who=f"bastion {j}").connect(), lambda r: r.alive)
        except UserError as exc:
            raise UserError(f"{self.who}: {exc}") from None

    def _release_bastion(self) -> None:
        if self._lease is not None:
            lease, self._lease, self.bastion = self._lease, None, None
            BASTIONS.release(lease)

    def _where(self) -> str:
        n = self.node
        return f"{n.host}:{n.port}" + (f" via bastion {n.proxy_jump}" if n.proxy_jump else "")

    def _open_socket(self):
        """A TCP connection to the node, or a direct-tcpip channel to it through the bastion."""
        n = self.node
        if self.bastion is None:
            sock = socket.create_connection((n.host, n.port), timeout=CONNECT_TIMEOUT)
            # Small SSH messages back to back (open a channel, then exec in it) otherwise wait out
            # the peer's delayed ACK: 40 ms per command, 5 ms per SFTP call, measured on loopback.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        t = self.bastion.client.get_transport() if self.bastion.client else None
        if t is None or not t.is_active():
            raise paramiko.SSHException("the bastion's connection was lost")
        # The bastion connects to the node; the originator address is only informational.
        return t.open_channel("direct-tcpip", (n.host, n.port), ("127.0.0.1", 0), timeout=CONNECT_TIMEOUT)

    def _handshake(self, policy: _Verify, types: list[str]) -> paramiko.SSHClient:
        n = self.node
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(policy)
        sock = None
        try:
            sock = self._open_socket()
            # Keys as OpenSSH offers them: identity_file (or ~/.ssh/id_* without one) and ssh-agent's
            # keys together; a passphrase-protected identity_file is used through the agent.
            client.connect(n.host, port=n.port, username=n.user, key_filename=n.identity_file,
                           look_for_keys=n.identity_file is None, allow_agent=True,
                           timeout=CONNECT_TIMEOUT, banner_timeout=CONNECT_TIMEOUT, auth_timeout=CONNECT_TIMEOUT,
                           channel_timeout=CONNECT_TIMEOUT, transport_factory=_preferring(types), sock=sock)
            return client
        except (UserError, _PinMismatch):
            client.close()
            raise
        except paramiko.PasswordRequiredException:
            client.close()
            raise UserError(f"{self.who}: identity_file {n.identity_file} is protected by a passphrase and no "
                            f"key of ssh-agent was accepted for {n.user}@{self._where()}: `ssh-add "
                            f"{n.identity_file}` (the runner asks for no passphrase)") from None
        except paramiko.AuthenticationException as exc:
            client.close()
            raise UserError(f"{self.who}: SSH authentication failed for {n.user}@{self._where()} ({exc}); "
                            "check user and identity_file") from None
        except (OSError, paramiko.SSHException) as exc:
            client.close()
            if sock is not None:
                sock.close()
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            if isinstance(exc, paramiko.SSHException) and ("banner" in why or "No existing session" in why):
                # TCP got through but sshd never spoke: a hung host or a partitioned network.
                why = f"no SSH answer within {CONNECT_TIMEOUT:.0f}s ({self.who.split()[0]} hung or network partitioned)"
            raise UserError(f"{self.who}: cannot connect to {self._where()}: {why}") from None

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
        """Also lets go of the bastion (closed once no node behind it is connected)."""
        if self._docker is not None:
            try:
                self._docker.close()
            except Exception:  # noqa: BLE001 - best effort on shutdown
                pass
            self._docker = None
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
        self._release_bastion()

    def __enter__(self) -> Remote:
        return self.connect() if self.client is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- commands ------------------------------------------------------------------------
    def run(self, command: str | list[str], timeout: float = 60.0, stdin: bytes | None = None,
            check: bool = False, max_output: int = MAX_OUTPUT, hold_stdin: bool = False) -> Result:
        """Run a command (a list is shell-quoted). Never put secrets in it: argv is visible on the node.
        Its stdout and its stderr are each read up to max_output bytes: a node that writes more is
        named in one UserError and the command is treated as failed (its channel closed).
        hold_stdin: stdin stays open after `stdin` until the command ends, so the command sees the
        runner's connection ending as EOF (runner/delivery/registry.py cleans up on it)."""
        if isinstance(command, list):
            command = shlex.join(command)
        assert self.client is not None, "not connected"
        chan = self.client.get_transport().open_session(timeout=CONNECT_TIMEOUT)
        chan.settimeout(timeout)
        deadline = time.monotonic() + timeout
        # The wait between reads or sends (settimeout) does not end a node that moves a byte just
        # inside it, forever: at the deadline the channel is closed, which ends every wait at once.
        expired = threading.Event()
        alarm = threading.Timer(timeout, lambda: (expired.set(), close_quietly(chan)))
        alarm.daemon = True
        alarm.start()
        try:
            return self._run(chan, command, stdin, hold_stdin, check, max_output, deadline, expired)
        except (OSError, EOFError, paramiko.SSHException) as e:  # TimeoutError is an OSError
            if not (isinstance(e, TimeoutError) or expired.is_set()):
                raise
            close_quietly(chan)
            raise UserError(f"node {self.node.name}: command timed out after {timeout:.0f}s: {command[:80]}") from None
        finally:
            alarm.cancel()

    def _run(self, chan: paramiko.Channel, command: str, stdin: bytes | None, hold_stdin: bool, check: bool,
             max_output: int, deadline: float, expired: threading.Event) -> Result:
        chan.exec_command(command)
        if stdin is not None:
            chan.sendall(stdin)
        if stdin is not None and not hold_stdin:
            chan.shutdown_write()
        err, over = bytearray(), []

        def read_err() -> None:
            try:
                got, too_much = read_capped(chan.recv_stderr, max_output)
            except OSError:
                return
            err.extend(got)
            if too_much:
                over.append("stderr")
                chan.close()  # stdout's reader sees the end at once

        t = threading.Thread(target=read_err, daemon=True)
        t.start()
        out, too_much = read_capped(chan.recv, max_output)
        if too_much:
            over.append("stdout")
            chan.close()  # the node stops being read; stderr's reader sees the end
        t.join(max(0.0, deadline - time.monotonic()))
        # An exit status the node never sends must not hold the runner either.
        if expired.is_set() or (not over and not chan.status_event.wait(max(0.0, deadline - time.monotonic()))):
            raise TimeoutError
        if over:
            chan.close()
            raise UserError(f"node {self.node.name}: `{command[:80]}` wrote more than {max_output >> 20} MiB to "
                            f"{over[0]}; treated as failed (a command's output is capped)")
        rc = chan.recv_exit_status()
        chan.close()
        res = Result(rc, out.decode(errors="replace"), err.decode(errors="replace"))
        if check and rc != 0:
            last = (res.err or res.out).strip().splitlines()[-1:] or [""]
            raise UserError(f"node {self.node.name}: `{command[:80]}` failed (exit {rc}): {visible(last[0])[:300]}")
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
        has no AES instructions.

        `-F /dev/null`: no ssh config (the user's, or the system's) may change where this goes or
        how (a HostName, a ProxyCommand, a stale ControlMaster socket): what was resolved and
        verified is spelled out here. Behind a bastion, both hops are pinned to the keys paramiko
        verified (runner/transport/jump.py), and each hop logs in with the key paramiko's did."""
        n = self.node
        assert self.client is not None, "not connected"
        key = self.client.get_transport().get_remote_server_key()
        if not hasattr(self, "_kh_dir"):
            self._kh_dir = tempfile.mkdtemp(prefix="runner-kh-")
        kh = os.path.join(self._kh_dir, "known_hosts")
        lines = [f"{known_hosts_name(n.host, n.port)} {key.get_name()} {key.get_base64()}\n"]
        bastion_key = self.bastion.host_key if self.bastion else None
        if bastion_key is not None:
            j = n.proxy_jump
            lines.append(f"{known_hosts_name(j.host, j.port)} {bastion_key.get_name()} {bastion_key.get_base64()}\n")
        with open(kh, "w") as fh:
            fh.writelines(lines)
        strict = ["-F", "/dev/null", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                  "-o", f"UserKnownHostsFile={kh}", "-o", "GlobalKnownHostsFile=/dev/null",
                  "-o", "ControlMaster=no", "-o", "ControlPath=none",
                  "-o", f"ConnectTimeout={int(CONNECT_TIMEOUT)}", "-o", "LogLevel=ERROR",
                  "-o", f"ServerAliveInterval={ALIVE_S}", "-o", f"ServerAliveCountMax={ALIVE_COUNT}"]
        argv = ["ssh", "-p", str(n.port), "-l", n.user, *strict]
        if bastion_key is not None:
            hop = proxy_command(n.proxy_jump, strict, n.host, n.port, self.bastion.identity_args(self._kh_dir))
            argv += ["-o", f"ProxyCommand={hop}"]
        argv += self.identity_args(self._kh_dir)
        if compress:
            argv.append("-C")
        if aes:
            argv += ["-o", "Ciphers=aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com"]
        return argv + [n.host]

    def keep_openssh_files(self) -> str | None:
        """The directory of openssh_argv's files (pinned known_hosts, an agent key's public half),
        from now on not removed by close(): for an argv run once this connection is closed (`runner
        exec`). The caller removes it; None when openssh_argv made none."""
        return self.__dict__.pop("_kh_dir", None)

    def ping(self, timeout: float = 6.0) -> None:
        """Round trip over a dedicated SFTP session (cheap: no shell), raising if the node is gone."""
        if not hasattr(self, "_ping_sftp"):
            # Opened with the same timeout: open_sftp() would wait up to an hour on a hung node.
            chan = self.client.get_transport().open_session(timeout=timeout)
            chan.invoke_subsystem("sftp")
            self._ping_sftp = WatchedSFTP(chan, self.node.name, timeout)
        self._ping_sftp.stat(".")

    # -- docker ---------------------------------------------------------------------------
    def docker(self, timeout: float = 60.0):
        """docker.DockerClient for this node's engine, riding this verified SSH connection."""
        with self._lock:
            if self._docker is None:
                from runner.transport.docker_answers import docker_client

                assert self.client is not None, "not connected"
                self._docker = docker_client(self.client, timeout, self.node.name)
            return self._docker


def is_loopback(host: str) -> bool:
    """Bulk streams to such a node skip compression: it only burns the CPU both ends share."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def connect_each(nodes: list[Node], accept_new_host_keys: bool = False, workers: int = DEFAULT_PARALLEL
                 ) -> tuple[dict[str, Remote], dict[str, str]]:
    """Connect to every node, `workers` at a time: (connected remotes, {node: one-line reason} for the rest)."""
    remotes: dict[str, Remote] = {}
    failed: dict[str, str] = {}
    for n, r, exc in parallel(nodes, lambda n: Remote(n, accept_new_host_keys).connect(), workers):
        if exc is None:
            remotes[n.name] = r
        elif isinstance(exc, UserError):
            failed[n.name] = str(exc)
        else:  # any other connect failure is this node's problem
            failed[n.name] = f"node {n.name}: cannot connect: {exc}"
    return remotes, failed


def connect_all(nodes: list[Node], accept_new_host_keys: bool = False, workers: int = DEFAULT_PARALLEL
                ) -> dict[str, Remote]:
    """Connect to every node; one UserError naming every node that failed."""
    remotes, failed = connect_each(nodes, accept_new_host_keys, workers)
    if failed:
        for r in remotes.values():
            r.close()
        raise UserError("; ".join(failed.values()))
    return remotes
