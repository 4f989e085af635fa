"""A container's output as its node's engine streams it: read in bounded pieces, and read to its
end when the container exits.

The engine's answer to GET /containers/{id}/logs is a series of frames (an 8-byte header whose last
4 bytes give the payload's length, then the payload). docker's own reader trusts that length and
reads it at once (up to 4 GiB held from one header); `log_chunks` never holds more than a PIECE.

`FollowedLog` is what `runner up` and `runner logs -f` read. Docker 20.10 (Debian 12's docker.io,
Raspberry Pi OS's) ends a follow when the container exits even where its reader of the json-file
is still behind the writer: measured on this machine's engine, under load (4 busy loops on 2
cores), 6 of 12 containers that printed 40,001 lines and exited lost a contiguous tail of 14,700 to
32,900 lines from the follow, every one of them in the engine's log file (`docker logs` had them
all; in an earlier run of 12, 4 lost 28,000 to 31,000). The tail is
what a user reads first: the last loss, the traceback. So the follow asks for each frame's
timestamp (stripped here: what is kept and shown is the job's bytes), and once the container has
exited, `rest()` reads the log again from the newest timestamp the follow gave and passes on what
comes after the frames already seen. The engine's `since` is inclusive and every piece of one long
line carries the first piece's timestamp, so the frames at that timestamp are counted, not
compared. An engine whose frames carry no timestamp (it ignored the ask, or a TTY container's
stream, which has no frames) is followed as before and not read again.
"""

from __future__ import annotations

import calendar
import re
from collections.abc import Iterator

from runner.core.node_output import MAX_KEPT_LOG, PIECE, LineSplitter

# RFC 3339 with nanoseconds, as the engine writes each frame's time (Docker: always 9 digits, UTC),
# then one space. A frame that does not start with it is taken as the engine's no.
_STAMP = re.compile(rb"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d) ")


def stamp_ns(piece: bytes) -> tuple[int, int] | None:
    """(nanoseconds since the epoch, length of the stamp and its space) of a frame's first piece, or
    None where it does not start with a timestamp."""
    m = _STAMP.match(piece)
    if m is None:
        return None
    y, mo, d, h, mi, s = (int(g) for g in m.groups()[:6])
    if not (1 <= mo <= 12 and 1 <= d <= 31 and h < 24 and mi < 60 and s < 61):
        return None
    zone = m.group(8)
    offset = 0 if zone == b"Z" else (1 if zone[:1] == b"+" else -1) * (int(zone[1:3]) * 3600 + int(zone[4:6]) * 60)
    seconds = calendar.timegm((y, mo, d, h, mi, s, 0, 0, 0)) - offset
    return seconds * 1_000_000_000 + int((m.group(7) or b"0").ljust(9, b"0")), m.end()


def _tty(container) -> bool:
    config = container.attrs.get("Config") if isinstance(container.attrs, dict) else None  # the node's word
    return isinstance(config, dict) and bool(config.get("Tty"))


def _frames(container, params: dict) -> Iterator[tuple[bool, bytes]]:
    """(whether the piece starts a frame, the piece) for the engine's answer to a logs call, each
    piece at most PIECE bytes. A TTY container's stream has no frames: its pieces come as they are,
    none starting a frame."""
    api = container.client.api
    res = api._get(api._url("/containers/{0}/logs", container.id), params=params, stream=True)
    try:
        api._raise_for_status(res)
        if params.get("follow"):  # a quiet rank must not time the stream out (docker's reader does the same)
            api._disable_socket_timeout(api._get_raw_response_socket(res))
        raw = res.raw
        if _tty(container):  # no frames (the runner makes no such container)
            read = getattr(raw, "read1", raw.read)  # urllib3 1.x has no read1: whole pieces then
            while data := read(PIECE):
                yield False, data
            return
        while len(header := raw.read(8)) == 8:
            left, first = int.from_bytes(header[4:8], "big"), True
            while left > 0:
                data = raw.read(min(left, PIECE))
                if not data:
                    return
                left -= len(data)
                yield first, data
                first = False
    finally:
        res.close()


