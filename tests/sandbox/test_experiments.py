"""The five reproduced experiments at reduced size (docs/experiments.md has the full-size commands).

Each test keeps what makes the experiment itself (layout, schedule, partition, flags, log line,
file names) and shrinks only widths, depth where the layout allows, and step counts.
smollm-3d runs through compose's CPU profile: tests/docker/test_compose.py.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
from collections import Counter
from pathlib import Path

import pytest
import yaml

from tests.support.runner_helpers import runner, wait_for
from tests.support.trainer_run import (
    held,
    hold_env,
    numeric_metrics,
    read_metrics,
    release,
    run_trainer,
    start_trainer,
)

TINY_LM = ("--model.hidden_size", "32", "--model.num_attention_heads", "4", "--model.intermediate_size", "64",
           "--model.vocab_size", "256", "--data.seq_len", "16")


# ------------------------------------------------------------------ pi-qwen3-3stage (seed 000)

# What `runner up` prints for the demo job: its own lines (a run's start and end, each node's push,
# the master listening, each rank's exit) and each rank's, prefixed [node/rank]: the trainer's
# logged lines ([rankN] ...), the resolved config (YAML, nested: parallel.diloco), the stage table and the bubble summary.
# A warning (`...py:760: UserWarning: ...`, `W1126 ...`), a traceback, a library's notice or a
# blank line matches none of them.
DEMO_LINE = re.compile(
    r"\[node-\d+/\d+\] (\[rank\d+\] .*|[a-z_]+:( .*)?|(  )+[a-z_0-9]+:( .*)?|stage \d+ \(pp rank \d+\): .*"
    r"|batch \d+ \S+ p=\d+ m=\d+ .*|  rank \d+ stage \d+: .*|master listening on .*|exited 0)"
    r"|run [\w.-]+( started on .*| finished: .*|: \d+ node\(s\) running after .*)"
    r"|push \S+: \S+ \w+ \(\d+/\d+ layers, .*\)|exporting \S+ \(.*\) from the host engine")
# torchrun's own race at the end of a multi-node run (pytorch/pytorch#69520, open): the master's
# agent hosts the rendezvous store and exits once the exit barrier is complete, possibly while
# another node's agent is still inside it; that agent then logs the lost connection (a c10d
# warning with its C++ stack) and "Error waiting on exit barrier" with a traceback, and exits 0.
# Only that block, only on a worker node that logged that error, is not counted against the run.
EXIT_BARRIER_RACE = re.compile(
    r"\[W\d{4} [\d:.]+ TCPStore\.cpp:\d+\] \[c10d\] recvValueWithTimeout failed .*|Exception raised from recvBytes .*"
    r"|frame #\d+: .*|<omitting python frames>|"
    r"|E\d{4} [\d:.]+ \d+ torch/distributed/elastic/agent/server/api\.py:\d+\] .*")


def unexpected_lines(output: str) -> list[str]:
    """The lines of a demo `runner up` that neither the runner nor the trainer means to print."""
    lines = output.splitlines()
    raced = {ln.split("]", 1)[0] for ln in lines if ln.startswith("[node-") and "Error waiting on exit barrier" in ln}
    out = []
    for ln in lines:
        node, _, text = ln.partition("] ")
        if node in raced and not node.startswith("[node-0/") and EXIT_BARRIER_RACE.fullmatch(text.rstrip()):
            continue
        if not DEMO_LINE.fullmatch(ln):
            out.append(ln)
    return out


@pytest.mark.sandbox
@pytest.mark.docker
def test_pi_qwen3_3stage_on_three_sandbox_nodes(sandbox, pushed, tmp_path):
    """The sandbox inventory's own job: configs/pi-qwen3-3stage-tiny.yaml (7 layers, the seed's
    7:14:7 split at a quarter depth) with the guide's flags, one stage per node; the merged
    timeline of batch 1 comes back with collect."""
    job = yaml.safe_load(Path(sandbox).read_text())["job"]
    assert job["args"] == ["--train_steps", "5", "--batch_size", "16", "--microbatch_num", "4", "--profile_batch", "1"]
    assert job["config"] == "configs/pi-qwen3-3stage-tiny.yaml"
    proc = runner("up", "-i", str(sandbox), "--logs-dir", str(tmp_path / "logs"), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_id = re.search(r"run (\S+) started", proc.stdout)[1]
    # Quiet: every line is one the runner or the trainer means to print (no library warning from
    # any rank, no font-cache notice, no torchrun banner).
    unexpected = unexpected_lines(proc.stdout + proc.stderr)
    assert unexpected == [], "\n".join(unexpected)
    for line in ("[node-0/0] stage 0 (pp rank 0): embeddings + layers 0-1 (2 layers",
                 "[node-0/0] stage 1 (pp rank 1): layers 2-4 (3 layers",
                 "[node-0/0] stage 2 (pp rank 2): layers 5-6 + norm + head (2 layers"):
        assert line in proc.stdout
    col = runner("collect", run_id, "-i", str(sandbox), "--dest", str(tmp_path / "art"), "--quiet")
    assert col.returncode == 0, col.stderr
    art = tmp_path / "art" / run_id
    losses = [m["loss"] for m in read_metrics(art / "node-2")]
    # Three nodes, one stage each, equal one process running the same job (fp32, 1e-5).
    one = tmp_path / "one-process"
    run_trainer(one, "--config", job["config"], *job["args"], "--parallel.pp", "1")
    ref = [m["loss"] for m in read_metrics(one)]
    assert len(losses) == len(ref) == 5
    for step, (a, b) in enumerate(zip(losses, ref, strict=True), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: 3 nodes {a} vs one process {b}"
    # Guide semantics: batch 16 per rank in 4 microbatches of 128-token blocks.
    assert read_metrics(art / "node-2")[0]["global_batch_tokens"] == 16 * 128
    # The Pi guide's per-step line, on the last stage's rank.
    assert re.search(r"\[rank2\] INFO step 5 loss \d+\.\d{4}", (art / "node-2" / "logs" / "rank2.log").read_text())
    timeline = art / "node-0" / "timeline_batch1_all.json"
    assert timeline.is_file(), sorted(p.name for p in (art / "node-0").iterdir())
    doc = json.loads(timeline.read_text())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    slices = [e for e in events if e.get("ph") == "X"]
    # 3 stages x 4 microbatches: a forward and a backward per (stage, microbatch), on every node.
    fwd = {(e["args"]["stage"], e["args"]["microbatch"]) for e in slices if e["name"].startswith("forward")}
    bwd = {(e["args"]["stage"], e["args"]["microbatch"]) for e in slices if e["name"].startswith("backward")}
    assert fwd == bwd == {(s, m) for s in range(3) for m in range(4)}
    assert len({e["pid"] for e in slices}) == 3


# ------------------------------------------------------------------ stub-zero3 (seed 001)

# The stub's ViT-MAE family at test width (tiny-vitmae: hidden 64, 2 layers, small images).
STUB_TINY = ("--model.preset", "tiny-vitmae", "--train.batch_size", "2", "--parallel.device", "cpu")


def _lr(step: int, base: float = 3e-4, warmup: int = 10, total: int = 1_000_000, min_lr: float = 0.0) -> float:
    """The stub's schedule for 1-based `step`: linear warmup base*it/warmup, then cosine to min_lr
    (the stub's iteration 0 has LR 0; here the first step already trains, at base/warmup)."""
    import math

    if step <= warmup:
        return base * step / warmup
    return min_lr + 0.5 * (base - min_lr) * (1 + math.cos(math.pi * (step - 1 - warmup) / (total - warmup)))


@pytest.mark.multiproc
def test_stub_zero3_preempt_checkpoint_and_resume(tmp_path):
    """Two ranks, ZeRO-3, the stub's own YAML and naming: SIGTERM mid-run (the ranks held after
    step 3 until it has reached them) writes `<prefix>.<timestamp>.preempt` after step 4 and exits
    143; `--resume latest` continues at step 5 with the stub's LR schedule and the very losses of
    an uninterrupted run."""
    out = tmp_path / "out"
    args = ["configs/stub-zero3.yaml", *STUB_TINY, "--train.steps", "400"]
    proc = start_trainer(out, *args, nproc=2, env=hold_env("step:3"), log=tmp_path / "first.log")
    try:
        wait_for(lambda: held(out, "step-3", range(2)) or proc.poll() is not None, 600)
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-4000:]
        os.kill(proc.pid, signal.SIGTERM)  # torchrun forwards it to both ranks, as `docker stop` does
        wait_for(lambda: held(out, "step-3", range(2), "signalled"), 120)
        release(out, "step-3")
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = (tmp_path / "first.log").read_text()
    assert rc != 0 and "exiting with 143" in text, text[-4000:]
    first = read_metrics(out)
    assert [m["step"] for m in first] == [1, 2, 3, 4]
    ckpts = out / "experiments" / "chkpts"  # the stub's checkpoint.directory, under OUTPUT_DIR
    preempt = [p for p in ckpts.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(preempt) == 1 and re.fullmatch(r"dummy-0\.1\.\d{4}_\d{4}_\d{4}_\d\d\.preempt", preempt[0].name)
    assert (ckpts / "latest").read_text().strip() == preempt[0].name
    assert json.loads((preempt[0] / "trainer_state.json").read_text())["step"] == 4

    run_trainer(out, *args[:-2], "--train.steps", "7", "--resume", "latest", nproc=2)
    resumed = read_metrics(out)
    assert [m["step"] for m in resumed] == list(range(1, 8))
    assert resumed[:4] == first  # appended, not rewritten
    for m in resumed:
        assert m["lr"] == pytest.approx(_lr(m["step"]), rel=1e-6, abs=1e-12)
    straight = tmp_path / "straight"
    run_trainer(straight, *args[:-2], "--train.steps", "7", nproc=2)
    assert numeric_metrics(out) == numeric_metrics(straight)  # bit for bit, bf16 ZeRO-3 included


# ------------------------------------------------------------------ minimal-3d (seed 002)

MINIMAL3D_LINE = re.compile(r"Step (\d+) \| Loss: (\d+\.\d{4}) \| LR: (\d\.\d{2}e[-+]\d\d) \| "
                            r"Throughput: (\d+\.\d{2}) samples/s$", re.M)


@pytest.mark.multiproc
def test_minimal_3d_eight_processes(tmp_path):
    """2 DP x 2 TP x 2 PP, 8 microbatches, 1F1B, through the original's own flags; its log line
    and its checkpoint-N naming."""
    out = tmp_path / "out"
    proc = run_trainer(out, "--config", "configs/minimal-3d.yaml", "--max-steps", "3", "--save-interval", "2",
                "--log-interval", "1", "--hidden-size", "32", "--num-layers", "4", "--num-attention-heads", "4",
                "--micro-batch-size", "8", "--model.intermediate_size", "64", "--model.vocab_size", "256",
                "--data.seq_len", "16", "--profile_batch", "1", nproc=8, timeout=900)
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert (cfg["parallel"]["tp"], cfg["parallel"]["pp"], cfg["parallel"]["pp_schedule"],
            cfg["train"]["microbatch_num"]) == (2, 2, "1f1b", 8)
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["global_batch_samples"] == 16 for m in metrics)  # mbs 8 x dp 2
    lines = [m for p in sorted((out / "logs").iterdir()) for m in MINIMAL3D_LINE.finditer(p.read_text())]
    assert [int(m[1]) for m in lines] == [1, 2, 3]
    # On the console too, from the last pipeline stage's first rank (which holds the loss).
    console = re.findall(r"^\[rank(\d)\] (Step \d+ \| .*)$", proc.stdout, re.M)
    assert [(int(r), line) for r, line in console] == [(4, m[0]) for m in lines]
    for m, rec in zip(lines, metrics, strict=True):
        assert float(m[2]) == pytest.approx(rec["loss"], abs=5e-5)
        assert m[3] == f"{rec['lr']:.2e}"
        assert float(m[4]) == pytest.approx(rec["samples_per_s"], abs=0.006)
        assert rec["samples_per_s"] == pytest.approx(16 / rec["step_time_s"])
    # warmup_ratio 0.1 of 3 steps rounds to no warmup here; cosine from 3e-4 towards 3e-5
    assert metrics[0]["lr"] == pytest.approx(3e-4) and metrics[2]["lr"] < metrics[1]["lr"] < 3e-4
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["checkpoint-2", "checkpoint-3"]
    assert (ckpts / "latest").read_text().strip() == "checkpoint-3"
    _assert_stage_reductions(json.loads((out / "timeline_batch1_all.json").read_text()), ranks=8, micro=8)


