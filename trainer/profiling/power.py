"""Cumulative energy from a power sensor: what EnergySampler reads (Joules since some start) made
from sensors that give Watts now (a Raspberry Pi 5's PMIC rails, a Jetson's INA3221 rails), by
integrating between readings (trapezoids: the mean of the two readings times the time between).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class PowerIntegrator:
    """A reader of cumulative Joules over `read_watts`. `min_interval`: the least seconds between
    two readings that the sensor bears (EnergySampler samples no faster)."""

    def __init__(self, read_watts: Callable[[], float], min_interval: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.read_watts, self.min_interval, self.clock = read_watts, min_interval, clock
        self.total = 0.0
        self._last: tuple[float, float] | None = None

    def __call__(self) -> float:
        t, w = self.clock(), self.read_watts()
        if self._last is not None:
            t0, w0 = self._last
            self.total += (w + w0) / 2 * (t - t0)
        self._last = (t, w)
        return self.total
