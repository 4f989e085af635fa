"""`Cluster`: the inventory's nodes connected over SSH (verified host keys), fanned out to in
parallel with --parallel, closed on exit; partial=True goes on with the nodes that answer."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

from runner.core.errors import UserError
from runner.core.fanout import DEFAULT_PARALLEL, parallel
from runner.inventory import Inventory, Node
from runner.inventory.choice import load
from runner.transport.ssh import Remote, connect_all, connect_each

T = TypeVar("T")


class Cluster:
    """The inventory's nodes, connected (verified host keys), closed on exit.

    partial=True (down, status, ls, logs) keeps going with the nodes that answer: one dead node
    must not stop `down` from stopping the others (that is how orphans are made). The nodes that
    could not be reached are in `unreachable` ({node: one-line reason}); if none answers at all,
    it is one error as with partial=False."""

    def __init__(self, inv: Inventory, accept_new_host_keys: bool = False, partial: bool = False,
                 workers: int = DEFAULT_PARALLEL):
        self.inv = inv
        self.accept_new = accept_new_host_keys
        self.partial = partial
        self.workers = workers
        self.remotes: dict[str, Remote] = {}
        self.unreachable: dict[str, str] = {}
        self.owner: Cluster | None = None  # the cluster this is a view of (view())

    def __enter__(self) -> Cluster:
        if not self.partial:
            self.remotes = connect_all(self.inv.nodes, self.accept_new, self.workers)
            return self
        self.remotes, self.unreachable = connect_each(self.inv.nodes, self.accept_new, self.workers)
        if not self.remotes:
            raise UserError("; ".join(self.unreachable.values()))
        return self

    def map(self, items: list, fn: Callable) -> list:
        """parallel() bounded by this command's --parallel."""
        return parallel(items, fn, self.workers)

    def __exit__(self, *exc) -> None:
        self.map(list(self.remotes.values()), Remote.close)

    def silent(self, timeout: float = 4.0) -> dict[str, str]:
        """The connected nodes that do not answer a ping within `timeout` now: node -> why. What a
        failed run asks before writing to its nodes: a write to a node behind a cut link would hang."""
        def ping(r: Remote) -> None:
            if not r.alive:
                raise ConnectionError("SSH connection closed")
            r.ping(timeout)

        out = {}
        for r, _, err in self.map(list(self.remotes.values()), ping):
            if err is not None:
                out[r.node.name] = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        return out

    def view(self, inv: Inventory) -> Cluster:
        """The same connections for a subset of the nodes (an elastic run's current layout): not
        entered, not closed; this cluster owns the connections."""
        v = Cluster(inv, self.accept_new, self.partial, self.workers)
        v.remotes = {n.name: self.remotes[n.name] for n in inv.nodes}
        v.owner = self
        return v

    def reconnected(self, name: str, remote: Remote) -> None:
        """A node's new connection (a lost node that answers again), here and in the cluster this is a
        view of: the next layout's view is made from that one, and must not get the dead connection."""
        self.remotes[name] = remote
        if self.owner is not None:
            self.owner.reconnected(name, remote)

    def __getitem__(self, name: str) -> Remote:
        return self.remotes[name]

    def reachable(self) -> list[Node]:
        """Connected nodes, master first (node rank order)."""
        return [n for n in self.inv.ordered() if n.name in self.remotes]

    def warn_unreachable(self, consequence: str = "left out") -> None:
        """One stderr line per node that did not answer, saying what that means for this command."""
        for msg in self.unreachable.values():
            sys.stderr.write(f"runner: warning: {msg} ({consequence})\n")

    def each(self, fn: Callable[[Remote], T]) -> dict[str, T]:
        """Run fn on every connected node in parallel; one UserError naming every node that failed."""
        res = self.map([self.remotes[n.name] for n in self.inv.nodes if n.name in self.remotes], fn)
        errors = [f"{r.node.name}: {_short(e)}" for r, _, e in res if e is not None]
        if errors:
            raise UserError("; ".join(errors))
        return {r.node.name: v for r, v, _ in res}


def _short(e: Exception) -> str:
    s = str(e).strip().splitlines()
    msg = s[0] if s else type(e).__name__
    return msg.split(": ", 1)[1] if msg.startswith("node ") and ": " in msg else msg


def open_nodes(args) -> Cluster:
    """The nodes of the command's inventory (its job section not read), for the commands that look
    for runs on them (status, ls, logs, down, collect, exec): going on with the nodes that answer."""
    return Cluster(load(args, with_job=False), args.accept_new_host_keys, partial=True, workers=args.parallel)
