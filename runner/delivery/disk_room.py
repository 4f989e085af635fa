"""Room on this machine's disk for what nodes send, checked before the first byte is written.

A node lists its files (`collect`) or a checkpoint's (`up --resume` relays one file at a time through
this machine); the listed sizes are the node's word, bounded afterwards by tar_bound and the relay's
size check. What the listing alone can decide is decided first: when the bytes it names would leave
the destination's filesystem with less than KEEP_FREE, nothing is written and one line says how much
was asked, how much is free and what to do. Before, a 60 GiB checkpoint collected onto a laptop with
20 GiB free filled its disk, then failed half-way, leaving a staging folder and a full disk behind.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from runner.errors import UserError

KEEP_FREE = 1 << 30        # left free on the destination's filesystem, at most
KEEP_FREE_SHARE = 0.05     # ... and at most this share of it (a small filesystem keeps 5%)


def keep_free(total: int) -> int:
    """What a filesystem of total bytes keeps free: 1 GiB, or 5% of a filesystem under 20 GiB."""
    return min(KEEP_FREE, int(total * KEEP_FREE_SHARE))


def size_text(n: float) -> str:
    """Bytes as people read them, binary units: 512 B, 3.0 MiB, 1.25 GiB."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.{2 if unit in ('GiB', 'TiB') else 1}f} {unit}"
    return f"{int(n)} B"


def existing(path: Path) -> Path:
    """path, or the nearest folder above it that exists (where it would be made)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_room(dest: Path, need: int, what: str, hint: str) -> None:
    """Refuse (UserError, exit 2) when writing need bytes under dest would leave its filesystem with
    less than keep_free(): `what` names the request, `hint` what the user can do instead."""
    where = existing(dest)
    du = shutil.disk_usage(where)
    keep = keep_free(du.total)
    if need > du.free - keep:
        raise UserError(f"{what} needs {size_text(need)}, and {where} has {size_text(du.free)} free "
                        f"({size_text(keep)} of it kept free); nothing was written: {hint}")
