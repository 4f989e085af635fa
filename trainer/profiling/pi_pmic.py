"""Raspberry Pi 5: power of the PMIC's rails from `vcgencmd pmic_read_adc`.

The Pi 5's PMIC (Renesas DA9091) reports a current and a voltage per supply rail, one per line:

      VDD_CORE_A current(7)=2.63568000A
      VDD_CORE_V volt(15)=0.86220800V

Power = sum over the rails that have both of V x I. That is the board's rails after the PMIC
(SoC core, DRAM, I/O, ...): it leaves out the PMIC's own conversion losses and what USB devices
draw from 5 V (EXT5V_V has a voltage and no current), so it reads below a meter at the wall.
Nothing is scaled or estimated. A Pi 4 and older have no such ADC: the command fails or lists no
rails, and the caller then says "no energy sensor" instead of inventing one.

In a container it needs the `vcgencmd` binary (Raspberry Pi OS' raspi-utils) and the firmware
mailbox device (`--device /dev/vcio`). Every reading starts a process (milliseconds on a Pi 5), so
readings are at most every MIN_INTERVAL seconds.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable

from trainer.profiling.power import PowerIntegrator

LINE = re.compile(r"^\s*(\S+)_([AV])\s+(?:current|volt)\(\d+\)=([0-9.eE+-]+)[AV]\s*$")
MIN_INTERVAL = 0.1


def parse(text: str) -> dict[str, float]:
    """Rail -> Watts, for the rails the output gives both a current and a voltage."""
    amps: dict[str, float] = {}
    volts: dict[str, float] = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            (amps if m[2] == "A" else volts)[m[1]] = float(m[3])
    return {rail: amps[rail] * volts[rail] for rail in sorted(amps.keys() & volts.keys())}


def _read(vcgencmd: str) -> tuple[dict[str, float], str]:
    try:
        proc = subprocess.run([vcgencmd, "pmic_read_adc"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {}, f"{vcgencmd} pmic_read_adc: {e.__class__.__name__}"
    rails = parse(proc.stdout) if proc.returncode == 0 else {}
    first = (proc.stderr or proc.stdout).strip().splitlines()[:1]
    return rails, f"{vcgencmd} pmic_read_adc: {first[0] if first else 'exit ' + str(proc.returncode)}"


def pmic_reader(vcgencmd: str | None = None, clock: Callable[[], float] | None = None
                ) -> tuple[Callable[[], float] | None, str]:
    """(reader of cumulative Joules, sensor name) or (None, why there is none)."""
    path = vcgencmd or shutil.which("vcgencmd")
    if path is None:
        return None, "no vcgencmd on PATH (a Raspberry Pi 5 PMIC needs raspi-utils and /dev/vcio in the container)"
    rails, why = _read(path)
    if not rails:
        return None, f"no PMIC rails ({why}; a Raspberry Pi 4 and older have no PMIC ADC)"

    def watts() -> float:
        now, _ = _read(path)
        return sum(now.values())

    kwargs = {"clock": clock} if clock is not None else {}
    return (PowerIntegrator(watts, MIN_INTERVAL, **kwargs),
            f"Raspberry Pi PMIC, {len(rails)} rails (vcgencmd pmic_read_adc; rails only, no conversion losses)")
