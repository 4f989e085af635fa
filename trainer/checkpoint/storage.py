"""Which ranks share a checkpoint directory, for multi-node runs WITHOUT shared storage.

On Raspberry Pis each node's OUTPUT_DIR is its own disk, so a checkpoint written by all ranks
ends up spread over the nodes: every node holds its own ranks' shards. The trainer then keeps
one complete-looking checkpoint directory per node instead of one in total:

- `probe()` (collective, once per run and directory) finds out who sees whose files: every rank
  writes `.probe-<token>-<rank>` under the checkpoint root and, after a barrier, looks for every
  other rank's file by name. Ranks that see each other share a disk; the lowest rank of each
  group is its *leader*. One node or NFS = one group led by rank 0 (nothing changes).
- The leader of each disk creates the temporary directory, and after the barrier that confirms
  every shard on every node is written, renames it and writes its own `latest`.
- The files only rank 0 writes and that every rank reads on resume (DCP's `.metadata`,
  `trainer_state.json`, `config.yaml`, and the model files of trainer/models/files.py) are broadcast
  to every other leader (`share_rank0_files`), so every node's directory describes the whole checkpoint.

DCP dedups replicated tensors (a DDP model is written once, by rank 0), so a rank may need a
shard file that lives on another node: resuming needs the union of all nodes' files in each
node's directory, which `runner up --resume` copies before the relaunch. `MISSING_HINT` is what
a rank says when a file is still missing.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainer.config import ConfigError
from trainer.models.files import MODEL_FILES

# Written by rank 0 alone, read by every rank on resume (DCP reads .metadata on every rank).
RANK0_FILES = (".metadata", "trainer_state.json", "config.yaml", *MODEL_FILES)
MISSING_HINT = ("checkpoints on nodes without shared storage hold only their own ranks' files: "
                "run `runner up --resume`, which syncs checkpoints across nodes")
_PROBE = ".probe-"


@dataclass(frozen=True)
class StorageLayout:
    leaders: tuple[int, ...]  # leaders[r]: the rank that finalizes the directory rank r writes to

    @property
    def shared(self) -> bool:
        return all(leader == 0 for leader in self.leaders)

    def is_leader(self, rank: int) -> bool:
        return self.leaders[rank] == rank

    def group(self, rank: int) -> list[int]:
        """The ranks writing to the same directory as `rank` (itself included), lowest first."""
        return [r for r, leader in enumerate(self.leaders) if leader == self.leaders[rank]]

    def describe(self) -> str:
        groups = sorted({tuple(self.group(r)) for r in range(len(self.leaders))})
        return "; ".join(f"ranks {','.join(map(str, g))}" for g in groups)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _seen(root: Path, token: str, world: int) -> list[int]:
    return [r for r in range(world) if (root / f"{_PROBE}{token}-{r}").is_file()]


# File systems another machine writes to (a "fuse.*" type by its first part: sshfs, s3fs, gcsfuse):
# a file another node's rank made may show up late there (NFS's attribute caching).
NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "glusterfs", "beegfs",
                        "orangefs", "afs", "9p", "virtiofs", "ocfs2", "gfs2", "fuse", "fuseblk"})


def fs_type(path: Path, mountinfo: str | None = None) -> str | None:
    """The type of the file system holding `path`: its innermost mount's in /proc/self/mountinfo (the
    later of two on one point), or None where that cannot be read."""
    try:
        text = Path("/proc/self/mountinfo").read_text() if mountinfo is None else mountinfo
        where = os.path.realpath(path) if mountinfo is None else str(path)
    except OSError:
        return None
    best, kind = -1, None
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:
            best, kind = len(point), right.split()[0]
    return kind


def late_files_possible(kind: str | None) -> bool:
    """Whether another node's new file may show up late on a file system of this type (None: unknown,
    so it may)."""
    return kind is None or kind.split(".")[0] in NETWORK_FS


def probe(root: Path, retries: int = 2, pause_s: float = 0.5) -> StorageLayout:
    """Collective: which ranks see the same `root`. A new file of another NFS client can show
    up late (attribute caching), so on a network file system a rank that misses some probes looks
    again before deciding they are on another disk; on a node's own disk it decides at once (each
    start and in-place regroup of a run whose nodes keep their own checkpoints: 1 s saved)."""
    if not _distributed():
        return StorageLayout((0,))
    world, rank = dist.get_world_size(), dist.get_rank()
    root.mkdir(parents=True, exist_ok=True)
    box = [secrets.token_hex(8)]
    dist.broadcast_object_list(box, src=0)  # a fresh token: stale probes of a crashed run never match
    token = box[0]
    mine = root / f"{_PROBE}{token}-{rank}"
    mine.write_text(token)
    dist.barrier()
    seen = _seen(root, token, world)
    for _ in range(retries if len(seen) < world and late_files_possible(fs_type(root)) else 0):
        if len(seen) == world:
            break
        time.sleep(pause_s)
        seen = _seen(root, token, world)
    everyone: list[list[int] | None] = [None] * world
    dist.all_gather_object(everyone, seen)
    dist.barrier()  # nobody deletes its probe while another rank may still look for it
    mine.unlink(missing_ok=True)
    return StorageLayout(tuple(min(s or [r]) for r, s in enumerate(everyone)))


def share_rank0_files(tmp: Path, layout: StorageLayout, rank: int) -> None:
    """Collective: copy rank 0's RANK0_FILES into every other leader's temporary directory."""
    if layout.shared or not _distributed():
        return
    payload, failed = None, None
    if rank == 0:
        try:
            payload = {n: (tmp / n).read_bytes() for n in RANK0_FILES if (tmp / n).is_file()}
        except OSError as e:  # still broadcast (nothing): the other ranks wait in it, then settle learns why
            payload, failed = {}, e
    box = [payload]
    dist.broadcast_object_list(box, src=0)
    if failed is not None:
        raise failed
    if rank != 0 and layout.is_leader(rank):
        for name, data in (box[0] or {}).items():
            (tmp / name).write_bytes(data)


def agree_on_latest(everyone: list[Any], pointer: Path) -> tuple[str | None, str | None]:
    """(checkpoint name to resume, warning) from every rank's (`latest` name or None,
    [(step, name) of its complete checkpoints]).

    All equal: that name (None = no checkpoint anywhere yet: start fresh). A crash between two
    nodes' renames leaves them different; the previous checkpoint is then still on every node
    (pruning waits for all renames), so take the newest checkpoint complete on every node."""
    names = [name for name, _ in everyone]
    if len(set(names)) == 1:
        return names[0], None
    common = set.intersection(*(set(map(tuple, ckpts)) for _, ckpts in everyone))
    latest = ", ".join(f"rank {r}: {name or 'none'}" for r, name in enumerate(names))
    if not common:
        raise ConfigError(f"{pointer}: the nodes' latest checkpoints differ ({latest}) and none is complete "
                          f"on every node; {MISSING_HINT}")
    step, name = max(common)
    return name, (f"nodes' latest checkpoints differ ({latest}): resuming from {name} (step {step}), "
                  f"the newest on every node")
