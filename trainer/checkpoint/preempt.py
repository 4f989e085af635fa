"""Preemption: SIGTERM / SIGUSR1 end the run after the current step with a checkpoint.

A signal handler only sets a flag (it may arrive in the middle of a collective, where nothing
else is safe). At the end of every step all ranks agree with one all_reduce(MAX) over the world,
so a signal that reached a single rank (Slurm `--signal` reaches them at slightly different
times; `docker stop` reaches torchrun, which forwards it) stops every rank at the same step.
The trainer then writes a `.preempt` checkpoint together and exits with EXIT_PREEMPTED.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from types import FrameType

import torch
import torch.distributed as dist

log = logging.getLogger("trainer")

# 128 + SIGTERM, what a shell reports for a process killed by SIGTERM: schedulers and `docker
# stop` treat the run as terminated (not crashed); `--resume latest` continues it.
EXIT_PREEMPTED = 143
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Installs the handlers; `agree()` is collective and returns True on every rank or none."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group               # a gloo group for the vote (None: the default group)
        self.received: int | None = None
        # More step-end numbers the same all_reduce(MAX) carries, so a feature that must stop every rank
        # at one step needs no collective of its own (elastic.in_place: a regroup pending); `rode` the results.
        self.riders: list[Callable[[], int]] = []
        self.rode: list[int] = []
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        for sig in SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. an embedding test harness): no handler
                return

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum

    def agree(self) -> bool:
        flag = torch.tensor([0 if self.received is None else 1, *(r() for r in self.riders)], dtype=torch.int32)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # On the host over gloo (self.group on NCCL runs): the vote never waits for the GPU.
            if self.group is None and dist.get_backend() == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        values = flag.tolist()
        stop, self.rode = bool(values[0]), [int(v) for v in values[1:]]
        if stop and self.received is None:
            self.received = int(signal.SIGTERM)  # another rank got it
        return stop

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received else "none"
