"""Copies of each node's checkpoint files on other nodes, for runs WITHOUT shared storage
(`checkpoint.replicas: K`).

Each node's checkpoint directory holds only its own ranks' shards (trainer/checkpoint/storage.py),
so a node that is lost for good (a dead SD card, a spot instance gone) takes its part of every
checkpoint with it, and no other node can resume. With K replicas, before a checkpoint is renamed
into place the leader of each disk sends the files its own ranks wrote to the next K leaders (in
rank order, round the ring), which keep them beside their own. Any K nodes can then be lost and
the union of the others' directories is the whole checkpoint: what `runner up --resume` gathers
on every node, and what an elastic run resumes from with fewer nodes.

The bytes go rank to rank over gloo (a CPU group of its own under NCCL), a chunk at a time
(CHUNK_BYTES): no rank holds more than one chunk of a file in memory. A received name must be a
plain file name of the checkpoint (no path, no dot file but DCP's own): a rank's message is
checked like any other input.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint.storage import RANK0_FILES, StorageLayout
from trainer.runtime.full_disk import naming

log = logging.getLogger("trainer")
CHUNK_BYTES = 64 << 20
# What a rank writes into a checkpoint: DCP shards, its RNG/data state, its manifest.
OWN_FILE_RE = re.compile(r"__(\d+)_\d+\.distcp|rank(\d+)\.pt|manifest\.rank(\d+)\.json")


def own_files(tmp: Path, ranks: list[int]) -> list[Path]:
    """The files of `tmp` that `ranks` wrote (rank 0's shared files are on every node already)."""
    out = []
    for p in sorted(tmp.iterdir()):
        m = OWN_FILE_RE.fullmatch(p.name)
        if p.is_file() and m and int(next(g for g in m.groups() if g is not None)) in ranks:
            out.append(p)
    return out


def _swap(out: torch.Tensor | None, dst: int, inbuf: torch.Tensor | None, src: int, group) -> None:
    """Send `out` to dst while receiving into `inbuf` from src (either may be None): both posted
    before either is waited on, so a ring of leaders never waits on itself."""
    works = []
    if out is not None:
        works.append(dist.isend(out, dst, group=group))
    if inbuf is not None:
        works.append(dist.irecv(inbuf, src, group=group))
    for w in works:
        w.wait()


def _swap_bytes(data: bytes, dst: int, src: int, group) -> bytes:
    """A small message each way: the lengths, then the bytes."""
    size = torch.empty(1, dtype=torch.int64)
    _swap(torch.tensor([len(data)], dtype=torch.int64), dst, size, src, group)
    n = int(size.item())
    inbuf = torch.empty(n, dtype=torch.uint8) if n else None
    _swap(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None, dst, inbuf, src, group)
    return b"" if inbuf is None else inbuf.numpy().tobytes()


def _plain_name(name: object) -> str:
    if not isinstance(name, str) or not (OWN_FILE_RE.fullmatch(name) or name in RANK0_FILES):
        raise ValueError(f"checkpoint replica: a rank sent the file name {name!r}, not one of a checkpoint's")
    return name


def replicate(tmp: Path, layout: StorageLayout, rank: int, copies: int, group=None) -> int:
    """Collective over every rank (only the disks' leaders move bytes): each leader's own files
    copied into the next `copies` leaders' `tmp`. Returns the bytes this rank received.

    A leader whose read or write fails (a full disk) keeps posting every send and receive of the
    copy, sending zeros and dropping what it receives, and raises the first error only after its
    peers are through: a rank that left the ring mid-copy left its neighbours waiting on it until
    the collective timeout, and the save's settling collective (disk_space.settle) with them."""
    leaders = sorted(set(layout.leaders))
    if copies < 1 or len(leaders) < 2 or not layout.is_leader(rank):
        return 0
    me = leaders.index(rank)
    mine = own_files(tmp, [r for r in range(len(layout.leaders)) if layout.leaders[r] == rank])
    received = 0
    failed: list[BaseException] = []
    for hop in range(1, min(copies, len(leaders) - 1) + 1):
        dst, src = leaders[(me + hop) % len(leaders)], leaders[(me - hop) % len(leaders)]
        sizes = [(p, p.stat().st_size) for p in mine]
        listing = json.dumps([[p.name, size] for p, size in sizes]).encode()
        theirs = json.loads(_swap_bytes(listing, dst, src, group) or b"[]")
        incoming = [(_plain_name(n), int(s)) for n, s in theirs]
        out_chunks = [(p, off, min(CHUNK_BYTES, size - off)) for p, size in sizes
                      for off in range(0, max(size, 1), CHUNK_BYTES)]
        in_chunks = [(n, off, min(CHUNK_BYTES, s - off)) for n, s in incoming for off in range(0, max(s, 1), CHUNK_BYTES)]
        handles: dict[str, object] = {}
        try:
            for j in range(max(len(out_chunks), len(in_chunks))):
                t_out = None
                if j < len(out_chunks):
                    p, off, n = out_chunks[j]
                    t_out = _read_chunk(p, off, n, failed)
                # an empty file still travels as one byte, not written
                got = torch.empty(in_chunks[j][2] or 1, dtype=torch.uint8) if j < len(in_chunks) else None
                _swap(t_out, dst, got, src, group)
                if got is not None and not failed:
                    name, _, n = in_chunks[j]
                    try:
                        fh = handles.get(name) or handles.setdefault(name, open(tmp / f".replica-{name}", "wb"))
                        if n:
                            fh.write(got.numpy().tobytes())
                            received += n
                    except OSError as e:
                        failed.append(naming(e, tmp / f".replica-{name}"))
        finally:
            for name, fh in handles.items():
                try:
                    fh.close()
                except OSError as e:  # a buffered write's failure shows at close
                    failed.append(naming(e, tmp / f".replica-{name}"))
        if not failed:
            for name, _ in incoming:  # complete: in place under their own names
                (tmp / f".replica-{name}").replace(tmp / name)
    if failed:
        raise failed[0]
    return received


def _read_chunk(p: Path, off: int, n: int, failed: list[BaseException]) -> torch.Tensor:
    """n bytes of p from off (one zero byte for an empty file); zeros, the error noted, when it
    cannot be read: the receiver still gets the chunk it waits for."""
    try:
        with open(p, "rb") as f:
            f.seek(off)
            data = f.read(n)
        if len(data) != n:
            raise OSError(f"{p}: {len(data)} bytes at {off}, {n} expected (the file changed while it was copied)")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.zeros(1, dtype=torch.uint8)
    except OSError as e:
        failed.append(e)
        return torch.zeros(max(n, 1), dtype=torch.uint8)


class Replicas:
    """`checkpoint.replicas` for one run: its gloo group (the default one under gloo; its own,
    made once by every rank at the same save, under NCCL) and the copies after each save."""

    def __init__(self, copies: int):
        self.copies = copies
        self.group = None
        self.made = False

    def copy(self, tmp: Path, layout: StorageLayout, rank: int, step: int) -> None:
        """Collective when copies > 0 and the storage is not shared (the same on every rank)."""
        if not self.copies or layout.shared or not (dist.is_available() and dist.is_initialized()):
            return
        if not self.made:
            self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            self.made = True
        got = replicate(tmp, layout, rank, self.copies, self.group)
        if got:
            log.info("checkpoint step %d: %d bytes of other nodes' files kept here (checkpoint.replicas %d)",
                     step, got, self.copies)
