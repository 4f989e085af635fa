"""Bastions (a node's `proxy_jump`): one verified SSH connection per bastion, shared by every node
behind it, and the OpenSSH ProxyCommand that takes the bulk streams through the same bastion.

Why one shared connection: a bastion's sshd drops unauthenticated connections beyond MaxStartups
(10 by default), so 64 nodes connecting at once through 64 bastion connections would fail at
random; one handshake serves them all, each node riding its own `direct-tcpip` channel. And nodes
that ask while the bastion is being connected wait for that one attempt: a dead bastion fails every
node behind it within one connect timeout, not one timeout per node. The connection is closed when
the last node behind it lets go; a bastion that dropped is connected again by the next node asking.

The streams (push, collect) run OpenSSH. Its `-J` hands the jump to a second `ssh` that reads the
user's config and known_hosts and none of our options, so the jump is spelled out instead: a
ProxyCommand running `ssh -W host:port bastion` with the same strict options (`-F /dev/null`,
BatchMode, StrictHostKeyChecking=yes and the temporary known_hosts holding both keys paramiko
verified). Every piece is shell-quoted; the host names and users were validated by the inventory.
"""

from __future__ import annotations

import shlex
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from runner.inventory import Jump


@dataclass(eq=False)
class Lease:
    """One node's hold on a shared bastion connection (release it exactly once)."""
    key: Hashable
    future: Future = field(default_factory=Future)
    refs: int = 0


class Bastions:
    """Shared connections by key, counted: acquire() connects once, release() closes at zero."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: dict[Hashable, Lease] = {}

    def acquire(self, key: Hashable, connect: Callable[[], Any], alive: Callable[[Any], bool]) -> tuple[Any, Lease]:
        """(the connection, the lease to release). connect() runs in the first caller's thread;
        callers arriving meanwhile get its result or its exception."""
        with self._lock:
            lease = self._current.get(key)
            if lease is not None and lease.future.done() and (
                    lease.future.exception() is not None or not alive(lease.future.result())):
                lease = None  # failed or dropped: this caller tries again (the old one's holders keep theirs)
            mine = lease is None
            if lease is None:
                lease = self._current[key] = Lease(key)
            lease.refs += 1
        if mine:
            try:
                lease.future.set_result(connect())
            except BaseException as exc:  # noqa: BLE001 - handed to every waiter, then raised below
                lease.future.set_exception(exc)
        try:
            return lease.future.result(), lease
        except BaseException:
            self.release(lease)
            raise

    def release(self, lease: Lease) -> None:
        with self._lock:
            lease.refs -= 1
            if lease.refs > 0:
                return
            if self._current.get(lease.key) is lease:
                del self._current[lease.key]
        if lease.future.done() and lease.future.exception() is None:
            lease.future.result().close()

    def __len__(self) -> int:
        """Connections held now (tests: one per bastion, whatever the number of nodes)."""
        with self._lock:
            return sum(1 for x in self._current.values() if x.future.done() and x.future.exception() is None)


BASTIONS = Bastions()


def proxy_command(jump: Jump, options: list[str], host: str, port: int, identity: list[str] | None = None) -> str:
    """OpenSSH `ProxyCommand` value reaching host:port through the bastion, with `options` (the
    strict ones of the outer ssh: -F, known_hosts, BatchMode, timeouts) and `identity` (the
    bastion's identity options, Remote.identity_args; default its identity_file alone). The outer
    ssh expands `%` tokens in the whole command and the inner one again in the identity path, so a
    literal % there is doubled twice."""
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if identity is None:
        identity = ["-i", jump.identity_file, "-o", "IdentitiesOnly=yes"] if jump.identity_file else []
    inner = ["ssh", *options, "-p", str(jump.port), "-l", jump.user]
    for i, a in enumerate(identity):  # a path after -i is %-expanded by the inner ssh too
        inner.append(a.replace("%", "%%") if i and identity[i - 1] == "-i" else a)
    inner += ["-W", target, jump.host]
    return " ".join(shlex.quote(a) for a in inner).replace("%", "%%")