def _params(*, follow: bool, tail: int | str, timestamps: bool = False, since: str | None = None) -> dict:
    params = {"stdout": 1, "stderr": 1, "timestamps": int(timestamps), "follow": int(follow), "tail": tail}
    if since is not None:
        params["since"] = since
    return params


def log_chunks(container, *, follow: bool, tail: int | str = "all") -> Iterator[bytes]:
    """A container's output (stdout and stderr as they interleave) as the engine streams it, in
    pieces of at most PIECE bytes."""
    for _, piece in _frames(container, _params(follow=follow, tail=tail)):
        yield piece


def log_tail(container, lines: int) -> list[str]:
    """The last `lines` lines of a container's output, shown (cut, made visible), for an error
    message: never more than lines x MAX_LINE held."""
    from collections import deque

    keep: deque[str] = deque(maxlen=lines)
    split = LineSplitter()
    for chunk in log_chunks(container, follow=False, tail=lines):
        keep.extend(split.feed(chunk))
    keep.extend(split.end())
    return list(keep)


class FollowedLog:
    """One container's output followed while it runs (`follow()`), then, once it has exited, what
    the engine's follow left out (`rest()`): together every byte the engine kept, once each, in
    pieces of at most PIECE bytes."""

    def __init__(self, container, tail: int | str = "all"):
        self.container, self.tail = container, tail
        self.newest: int | None = None  # the newest frame's timestamp (ns) the follow gave
        self.at_newest = 0              # how many frames carried it
        self.timed = not _tty(container)  # every frame so far began with a timestamp (a TTY's stream has no frames)
        self.caught_up = 0              # frames rest() passed on (the follow's shortfall)

    def _take(self, first: bool, piece: bytes) -> bytes:
        """The piece without its frame's timestamp, noting the timestamp."""
        if not first or not self.timed:
            return piece
        got = stamp_ns(piece)
        if got is None:  # the engine did not stamp its frames: pass them on whole, read nothing again
            self.timed = False
            return piece
        self._note(got[0])
        return piece[got[1]:]

    def _note(self, ns: int) -> None:
        """A frame stamped ns was passed on."""
        if ns == self.newest:
            self.at_newest += 1
        elif self.newest is None or ns > self.newest:
            self.newest, self.at_newest = ns, 1

    def follow(self) -> Iterator[bytes]:
        for first, piece in _frames(self.container, _params(follow=True, tail=self.tail, timestamps=self.timed)):
            if piece := self._take(first, piece):
                yield piece

    def rest(self, max_bytes: int = 2 * MAX_KEPT_LOG) -> Iterator[bytes]:
        """After the container exited: the frames after those follow() gave (all of them where it
        gave none, from the same tail), at most max_bytes of them (what this machine keeps of a
        node's output; an engine that sends more is not read further)."""
        import docker.errors  # here, not at import: urllib3 opens a socket as it loads (dry runs open none)

        if not self.timed:
            return
        newest, seen, since = self.newest, self.at_newest, None
        if newest is not None:
            since = f"{newest // 1_000_000_000}.{newest % 1_000_000_000:09d}"
        frames = _frames(self.container, _params(follow=False, tail="all" if since else self.tail, timestamps=True,
                                                 since=since))
        try:
            yield from self._after(frames, newest, seen, max_bytes)
        except docker.errors.NotFound:  # removed since it exited (`runner down`): nothing left to read
            return

    def _after(self, frames: Iterator[tuple[bool, bytes]], newest: int | None, seen: int,
               left: int) -> Iterator[bytes]:
        """The pieces of frames after the `seen` frames stamped `newest` (and any older)."""
        skip = False
        for first, piece in frames:
            if first:
                got = stamp_ns(piece)
                if got is None:  # not stamped as the follow's frames were: not the same log, read no further
                    return
                ns, cut = got
                skip = newest is not None and (ns < newest or (ns == newest and seen > 0))
                if skip:
                    seen -= ns == newest
                    continue
                self.caught_up += 1
                self._note(ns)
                piece = piece[cut:]
            elif skip:
                continue
            if len(piece) > left:
                return
            left -= len(piece)
            if piece:
                yield piece
