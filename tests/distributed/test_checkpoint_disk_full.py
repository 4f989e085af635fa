"""A checkpoint that does not fit on a node's disk (trainer/checkpoint/disk_space.py): refused before
it is written when the newest checkpoint there says it would not fit, caught as ENOSPC when it is
the first; either way one line on every rank, exit 2, the previous checkpoint and `latest` intact,
no unfinished `.tmp-` left. The disk is a real tmpfs that fills (tests/support/small_fs.py)."""

from __future__ import annotations

import errno
import os
import re
import traceback

import pytest
from torch.distributed.checkpoint import CheckpointException

from tests.support.small_fs import small_fs
from tests.support.trainer_run import run_trainer
from trainer.checkpoint import disk_space

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]
MiB = 1 << 20
# A tiny run's checkpoint is 2.1 MiB; the run's other files ~30 KiB.
TINY = ("configs/tiny.yaml", "--train.steps", "6", "--checkpoint.interval", "3")


def test_a_full_disk_is_found_inside_dcps_exception_and_nothing_else_is():
    full = OSError(errno.ENOSPC, "No space left on device", "/out/checkpoints/.tmp-step-3/__0_0.distcp")
    wrapped = CheckpointException("failed", {1: (full, traceback.StackSummary())})
    assert disk_space.disk_full(wrapped) is full
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("write failed") from e
    except RuntimeError as e:
        assert disk_space.disk_full(e) is full
    assert disk_space.disk_full(OSError(errno.EACCES, "Permission denied")) is None
    assert disk_space.disk_full(CheckpointException("x", {0: (ValueError("bad"), traceback.StackSummary())})) is None


def test_settle_in_one_process_says_the_full_disk_or_raises_the_error_again(tmp_path):
    out = disk_space.Outcome()
    assert disk_space.settle(out) is None
    with disk_space.catching_full(tmp_path) as out:
        raise OSError(errno.ENOSPC, "No space left on device", "x/__0_0.distcp")
    assert disk_space.settle(out) == "this disk (No space left on device writing x/__0_0.distcp)"
    with disk_space.catching_full(tmp_path) as out:  # not a full disk: tmp_path has room
        raise ValueError("a bug")
    with pytest.raises(ValueError, match="a bug"):
        disk_space.settle(out)
    with pytest.raises(KeyboardInterrupt), disk_space.catching_full(tmp_path):
        raise KeyboardInterrupt


