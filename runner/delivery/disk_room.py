"""Room on this machine's disk for what nodes send, checked before the first byte is written.

A node lists its files (`collect`) or a checkpoint's (`up --resume` relays one file at a time
through this machine); the listed sizes are the node's word, bounded afterwards by tar_bound and the
relay's size check. What the listing alone can decide is decided first: when the bytes it names
would leave the destination's filesystem with less than 1 GiB free (5% of one under 20 GiB:
contract.memory.disk_keep_free, the rule the trainer's checkpoints keep too), nothing is written and
one line says how much was asked, how much is free and what to do. Before, a collect larger than the
free space filled the disk and stopped half-way: on a 16 MiB disk, one node's 10 MiB placed and the
other's stream ended in `No space left on device`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from contract.memory import disk_keep_free, size_text
from runner.errors import UserError


def existing(path: Path) -> Path:
    """path, or the nearest folder above it that exists (where it would be made)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def room(dest: Path) -> tuple[Path, int, int]:
    """(where it is measured, its free bytes, what it keeps free) for writing under dest."""
    where = existing(dest)
    du = shutil.disk_usage(where)
    return where, du.free, disk_keep_free(du.total)


def check_room(dest: Path, need: int, what: str, hint: str) -> None:
    """Refuse (UserError, exit 2) when writing need bytes under dest would leave its filesystem with
    less than disk_keep_free(): `what` names the request, `hint` what the user can do instead."""
    where, free, keep = room(dest)
    if need > free - keep:
        raise UserError(f"{what} needs {size_text(need)}, and {where} has {size_text(free)} free "
                        f"({size_text(keep)} of it kept free); nothing was written: {hint}")
