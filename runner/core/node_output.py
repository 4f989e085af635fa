"""Bytes from a node or a job, bounded before they are held and made harmless before they are printed.

Whatever a node, its engine or a job writes is read in bounded pieces: lines are cut at MAX_LINE
bytes (the piece is shown with CUT_MARK and the rest of the line follows as the next piece), a
command's output is capped (runner/transport/ssh.py), a log stream's frames are read a piece at a time
whatever length their header claims. Before a line reaches the terminal, C0 and C1 control
characters (except tab) are shown in `cat -v` notation: ESC as `^[`, CR as `^M`, DEL as `^?`, the
C1 CSI (U+009B) as `M-^[`. So a job cannot write the clipboard (OSC 52), retitle the window, or
repaint a line as another node's (`\\r` + erase-line). The per-node log file keeps the raw bytes,
at most 2 x MAX_KEPT_LOG of them (KeptLog: the newest output, the file before it, older dropped).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

MAX_LINE = 64 << 10        # bytes of one line held or printed; a longer one goes on in pieces
PIECE = 64 << 10           # bytes read at a time from a stream whose frame says how long it is
CUT_MARK = " [runner: line over 64 KiB, cut here; it goes on in the next line]"
MAX_KEPT_LOG = 256 << 20   # bytes of one kept log file on this machine; then it becomes <name>.1

# C0 (but tab), DEL and C1: what a terminal acts on instead of showing.
_SHOW = {c: ("^" + chr(c + 64) if c < 0x20 else "^?" if c == 0x7f else "M-^" + chr(c - 0x80 + 64))
         for c in (*range(0x00, 0x09), *range(0x0a, 0x20), *range(0x7f, 0xa0))}


def visible(text: str) -> str:
    """text with every control character but tab shown as `cat -v` shows it (ESC -> `^[`)."""
    if text.isprintable():  # the common line: one scan in C, no copy (a tab takes the long way)
        return text
    return text.translate(_SHOW)


def visible_lines(text: str) -> str:
    """text's lines each made visible(): a multi-line report (a script shown) keeps its lines."""
    return "\n".join(visible(ln) for ln in text.split("\n"))


class LineSplitter:
    """Bytes in as they arrive, the lines they complete out as shown() makes them, each at most
    max_line bytes (a longer line comes out in pieces, each but the last marked cut). Linear: each
    byte is scanned once and the pending part of a line never exceeds max_line, however long the
    line or small the chunks."""

    def __init__(self, max_line: int = MAX_LINE):
        self.max_line = max_line
        self.pending = bytearray()

    def feed(self, chunk: bytes) -> list[str]:
        if not self.pending and chunk.endswith(b"\n") and len(chunk) <= self.max_line:
            return [shown(ln) for ln in chunk[:-1].split(b"\n")]  # whole lines: the usual frame
        out: list[str] = []
        start = 0
        while (nl := chunk.find(b"\n", start)) >= 0:
            self._add(chunk, start, nl, out)
            out.append(shown(self.pending))
            self.pending.clear()
            start = nl + 1
        self._add(chunk, start, len(chunk), out)
        return out

    def end(self) -> list[str]:
        """The last line, when the stream ended without a newline."""
        if not self.pending:
            return []
        line = shown(self.pending)
        self.pending.clear()
        return [line]

    def _add(self, chunk: bytes, start: int, stop: int, out: list[str]) -> None:
        """Append chunk[start:stop] (no newline in it) to the pending line, giving out full pieces."""
        p = self.pending
        while stop - start > self.max_line - len(p):
            take = self.max_line - len(p)
            p += chunk[start:start + take]
            cut = _char_boundary(p)
            out.append(shown(p[:cut], cut=True))
            del p[:cut]  # at most the 3 bytes of a UTF-8 character cut in two
            start += take
        p += chunk[start:stop]


