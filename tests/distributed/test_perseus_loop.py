"""The Perseus frequency-plan loop against the real server (Zeus 0.16 on loopback, its own venv):
the trainer under torchrun on gloo registers, runs num_prof_steps steps per plan, reports, and
records each plan; the server's dump is read back."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.support.perseus_helpers import perseus_server, write_plan
from tests.support.trainer_run import run_trainer

pytestmark = pytest.mark.multiproc

SHAPE = ("--model.num_hidden_layers", "4", "--data.seq_len", "16", "--train.batch_size", "8", "--train.microbatch_num",
         "4", "--parallel.pp", "2")
MODEL = ("--model.preset", "tiny-llama", *SHAPE)
# What torch's schedules run per step on 2 stages with 4 microbatches: (instruction, microbatch).
ORDER = {
    "1f1b": [[("forward", 0), ("forward", 1), ("backward", 0), ("forward", 2), ("backward", 1), ("forward", 3),
              ("backward", 2), ("backward", 3)],
             [("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1), ("forward", 2), ("backward", 2),
              ("forward", 3), ("backward", 3)]],
    "gpipe": [[("forward", m) for m in range(4)] + [("backward", m) for m in range(4)]] * 2,
}


def plan_for(schedule: str, base: int) -> list[list[tuple[str, int]]]:
    """A plan whose every position has its own frequency: base + 100 * rank + position."""
    return [[(name, base + 100 * r + i) for i, (name, _) in enumerate(order)] for r, order in enumerate(ORDER[schedule])]


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def check_plans_csv(out: Path, schedule: str, plans: list[list[list[tuple[str, int]]]], windows: list[str]) -> None:
    for r in range(2):
        rows = read_csv(out / f"plans-{r}.csv")
        expect = [{"plan": str(p), "window": windows[p], "position": str(i), "instruction": name, "stage": str(r),
                   "microbatch": str(ORDER[schedule][r][i][1]), "frequency": str(mhz), "applied": "false"}
                  for p, plan in enumerate(plans) for i, (name, mhz) in enumerate(plan[r])]
        assert rows == expect


def check_results(results: list[list[dict]], rounds: int, steps: int) -> None:
    """Per round one result per rank: `steps` iteration times, 4 forward and 4 backward times each."""
    assert len(results) == rounds
    for per_rank in results:
        assert [r["rank"] for r in per_rank] == [0, 1]
        for r in per_rank:
            assert len(r["iter_time"]) == steps and all(t > 0 for t in r["iter_time"])
            assert len(r["iter_energy"]) == steps
            for kind in ("forward", "backward"):
                assert [len(x) for x in r["time_breakdown"][kind]] == [4] * steps
                assert all(t > 0 for x in r["time_breakdown"][kind] for t in x)
                assert [len(x) for x in r["energy_breakdown"][kind]] == [4] * steps
            # a step holds its instructions: their times add up to less than the step's
            for i, t in enumerate(r["iter_time"]):
                assert sum(r["time_breakdown"]["forward"][i]) + sum(r["time_breakdown"]["backward"][i]) < t


def test_fixed_plan_three_rounds_1f1b(tmp_path):
    """(a) PointSolution, 1F1B over 2 ranks, num_prof_steps 2, 7 steps: warm-up + 3 rounds."""
    plan = plan_for("1f1b", 1000)
    with perseus_server(tmp_path, [write_plan(tmp_path / "plan.py", plan)]) as srv:
        out = tmp_path / "out"
        run_trainer(out, *MODEL, "--parallel.pp_schedule", "1f1b", "--train_steps", "7", "--num_prof_steps", "2",
                    "--perseus_url", srv.url, nproc=2)
        results, scheds = srv.results(), srv.schedules()
        ranks = json.loads((srv.job_dir() / "ranks.json").read_text())
    check_results(results, rounds=3, steps=2)
    assert [[s["frequencies"] for s in sc] for sc in scheds] == [[[list(p) for p in rank] for rank in plan]] * 3
    assert [(r["rank"], r["pp_rank"], r["dp_rank"], r["tp_rank"], r["available_frequencies"]) for r in ranks] == \
        [(0, 0, 0, 0, []), (1, 1, 0, 0, [])]  # no GPU here: no clock list
    check_plans_csv(out, "1f1b", [plan] * 3, ["1-2", "3-4", "5-6"])
    prof = read_csv(out / "profile.csv")
    assert list(prof[0]) == ["stage", "instruction", "frequency", "time", "energy", "plan"]
    for p in range(3):
        for s in range(2):
            fwd = sorted(int(r["frequency"]) for r in prof if r["plan"] == str(p) and r["stage"] == str(s)
                         and r["instruction"] == "forward")
            assert fwd == sorted(mhz for name, mhz in plan[s] if name == "forward")
    for r in range(2):
        log = (out / "logs" / f"rank{r}.log").read_text()
        assert log.count("NOT applied (profile.gpu_clocks off)") == 3  # once per plan
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 8))


def test_plan_sequence_ends_with_profiling_done_gpipe(tmp_path):
    """(b) PlanSequence over 3 different plans, GPipe on BERT (BertStage), one step per plan: after
    the third the server says [profiling-done], training ends (exit 0) long before train.steps,
    CSVs written."""
    plans = [plan_for("gpipe", base) for base in (1400, 1200, 1000)]
    files = [write_plan(tmp_path / f"plan-{i}.py", p) for i, p in enumerate(plans)]
    with perseus_server(tmp_path, files, scheduler="PlanSequence") as srv:
        out = tmp_path / "out"
        proc = run_trainer(out, "--model.preset", "tiny-bert", *SHAPE, "--parallel.pp_schedule", "gpipe", "--train_steps", "50",
                           "--num_prof_steps", "1", "--export_timing_csv", "--perseus_url", srv.url, nproc=2)
        results = srv.results()
    assert proc.returncode == 0
    check_results(results, rounds=3, steps=1)
    check_plans_csv(out, "gpipe", plans, ["1-1", "2-2", "3-3"])
    assert len({tuple(map(tuple, p[0])) for p in plans}) == 3
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # warm-up + 3 plans, then done
    assert "[profiling-done] all 3 plans ran" in proc.stdout
    for r in range(2):
        rows = read_csv(out / f"instructions-{r}.csv")
        assert sum(row["instruction"] == "forward_microstep" for row in rows) == 16  # 4 steps x 4 microbatches
    assert {r["plan"] for r in read_csv(out / "profile.csv")} == {"0", "1", "2"}


def test_plan_that_does_not_fit_the_rank_is_one_line(tmp_path):
    """A plan made for another layout (3 instructions where the rank runs F0 B0) stops the run with
    one line naming the server and the mismatch, before any step runs under a plan."""
    plan = [[("forward", 1000), ("backward", 1000), ("backward", 900)]]
    with perseus_server(tmp_path, [write_plan(tmp_path / "plan.py", plan)]) as srv:
        out = tmp_path / "out"
        proc = run_trainer(out, "--model.preset", "tiny-llama", "--model.num_hidden_layers", "2", "--data.seq_len",
                           "16", "--train.batch_size", "2", "--train_steps", "5", "--num_prof_steps", "1",
                           "--perseus_url", srv.url, check=False)
    assert proc.returncode == 2
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert err == [f"error: Perseus server {srv.url}: plan 0 for rank 0 does not match this rank's instructions: "
                   f"it lists 3 instructions (1 forward, 2 backward) but this rank runs 2 per step "
                   f"(1 forward, 1 backward)"]
    assert "Traceback" not in proc.stderr
    assert not (out / "plans-0.csv").read_text().strip().splitlines()[1:]  # header only: no plan ran
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]  # only the warm-up step, which runs under no plan


# Interleaved 1F1B on GPT-2 (GPT2Stage): two stages per rank (0+2 and 1+3), the third schedule and
# third stage class Perseus plans follow (1F1B on llama's DecoderStage in (a), GPipe on BertStage in
# (b); qwen2/qwen3/mistral are DecoderStage too). (instruction, stage, microbatch) per rank and step.
INTERLEAVED_ARGS = ("--model.preset", "tiny-gpt2", *SHAPE, "--parallel.pp_schedule", "interleaved1f1b",
                    "--parallel.virtual_stages", "2")
INTERLEAVED = [
    [("forward", 0, 0), ("forward", 0, 1), ("forward", 2, 0), ("forward", 2, 1), ("forward", 0, 2), ("backward", 2, 0),
     ("forward", 0, 3), ("backward", 2, 1), ("forward", 2, 2), ("backward", 0, 0), ("forward", 2, 3), ("backward", 0, 1),
     ("backward", 2, 2), ("backward", 2, 3), ("backward", 0, 2), ("backward", 0, 3)],
    [("forward", 1, 0), ("forward", 1, 1), ("forward", 3, 0), ("backward", 3, 0), ("forward", 3, 1), ("backward", 3, 1),
     ("forward", 1, 2), ("backward", 1, 0), ("forward", 1, 3), ("backward", 1, 1), ("forward", 3, 2), ("backward", 3, 2),
     ("forward", 3, 3), ("backward", 3, 3), ("backward", 1, 2), ("backward", 1, 3)]]


def test_plans_follow_interleaved_1f1b_gpt2(tmp_path):
    """Two plans (PlanSequence), one step each, then [profiling-done]. Each plan position lands on
    the instruction the rank runs there, on either of its stages (plans-*.csv against the guide's
    instructions CSVs, read as `trainer perseus-plans` reads them); the server gets every
    instance's time; profile.csv is labelled per stage and frequency."""
    from trainer.profiling.perseus_plans import rank_order

    order = INTERLEAVED
    plans = [[[(name, base + 100 * r + i) for i, (name, _, _) in enumerate(o)] for r, o in enumerate(order)]
             for base in (1300, 900)]
    files = [write_plan(tmp_path / f"plan-{i}.py", p) for i, p in enumerate(plans)]
    with perseus_server(tmp_path, files, scheduler="PlanSequence") as srv:
        out = tmp_path / "out"
        run_trainer(out, *INTERLEAVED_ARGS, "--train_steps", "50", "--num_prof_steps", "1", "--export_timing_csv",
                    "--perseus_url", srv.url, nproc=2)
        results = srv.results()
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    for r in range(2):
        assert rank_order(out / f"instructions-{r}.csv") == order[r]  # the guide's CSV, every step alike
        assert (out / f"time-energy-{r}.csv").read_text().strip()  # rows, or the line saying there is no sensor
        rows = read_csv(out / f"plans-{r}.csv")
        assert [(row["plan"], row["instruction"], row["stage"], row["microbatch"], row["frequency"]) for row in rows] \
            == [(str(p), name, str(stage), str(mb), str(plan[r][i][1]))
                for p, plan in enumerate(plans) for i, (name, stage, mb) in enumerate(order[r])]
    assert [[(x["rank"], [len(t) for t in x["time_breakdown"]["forward"]], [len(t) for t in x["time_breakdown"]
              ["backward"]]) for x in per_rank] for per_rank in results] == [[(0, [8], [8]), (1, [8], [8])]] * 2
    labelled = {(row["plan"], row["stage"], row["instruction"], row["frequency"]) for row in read_csv(out / "profile.csv")
                if row["instruction"] != "load"}  # batch input: no plan position, no frequency
    assert labelled == {(str(p), str(stage), name, str(plan[r][i][1])) for p, plan in enumerate(plans)
                        for r in range(2) for i, (name, stage, _) in enumerate(order[r])}


@pytest.mark.parametrize("preset", ["tiny-t5", "tiny-bloom", "tiny-wide-resnet"])
def test_the_loop_runs_the_perseus_families(tmp_path, preset):
    """The Perseus paper's other families through the loop (GPipe, 2 stages, 2 rounds): T5's stages
    carry the encoder output beside the decoder's hidden, Wide-ResNet's 4-D activations; every
    position of the plan lands on the instruction the rank runs there."""
    plan = plan_for("gpipe", 1000)
    with perseus_server(tmp_path, [write_plan(tmp_path / "plan.py", plan)]) as srv:
        out = tmp_path / "out"
        run_trainer(out, "--model.preset", preset, "--data.seq_len", "16", "--train.batch_size", "8",
                    "--train.microbatch_num", "4", "--parallel.pp", "2", "--parallel.pp_schedule", "gpipe",
                    "--train_steps", "3", "--num_prof_steps", "1", "--perseus_url", srv.url, nproc=2)
        results = srv.results()
    check_results(results, rounds=2, steps=1)
    check_plans_csv(out, "gpipe", [plan] * 2, ["1-1", "2-2"])
    assert {r["plan"] for r in read_csv(out / "profile.csv")} == {"0", "1"}