def _assert_stage_reductions(trace: dict, ranks: int, micro: int) -> None:
    """DP x PP: each rank's stage reduces its gradients over its DP group once per step (ZeRO-2:
    FSDP2's reduce-scatter, driven by PipelineStage.perform_reduce_grad), on the rank's own track,
    after its last backward and before the gradient norm and the optimizer step."""
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in range(ranks):
        evs = {}
        for e in (e for e in xs if e["pid"] == rank):
            evs.setdefault(e["name"].split(" ")[0], []).append(e)
        (red,) = evs["dp_reduce"]
        assert red["tid"] == 0 and red["dur"] > 0
        assert red["args"]["stage"] == evs["forward"][0]["args"]["stage"]
        assert len(evs["backward"]) == micro
        last_bwd_end = max(e["ts"] + e["dur"] for e in evs["backward"])
        (norm,), (opt,) = evs["grad_norm"], evs["optimizer"]
        assert red["ts"] >= last_bwd_end - 1e-3, f"rank {rank}: reduction began before its last backward ended"
        assert red["ts"] + red["dur"] <= norm["ts"] + 1e-3 and norm["ts"] + norm["dur"] <= opt["ts"] + 1e-3


# ------------------------------------------------------------------ perseus-gpt3-xl (seed 004)


@pytest.mark.multiproc
def test_perseus_gpt3_xl_four_stages_timing_csvs(tmp_path):
    """4 stages with Perseus' own partition string (Merak item counting over all 24 GPT-3 XL
    blocks, narrowed to width 32), --export_timing_csv true --num_prof_steps 4: per-rank
    instruction CSVs with the send/recv rows 1F1B implies, the honest no-sensor energy file of this
    machine, and profile.csv with load/forward/backward per stage over batches 1-4 (batch 0 is warm-up)."""
    out = tmp_path / "out"
    proc = run_trainer(out, "--config", "configs/perseus-gpt3-xl.yaml", *TINY_LM, "--train.batch_size", "8",
                       "--train.microbatch_num", "8", "--train.steps", "5", "--train.dtype", "fp32",
                       "--partition_method", "custom:0,8,14,21,27", "--export_timing_csv", "true",
                       "--num_prof_steps", "4", nproc=4, timeout=900)
    # Merak's items: wte, wpe, 24 blocks, ln_f + head (27): blocks 0-5 | 6-11 | 12-18 | 19-23.
    for line in ("stage 0 (pp rank 0): embeddings + layers 0-5 (6 layers", "stage 1 (pp rank 1): layers 6-11 (6 layers",
                 "stage 2 (pp rank 2): layers 12-18 (7 layers",
                 "stage 3 (pp rank 3): layers 19-23 + norm + head (5 layers"):
        assert line in proc.stdout
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4, 5]
    # This machine has no energy sensor (no /sys/class/powercap, no GPU): every rank's file says so
    # in one comment line and holds no number.
    from trainer.profiling.energy import probe

    reader, why = probe(0, use_cuda=False)
    if not Path("/sys/class/powercap").exists():  # each sensor kind says why it is absent, in order
        assert reader is None and why.split("; ")[1] == "/sys/class/powercap does not exist", why
    for rank in range(4):
        with (out / f"instructions-{rank}.csv").open() as f:
            rows = list(csv.DictReader(f))
        assert list(rows[0]) == ["instruction", "start", "end", "stage", "microbatch"]
        kinds = Counter(r["instruction"] for r in rows)
        # batches 1-4 (batch 0 is warm-up): 8 microbatches x 4 steps, a forward and a backward each
        assert kinds["forward_microstep"] == kinds["backward_microstep"] == 32
        assert kinds["batch_input"] == kinds["optimizer_step"] == 4
        # what 1F1B over 4 stages implies: activations go down the pipeline, gradients come back up,
        # one of each per microbatch and step; nothing untagged (shape inference ran in batch 0)
        sends = {"send_activation": rank < 3, "recv_activation": rank > 0, "send_grad": rank > 0,
                 "recv_grad": rank < 3}
        for name, expected in sends.items():
            assert kinds[name] == (32 if expected else 0), (rank, name, kinds)
            mbs = Counter(r["microbatch"] for r in rows if r["instruction"] == name)
            assert mbs == ({str(j): 4 for j in range(8)} if expected else {}), (rank, name)
        assert kinds["send"] == kinds["recv"] == 0
        assert all(float(r["end"]) >= float(r["start"]) for r in rows)
        assert {int(r["stage"]) for r in rows if r["stage"]} == {rank}
        energy = (out / f"time-energy-{rank}.csv").read_text()
        if reader is None:
            assert energy == f"# no energy sensor: {why}\n"
            assert f"no energy sensor: {why}; time-energy-{rank}.csv says so" in (
                out / "logs" / f"rank{rank}.log").read_text()
        else:
            assert energy.startswith("time,energy\n")
    with (out / "profile.csv").open() as f:
        prof = list(csv.DictReader(f))
    # Perseus' columns; `frequency` (the GPU clock plan) only where a GPU clock is set.
    assert list(prof[0]) == ["stage", "instruction", "time", "energy"]
    assert [(int(r["stage"]), r["instruction"]) for r in prof] == [
        (s, k) for s in range(4) for k in ("load", "forward", "backward")]
    assert all(float(r["time"]) > 0 for r in prof)
    assert all((r["energy"] == "") == (reader is None) for r in prof)
    assert "profile.csv: 4 profiled steps (1..4)" in (out / "logs" / "rank0.log").read_text()
