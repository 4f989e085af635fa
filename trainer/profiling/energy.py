"""Cumulative energy from a real sensor, sampled in a background thread; never invented.

Sensors, in order: NVML total energy of this rank's GPU (the counter Perseus reads; pynvml from
nvidia-ml-py; nvml.py finds the NVML device behind `cuda:i`), a Jetson's INA3221 rails (jetson.py;
Jetsons have no NVML), RAPL through powercap (sum of the top-level
/sys/class/powercap/intel-rapl:N packages, wrap-around handled) where readable, then a Raspberry
Pi 5's PMIC rails (pi_pmic.py, `vcgencmd pmic_read_adc`). The last two give Watts, integrated over
time (power.py). None on a Pi 4, nor in most containers (powercap is absent or root-only since
CVE-2020-8694): then `probe()` returns None and a reason, and time-energy-{rank}.csv says so in a
comment line.
"""

from __future__ import annotations

import glob
import threading
from collections.abc import Callable
from pathlib import Path

from trainer.profiling.clocks import RankClock
from trainer.profiling.nvml import nvml_reader

POWERCAP = "/sys/class/powercap"


def _nvml_reader(cuda_index: int) -> tuple[Callable[[], float] | None, str]:
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA GPU"
    return nvml_reader(cuda_index)


def _rapl_reader(root: str = POWERCAP) -> tuple[Callable[[], float] | None, str]:
    zones = sorted(p for p in glob.glob(f"{root}/intel-rapl:*") if p.count(":") == 1)
    if not Path(root).exists():
        return None, f"{root} does not exist"
    if not zones:
        return None, f"no intel-rapl package zones under {root}"
    files, ranges = [], []
    for z in zones:
        try:
            int(Path(z, "energy_uj").read_text())
            files.append(Path(z, "energy_uj"))
            ranges.append(int(Path(z, "max_energy_range_uj").read_text()))
        except (OSError, ValueError) as e:
            return None, f"{z}/energy_uj not readable ({e.__class__.__name__}; needs root since CVE-2020-8694)"
    last = [int(f.read_text()) for f in files]
    total = [0.0]

    def read() -> float:
        for i, f in enumerate(files):
            v = int(f.read_text())
            total[0] += ((v - last[i]) % (ranges[i] + 1)) / 1e6  # counter wraps at max_energy_range_uj
            last[i] = v
        return total[0]

    return read, "RAPL " + ",".join(Path(z).name for z in zones)


def probe(cuda_index: int, use_cuda: bool) -> tuple[Callable[[], float] | None, str]:
    """(reader of cumulative Joules, sensor name) or (None, why there is none).

    cuda_index: this rank's device as torch numbers it (cuda:i), not an NVML index.
    """
    reasons = []
    if use_cuda:
        reader, why = _nvml_reader(cuda_index)
        if reader is not None:
            return reader, why
        reasons.append(why)
    from trainer.profiling.jetson import ina3221_reader
    from trainer.profiling.pi_pmic import pmic_reader

    for find in (ina3221_reader, lambda: _rapl_reader(POWERCAP), pmic_reader):
        reader, why = find()
        if reader is not None:
            return reader, why
        reasons.append(why)
    return None, "; ".join(reasons)


class EnergySampler:
    """Rows (local clock ns, Joules since the first reading), one each time the counter moves."""

    def __init__(self, clock: RankClock, reader: Callable[[], float], interval: float = 0.01):
        # A sensor read by starting a process (the Pi's vcgencmd) says how often it bears it.
        interval = max(interval, getattr(reader, "min_interval", 0.0))
        self.clock, self.reader, self.interval = clock, reader, interval
        self.rows: list[tuple[int, float]] = []
        self._base: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._moved = threading.Condition()    # notified on every new row (rows stay in time order)

    def _sample(self, force: bool = False) -> None:
        with self._moved:
            v = self.reader()
            if self._base is None:
                self._base = v
            e = v - self._base
            if force or not self.rows or e != self.rows[-1][1]:
                self.rows.append((self.clock.now(), e))
                self._moved.notify_all()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> None:
        self._stop.clear()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="energy-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._sample(force=True)  # closes the interval, so every instruction inside it interpolates

    def cover(self, t_ns: int, timeout: float = 1.0) -> None:
        """Make energy_at(t_ns) known while the sampler runs: rows are added only when the counter
        moves, so an instruction that just ended lies past the last row (NVML's counter moves every
        few ms to tens of ms). Wait, up to `timeout`, for the counter's next move after t_ns; if it
        does not move (an idle or stuck sensor), record the reading as of now."""
        with self._moved:
            self._moved.wait_for(lambda: bool(self.rows) and self.rows[-1][0] >= t_ns,
                                 timeout=timeout if self._thread is not None else 0)
        if not self.rows or self.rows[-1][0] < t_ns:
            self._sample(force=True)

    def energy_at(self, t_ns: int) -> float | None:
        """Cumulative Joules at t (linear interpolation, as Perseus' post-processing does)."""
        rows = self.rows
        if not rows or t_ns < rows[0][0] or t_ns > rows[-1][0]:
            return None
        for (ta, ea), (tb, eb) in zip(rows, rows[1:], strict=False):
            if ta <= t_ns <= tb:
                return ea + (eb - ea) * (t_ns - ta) / max(tb - ta, 1)
        return rows[-1][1]
