"""A write that met a full disk (ENOSPC, or EDQUOT: a quota), anywhere in the trainer: one line, exit
2, instead of a traceback. Checkpoints have their own, collective handling
(trainer/checkpoint/disk_space.py); this covers the run's other files (metrics.jsonl, timelines,
CSVs), whose writer is one rank. Torch-free: the CLI imports it."""

from __future__ import annotations

import errno
import os

FULL = (errno.ENOSPC, errno.EDQUOT)


def naming(e: OSError, path: str | os.PathLike) -> OSError:
    """A write's OSError (raised at write or close, it names no file): the same error naming path."""
    return e if e.filename else OSError(e.errno, e.strerror, str(path))


def full_disk_line(e: BaseException) -> str | None:
    """The one line for a full disk behind e, or None when e is not one."""
    if not (isinstance(e, OSError) and e.errno in FULL):
        return None
    where = f"writing {e.filename}" if e.filename else "writing the run's files"
    return (f"no room left on the disk {where} ({e.strerror}): free space there, then run again "
            "(with --resume latest, from the last checkpoint if there is one)")
