"""What this rank's data-parallel sync costs: the bytes it hands to its collectives, and how long
they are in flight. metrics.jsonl's `dp_sync_bytes` and `dp_sync_s` (trainer/train.py) read it.

The byte convention: the size of the tensors this rank hands to a data-parallel collective, counted
where the collective is called (per rank, per call), not the bytes a ring or tree algorithm puts
on the wire. An all-reduce of S bytes counts S (a ring sends 2 (n-1)/n x S of them per rank); an
all-gather counts this rank's input (a ring sends (n-1) x it). What counts:

- allreduce, DDP: every gradient bucket its communication hook reduces (data_parallel.GradReduceHook);
- allreduce, FSDP2 (zero2/zero3, the within-node part of *_hybrid) and the pipeline's replicate:
  each reduce-scatter's input, each all-reduce of HSDP/replicate (data_parallel.MeteredReduceScatter);
- diloco: each fragment's pseudo-gradient in the sync dtype, plus the int8 scales (diloco.py).

Time: the wall time during which at least one of them was in flight (from the call to the moment
its future completes, overlapping calls counted once), cumulative since step 0, like the bytes.
Both are restored from a checkpoint (per rank: Checkpointer's rank file), so a resumed run logs
the bytes of the straight run. On CPU/gloo the futures complete when the data arrived; FSDP2's
collectives are timed around their (blocking) call, so on CUDA their time is the host's launch
time only.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch


class SyncMeter:
    """Bytes and busy seconds of one rank's data-parallel collectives; callbacks may run on the
    backend's threads (gloo's workers), hence the lock."""

    def __init__(self) -> None:
        self.bytes = 0
        self.seconds = 0.0
        self._busy_until = 0.0
        self._lock = threading.Lock()

    def count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes += int(nbytes)

    def span(self, start: float, end: float) -> None:
        """Add [start, end] to the busy time, less what earlier spans already covered. Collectives
        of one rank complete in the order they were issued, so the spans arrive in start order."""
        with self._lock:
            self.seconds += max(0.0, end - max(start, self._busy_until))
            self._busy_until = max(self._busy_until, end)

    def until_done(self, fut: torch.futures.Future, start: float) -> torch.futures.Future:
        """`fut` chained with a callback that records [start, completion]; resolves to fut's value."""
        def done(f: torch.futures.Future) -> Any:
            self.span(start, time.perf_counter())
            return f.value()

        return fut.then(done)

    def state_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "seconds": self.seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bytes, self.seconds = int(state["bytes"]), float(state["seconds"])


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
