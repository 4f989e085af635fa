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
PIECE = 1 << 20                 # bytes read at a time by tail_lines


def value_count(data: str | bytes) -> int:
    """An upper bound on the values in a JSON text, before parsing it: each value after the first
    follows a ',' or a ':' (one inside a string counts too: only against the text)."""
    if isinstance(data, str):
        return data.count(",") + data.count(":")
    return data.count(b",") + data.count(b":")


def loads(data: str | bytes, what: str, max_values: int = MAX_VALUES) -> Any:
    """json.loads of data, refused (ValueError naming `what`) past max_values values or nested
    past the recursion limit."""
    if value_count(data) > max_values:
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
    lines: list[bytes] = []
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        start = max(0, size - max_bytes)
        fh.seek(start)
        # A tail that starts inside a line: that line's rest is not a line.
        pending, skipping, dropped = b"", start > 0, start > 0
        left = max_bytes
        while left > 0 and (chunk := fh.read(min(PIECE, left))):
            left -= len(chunk)
            parts = chunk.split(b"\n")
            if len(parts) == 1:  # no newline here: the current line goes on
                if not skipping:
                    pending += chunk
                    if len(pending) > max_line:
                        dropped, pending, skipping = True, b"", True
                continue
            if not skipping:  # the first part ends the current line
                line = pending + parts[0]
                if len(line) <= max_line:
                    lines.append(line)
                else:
                    dropped = True
            middle = parts[1:-1]
            if max(map(len, middle), default=0) > max_line:
                dropped, middle = True, [m for m in middle if len(m) <= max_line]
            lines += middle
            pending, skipping = parts[-1], False
            if len(pending) > max_line:
                dropped, pending, skipping = True, b"", True
        if pending and not skipping:
            lines.append(pending)  # the last line, written without its newline yet
    return lines, dropped