def _one_error(proc, nproc: int) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert proc.returncode != 0 and len(lines) == nproc and len(set(lines)) == 1, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr or nproc > 1, proc.stderr[-4000:]  # torchrun adds its own summary
    return lines[0]


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_checkpoint_the_disk_cannot_hold_is_refused_before_it_is_written(tmp_path, nproc):
    """3 MiB: step-3 (2.1 MiB) fits; step-6 would need as much again: refused before writing."""
    with small_fs(tmp_path / "out", 3 * MiB) as out:
        proc = run_trainer(out, *TINY, *(("--parallel.sharding", "ddp") if nproc > 1 else ()), nproc=nproc,
                           check=False)
        line = _one_error(proc, nproc)
        disk = "rank 0's disk" if nproc > 1 else "this disk"
        assert re.match(rf"error: checkpoint step 6 not saved, no room on {re.escape(disk)} \(step-3 took 2\.[12] MiB "
                        rf"and {out}/checkpoints has \d+\.\d KiB free ", line), line
        assert line.endswith("free (153.6 KiB of it kept free)); the last complete checkpoint, step-3, is intact: "
                             "free space there (or lower checkpoint.keep_last), then run again with --resume latest"), line
        ckpts = out / "checkpoints"
        assert sorted(os.listdir(ckpts)) == ["latest", "step-3"] and (ckpts / "latest").read_text() == "step-3\n"


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_first_checkpoint_that_meets_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, nproc):
    """1.5 MiB: the first checkpoint (nothing to measure it by) meets ENOSPC inside DCP's writers.
    Before: a CheckpointException traceback of every rank's stack, the unfinished .tmp-step-3 left."""
    with small_fs(tmp_path / "out", 3 * MiB // 2) as out:
        proc = run_trainer(out, *TINY, *(("--parallel.sharding", "ddp") if nproc > 1 else ()), nproc=nproc,
                           check=False)
        line = _one_error(proc, nproc)
        assert line.startswith("error: checkpoint step 3 not saved, no room on "), line
        # ENOSPC from a file DCP writes, or torch's zip writer's short write ("unexpected pos") on a full disk
        assert re.search(r"disk \((No space left on device writing (under )?\S+|full, [\d.]+ [KM]?i?B free, after: .+)\); ",
                         line) and line.endswith(
            "no earlier checkpoint exists: free space there, then run again"), line
        assert os.listdir(out / "checkpoints") == [], os.listdir(out / "checkpoints")


def test_per_node_disks_one_of_them_full_stops_every_node_with_the_same_line(tmp_path):
    """Two "nodes" without shared storage (Pis: each OUTPUT_DIR its own disk), ZeRO-3 so that each
    holds half the shards (1.1 MiB); node 1's disk is 2 MiB. Step 3 fits on both; step 6 would not
    fit on node 1 only: both nodes' ranks give the same line
    naming rank 1's disk, both keep step-3 and `latest`. Before: no check at all; a full node's
    DCP write failed on every rank as a traceback."""
    from tests.distributed.test_checkpoint_nodes import ARGS, run_nodes

    with small_fs(tmp_path / "node1", 2 * MiB) as node1:
        outs = [tmp_path / "node0", node1]
        done = run_nodes(outs, *ARGS, "--parallel.sharding", "zero3", "--checkpoint.interval", "3", check=False)
        lines = [ln for d in done for ln in d.stderr.splitlines() if ln.startswith("error: ")]
        assert [d.returncode for d in done] != [0, 0] and len(lines) == 2 and len(set(lines)) == 1, \
            [d.stderr[-3000:] for d in done]
        assert lines[0].startswith("error: checkpoint step 6 not saved, no room on rank 1's disk (step-3 took "), lines
        for out in outs:
            ckpts = out / "checkpoints"
            assert sorted(os.listdir(ckpts)) == ["latest", "step-3"] and (ckpts / "latest").read_text() == "step-3\n"


def test_a_replica_that_meets_a_full_disk_stops_every_node_with_the_same_line(tmp_path):
    """checkpoint.replicas 1 without shared storage: node 1's 2 MiB disk holds its own half of step 3
    (1.1 MiB) but not node 0's half beside it, so the copy meets ENOSPC midway. Before: node 1 left
    the copy's ring at the failed write and node 0 waited for the next chunk, both until the 30-minute
    collective timeout. Now node 1 finishes the ring (dropping what it receives) and every rank
    gives the same line; nothing of step 3 is kept on either node."""
    from tests.distributed.test_checkpoint_nodes import ARGS, run_nodes

    with small_fs(tmp_path / "node1", 2 * MiB) as node1:
        outs = [tmp_path / "node0", node1]
        done = run_nodes(outs, *ARGS, "--parallel.sharding", "zero3", "--checkpoint.interval", "3",
                         "--checkpoint.replicas", "1", check=False)
        lines = [ln for d in done for ln in d.stderr.splitlines() if ln.startswith("error: ")]
        assert [d.returncode for d in done] != [0, 0] and len(lines) == 2 and len(set(lines)) == 1, \
            [d.stderr[-3000:] for d in done]
        assert re.match(r"error: checkpoint step 3 not saved, no room on rank 1's disk \(No space left on device "
                        r"writing \S+/\.replica-\S+\); no earlier checkpoint exists", lines[0]), lines
        for out in outs:
            assert os.listdir(out / "checkpoints") == [], os.listdir(out / "checkpoints")


def test_a_replica_chunk_that_cannot_be_read_still_travels_as_zeros(tmp_path):
    """The sender's side of the same rule: a file gone or shorter than listed is noted and its chunk
    sent as zeros of the listed size, so the receiver is not left waiting."""
    from trainer.checkpoint.replicas import _read_chunk

    f = tmp_path / "__0_0.distcp"
    f.write_bytes(b"abcdef")
    failed: list[BaseException] = []
    assert bytes(_read_chunk(f, 2, 3, failed).numpy()) == b"cde" and not failed
    assert bytes(_read_chunk(f, 0, 0, failed).numpy()) == b"\0" and not failed  # an empty file: one byte
    short = _read_chunk(f, 4, 5, failed)
    assert bytes(short.numpy()) == b"\0" * 5 and "2 bytes at 4, 5 expected" in str(failed[-1])
    gone = _read_chunk(tmp_path / "gone", 0, 7, failed)
    assert bytes(gone.numpy()) == b"\0" * 7 and isinstance(failed[-1], FileNotFoundError) and len(failed) == 2


def test_a_full_disk_under_the_runs_other_files_is_one_line(tmp_path):
    """No checkpoints: the disk fills with metrics.jsonl (200 KiB, 400 steps logged every step).
    Before: `OSError: [Errno 28] No space left on device` from metrics.py, a traceback, exit 1,
    naming no file."""
    with small_fs(tmp_path / "out", 200 << 10) as out:
        proc = run_trainer(out, "configs/tiny.yaml", "--train.steps", "400", "--checkpoint.interval", "0",
                           "--logging.log_interval", "1", check=False)
        line = _one_error(proc, 1)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert line == (f"error: no room left on the disk writing {out}/metrics.jsonl (No space left on device): "
                        "free space there, then run again (with --resume latest, from the last checkpoint if there "
                        "is one)"), line


def _share_rank0(rank: int, store: str, root: str, out) -> None:
    """One rank of share_rank0_files over two "nodes"; rank 0 cannot read its .metadata (EIO)."""
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist

    from trainer.checkpoint.storage import StorageLayout, share_rank0_files

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    tmp = Path(root) / f"node{rank}"
    tmp.mkdir()
    if rank == 0:
        (tmp / ".metadata").write_bytes(b"meta")
        real = Path.read_bytes

        def failing(self):
            if self.name == ".metadata":
                raise OSError(errno.EIO, "Input/output error", str(self))
            return real(self)
        Path.read_bytes = failing
    try:
        share_rank0_files(tmp, StorageLayout((0, 1)), rank)
        got = "returned"
    except Exception as e:  # noqa: BLE001 - what each rank ends with is the result
        got = f"{type(e).__name__}: {e}"
    out.put((rank, got))


def test_rank0_failing_to_read_its_shared_files_still_completes_the_broadcast(tmp_path):
    """Before: rank 0 raised before the broadcast the other nodes' leaders wait in; in a run it then
    entered the save's settling all_gather while they were still in the broadcast (mismatched
    collectives). Here, where rank 0's process ends, rank 1's broadcast failed with gloo's
    connection error. Now rank 0 broadcasts nothing and raises after: the others return at once,
    and the save's settle names rank 0 on every rank."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_share_rank0, args=(r, str(tmp_path / "store"), str(tmp_path), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert got[0].startswith("OSError: [Errno 5] Input/output error"), got
    # Rank 1 completed the broadcast: had rank 0 left it, rank 1 would end in gloo's error (its
    # peer gone, or the group's 20 s timeout), not return.
    assert got[1] == "returned", got
    assert not (tmp_path / "node1" / ".metadata").exists()