def _char_boundary(b: bytearray) -> int:
    """Where to cut b (full) so that a UTF-8 character is not split: before its lead byte."""
    n = len(b)
    for i in range(n - 1, max(n - 4, 0) - 1, -1):
        c = b[i]
        if c < 0x80:
            return n
        if c >= 0xC0:  # a lead byte: whole if its character fits before n
            need = 2 if c < 0xE0 else 3 if c < 0xF0 else 4
            return n if i + need <= n else (i or n)
    return n


def shown(line: bytes | bytearray, cut: bool = False) -> str:
    """One line of node output as the terminal gets it: decoded, a CRLF's CR dropped, controls
    made visible, the cut marker on a piece of a longer line."""
    text = line.decode(errors="replace")
    if not text.isprintable():  # the usual line is printable as it is: one scan in C
        text = visible(text.rstrip("\r"))
    return text + CUT_MARK if cut else text


def cells(*values) -> list:
    """rich table cells from values a node gave (labels, states, versions): plain text, never read
    as rich markup (`[link=...]` would make a hyperlink), controls visible, at most 200 characters."""
    from rich.text import Text

    return [Text(visible(str(v))[:200]) for v in values]


class KeptLog:
    """A node's raw output kept on this machine as it arrives, bounded: `path` takes the newest
    bytes until it holds max_bytes, then becomes `path.1` (the one before is dropped) and a new
    `path` starts, so a node costs this disk at most 2 x max_bytes however much its job writes
    (docker's json-file `max-size`/`max-file` the same way). Appends to what an earlier watcher of
    the run kept (an elastic run's next layout). `files(path)` reads them back in order."""

    def __init__(self, path: Path, max_bytes: int | None = None):
        self.path, self.max_bytes = path, max_bytes or MAX_KEPT_LOG
        self.fh = open(path, "ab")
        self.size = self.fh.tell()
        self.dropped = False
        self.failed = False

    def write(self, chunk: bytes) -> None:
        """Keep chunk. A write this disk refuses (full, a quota) stops the keeping with one warning:
        the job, its streaming to the terminal and the node's own copy go on (before, the watcher
        took the error for a lost node and stopped the run)."""
        if self.failed:
            return
        try:
            view = memoryview(chunk)
            while view:
                if self.size >= self.max_bytes:
                    self._rotate()
                take = view[:self.max_bytes - self.size]
                self.fh.write(take)
                self.size += len(take)
                view = view[len(take):]
            self.fh.flush()
        except OSError as exc:
            self.failed = True
            logging.getLogger("runner.logs").warning(
                "%s: not kept from here on (%s); the run goes on, and its output is still shown here and kept on "
                "the node (`runner logs`)", self.path, exc.strerror or exc)

    def _rotate(self) -> None:
        self.fh.close()
        if not self.dropped and older(self.path).exists():  # once a watcher: what goes is named
            self.dropped = True
            logging.getLogger("runner.logs").warning(
                "%s: over 2 x %d MiB of output kept; the oldest is dropped from here on (the trainer's own "
                "log, logs/rank<r>.log, is in the node's run dir: `runner collect`)", self.path, self.max_bytes >> 20)
        os.replace(self.path, older(self.path))
        self.fh = open(self.path, "wb")
        self.size = 0

    def close(self) -> None:
        try:
            self.fh.close()
        except OSError:  # the buffered rest met the same full disk: already warned, or nothing was left
            pass

    @staticmethod
    def files(path: Path) -> list[Path]:
        """The kept files of one log, oldest first (a line cut at the turn goes on in the next)."""
        return [p for p in (older(path), path) if p.is_file()]


def older(path: Path) -> Path:
    return path.with_name(path.name + ".1")


def read_capped(recv: Callable[[int], bytes], cap: int, piece: int = PIECE) -> tuple[bytearray, bool]:
    """Read until EOF or until more than cap bytes came: (what was read, at most cap; over)."""
    buf = bytearray()
    while chunk := recv(piece):
        if len(buf) + len(chunk) > cap:
            buf += chunk[:cap - len(buf)]
            return buf, True
        buf += chunk
    return buf, False
