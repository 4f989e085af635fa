"""Collect's local unpacker, run as `python -I untar.py STAGING NAMES` with a node's
`tar -cf -` on stdin: each regular file whose name is in NAMES (a file of NUL-separated names, the
ones collect listed and asked for) is written to STAGING/<name>, and nothing else is. The stream
gives bytes and names only: no link, directory, device, owner, mode or time of its own is made
here, no name not asked for, none twice, and no byte the stream did not carry (no sparse member). Python's tarfile reads it, so the laptop's own tar (GNU,
or macOS's bsdtar, which lacks GNU's extraction flags) plays no part. Standard library only.

Exit 0 when the stream was a whole tar, read to its end: a name it lacked (a file deleted on the
node since the listing) is simply absent, and collect's verification names it. Exit 1 with one line
on stderr when it was not (cut short, not a tar). The caller bounds the stream's bytes and its pace
(runner/transport/stream.py) and checks every file's size and sha256 before it takes its place.
"""

from __future__ import annotations

import os
import shutil
import sys
import tarfile
from pathlib import Path

CHUNK = 1 << 20
# Created here and nowhere else: the file must not exist yet (a second member of the same name is
# skipped before this) and no link is followed (staging holds only what this wrote).
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)


def _wanted(names_file: Path) -> set[str]:
    return {n.decode("utf-8", "surrogateescape") for n in names_file.read_bytes().split(b"\0") if n}


def _target(staging: Path, rel: str) -> Path | None:
    """staging/rel, or None for a name that is not a plain relative path (collect never asks for one:
    its listing checked every name; this holds even if it did)."""
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") or "\0" in p for p in parts):
        return None
    return staging.joinpath(*parts)


def _write(src, path: Path, size: int) -> int:
    """Copy at most size bytes of src to a new file at path (mode 0600: collect sets the mode once
    the file is verified); the count copied."""
    path.parent.mkdir(parents=True, exist_ok=True)
    done = 0
    with os.fdopen(os.open(path, NEW_FILE, 0o600), "wb") as out:
        while done < size and (buf := src.read(min(CHUNK, size - done))):
            out.write(buf)
            done += len(buf)
    return done


def unpack(stream, staging: Path, wanted: set[str]) -> None:
    """Read the whole tar from stream, writing the wanted regular files under staging. Raises
    tarfile.TarError or EOFError when the stream is not a whole tar."""
    with tarfile.open(fileobj=stream, mode="r|", bufsize=CHUNK, encoding="utf-8", errors="surrogateescape") as tf:
        for member in tf:
            # A sparse member (GNU type S, or pax GNU.sparse.*) is refused: tarfile gives its holes
            # as zeros up to a size the header claims, so 1.5 KB of stream could fill this disk. The
            # node's `tar -cf -` never writes one (no --sparse); the file is then missing, and said so.
            if member.name not in wanted or not member.isreg() or member.issparse():
                continue  # tarfile skips its data as it reads on
            wanted.discard(member.name)
            path = _target(staging, member.name)
            if path is None:
                continue
            data = tf.extractfile(member)
            n = _write(data, path, member.size)
            if n != member.size:
                raise EOFError(f"{member.name!r} cut short at {n} of {member.size} bytes")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -I untar.py STAGING NAMES_FILE < stream.tar", file=sys.stderr)
        return 2
    staging, names = Path(argv[0]), Path(argv[1])
    staging.mkdir(parents=True, exist_ok=True)
    stdin = sys.stdin.buffer
    try:
        unpack(stdin, staging, _wanted(names))
    except (tarfile.TarError, EOFError) as exc:
        print(f"the stream is not a whole tar: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # this machine's side: a full disk, a staging dir not writable
        print(f"cannot write under {staging}: {exc}", file=sys.stderr)
        return 1
    # Past the end blocks: tar's record padding. Read it through, so the sender ends as it would
    # with any reader (the caller's byte bound still counts all of it).
    with open(os.devnull, "wb") as sink:
        shutil.copyfileobj(stdin, sink, CHUNK)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
