"""What every backend's hang watch shares (issue 57): heartbeat files read from where a backend
finds them (a node over SFTP: runner/backends/ssh/hang_watch.py; a Slurm run dir on the shared
filesystem: runner/backends/slurm/hang.py), judged by one rule (contract/hang.py), announced in
one line.

The files are never trusted (a job wrote them): only regular files named rank<R>.json of at most
contract.heartbeat.MAX_BYTES, each validated (`contract.heartbeat.parse`) and holding the rank its
name says; a refused one is named once in a warning and left out. Files an earlier attempt left in
the run dir (a resume, a requeue, an elastic layout with fewer ranks) are told apart by never
moving: a file is taken only once it has changed since this reader first saw it, and only when it
belongs to this launch's world size.
"""

from __future__ import annotations

import logging
import stat
import time
from collections.abc import Callable, Iterable

from contract import hang as rule
from contract import heartbeat as fmt
from runner.core.node_output import visible
from runner.transport.sftp import WatchedSFTP, listdir_within
from runner.transport.ssh import Remote

log = logging.getLogger("runner.watch")
POLL_S = 2.0               # between two rounds of reads (the trainer writes every watch.heartbeat_s: 1 s)
READ_TIMEOUT_S = 10.0      # one SFTP answer, whole
MAX_FILES = 4096           # entries of a heartbeat dir looked at
STACKS_TIMEOUT_S = 60.0    # the helper waits 5 s for handlers, py-spy at most 30 s a stopped rank

# A listed entry: (file name, st_mode or None, st_size or None), as an SFTP listing or an lstat gives them.
Entry = tuple[str, "int | None", "int | None"]


def stopping_line(verdict_line: str, then: str = "stopping the run") -> str:
    """The one line a hang is announced with, before the stacks are taken and the run stopped (or,
    `then`, regrouped without the rank), from the rule's own (a contract.hang.Verdict's line: node,
    rank, step, phase, how long, why)."""
    return f"runner: {verdict_line}; taking every rank's stacks, then {then}"


def watched_sftp(remote: Remote, who: str) -> WatchedSFTP:
    """A dedicated SFTP session on `remote`'s connection, every answer whole within READ_TIMEOUT_S."""
    client = remote.client
    transport = client.get_transport() if client is not None else None
    if transport is None:
        raise ConnectionError("not connected")
    chan = transport.open_session(timeout=READ_TIMEOUT_S)
    chan.invoke_subsystem("sftp")
    return WatchedSFTP(chan, who, READ_TIMEOUT_S)


class BeatReader:
    """One per launch: `take` the listed heartbeat files of a place (a node, a run dir), `feed`
    what they held to the rule, `verdict` says whether the job is hung (a contract.hang.Verdict)."""

    def __init__(self, world: int | None, hang_timeout_s: float | None,
                 clock: Callable[[], float] = time.monotonic):
        self.world, self.clock = world, clock
        self.watch = rule.Watch(hang_timeout_s=hang_timeout_s, started=clock())
        self._first: dict[tuple[str, str], tuple] = {}   # (place, file) -> what it held when first seen
        self._fresh: set[tuple[str, str]] = set()        # ... files that moved since: this launch's
        self._refused: set[tuple[str, str]] = set()

    def take(self, place: str, entries: Iterable[Entry], read: Callable[[str], bytes]) -> list[fmt.Heartbeat]:
        """The heartbeats of one place's listing that belong to this launch. `read(name)` returns at
        most MAX_BYTES + 1 bytes of the file, or raises OSError (replaced since the listing: the next
        round has it)."""
        out = []
        for name, mode, size in entries:
            m = fmt.NAME_RE.fullmatch(name)
            if not m or mode is None or not stat.S_ISREG(mode) or (size or 0) > fmt.MAX_BYTES:
                continue
            key = (place, name)
            try:
                beat = fmt.parse(read(name), f"{place}: {fmt.DIR}/{name}")
                if beat.rank != int(m[1]):
                    raise ValueError(f"{place}: {fmt.DIR}/{name} holds rank {beat.rank}")
            except OSError:
                continue
            except ValueError as exc:
                if key not in self._refused:
                    self._refused.add(key)
                    log.warning("hang watch: %s; left out", visible(str(exc))[:300])
                continue
            mark = (beat.pid, beat.pid_start, beat.seq)
            if key not in self._fresh:
                if self._first.setdefault(key, mark) == mark:
                    continue  # unchanged since first seen: an earlier attempt's, or not moving yet
                self._fresh.add(key)
            if self.world is None or beat.world_size == self.world:
                out.append(beat)
        return out

    def take_sftp(self, place: str, sftp: WatchedSFTP, d: str) -> list[fmt.Heartbeat]:
        """`take` over an SFTP session: the heartbeat dir `d` listed (at most MAX_FILES entries, no
        link followed) and each file read bounded; [] while the dir does not exist yet."""
        try:
            entries = listdir_within(sftp, d, MAX_FILES) or []
        except OSError:
            return []

        def read(name: str) -> bytes:
            with sftp.open(f"{d}/{name}", "r") as fh:
                return fh.read(fmt.MAX_BYTES + 1)

        return self.take(place, ((a.filename, a.st_mode, a.st_size) for a in entries), read)

    def feed(self, beats: Iterable[fmt.Heartbeat]) -> None:
        now = self.clock()
        for b in beats:
            self.watch.update(b, now)

    def verdict(self) -> rule.Verdict | None:
        return self.watch.verdict(self.clock())

    def restart(self, world: int | None = None) -> None:
        """A new world (an in-place regroup, a requeued job): every file is an earlier one's until it
        moves again, and the rule starts over (with its start-up budget, from now)."""
        self.watch = rule.Watch(hang_timeout_s=self.watch.hang_timeout_s, started=self.clock())
        self._first.clear()
        self._fresh.clear()
        self.world = world
