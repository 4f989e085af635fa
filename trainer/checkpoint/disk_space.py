"""Room for a checkpoint on every node's disk: one line on every rank instead of a traceback on one.

Before a save, the first rank of each disk (storage.StorageLayout) compares the newest complete
checkpoint's size there (the next one of the same run and layout is that size) with the disk's free
space less what is kept free: 1 GiB, or 5% of a disk under 20 GiB (contract.memory.disk_keep_free: a
Pi's SD card must keep room for its logs and its engine). A save that still meets a full disk (the
first one, with nothing to measure; another writer) is caught as ENOSPC or EDQUOT, also inside DCP's
CheckpointException. Either way every rank learns which rank's disk it was (one small all_gather),
the unfinished `.tmp-<name>` is removed, the previous checkpoint and `latest` are left as they were,
and the run ends with CheckpointSpaceError: one line, exit 2. Before: ENOSPC surfaced as a
CheckpointException traceback of every rank's stack, or, from a rank's own file (rank<r>.pt), on
that rank only while the others waited at the next barrier for the collective timeout (30 minutes).
Any other error in a block of writes is settled the same way: its rank raises it, the others
CheckpointWriteError naming that rank, so none of them waits for the timeout either.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from contract.memory import disk_keep_free, size_text
from trainer.config import ConfigError
from trainer.runtime.full_disk import FULL

FULL_BELOW = 1 << 20   # free bytes under which a failed write is taken for a full disk


class CheckpointSpaceError(ConfigError):
    """A checkpoint that does not fit on a node's disk (the CLI prints it as one line, exit 2)."""


class CheckpointWriteError(ConfigError):
    """Another rank failed writing its part of a checkpoint (that rank shows its own traceback)."""


def dir_bytes(path: Path) -> int:
    total = 0
    for top, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(top, f)).st_size
            except OSError:
                pass
    return total


def room_problem(root: Path, newest: Path | None) -> str | None:
    """Why the next checkpoint would not fit beside `newest` under root (None: it would, or there
    is nothing to measure it by yet)."""
    if newest is None:
        return None
    need, du = dir_bytes(newest), shutil.disk_usage(root)
    keep = disk_keep_free(du.total)
    if need <= du.free - keep:
        return None
    return (f"{newest.name} took {size_text(need)} and {root} has {size_text(du.free)} free "
            f"({size_text(keep)} of it kept free)")


def disk_full(exc: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT error behind exc: itself, its cause or context, or any rank's failure in a
    DCP CheckpointException (a BaseException, not an Exception)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL:
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] for f in failures.values() if isinstance(f, tuple) and f]
        todo += [e.__cause__, e.__context__]
    return None


def _gather(mine: object) -> list:
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def _first(problems: list[str | None]) -> str | None:
    """The first rank's problem, naming its disk: `this disk (...)` in one process."""
    for r, p in enumerate(problems):
        if p:
            return f"this disk ({p})" if len(problems) == 1 else f"rank {r}'s disk ({p})"
    return None


def agree(problem: str | None) -> str | None:
    """Every rank's problem (None for none), gathered: the first one, naming its rank, on every rank."""
    return _first(_gather(problem))


def refusal(step: int, problem: str, previous: str | None) -> CheckpointSpaceError:
    if previous:
        then = f"the last complete checkpoint, {previous}, is intact: free space there (or lower " \
               "checkpoint.keep_last), then run again with --resume latest"
    else:
        then = "no earlier checkpoint exists: free space there, then run again"
    return CheckpointSpaceError(f"checkpoint step {step} not saved, no room on {problem}; {then}")


class Outcome:
    """What a block of checkpoint writes ended with on this rank: nothing, or its error and, when
    the disk was full, what to say about it."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.full: str | None = None


@contextlib.contextmanager
def catching_full(root: Path) -> Iterator[Outcome]:
    """Run a block of checkpoint writes under root; whatever ends it early is kept (not raised), so
    the caller reaches the collective `settle` on every rank. A full disk is an ENOSPC/EDQUOT in the
    error's chain, or any error after which root's disk has under FULL_BELOW free: torch's zip writer
    reports a short write as `RuntimeError: ... unexpected pos 704 vs 598`, no errno."""
    out = Outcome()
    try:
        yield out
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - settled on every rank, then raised
        out.error = e
        full = disk_full(e)
        if full is not None:
            out.full = f"{full.strerror or os.strerror(full.errno)} writing {full.filename or f'under {root}'}"
        else:
            try:
                free = shutil.disk_usage(root).free
            except OSError:
                return
            if free < FULL_BELOW:
                last = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
                out.full = f"full, {size_text(free)} free, after: {last}"


def settle(out: Outcome) -> str | None:
    """Collective, on every rank after a block of writes: the first full disk (as `agree` words it)
    when any rank's disk was full. Else a rank whose block failed raises its error again, and the
    others raise CheckpointWriteError naming it, instead of waiting at the next barrier for the
    collective timeout."""
    mine = (out.full, None if out.error is None else (str(out.error).strip().splitlines() or [""])[-1][:300]
            or type(out.error).__name__)
    try:
        gathered = _gather(mine)
    except Exception:
        if out.error is not None:
            raise out.error from None
        raise
    if full := _first([f for f, _ in gathered]):
        return full
    if out.error is not None:
        raise out.error
    failed = [(r, e) for r, (_, e) in enumerate(gathered) if e]
    if failed:
        r, e = failed[0]
        raise CheckpointWriteError(f"checkpoint not saved: rank {r} failed writing it ({e}); its own log has "
                                   "the traceback")
    return None
