"""Energy sensors beyond NVML and RAPL: a Raspberry Pi 5's PMIC rails (`vcgencmd pmic_read_adc`)
and a Jetson's INA3221 rails (hwmon sysfs, or the older IIO driver), integrated over time into
time-energy-{rank}.csv. Neither board exists here, so these tests drive the real readers with a
FAKE vcgencmd (tests/fixtures/fake_vcgencmd/) and a FAKE sysfs tree built in tmp_path, both named
as such. A Pi 4 (no PMIC ADC) keeps the honest comment line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trainer.profiling import energy, jetson, pi_pmic
from trainer.profiling.clocks import RankClock
from trainer.profiling.power import PowerIntegrator
from trainer.profiling.timing_csv import write_time_energy

FAKE_VCGENCMD_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "fake_vcgencmd"


class FakeClock:
    """Seconds that move only when the test says so (the integrator's time, not the machine's)."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def fake_vcgencmd(tmp_path, monkeypatch) -> Path:
    """The fake vcgencmd, executable, first on PATH (and no RAPL or Jetson tree to find first)."""
    d = tmp_path / "fake_vcgencmd"
    shutil.copytree(FAKE_VCGENCMD_DIR, d)
    (d / "vcgencmd").chmod(0o755)
    monkeypatch.setenv("PATH", f"{d}:{Path('/usr/bin')}:{Path('/bin')}")
    monkeypatch.setattr(energy, "POWERCAP", str(tmp_path / "no-powercap"))
    monkeypatch.setattr(jetson, "HWMON", str(tmp_path / "no-hwmon"))
    monkeypatch.setattr(jetson, "IIO", str(tmp_path / "no-iio"))
    return d / "vcgencmd"


def _fixture_watts() -> float:
    amps, volts = {}, {}
    for line in (FAKE_VCGENCMD_DIR / "pi5_pmic_read_adc.txt").read_text().splitlines():
        name, _, value = line.strip().partition("=")
        rail, kind = name.split()[0].rsplit("_", 1)
        (amps if kind == "A" else volts)[rail] = float(value[:-1])
    return sum(amps[r] * volts[r] for r in amps if r in volts)


def test_pmic_rails_parsed_and_summed():
    rails = pi_pmic.parse((FAKE_VCGENCMD_DIR / "pi5_pmic_read_adc.txt").read_text())
    assert len(rails) == 12  # EXT5V_V and BATT_V have no current: not counted
    assert rails["VDD_CORE"] == pytest.approx(2.1045 * 0.880175)
    assert sum(rails.values()) == pytest.approx(_fixture_watts())
    assert 2.0 < sum(rails.values()) < 4.0


def test_pmic_reader_integrates_power_over_time(fake_vcgencmd, monkeypatch):
    clock = FakeClock()
    reader, name = pi_pmic.pmic_reader(str(fake_vcgencmd), clock=clock)
    assert reader is not None and "Raspberry Pi PMIC, 12 rails" in name
    assert reader.min_interval == pi_pmic.MIN_INTERVAL
    watts = _fixture_watts()
    assert reader() == 0.0
    clock.t += 2.0
    assert reader() == pytest.approx(2.0 * watts)
    clock.t += 0.5
    assert reader() == pytest.approx(2.5 * watts)


def test_pi5_energy_reaches_time_energy_csv(fake_vcgencmd, monkeypatch, tmp_path):
    """probe() finds the (fake) PMIC after NVML, Jetson and RAPL found nothing; the sampler's rows
    land in Perseus' `time,energy` file; the PMIC is sampled no faster than every 0.1 s."""
    reader, name = energy.probe(0, use_cuda=False)
    assert reader is not None and name.startswith("Raspberry Pi PMIC"), name
    clock = FakeClock()
    reader.clock = clock  # the test moves the integrator's time
    s = energy.EnergySampler(RankClock(0, 0), reader)
    assert s.interval == pi_pmic.MIN_INTERVAL
    for _ in range(3):
        s._sample()
        clock.t += 1.0
    path = tmp_path / "time-energy-0.csv"
    write_time_energy(path, s, "", lambda t: t)
    lines = path.read_text().splitlines()
    assert lines[0] == "time,energy"
    energies = [float(x.split(",")[1]) for x in lines[1:]]
    assert energies == pytest.approx([0.0, _fixture_watts(), 2 * _fixture_watts()], abs=1e-6)


