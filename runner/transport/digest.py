"""sha256, the one way files are checked: here (`sha256_file`) and on a node (`remote_sha256`:
GNU sha256sum with the names on stdin, so no command line grows with the file count)."""

from __future__ import annotations

import hashlib
import re
import shlex
import zlib
from pathlib import Path
from typing import Literal, overload

from runner.core.errors import UserError
from runner.transport.ssh import Remote

HASH_BATCH = 1000        # names per sha256sum round trip: stdin and stdout stay far below SSH windows
HASH_RATE = 20e6         # bytes/s a slow node (Pi, SD card) hashes at least: sets the command timeout
HASH_TIMEOUT_MAX = 7 * 86400.0


@overload
def sha256_file(path: str | Path, crc32: Literal[False] = False) -> str: ...
@overload
def sha256_file(path: str | Path, crc32: Literal[True]) -> tuple[str, int, int]: ...
def sha256_file(path: str | Path, crc32: bool = False) -> str | tuple[str, int, int]:
    """Hex sha256 of a local file; with crc32=True (sha256, crc32, size) from the same read."""
    h, crc, size = hashlib.sha256(), 0, 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
            if crc32:
                crc = zlib.crc32(chunk, crc)
                size += len(chunk)
    return (h.hexdigest(), crc, size) if crc32 else h.hexdigest()


def parse_sha256sum(out: str) -> dict[str, str]:
    """GNU sha256sum lines; a leading backslash means the name has \\\\ and \\n escaped."""
    sums = {}
    for line in out.split("\n"):
        escaped = line.startswith("\\")
        if escaped:
            line = line[1:]
        if len(line) < 66 or not re.fullmatch(r"[0-9a-f]{64}", line[:64]):
            continue
        name = line[66:]
        if escaped:
            name = re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r", "\\": "\\"}.get(m[1], m[1]), name)
        sums[name] = line[:64]
    return sums


def remote_sha256(remote: Remote, root: str, names: list[str], total_bytes: int = 0
                  ) -> tuple[dict[str, str], dict[str, str]]:
    """({name: sha256}, {name: why it could not be hashed}) for files under root on the node."""
    sums: dict[str, str] = {}
    failed: dict[str, str] = {}
    timeout = min(120 + total_bytes / HASH_RATE, HASH_TIMEOUT_MAX)  # sizes come from the node: bounded
    for i in range(0, len(names), HASH_BATCH):
        batch = names[i:i + HASH_BATCH]
        res = remote.run(["sh", "-c", f"cd {shlex.quote(root)} && xargs -0 sha256sum --"],
                         stdin=b"\0".join(n.encode() for n in batch), timeout=timeout)
        got = parse_sha256sum(res.out)
        if res.rc not in (0, 123):  # 123: some files failed (named on stderr); else sha256sum/xargs itself did
            why = res.err.strip().splitlines()[-1:] or [f"exit {res.rc}"]
            raise UserError(f"node {remote.node.name}: hashing files in {root} failed (exit {res.rc}): {why[0][:200]}")
        for n in batch:
            if n in got:
                sums[n] = got[n]
            else:
                why = [ln for ln in res.err.splitlines() if n in ln]
                failed[n] = why[0].strip()[:200] if why else f"sha256sum gave no digest (exit {res.rc})"
    return sums, failed
