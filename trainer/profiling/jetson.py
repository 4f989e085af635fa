"""NVIDIA Jetson: power from the INA3221 rail monitors (hwmon sysfs), where NVML has no energy
counter (Jetsons have no NVML).

JetPack 5+ kernels expose each INA3221 as /sys/class/hwmon/hwmonN with `name` = ina3221 and, per
channel i in 1..3, `in{i}_label` (the rail: VDD_IN, VDD_CPU_GPU_CV, VDD_SOC on an Orin),
`in{i}_input` (bus voltage, mV) and `curr{i}_input` (mA). Older L4T (Jetson Nano, JetPack 4) has
the `ina3221x` IIO driver instead: /sys/bus/i2c/drivers/ina3221x/*/iio:device*/in_power{i}_input
(mW) with `rail_name_{i}`. Rails named *_IN measure the module's whole input and the others are
parts of it, so where an input rail exists only it is counted; else every rail is summed (AGX
Xavier: GPU, CPU, SOC, CV, VDDRQ, SYS5V). The carrier board outside the module is not measured.
"""

from __future__ import annotations

import glob
from collections.abc import Callable
from pathlib import Path

from trainer.profiling.power import PowerIntegrator

HWMON = "/sys/class/hwmon"
IIO = "/sys/bus/i2c/drivers/ina3221x"
MIN_INTERVAL = 0.01


def _text(p: Path) -> str | None:
    try:
        return p.read_text().strip()
    except OSError:
        return None


def _num(p: Path) -> float:
    return float(p.read_text().strip())


def channels(hwmon: str | None = None, iio: str | None = None) -> list[tuple[str, Callable[[], float]]]:
    """(rail, read Watts) per INA3221 channel that is enabled and readable."""
    hwmon, iio = hwmon or HWMON, iio or IIO
    out: list[tuple[str, Callable[[], float]]] = []
    for d in sorted(Path(p) for p in glob.glob(f"{hwmon}/hwmon*")):
        if _text(d / "name") != "ina3221":
            continue
        for i in (1, 2, 3):
            volt, curr = d / f"in{i}_input", d / f"curr{i}_input"
            if _text(d / f"in{i}_enable") == "0" or _text(volt) is None or _text(curr) is None:
                continue
            label = _text(d / f"in{i}_label") or _text(d / f"curr{i}_label") or f"{d.name}:ch{i}"
            out.append((label, lambda v=volt, c=curr: _num(v) / 1e3 * _num(c) / 1e3))
    for d in sorted(Path(p) for p in glob.glob(f"{iio}/*/iio:device*")):
        for i in (0, 1, 2):
            power = d / f"in_power{i}_input"
            if _text(power) is None:
                continue
            label = _text(d / f"rail_name_{i}") or f"{d.name}:ch{i}"
            out.append((label, lambda p=power: _num(p) / 1e3))
    return out


def ina3221_reader(hwmon: str | None = None, iio: str | None = None, clock: Callable[[], float] | None = None
                   ) -> tuple[Callable[[], float] | None, str]:
    """(reader of cumulative Joules, sensor name) or (None, why there is none)."""
    hwmon, iio = hwmon or HWMON, iio or IIO
    chans = channels(hwmon, iio)
    if not chans:
        return None, f"no INA3221 rails under {hwmon} or {iio} (not a Jetson)"
    inputs = [c for c in chans if c[0].upper().endswith("_IN")]
    used = inputs or chans
    try:
        for _, read in used:
            read()  # fails here, not in the sampler thread, if a file is unreadable
    except (OSError, ValueError) as e:
        return None, f"INA3221 rails not readable ({e.__class__.__name__}: {e})"

    def watts() -> float:
        return sum(read() for _, read in used)

    kwargs = {"clock": clock} if clock is not None else {}
    what = "module input" if inputs else "sum of rails"
    return (PowerIntegrator(watts, MIN_INTERVAL, **kwargs),
            f"Jetson INA3221 {', '.join(label for label, _ in used)} ({what})")