def test_pi4_keeps_the_honest_comment_line(fake_vcgencmd, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_VCGENCMD_BOARD", "pi4")
    reader, why = energy.probe(0, use_cuda=False)
    assert reader is None
    assert "no PMIC rails" in why and "Command not registered" in why and "Pi 4" in why
    path = tmp_path / "time-energy-0.csv"
    write_time_energy(path, None, why, lambda t: t)
    assert path.read_text() == f"# no energy sensor: {why}\n"


def _fake_hwmon(root: Path, rails: dict[str, tuple[int, int]], index: int = 3, enabled: dict | None = None) -> Path:
    """A FAKE INA3221 hwmon device: in{i}_label, in{i}_input (mV), curr{i}_input (mA)."""
    d = root / f"hwmon{index}"
    d.mkdir(parents=True)
    (d / "name").write_text("ina3221\n")
    for i, (label, (mv, ma)) in enumerate(rails.items(), 1):
        (d / f"in{i}_label").write_text(f"{label}\n")
        (d / f"in{i}_input").write_text(f"{mv}\n")
        (d / f"curr{i}_input").write_text(f"{ma}\n")
        if enabled and label in enabled:
            (d / f"in{i}_enable").write_text(f"{enabled[label]}\n")
    return d


def test_jetson_orin_counts_the_module_input_only(tmp_path):
    hw = tmp_path / "fake_sysfs" / "class" / "hwmon"
    other = hw / "hwmon0"
    other.mkdir(parents=True)
    (other / "name").write_text("cpu_thermal\n")  # another hwmon device: ignored
    _fake_hwmon(hw, {"VDD_IN": (19104, 720), "VDD_CPU_GPU_CV": (19104, 160), "VDD_SOC": (19104, 220)})
    clock = FakeClock()
    reader, name = jetson.ina3221_reader(str(hw), str(tmp_path / "no-iio"), clock=clock)
    assert reader is not None and name == "Jetson INA3221 VDD_IN (module input)"
    reader()
    clock.t += 3.0
    assert reader() == pytest.approx(3.0 * 19.104 * 0.720)


def test_jetson_without_input_rail_sums_rails_and_skips_disabled(tmp_path):
    hw = tmp_path / "fake_sysfs" / "class" / "hwmon"
    _fake_hwmon(hw, {"GPU": (5000, 1000), "CPU": (5000, 400), "SOC": (5000, 600)}, index=1,
                enabled={"SOC": 0})
    _fake_hwmon(hw, {"CV": (5000, 200)}, index=2)
    clock = FakeClock()
    reader, name = jetson.ina3221_reader(str(hw), str(tmp_path / "no-iio"), clock=clock)
    assert name == "Jetson INA3221 GPU, CPU, CV (sum of rails)"
    reader()
    clock.t += 1.0
    assert reader() == pytest.approx(5.0 * (1.0 + 0.4 + 0.2))


def test_jetson_nano_iio_driver(tmp_path):
    dev = tmp_path / "fake_sysfs" / "ina3221x" / "6-0040" / "iio:device0"
    dev.mkdir(parents=True)
    for i, (rail, mw) in enumerate({"POM_5V_IN": 4200, "POM_5V_GPU": 900, "POM_5V_CPU": 1300}.items()):
        (dev / f"rail_name_{i}").write_text(f"{rail}\n")
        (dev / f"in_power{i}_input").write_text(f"{mw}\n")
    clock = FakeClock()
    reader, name = jetson.ina3221_reader(str(tmp_path / "no-hwmon"), str(dev.parent.parent), clock=clock)
    assert name == "Jetson INA3221 POM_5V_IN (module input)"
    reader()
    clock.t += 2.0
    assert reader() == pytest.approx(2.0 * 4.2)


def _fake_rapl(root: Path) -> Path:
    """A FAKE powercap tree with one readable RAPL package zone."""
    zone = root / "intel-rapl:0"
    zone.mkdir(parents=True)
    (zone / "energy_uj").write_text("1000000\n")
    (zone / "max_energy_range_uj").write_text("262143328850\n")
    return root


def test_jetson_found_by_probe_before_rapl_and_pmic(tmp_path, monkeypatch, fake_vcgencmd):
    """All three sensors present (a FAKE hwmon tree, a FAKE powercap tree, the FAKE vcgencmd):
    probe() takes the Jetson's. Each of the others is found once those before it are gone, so each
    fake is one probe() would take: the order is what picks the Jetson."""
    hw = tmp_path / "fake_sysfs" / "class" / "hwmon"
    _fake_hwmon(hw, {"VDD_IN": (19000, 500)})
    monkeypatch.setattr(jetson, "HWMON", str(hw))
    monkeypatch.setattr(energy, "POWERCAP", str(_fake_rapl(tmp_path / "fake_sysfs" / "class" / "powercap")))
    reader, name = energy.probe(0, use_cuda=False)
    assert reader is not None and name == "Jetson INA3221 VDD_IN (module input)"
    monkeypatch.setattr(jetson, "HWMON", str(tmp_path / "no-hwmon"))
    reader, name = energy.probe(0, use_cuda=False)
    assert reader is not None and name == "RAPL intel-rapl:0"
    monkeypatch.setattr(energy, "POWERCAP", str(tmp_path / "no-powercap"))
    reader, name = energy.probe(0, use_cuda=False)
    assert reader is not None and name.startswith("Raspberry Pi PMIC")


def test_no_jetson_tree_says_why(tmp_path):
    reader, why = jetson.ina3221_reader(str(tmp_path / "none"), str(tmp_path / "none2"))
    assert reader is None and "not a Jetson" in why


def test_integrator_trapezoids():
    watts = iter([10.0, 20.0, 20.0])
    clock = FakeClock()
    integ = PowerIntegrator(lambda: next(watts), clock=clock)
    assert integ() == 0.0
    clock.t += 1.0
    assert integ() == 15.0  # mean of 10 W and 20 W over 1 s
    clock.t += 0.5
    assert integ() == 25.0
