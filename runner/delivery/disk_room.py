"""Room on this machine's disk for what nodes send, checked before the first byte is written.

A node lists its files (`collect`) or a checkpoint's (`up --resume` relays one file at a time
through this machine); the listed sizes are the node's word, bounded afterwards by tar_bound and the
relay's size check. What the listing alone can decide is decided first: when the bytes it names
would leave the destination's filesystem with less than 1 GiB free (5% of one under 20 GiB:
contract.memory.disk_keep_free, the rule the trainer's checkpoints keep too), nothing is written and
one line says how much was asked, how much is free and what to do. Before, a collect larger than the
free space filled the disk and stopped half-way: on a 16 MiB disk, one node's 10 MiB placed and the
other's stream ended in `No space left on device`.

The same rule holds for what the runner writes onto a node: `up --resume` completing a checkpoint
there, and `push` loading an image into the node's engine (docker load unpacks the whole stream into
its data root's tmp/ before it registers the layers there: twice the layers' bytes at the peak,
measured: a 51 MB image failed to load with 80 MiB free and loaded with 100 MiB). `node_room`
measures the node's filesystem with `df`, its answer bounded and checked like any node's.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from contract.memory import disk_keep_free, size_text
from runner.core.errors import UserError

log = logging.getLogger("runner")

# Measured where the path is, or the nearest folder above it that exists; the path is an argument,
# never part of the script.
NODE_DF = 'd=$1; while [ ! -e "$d" ]; do d=$(dirname -- "$d"); done; df -Pk -- "$d"'
# The node engine's data root, where docker load writes.
ENGINE_DF = 'd=$(docker info --format "{{.DockerRootDir}}") && [ -n "$d" ] && df -Pk -- "$d"'
LOAD_FACTOR = 2  # docker load's peak on the data root, per byte of layers loaded


class NoRoom(UserError):
    """A filesystem without room for what would be written: trying again another way will not help."""


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
        raise NoRoom(f"{what} needs {size_text(need)}, and {where} has {size_text(free)} free "
                     f"({size_text(keep)} of it kept free); nothing was written: {hint}")


def node_room(remote, path: str, script: str = NODE_DF) -> tuple[int, int]:
    """(free bytes, filesystem bytes) where a node would write under path, from its `df -Pk`
    (ENGINE_DF: where its engine keeps images, path unused)."""
    node = remote.node.name
    res = remote.run(["sh", "-c", script, "room", path], timeout=60, max_output=64 << 10)
    rows = [ln.split() for ln in res.out.splitlines()[1:] if ln.strip()]
    # POSIX df -P: filesystem, 1024-blocks, used, available, capacity, mounted on (which may hold spaces)
    nums = rows[-1][1:4] if rows and len(rows[-1]) >= 6 else []
    if res.rc != 0 or len(nums) != 3 or not all(x.isdigit() and len(x) <= 15 for x in nums):
        raise UserError(f"node {node}: `df -Pk` of {path} failed or answered no sizes "
                        f"({' '.join((res.err or res.out).split())[:200]!r}); nothing was written")
    return int(nums[2]) * 1024, int(nums[0]) * 1024


def check_node_room(remote, path: str, need: int, what: str, hint: str) -> None:
    """check_room on a node: writing need bytes under path must leave its filesystem
    disk_keep_free() free."""
    free, total = node_room(remote, path)
    keep = disk_keep_free(total)
    if need > free - keep:
        raise NoRoom(f"{what} needs {size_text(need)}, and node {remote.node.name}'s {path} has "
                     f"{size_text(free)} free ({size_text(keep)} of it kept free); nothing was written: {hint}")


def engine_room(remote) -> tuple[int, int] | None:
    """(free, filesystem bytes) of the node engine's data root, where docker load writes; None for an
    engine whose data root this shell cannot see (one in a VM: Docker Desktop): not measured, so
    only a known shortage refuses."""
    try:
        return node_room(remote, "its engine's data root", ENGINE_DF)
    except UserError as exc:
        log.info("%s (room for the image not checked)", exc)
        return None


PUSH_AGAIN = "nothing was sent: free space there (docker image prune, docker system df), then push again"


def engine_shortage(node: str | None, room: tuple[int, int] | None, layer_bytes: int, what: str,
                    then: str = PUSH_AGAIN, about: bool = False, how: str = "docker load") -> str | None:
    """Why docker load of layer_bytes (LOAD_FACTOR x at its peak, plus what is kept free) does not
    fit in a data root of `room`, or None (docker pull's peak is the same bound: each layer's
    download beside its unpacked copy). The line names the node (None: the caller does), what needs
    the room (`about`: an estimate, layer_sizes.py) and ends with `then`, what to do."""
    if room is None:
        return None
    free, total = room
    keep, need = disk_keep_free(total), LOAD_FACTOR * layer_bytes
    if need <= free - keep:
        return None
    head = f"node {node}: " if node else ""
    return (f"{head}{what} needs {'about ' if about else ''}{size_text(need)} while {how} unpacks it "
            f"({LOAD_FACTOR} x {size_text(layer_bytes)} of layers), and its engine's data root (docker info's "
            f"DockerRootDir) has {size_text(free)} free ({size_text(keep)} of it kept free); {then}")


def check_engine_room(remote, layer_bytes: int, what: str) -> None:
    """NoRoom when the node's engine cannot load layer_bytes (engine_shortage)."""
    why = engine_shortage(remote.node.name, engine_room(remote), layer_bytes, what)
    if why:
        raise NoRoom(why)
