"""Python's cyclic garbage collector on a schedule (`train.gc_interval`).

Left automatic, a collection starts whenever enough objects were allocated (now and then one over
every tracked object): at any point of a step, in the middle of the host's work of queueing
kernels, and a CUDA step that the host feeds just in time then waits for it (single slow steps
among even ones). With an interval N the automatic collector
is off for the training loop; after every N-th step the young generations are collected, at the
step's end, while the device still runs the work already queued. Reference counting frees
everything else as before; the collector's state is restored when the loop ends.

As torchtitan does (gc_freq, 50 by default); `auto` is 50 on CUDA and Python's own collector on
CPU, where the host is the device and nothing overlaps.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("trainer")

AUTO_CUDA = 50
GENERATION = 1  # the young generations: the loop's cycles are short-lived; a full pass would scan the model


def resolve_gc_interval(value: int | str, device_type: str) -> int:
    """train.gc_interval: auto -> 50 on CUDA, 0 (Python's automatic collector) elsewhere."""
    if value == "auto":
        return AUTO_CUDA if device_type == "cuda" else 0
    return int(value)


class GcSchedule:
    """`with schedule.active():` around the loop, `schedule.after_step(step)` after each step."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.collections = 0

    @contextmanager
    def active(self) -> Iterator[None]:
        if self.interval <= 0:
            yield
            return
        was_enabled = gc.isenabled()
        gc.collect()  # start clean: what set-up left (the model's build, checkpoint loads)
        gc.disable()
        log.info("garbage collection: automatic off, generation %d collected every %d steps", GENERATION,
                 self.interval)
        try:
            yield
        finally:
            if was_enabled:
                gc.enable()

    def after_step(self, step: int) -> None:
        if self.interval > 0 and step % self.interval == 0:
            gc.collect(GENERATION)
            self.collections += 1
