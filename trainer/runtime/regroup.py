"""Leaving a process group that cannot finish, and meeting in a new one, in the same process (issue 58).

Three pieces, each proven in tests/distributed/test_regroup.py with real gloo processes:

1. `ConnectionCut`: how a rank abandons an op that waits on a peer which will never answer. On gloo
   (torch 2.13) nothing torch offers unblocks a `recv` or an `all_reduce` blocked on a stopped peer:
   `ProcessGroup.abort()` and the backend's `abort()` return at once and change nothing (an
   `all_reduce` after them still succeeds), `shutdown()`, `destroy_process_group()` and the
   backend's `set_timeout()` called from another thread leave the op waiting, `shrink_group` is
   NCCL-only (gloo's `supports_shrinking` is False), and a short timeout given to the group ends
   every op at that bound, a slow step's too (each measured for issue 58: 3 gloo processes, one
   SIGSTOPped). What does end a blocked gloo op is its connection closing: a peer SIGKILLed closes
   its side and the op raises "Connection closed by peer" at once, but a peer SIGSTOPped, hung or
   behind a cut link closes nothing, and TCP waits for it for ever. So the rank closes its own
   side: it shuts down (shutdown(2), not close: the fds stay gloo's) every connected TCP socket it
   opened since the cut was set up (the group's pairs and its store client), and the op raises
   within milliseconds. Listening sockets are left alone: gloo's listener aborts the process when
   its accept fails. Under NCCL the same cut frees the CPU-side gloo groups, and
   `torch.distributed.distributed_c10d._abort_process_group()` (ncclCommAbort) frees the device
   ones (`abort_groups`).
2. `Watcher`: a thread that stats OUTPUT_DIR/regroup.json (contract/regroup.py) about every 100 ms
   and, for an epoch above the rank's, cuts (a loss: `at_step` null) or leaves it to the step
   boundary (a node back: `at_step`), and wakes whoever waits for it.
3. `rejoin`: the old default group destroyed, a new one made on the runner's address and port
   (the new rank 0 hosts the TCPStore), under the file's store prefix, so that nothing of an older
   epoch can answer or take a rank.

What the training loop does between them (catch the step's error, wait for the file, rejoin,
assemble the new stages from memory: trainer/parallel/stage_replicas.py, stage_assembly.py) is,
once integrated, train.run's; tests/support/regroup_exact.py does it today around an unchanged Trainer.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from contract import regroup as contract
from contract.regroup import Regroup

log = logging.getLogger("trainer")
POLL_S = 0.1


def socket_inodes() -> dict[int, int]:
    """This process's sockets: inode -> one fd of it (/proc/self/fd)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in names:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            out.setdefault(int(link[8:-1]), int(fd))
    return out


class ConnectionCut:
    """Shuts down the TCP connections this process opened after it was made (module doc, 1).

    Made before the first process group (and kept across regroups), so the sockets it spares are
    those the process had before any group: a tracker's or a hub client's, never a group's."""

    def __init__(self) -> None:
        self.spared = set(socket_inodes())

    def mark(self) -> set[int]:
        """The sockets now: give it to `spare_since` after opening a connection that is not a group's
        (a tracker's client made after the first group) so that a cut leaves it alone."""
        return set(socket_inodes())

    def spare_since(self, mark: set[int]) -> None:
        self.spared |= set(socket_inodes()) - mark

    def cut(self) -> int:
        """Shut down every connected TCP socket opened since; returns how many."""
        n = 0
        for inode, fd in socket_inodes().items():
            if inode in self.spared:
                continue
            try:
                s = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                    s.getpeername()  # a listener has none: OSError, left alone
                    s.shutdown(socket.SHUT_RDWR)
                    n += 1
            except OSError:
                pass
            finally:
                s.close()  # our dup only: the fd gloo holds stays open, shut down
        return n


