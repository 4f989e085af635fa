"""JSON that someone else wrote (a node's timeline pieces, a job's metrics.jsonl), read within bounds:
at most `max_bytes` of a file, at most MAX_VALUES values (each ',' and ':' counted in the bytes
before anything is parsed: parsed, 64 MiB of `{},` are 22 million dicts, 1.5 GiB), and nesting
past Python's recursion limit as a ValueError like any other malformed file (json raises
RecursionError, which is not one). Every failure is a ValueError naming the file.

`runner collect` reads what the nodes sent through here after it verified the bytes: before, a
timeline piece of 200,000 `[` ended `collect` in a RecursionError traceback, and any size was read
whole into the runner's memory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from contract.memory import size_text

MAX_VALUES = 2_000_000          # a real timeline piece: tens of thousands
MAX_FILE = 64 << 20             # a timeline piece or summary read whole (a real one: KBs to a few MB)


def loads(data: str | bytes, what: str, max_values: int = MAX_VALUES) -> Any:
    """json.loads of data, refused (ValueError naming `what`) past max_values values or nested
    past the recursion limit."""
    comma, colon = (",", ":") if isinstance(data, str) else (b",", b":")
    if data.count(comma) + data.count(colon) > max_values:
        raise ValueError(f"{what}: holds over {max_values:,} JSON values; not read")
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"{what}: JSON nested deeper than Python reads; not read") from None


def read(path: Path, max_bytes: int = MAX_FILE, max_values: int = MAX_VALUES) -> Any:
    """A whole JSON file of at most max_bytes (its size checked before, and the read stopped at it
    however it grows meanwhile)."""
    size = os.stat(path).st_size
    if size > max_bytes:
        raise ValueError(f"{path}: {size_text(size)}, over the {size_text(max_bytes)} such a file may be; not read")
    with open(path, "rb") as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{path}: grew past {size_text(max_bytes)} while read; not read")
    return loads(data, str(path), max_values)


def tail_lines(path: Path, max_bytes: int, max_line: int) -> tuple[list[bytes], bool]:
    """The complete lines in the last max_bytes of a file, each at most max_line bytes (longer ones
    left out), read a piece at a time: (lines, whether anything was left out). Never holds more
    than max_bytes plus one piece, however long a line without a newline runs."""
    piece = 1 << 20
    lines: list[bytes] = []
    dropped = False
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        start = max(0, size - max_bytes)
        fh.seek(start)
        pending, skipping = b"", start > 0  # a tail starts inside a line: its rest is not a line
        dropped = start > 0
        read = 0
        while read < max_bytes and (chunk := fh.read(min(piece, max_bytes - read))):
            read += len(chunk)
            parts = chunk.split(b"\n")
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                if skipping:
                    skipping = last  # the cut line ends at the first newline
                    continue
                pending += part
                if len(pending) > max_line:
                    dropped, pending, skipping = True, b"", last
                    continue
                if not last:
                    lines.append(pending)
                    pending = b""
        if pending:
            lines.append(pending)  # the last line, written without its newline yet
    return lines, dropped
