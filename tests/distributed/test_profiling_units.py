"""Profiling pieces without a process group: batch specs, bubble formulas and sums, trace merge,
energy sensors (a fake powercap tree and this machine's real one), plus a one-process run."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from tests.support.runner_helpers import wait_for
from tests.support.trainer_run import run_trainer
from trainer.config import ConfigError
from trainer.config.batches import parse_batches
from trainer.profiling import bubble, energy, trace
from trainer.profiling.clocks import RankClock, injected_skew_ns

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("spec,want", [("0", [0]), ("1,3", [1, 3]), ("2-4", [2, 3, 4]), ("2:5", [2, 3, 4]),
                                       ("[1, 2]", [1, 2]), ([5, 1], [1, 5]), ("none", []), ("-1", []),
                                       ("1, 4-5", [1, 4, 5])])
def test_parse_batches(spec, want):
    assert parse_batches(spec) == want


@pytest.mark.parametrize("spec", ["x", "3-1", "1;2"])
def test_parse_batches_errors_are_one_line(spec):
    with pytest.raises(ConfigError) as e:
        parse_batches(spec)
    assert str(e.value).startswith("profile.batch:") and "\n" not in str(e.value)


@pytest.mark.parametrize("timelines,n,want", [([0], 4, [1, 2, 3, 4]), ([], 2, [1, 2]), ([1], 4, [1, 2, 3, 4]),
                                            ([3, 7], 2, [3, 4]), ([0], 0, []), ([], 0, [])])
def test_profile_csv_window_skips_warmup_batch(timelines, n, want):
    from trainer.profiling.callback import aggregated_steps

    assert aggregated_steps(timelines, n) == want


def test_timing_csv_with_nothing_to_record_warns_once(caplog):
    from types import SimpleNamespace

    from trainer.config import Config
    from trainer.profiling.callback import make_callback

    cfg = Config()
    cfg.profile.batch, cfg.profile.export_timing_csv = "none", True
    with caplog.at_level("WARNING", logger="trainer"):
        assert make_callback(SimpleNamespace(cfg=cfg, env=SimpleNamespace(rank=0))) is None
        assert make_callback(SimpleNamespace(cfg=cfg, env=SimpleNamespace(rank=1))) is None  # rank 0 speaks
        cfg.profile.export_timing_csv = False
        assert make_callback(SimpleNamespace(cfg=cfg, env=SimpleNamespace(rank=0))) is None  # asked for nothing
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["profiling: --export_timing_csv with nothing to record (profile.batch none, num_prof_steps 0): "
                    "no CSV is written; set --num_prof_steps N or --profile_batch K"]


def test_theoretical_bubble():
    assert bubble.theoretical_bubble("1f1b", 2, 4) == 1 / 5
    assert bubble.theoretical_bubble("gpipe", 4, 8) == 3 / 11
    assert bubble.theoretical_bubble("interleaved1f1b", 2, 4, 2) == 1 / 9  # (p-1)/(v*m+p-1)
    assert bubble.theoretical_bubble("1f1b", 1, 4) == 0.0
    assert bubble.theoretical_bubble("zbv", 2, 4, 2) is None


def _ev(action, s, e, stage=0, mb=0):
    return {"action": action, "start_ns": s, "end_ns": e, "stage": stage, "mb": mb, "peer": None, "bytes": 0}


def payloads():
    # Two ranks, window 0..100 ns of pipeline actions; optimizer outside the window is ignored.
    r0 = [_ev("forward", 0, 30), _ev("send_F", 30, 35), _ev("recv_B", 35, 70), _ev("backward", 70, 100),
          _ev("optimizer", 100, 150, mb=None)]
    r1 = [_ev("recv_F", 0, 35, 1), _ev("forward", 35, 55, 1), _ev("backward", 55, 70, 1)]
    return [{"rank": 0, "node": "n0", "stages": [0], "events": r0, "net": [(0, 0, 0), (50, 1000, 500)],
             "offset_ns": 0, "error_ns": 0},
            {"rank": 1, "node": "n1", "stages": [1], "events": r1, "net": [], "offset_ns": -7, "error_ns": 2}]


def test_bubble_summary_numbers():
    s = bubble.summarize(payloads(), 3, "1f1b", 2, 1, 1)
    assert s["window_ms"] == pytest.approx(100e-6)
    r0, r1 = s["ranks"]
    assert r0["busy_ms"] == pytest.approx(60e-6) and r0["idle_ms"] == pytest.approx(40e-6)
    assert r0["comm_wait_ms"] == pytest.approx(40e-6)
    assert r1["bubble_fraction"] == pytest.approx(0.65)
    assert s["measured_bubble"] == pytest.approx((0.4 + 0.65) / 2)
    assert s["theoretical_bubble"] == 0.5
    assert "bubble measured 0.525 vs theory 0.500" in bubble.format_summary(s)


def test_chrome_trace_and_seed_records():
    t = trace.chrome_trace(payloads(), 3, {"schedule": "1f1b"})
    names = {e["pid"]: e["args"]["name"] for e in t["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "n0/rank0/stage0", 1: "n1/rank1/stage1"}
    xs = [e for e in t["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 8 and min(e["ts"] for e in xs) == 0.0
    fwd1 = next(e for e in xs if e["pid"] == 1 and e["name"] == "forward mb0")
    assert (fwd1["ts"], fwd1["dur"]) == (0.035, 0.02)
    assert t["otherData"]["clock_offsets_ns"] == {"0": 0, "1": -7}
    counters = [e for e in t["traceEvents"] if e["ph"] == "C"]
    assert counters[0]["args"] == {"up": pytest.approx(1000 * 8 / 1e6 / 50e-9), "down": pytest.approx(500 * 8 / 1e6 / 50e-9)}
    seed = trace.seed_records(payloads())
    assert [r["action"] for r in seed[:4]] == ["F", "SEND_F", "RECV_B", "B"]
    assert seed[0] == {"rank": 0, "action": "F", "stage_idx": 0, "mb_idx": 0, "start_ns": 0, "end_ns": 30,
                       "net_series": []}
    assert seed[2]["net_series"] == [[50, pytest.approx(160000.0), pytest.approx(80000.0)]]


def test_clock_skew_hook():
    assert injected_skew_ns(1, {"TRAINER_TEST_CLOCK_SKEW_NS": "1:5000000000"}) == 5_000_000_000
    assert injected_skew_ns(2, {"TRAINER_TEST_CLOCK_SKEW_NS": "1:5,2:-3"}) == -3
    assert injected_skew_ns(0, {}) == 0
    c = RankClock(epoch_ns=1000, perf0=0, offset_ns=-400)
    assert c.to_ref(1500) == 1100


def _powercap(root: Path, values: list[int], max_range: int = 1000) -> None:
    for i, v in enumerate(values):
        z = root / f"intel-rapl:{i}"
        z.mkdir(parents=True, exist_ok=True)
        (z / "energy_uj").write_text(f"{v}\n")
        (z / "max_energy_range_uj").write_text(f"{max_range}\n")
    (root / "intel-rapl:0:0").mkdir(exist_ok=True)  # a sub-zone: must not be counted twice


def test_rapl_reader_sums_packages_and_handles_wraparound(tmp_path):
    _powercap(tmp_path, [900, 100])
    read, name = energy._rapl_reader(str(tmp_path))
    assert name == "RAPL intel-rapl:0,intel-rapl:1"
    assert read() == 0.0
    _powercap(tmp_path, [50, 300])  # package 0 wrapped at 1000: +151 uJ; package 1 +200 uJ
    assert read() == pytest.approx(351e-6)


def test_rapl_reader_reports_missing_or_unreadable(tmp_path):
    read, why = energy._rapl_reader(str(tmp_path / "absent"))
    assert read is None and "does not exist" in why
    _powercap(tmp_path, [1])
    # A read that fails (as a root-only energy_uj does for a user; root would bypass a chmod here).
    (tmp_path / "intel-rapl:0" / "energy_uj").unlink()
    (tmp_path / "intel-rapl:0" / "energy_uj").mkdir()
    read, why = energy._rapl_reader(str(tmp_path))
    assert read is None and "not readable" in why


def test_energy_probe_matches_this_machine():
    rapl = sorted(Path(energy.POWERCAP).glob("intel-rapl:*/energy_uj"))
    readable = bool(rapl) and all(os.access(p, os.R_OK) for p in rapl)
    reader, why = energy.probe(0, use_cuda=False)
    assert (reader is not None) == readable, why
    if reader is None:
        assert why  # the reason that goes into time-energy-{rank}.csv and the log


def test_energy_interpolation():
    s = energy.EnergySampler(RankClock(0, 0), reader=lambda: 0.0)
    s.rows = [(0, 0.0), (100, 10.0), (200, 30.0)]
    assert s.energy_at(50) == 5.0 and s.energy_at(150) == 20.0 and s.energy_at(250) is None


def test_energy_cover_waits_for_the_counter_past_an_instruction():
    """A Perseus round's last instruction ends after the sampler's last row (rows come only when the
    counter moves): cover(t) waits for the counter's next move after t, or records the reading now
    when it does not move, so energy_at(t) is known and the result does not report 0 J for it."""
    import time

    counter = {"j": 0.0, "moving": False}

    def read() -> float:
        if counter["moving"]:
            counter["j"] += 1.5
        return counter["j"]

    clock = RankClock(0, time.perf_counter_ns())
    s = energy.EnergySampler(clock, read, interval=0.001)
    s.start()
    t1 = clock.now()
    assert s.energy_at(t1) is None  # the counter has not moved since the first row
    s.cover(t1, timeout=0)  # a stuck counter: the reading as of now, flat
    assert s.rows[-1][0] >= t1 and s.rows[-1][1] == 0.0 and s.energy_at(t1) == 0.0
    t2 = clock.now()
    counter["moving"] = True
    s.cover(t2, timeout=60)  # returns on the sampler's first row after t2: the counter's move
    assert s.rows[-1][0] >= t2 and s.rows[-1][1] > 0.0 and s.energy_at(t2) is not None
    s.stop()
    assert [t for t, _ in s.rows] == sorted(t for t, _ in s.rows)


class FakeNVML:
    """Stands in for pynvml: no NVIDIA GPU (hence no libnvidia-ml) exists on the test machine.

    Mimics NVML's behaviour that matters here: devices numbered in PCI order whatever
    CUDA_VISIBLE_DEVICES says, lookups by index/UUID/PCI address, and a cumulative energy counter
    in millijoules that advances by `step_mj` each time it is read.
    """

    class NVMLError(Exception):
        pass

    def __init__(self, uuids: list[str], step_mj: int = 1500):
        self.uuids, self.step_mj = uuids, step_mj
        self.energy_mj = {u: 1_000_000 * (i + 1) for i, u in enumerate(uuids)}  # counters start anywhere
        self.inits = 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        if not 0 <= i < len(self.uuids):
            raise self.NVMLError("Invalid Argument")
        return self.uuids[i]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid not in self.uuids:
            raise self.NVMLError("Not Found")
        return uuid

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> str:
        return self.nvmlDeviceGetHandleByIndex(int(bus_id.split(":")[1], 16) - 0x10)  # bus 0x10 + index

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        return handle

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:
        self.energy_mj[handle] += self.step_mj
        return self.energy_mj[handle]


GPU = [f"GPU-{i}{i}{i}{i}aaaa-bbbb-cccc-dddd-eeeeeeeeeee{i}" for i in range(4)]


def _ident(index, uuid=None, pci=None):
    from trainer.profiling.nvml import CudaIdentity

    return CudaIdentity(index, uuid, pci)


@pytest.mark.parametrize("visible,index,want", [
    (None, 1, GPU[1]),                          # all GPUs visible: cuda:i is NVML i
    ("2,3", 0, GPU[2]), ("2,3", 1, GPU[3]),     # a subset: cuda:0 is the first listed, not NVML 0
    ("3, 1", 0, GPU[3]),
    (f"{GPU[3]},{GPU[0]}", 1, GPU[0]),          # full UUIDs
    ("GPU-2222,GPU-1111", 0, GPU[2]),           # unique UUID prefixes, as CUDA accepts them
])
def test_nvml_handle_follows_cuda_visible_devices(visible, index, want):
    from trainer.profiling.nvml import nvml_handle

    handle, how = nvml_handle(FakeNVML(GPU), _ident(index), visible)
    assert handle == want, how


def test_nvml_handle_prefers_what_cuda_reports():
    from trainer.profiling.nvml import nvml_handle

    nvml = FakeNVML(GPU)
    # CUDA's own UUID of the device wins over a CUDA_VISIBLE_DEVICES index (whose order may differ).
    assert nvml_handle(nvml, _ident(0, uuid=GPU[3]), "1,3")[0] == GPU[3]
    assert nvml_handle(nvml, _ident(0, pci="0000:12:00.0"), "1")[0] == GPU[2]
    # A UUID NVML does not know falls through to the PCI address, then to the env.
    handle, how = nvml_handle(nvml, _ident(1, uuid="GPU-99999999-0000-0000-0000-000000000000"), "0,2")
    assert handle == GPU[2] and "CUDA_VISIBLE_DEVICES entry 2" in how


@pytest.mark.parametrize("visible,err", [("MIG-1234-5678", "MIG instance"), ("GPU-", "matches 4"),
                                         ("GPU-7", "matches 0"), ("gpu0", "neither an index"),
                                         ("", "lists 0")])
def test_nvml_handle_errors_say_why(visible, err):
    from trainer.profiling.nvml import nvml_handle

    with pytest.raises(ValueError, match=err):
        nvml_handle(FakeNVML(GPU), _ident(0), visible)


def test_cuda_identity_in_nvml_spelling():
    from types import SimpleNamespace

    from trainer.profiling.nvml import identity_from_props

    # Stand-in for torch.cuda.get_device_properties(i) (no CUDA device here), with the fields it has.
    props = SimpleNamespace(uuid="58d1b6a3-1f2e-4c5d-8e9f-0a1b2c3d4e5f", pci_domain_id=0, pci_bus_id=0x3B,
                            pci_device_id=0)
    ident = identity_from_props(2, props)
    assert (ident.index, ident.uuid, ident.pci_bus_id) == (2, "GPU-58d1b6a3-1f2e-4c5d-8e9f-0a1b2c3d4e5f",
                                                           "0000:3b:00.0")
    ident = identity_from_props(0, SimpleNamespace(uuid="", name="older torch"))
    assert (ident.uuid, ident.pci_bus_id) == (None, None)


def test_nvml_reader_counts_joules_of_the_mapped_gpu():
    from trainer.profiling.nvml import nvml_reader

    nvml = FakeNVML(GPU, step_mj=250)
    read, name = nvml_reader(1, nvml=nvml, ident=_ident(1), environ={"CUDA_VISIBLE_DEVICES": "0,3"})
    assert name == f"NVML {GPU[3]} (by CUDA_VISIBLE_DEVICES entry 3 (NVML index))"
    before = nvml.energy_mj[GPU[3]]
    assert read() == pytest.approx((before + 250) / 1e3)  # mJ -> J, from GPU 3's counter only
    assert nvml.energy_mj[GPU[0]] == 1_000_000 and nvml.inits == 1
    # A device NVML cannot find is "no sensor", with the reason, not a crash.
    read, why = nvml_reader(2, nvml=nvml, ident=_ident(2), environ={"CUDA_VISIBLE_DEVICES": "0,3"})
    assert read is None and why.startswith("NVML unusable for cuda:2") and "lists 2" in why


def test_energy_sampler_csv_from_nvml(tmp_path):
    """The sampler thread over an NVML counter writes Perseus' `time,energy`: cumulative Joules
    from 0, one row per counter change, times and energies increasing."""
    import time

    from trainer.profiling.nvml import nvml_reader
    from trainer.profiling.timing_csv import write_time_energy

    nvml = FakeNVML(GPU, step_mj=1500)
    read, _ = nvml_reader(0, nvml=nvml, ident=_ident(0, uuid=GPU[0]), environ={})
    clock = RankClock(epoch_ns=10**18, perf0=time.perf_counter_ns(), offset_ns=-10**9)
    s = energy.EnergySampler(clock, read, interval=0.005)
    s.start()
    start_mj = 1_000_000  # GPU[0]'s counter before any read (FakeNVML)
    wait_for(lambda: nvml.energy_mj[GPU[0]] - start_mj >= 6 * 1500, 60, interval=0.005)  # >= 6 reads, not a time
    s.stop()
    path = tmp_path / "time-energy-0.csv"
    write_time_energy(path, s, "", clock.to_ref)
    lines = path.read_text().splitlines()
    assert lines[0] == "time,energy"
    rows = [tuple(map(float, line.split(","))) for line in lines[1:]]
    assert len(rows) >= 5 and rows[0][1] == 0.0
    times, joules = [t for t, _ in rows], [e for _, e in rows]
    assert times == sorted(times) and all(b > a for a, b in zip(joules, joules[1:], strict=False))
    # every read advances the counter by 1.5 J, and every change is a row: row k holds k reads' worth
    assert joules == pytest.approx([1.5 * k for k in range(len(rows))])
    # times are on rank 0's clock: epoch 1e9 s shifted by the -1 s offset
    assert 10**9 - 1 <= times[0] < times[-1] < 10**9 + 60


@pytest.mark.multiproc
def test_single_process_seed_format_and_plots(tmp_path):
    run_trainer(tmp_path, "--model.preset", "tiny-llama", "--train.steps", "3", "--data.seq_len", "16",
                "--train.batch_size", "4", "--train.microbatch_num", "2", "--profile_batch", "1",
                "--profile.format", "seed", "--export_timing_csv")
    seed = json.loads((tmp_path / "timeline_batch1_rank0.json").read_text())  # the guide's world-1 name
    assert [r["action"] for r in seed if r["action"] in ("F", "B")] == ["F", "B", "F", "B"]
    assert [r["mb_idx"] for r in seed if r["action"] == "F"] == [0, 1]
    chrome = json.loads((tmp_path / "timeline_batch1_all.json").read_text())
    assert "traceEvents" in chrome
    rows = list(csv.reader((tmp_path / "instructions-0.csv").open()))
    assert rows[0] == ["instruction", "start", "end", "stage", "microbatch"]
    assert [r[0] for r in rows[1:]] == ["batch_input", "forward_microstep", "backward_microstep",
                                        "forward_microstep", "backward_microstep", "grad_norm", "optimizer_step"]
    from trainer.cli import main

    assert main(["plot", str(tmp_path)]) == 0
    for name in ("timeline_batch1_gantt.png", "metrics.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == PNG and len(data) > 5000


def test_plot_errors_are_one_line(tmp_path, capsys):
    from trainer.cli import main

    assert main(["plot", str(tmp_path / "nope")]) == 2
    assert main(["plot", str(tmp_path)]) == 2  # exists, but holds nothing to plot
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: plot: '{tmp_path / 'nope'}' is not a directory (give the run's OUTPUT_DIR)",
                   f"error: plot: nothing to plot in '{tmp_path}' (no timeline_batch*_all.json, no metrics.jsonl)"]