def abort_groups(cut: ConnectionCut) -> int:
    """Make every op of this process's groups return: NCCL communicators aborted (ncclCommAbort, from
    any thread), gloo connections cut. Returns the connections cut."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        try:
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        except Exception as e:  # noqa: BLE001 - the cut below still frees the host side
            log.warning("regroup: NCCL abort failed: %s", str(e)[:200])
    return cut.cut()


class Watcher:
    """The regroup file of one rank's run dir, watched from a thread (module doc, 2).

    `baseline`: the epoch this rank runs in (0 at a launch; a file already there when the watcher
    starts is an old epoch's, so its epoch is taken as the baseline; a process started to join a
    running job is given it: the epoch before the one it joins). `pending` is set, and the
    event with it, when a newer epoch names this node; a file that does not read is passed over
    with one warning per change (the runner writes it whole, by a rename)."""

    def __init__(self, run_dir: Path, node: str, local_rank: int, cut: ConnectionCut,
                 poll_s: float = POLL_S, baseline: int | None = None) -> None:
        self.path = Path(run_dir) / contract.REGROUP_FILE
        self.node, self.local_rank, self.cut, self.poll_s = node, local_rank, cut, poll_s
        self.epoch = 0
        self.pending: Regroup | None = None
        self.times: dict[str, float] = {}
        self.ready = threading.Event()
        self._seen: tuple[int, int, int] | None = None
        self._stop = threading.Event()
        first = self._read()
        if first is not None:
            self.epoch = first.epoch
        if baseline is not None:  # a node coming back: the file of its epoch may be there before it starts
            self.epoch, self._seen = baseline, None
        self._thread = threading.Thread(target=self._run, name="regroup-watch", daemon=True)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _changed(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == self._seen:
            return False
        self._seen = key
        return True

    def _read(self) -> Regroup | None:
        if not self._changed():
            return None
        try:
            return contract.read(self.path)
        except (OSError, ValueError) as e:
            log.warning("regroup: %s", str(e)[:300])
            return None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            spec = self._read()
            if spec is None or spec.epoch <= self.epoch or (self.pending and spec.epoch <= self.pending.epoch):
                continue
            times = {"seen": time.time()}
            if spec.at_step is None or spec.rank_of(self.node, self.local_rank) is None:
                n = abort_groups(self.cut)  # the step in flight returns now, with an error
                times["left"] = time.time()
                log.warning("regroup: epoch %d (%s): left the old group, %d connection(s) cut", spec.epoch,
                            spec.why or "no reason given", n)
            self.times, self.pending = times, spec
            self.ready.set()

    def wait(self, timeout: float) -> Regroup | None:
        """The pending regroup (its cut done), waiting up to `timeout` s for one (a peer's death can
        reach a rank before the runner has decided what follows)."""
        return self.pending if self.ready.wait(timeout) else None

    def done(self, spec: Regroup) -> None:
        """The rank now runs in spec's epoch."""
        self.epoch = spec.epoch
        if self.pending is spec:
            self.pending = None
            self.ready.clear()


def write_status(run_dir: Path, local_rank: int, epoch: int, state: str, times: dict[str, float],
                 rank: int | None = None, step: int | None = None, error: str = "") -> None:
    """This rank's regroup-status file (contract/regroup.py), replaced whole."""
    path = Path(run_dir) / contract.status_name(local_rank)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(contract.status_text(epoch, state, times, rank, step, error))
    os.replace(tmp, path)


def rejoin(spec: Regroup, rank: int, backend: str = "gloo", timeout_s: float | None = None,
           nnodes: int | None = None) -> float:
    """Destroy this process's groups and join spec's: rank 0 hosts the store on spec's port. The env
    the trainer reads its place from (RANK, WORLD_SIZE, MASTER_*) is rewritten. Returns the seconds
    it took. Collective over the new group's ranks."""
    t0 = time.perf_counter()
    if dist.is_initialized():
        dist.destroy_process_group()  # after a cut: its ops have all returned, nothing waits on it
    timeout = timedelta(seconds=timeout_s or spec.timeout_s)
    store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, is_master=rank == 0,
                          wait_for_workers=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(spec.store_prefix, store), rank=rank,
                            world_size=spec.world_size, timeout=timeout)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(spec.world_size), "MASTER_ADDR": spec.master_addr,
                       "MASTER_PORT": str(spec.master_port), "GROUP_WORLD_SIZE": str(nnodes or len(spec.ranks))})
    return time.perf_counter() - t0
