"""Profiling through the real trainer under torchrun on gloo: merged timelines, causality after
clock-offset correction (also with one rank's clock skewed by 5 s), bubble summary, CSVs."""

from __future__ import annotations

import csv
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.support.trainer_run import run_trainer

pytestmark = pytest.mark.multiproc

MODEL = ("--model.preset", "tiny-llama", "--model.num_hidden_layers", "4", "--data.seq_len", "16",
         "--train.seed", "0", "--optim.lr", "0.001")
COMPUTE = {"forward", "backward", "backward_input", "backward_weight"}


def slices(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def action(e: dict) -> str:
    return e["name"].split(" ")[0]


def by_key(trace: dict) -> dict[tuple[str, int, int], dict]:
    """(action, stage, microbatch) -> slice, for compute slices."""
    out = {}
    for e in slices(trace):
        if action(e) in COMPUTE:
            key = (action(e), e["args"]["stage"], e["args"]["microbatch"])
            assert key not in out, f"duplicate slice {key}"
            out[key] = e
    return out


def assert_causal(trace: dict, stages: int, micro: int) -> None:
    """Stage s's forward of j starts after stage s-1's forward of j ends; backward the other way.

    Allowed slack: the offset estimates' stated error bounds (half the best ping-pong round trip).
    """
    err = trace["otherData"]["clock_error_ns"]
    rank_of = {e["args"]["stage"]: e["pid"] for e in slices(trace) if e["args"]["stage"] is not None}
    k = by_key(trace)
    for s in range(1, stages):
        slack = (err[str(rank_of[s])] + err[str(rank_of[s - 1])]) / 1e3
        for j in range(micro):
            f0, f1 = k[("forward", s - 1, j)], k[("forward", s, j)]
            assert f1["ts"] + slack >= f0["ts"] + f0["dur"], f"forward mb{j}: stage {s} before stage {s - 1} ended"
            b1, b0 = k[("backward", s, j)], k[("backward", s - 1, j)]
            assert b0["ts"] + slack >= b1["ts"] + b1["dur"], f"backward mb{j}: stage {s - 1} before stage {s} ended"


def assert_no_overlap(trace: dict) -> None:
    """Per rank and track: the rank's actions (tid 0) never overlap; nor do overlapping-comm slices (tid 1)."""
    per: dict[tuple[int, int], list[dict]] = {}
    for e in slices(trace):
        per.setdefault((e["pid"], e["tid"]), []).append(e)
    for (pid, tid), evs in per.items():
        evs.sort(key=lambda e: e["ts"])
        for a, b in zip(evs, evs[1:], strict=False):
            assert b["ts"] >= a["ts"] + a["dur"] - 1e-3, f"rank {pid} tid {tid}: {a['name']} overlaps {b['name']}"
    assert {tid for _, tid in per} <= {0, 1}


@pytest.fixture(scope="module")
def pp2(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pp2")
    # Timelines of batches 1 and 3 (a list), profile.csv over batches 1-2: batches 1, 2, 3 are recorded.
    run_trainer(out, *MODEL, "--train.steps", "4", "--train.batch_size", "8", "--train.microbatch_num", "4",
                "--parallel.pp", "2", "--parallel.pp_schedule", "1f1b", "--profile_batch", "1,3",
                "--export_timing_csv", "--num_prof_steps", "2", nproc=2)
    return out


@pytest.mark.parametrize("batch", [1, 3])
def test_pp2_1f1b_trace(pp2, batch):
    trace = json.loads((pp2 / f"timeline_batch{batch}_all.json").read_text())
    assert trace["otherData"]["batch"] == batch
    assert set(trace) >= {"traceEvents", "displayTimeUnit"}
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert sorted(names) == [0, 1] and names[0].endswith("/rank0/stage0") and names[1].endswith("/rank1/stage1")
    for e in slices(trace):
        assert {"stage", "microbatch", "peer", "bytes"} <= set(e["args"]), e
        assert e["dur"] >= 0 and isinstance(e["ts"], (int, float))
    counts = Counter((e["pid"], action(e)) for e in slices(trace))
    for rank in (0, 1):
        assert counts[(rank, "forward")] == 4 and counts[(rank, "backward")] == 4, counts
        assert counts[(rank, "optimizer")] == 1 and counts[(rank, "batch_input")] == 1
    # Each microbatch crosses once each way: 4 activations 0->1, 4 gradients 1->0, with their sizes.
    assert counts[(0, "send_F")] == counts[(1, "recv_F")] == 4
    assert counts[(1, "send_B")] == counts[(0, "recv_B")] == 4
    p2p = [e for e in slices(trace) if action(e) in ("send_F", "recv_F", "send_B", "recv_B")]
    assert all(e["args"]["peer"] == 1 - e["pid"] for e in p2p)
    assert all(e["args"]["bytes"] == 2 * 16 * 64 * 4 for e in p2p)  # 2 samples x 16 tokens x hidden 64 x fp32
    assert_no_overlap(trace)
    assert_causal(trace, 2, 4)


def test_pp2_timelines_only_for_listed_batches(pp2):
    # Batch 2 is recorded (num_prof_steps) but not listed in --profile_batch: no timeline of its own.
    assert sorted(p.name for p in pp2.glob("timeline_batch*")) == [
        "timeline_batch1_all.json", "timeline_batch1_summary.json", "timeline_batch3_all.json",
        "timeline_batch3_summary.json"]
    t1, t3 = (json.loads((pp2 / f"timeline_batch{k}_all.json").read_text()) for k in (1, 3))
    # Each file holds its own batch: batch 3 started after batch 1 ended (absolute origins, rank 0's clock).
    end1 = t1["otherData"]["origin_ns"] + max(e["ts"] + e["dur"] for e in slices(t1)) * 1e3
    assert t3["otherData"]["origin_ns"] > end1
    log = (pp2 / "logs" / "rank0.log").read_text()
    assert log.count("timeline of batch 1:") == 1 and log.count("timeline of batch 3:") == 1


@pytest.mark.parametrize("batch", [1, 3])
def test_pp2_bubble_summary(pp2, batch):
    s = json.loads((pp2 / f"timeline_batch{batch}_summary.json").read_text())
    assert s["batch"] == batch
    assert s["theoretical_bubble"] == pytest.approx(1 / 5, abs=1e-12)  # (p-1)/(m+p-1), p=2, m=4
    assert (s["pp"], s["microbatches"], s["schedule"]) == (2, 4, "1f1b")
    assert 0.0 < s["measured_bubble"] < 1.0
    for r in s["ranks"]:
        assert 0.0 < r["bubble_fraction"] < 1.0
        assert r["busy_ms"] + r["idle_ms"] == pytest.approx(s["window_ms"], rel=1e-9)
        assert r["busy_ms"] == pytest.approx(r["action_ms"]["forward"] + r["action_ms"]["backward"], rel=1e-9)
    log = (pp2 / "logs" / "rank0.log").read_text()
    assert log.count("vs theory 0.200") == 2  # both timelines' summaries are printed


def test_pp2_timing_csvs(pp2):
    for rank in (0, 1):
        rows = list(csv.DictReader((pp2 / f"instructions-{rank}.csv").open()))
        assert list(rows[0]) == ["instruction", "start", "end", "stage", "microbatch"]
        c = Counter(r["instruction"] for r in rows)
        # batches 1, 2 (num_prof_steps 2 from batch 1) and 3 (second timeline) recorded
        assert c["batch_input"] == 3 and c["forward_microstep"] == 12 and c["backward_microstep"] == 12
        assert c["send_activation" if rank == 0 else "recv_activation"] == 12
        assert c["recv_grad" if rank == 0 else "send_grad"] == 12
        assert c["optimizer_step"] == 3
        assert all(float(r["end"]) >= float(r["start"]) for r in rows)
        assert {r["stage"] for r in rows} == {str(rank)}
        fwd_mbs = [r["microbatch"] for r in rows if r["instruction"] == "forward_microstep"]
        assert fwd_mbs == ["0", "1", "2", "3"] * 3
    prof = list(csv.DictReader((pp2 / "profile.csv").open()))
    assert list(prof[0]) == ["stage", "instruction", "time", "energy"]
    assert [(r["stage"], r["instruction"]) for r in prof] == [
        ("0", "load"), ("0", "forward"), ("0", "backward"), ("1", "load"), ("1", "forward"), ("1", "backward")]
    assert all(float(r["time"]) > 0 for r in prof)


def test_pp2_energy_file_is_honest(pp2):
    from trainer.profiling.energy import probe

    reader, why = probe(0, use_cuda=False)
    text = (pp2 / "time-energy-0.csv").read_text()
    prof = list(csv.DictReader((pp2 / "profile.csv").open()))
    if reader is None:  # this machine: no readable RAPL -> a comment, no numbers; profile energy empty
        assert text == f"# no energy sensor: {why}\n"
        assert all(r["energy"] == "" for r in prof)
        assert "no energy sensor" in (pp2 / "logs" / "rank0.log").read_text()
    else:
        lines = text.splitlines()
        assert lines[0] == "time,energy"
        energies = [float(line.split(",")[1]) for line in lines[1:]]
        assert energies == sorted(energies) and energies[-1] > 0


def test_pp3_skewed_clock_still_causal(tmp_path):
    # Rank 1's clock runs 5 s ahead; the start-up ping-pong must find and remove that.
    skew = 5_000_000_000
    run_trainer(tmp_path, *MODEL, "--train.steps", "2", "--train.batch_size", "6", "--train.microbatch_num", "3",
                "--parallel.pp", "3", "--parallel.pp_schedule", "1f1b", "--parallel.partition", "custom:0,1,3,4",
                "--profile_batch", "1", "--profile.format", "seed", nproc=3,
                env={"TRAINER_TEST_CLOCK_SKEW_NS": f"1:{skew}"})
    trace = json.loads((tmp_path / "timeline_batch1_all.trace.json").read_text())
    offsets, errors = trace["otherData"]["clock_offsets_ns"], trace["otherData"]["clock_error_ns"]
    # Found within the trainer's own bound on its estimate (half its best round trip, measured in
    # this run), plus 50 ms for the moments the ranks read their clocks at start-up; and that
    # bound is far under the skew it removed.
    assert abs(offsets["1"] + skew) <= errors["1"] + 50_000_000, (offsets, errors)
    assert abs(offsets["2"]) <= errors["2"] + 50_000_000, (offsets, errors)
    assert errors["1"] < skew / 10, errors
    assert_no_overlap(trace)
    assert_causal(trace, 3, 3)
    s = json.loads((tmp_path / "timeline_batch1_summary.json").read_text())
    assert s["theoretical_bubble"] == pytest.approx(2 / 5, abs=1e-12)  # p=3, m=3
    assert 0.0 < s["measured_bubble"] < 1.0
    # The Pi guide's flat format, under its own file name.
    seed = json.loads((tmp_path / "timeline_batch1_all.json").read_text())
    assert isinstance(seed, list)
    assert all(list(r) == ["rank", "action", "stage_idx", "mb_idx", "start_ns", "end_ns", "net_series"] for r in seed)
    assert [r["rank"] for r in seed] == sorted(r["rank"] for r in seed)  # concatenated in rank order
    c = Counter((r["rank"], r["action"]) for r in seed)
    for rank in range(3):
        assert c[(rank, "F")] == c[(rank, "B")] == 3
    assert c[(0, "SEND_F")] == c[(1, "RECV_F")] == c[(1, "SEND_F")] == c[(2, "RECV_F")] == 3
    for r in seed:
        assert isinstance(r["start_ns"], int) and r["end_ns"] >= r["start_ns"]
        for point in r["net_series"]:
            assert len(point) == 3 and r["start_ns"] <= point[0] <= r["end_ns"] and point[1] >= 0


def test_pp2_plots(pp2, tmp_path):
    from trainer.tools.plots import plot_dir

    # Plots are written beside their inputs: into a copy, so the shared run's files stay as the
    # trainer left them for the other tests (whatever order they run in).
    out = Path(shutil.copytree(pp2, tmp_path / "run"))
    made = {p.name for p in plot_dir(out)}
    assert made == {"timeline_batch1_gantt.png", "timeline_batch3_gantt.png", "metrics.png"}
    assert not list(pp2.glob("*.png"))
    for name in made:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_pp2_zbv_split_backward_slices(tmp_path):
    # ZBV: two stages per rank in a V (rank 0 holds 0 and 3); backward split into input (I) and weight (W).
    run_trainer(tmp_path, *MODEL, "--train.steps", "2", "--train.batch_size", "8", "--train.microbatch_num", "4",
                "--parallel.pp", "2", "--parallel.pp_schedule", "zbv", "--parallel.virtual_stages", "2",
                "--profile_batch", "1", nproc=2)
    trace = json.loads((tmp_path / "timeline_batch1_all.json").read_text())
    counts = Counter((action(e), e["args"]["stage"]) for e in slices(trace))
    for stage in range(4):
        for act in ("forward", "backward_input", "backward_weight"):
            assert counts[(act, stage)] == 4, (act, stage, counts)
    assert counts[("send_F", 0)] == counts[("recv_F", 1)] == counts[("send_B", 1)] == counts[("recv_B", 0)] == 4
    assert_no_overlap(trace)
    s = json.loads((tmp_path / "timeline_batch1_summary.json").read_text())
    assert s["theoretical_bubble"] is None and 0.0 < s["measured_bubble"] < 1.0


def test_ddp_gradient_reduction_slices(tmp_path):
    """Plain DDP (3 ranks, 2 microbatches): the bucket all-reduces, timed by a comm hook, show on the
    rank's second track inside the last microbatch's backward (the first runs under no_sync) and
    cover every gradient byte once; the hook leaves the numbers bit-identical to DDP without it
    (3 ranks: 1/3 is where dividing and DDP's multiply-by-reciprocal part ways)."""
    from tests.support.trainer_run import read_metrics
    from trainer.config import ModelConfig
    from trainer.models.build import build_model, model_spec

    ddp = (*MODEL, "--train.steps", "2", "--train.batch_size", "4", "--train.microbatch_num", "2",
           "--parallel.sharding", "ddp")
    run_trainer(tmp_path / "prof", *ddp, "--profile_batch", "1", nproc=3)
    run_trainer(tmp_path / "plain", *ddp, "--profile_batch", "none", nproc=3)
    prof, plain = read_metrics(tmp_path / "prof"), read_metrics(tmp_path / "plain")
    assert [(m["loss"], m["grad_norm"]) for m in prof] == [(m["loss"], m["grad_norm"]) for m in plain]
    assert not list((tmp_path / "plain").glob("timeline_*"))
    trace = json.loads((tmp_path / "prof" / "timeline_batch1_all.json").read_text())
    mcfg = ModelConfig(preset="tiny-llama", num_hidden_layers=4)
    grad_bytes = 4 * sum(p.numel() for p in build_model(model_spec(mcfg), mcfg, 0).parameters())
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    for rank in (0, 1, 2):
        evs = [e for e in slices(trace) if e["pid"] == rank]
        red = [e for e in evs if action(e) == "dp_reduce"]
        assert red and {e["tid"] for e in red} == {1}, evs
        assert threads[(rank, 1)] == "gradient reduction (overlaps backward)"
        assert sum(e["args"]["bytes"] for e in red) == grad_bytes  # every gradient, in DDP's buckets
        bwd = sorted((e for e in evs if action(e) == "backward"), key=lambda e: e["ts"])
        assert [e["args"]["microbatch"] for e in bwd] == [0, 1]
        opt = next(e for e in evs if action(e) == "optimizer")
        for r in red:
            assert r["dur"] > 0
            assert r["ts"] >= bwd[1]["ts"], "reduced before the last microbatch's backward began"
            assert r["ts"] + r["dur"] <= bwd[1]["ts"] + bwd[1]["dur"] + 1e-3, "outlived backward (DDP waits for it)"
            assert r["ts"] + r["dur"] <= opt["ts"] + 1e-3
    assert_no_overlap(trace)
