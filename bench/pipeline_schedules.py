"""Pipeline schedules and parallel layouts side by side on this machine.

    python -m bench.pipeline_schedules [--preset llama-20m] [--steps 5] [--out bench/results/...json]

Part 1, pp=2 with GPipe, 1F1B and interleaved 1F1B (2 virtual stages per rank) at m = 4 and 8
microbatches, same model and global batch: median step time; the measured bubble, from the
trainer's own profile of one batch (idle time in the batch's pipeline window,
trainer/profiling/bubble.py): of the bottleneck (busiest) stage, which is what the theory
(p-1)/(m+p-1) (interleaved: (p-1)/(v*m+p-1)) describes since it assumes equal stages, and as the
mean over ranks with the stage imbalance beside it; and the peak bytes of
activations saved for backward per stage, counted by a saved-tensors hook (tensors packed by
autograd, released when their graph is freed), which is what 1F1B bounds at p microbatches
where GPipe holds all m.

Part 2, tokens/s of dp=2 (DDP), tp=2 and pp=2 (2 processes x 1 thread) relative to one process
with 2 threads (the same two cores), each through the real `trainer` entry point (metrics.jsonl),
same model, global batch and steps.

Prints a Markdown table and writes JSON. Numbers are this machine's (2 CPU cores, gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved1f1b", 2)]


# ---------------------------------------------------------------- worker (one torchrun rank)


class SavedBytes:
    """Live and peak bytes of tensors autograd saved for backward."""

    def __init__(self, params) -> None:
        self.live = 0
        self.peak = 0
        # Weights saved by every microbatch's matmuls are not activations: not counted.
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}

    def hooks(self):
        import torch

        meter = self

        class Packed:
            __slots__ = ("t", "n")

            def __init__(self, t: torch.Tensor):
                own = t.untyped_storage().data_ptr() in meter.param_storages
                self.t, self.n = t, 0 if own else t.numel() * t.element_size()
                meter.live += self.n
                meter.peak = max(meter.peak, meter.live)

            def __del__(self):
                meter.live -= self.n

        return torch.autograd.graph.saved_tensors_hooks(Packed, lambda p: p.t)


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from trainer.config import ModelConfig
    from trainer.models.build import build_model, model_spec
    from trainer.parallel.pipeline import PipelineRunner, check_schedule, split_for_pipeline

    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    mcfg = ModelConfig(preset=a.preset, num_hidden_layers=a.layers)
    spec = model_spec(mcfg)
    model = build_model(spec, mcfg, seed=0)
    sched = check_schedule(a.schedule, pp, a.vstages, a.micro, spec.num_layers)
    parts, tied, _ = split_for_pipeline(model, sched, "uniform_transformer", rank, pp, a.vstages)
    del model
    runner = PipelineRunner(parts, sched, pp * a.vstages, dist.group.WORLD, torch.device("cpu"), tied=tied)
    params = [p for m in runner.model_parts for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    vocab = spec.hf_config.vocab_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (a.batch, a.seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    meter = SavedBytes(params)
    times = []
    for step in range(a.steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        with meter.hooks():
            runner.forward_backward(x, y, a.micro)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step:  # the first step infers shapes and warms allocators
            times.append(time.perf_counter() - t0)
    step_time = statistics.median(times)

    # The same microbatches through this rank's stages alone (no pipeline, no waiting).
    mb = a.batch // a.micro
    dist.barrier()
    busy = []
    for _ in range(2):
        t0 = time.perf_counter()
        for i in range(a.micro):
            h = x[i * mb:(i + 1) * mb]
            for s in runner.stage_ids:
                inp = h if s == 0 else torch.randn(mb, a.seq, spec.hidden_size, requires_grad=True)
                out = runner.parts[s](inp)
                loss = F.cross_entropy(out.flatten(0, 1), y[i * mb:(i + 1) * mb].flatten()) \
                    if out.shape[-1] == vocab and s == pp * a.vstages - 1 else out.float().pow(2).mean()
                loss.backward()
        opt.zero_grad(set_to_none=True)
        busy.append(time.perf_counter() - t0)
    busy_time = min(busy)
    result = {"rank": rank, "stages": runner.stage_ids, "step_time_s": step_time, "busy_s": busy_time,
              "bubble": max(0.0, 1 - busy_time / step_time), "peak_saved_bytes": meter.peak}
    gathered = [None] * pp
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(a.json).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _torchrun(nproc: int, *args: str, threads: int = 1) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**_env(), "OMP_NUM_THREADS": str(threads)},
                          cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")


def schedule_row(a: argparse.Namespace, schedule: str, v: int, m: int, tmp: Path) -> dict:
    out = tmp / f"{schedule}-{m}.json"
    _torchrun(2, "-m", "bench.pipeline_schedules", "--worker", "--schedule", schedule, "--vstages", str(v),
              "--micro", str(m), "--preset", a.preset, "--steps", str(a.steps), "--batch", str(a.batch),
              "--seq", str(a.seq), "--json", str(out), *(["--layers", str(a.layers)] if a.layers else []))
    ranks = json.loads(out.read_text())
    prof = profiled_bubble(a, schedule, v, m, tmp)
    return {"schedule": schedule, "virtual_stages": v, "microbatches": m,
            "step_time_s": max(r["step_time_s"] for r in ranks),
            **bubble_figures(prof), "bubble_theory": prof["theoretical_bubble"],
            "bubble_alone_vs_step": statistics.mean(r["bubble"] for r in ranks),
            "peak_saved_mb_per_rank": [r["peak_saved_bytes"] / 2**20 for r in ranks],
            "stages_per_rank": [r["stages"] for r in ranks]}


def profiled_bubble(a: argparse.Namespace, schedule: str, v: int, m: int, tmp: Path) -> dict:
    """The trainer's own bubble analysis of one profiled batch (trainer/profiling/bubble.py): idle
    time of each rank inside the batch's pipeline window (waits for activations and gradients,
    warm-up and cool-down), the optimizer outside it. Batch 2: after the first steps' warm-up."""
    out = tmp / f"prof-{schedule}-{m}"
    _torchrun(2, "-m", "trainer", "--model.preset", a.preset,
              *(["--model.num_hidden_layers", str(a.layers)] if a.layers else []),
              "--parallel.pp", "2", "--parallel.pp_schedule", schedule, "--parallel.virtual_stages", str(v),
              "--train.batch_size", str(a.batch), "--train.microbatch_num", str(m), "--data.seq_len", str(a.seq),
              "--train.steps", "3", "--profile_batch", "2", "--output-dir", str(out))
    return json.loads((out / "timeline_batch2_summary.json").read_text())


def bubble_figures(prof: dict) -> dict:
    """The theory assumes equal stages. The busiest rank's idle fraction is the schedule's own
    bubble (warm-up, cool-down, waits no faster stage could fill); the others idle longer by the
    stage imbalance (here the last stage also carries the LM head and the loss), given apart."""
    ranks = prof["ranks"]
    busiest = max(ranks, key=lambda r: r["busy_ms"])
    return {"bubble_measured": busiest["bubble_fraction"], "bubble_mean_ranks": prof["measured_bubble"],
            "stage_imbalance": 1 - min(r["busy_ms"] for r in ranks) / busiest["busy_ms"]}


def layout_row(a: argparse.Namespace, name: str, args: list[str], tmp: Path) -> dict:
    out = tmp / f"layout-{name}"
    n_micro = 4
    common = ["--model.preset", a.preset, *(["--model.num_hidden_layers", str(a.layers)] if a.layers else []),
              "--train.steps", str(a.steps + 1), "--data.seq_len", str(a.seq),
              "--train.microbatch_num", str(n_micro), "--train.grad_clip", "1.0", "--output-dir", str(out)]
    per_rank_batch = a.batch // 2 if name == "dp=2" else a.batch
    if name.startswith("1 process"):  # the baseline: one process using both cores' threads
        _torchrun(1, "-m", "trainer", *common, "--train.batch_size", str(a.batch), *args, threads=2)
    else:
        _torchrun(2, "-m", "trainer", *common, "--train.batch_size", str(per_rank_batch), *args)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tps = statistics.median(r["tokens_per_s"] for r in recs[1:])
    return {"layout": name, "tokens_per_s": tps, "step_time_s": statistics.median(r["step_time_s"] for r in recs[1:]),
            "global_batch_tokens": recs[-1]["global_batch_tokens"]}


def markdown(rows: list[dict], layouts: list[dict], a: argparse.Namespace) -> str:
    lines = [f"Model {a.preset}, global batch {a.batch} x {a.seq} tokens, pp=2, {a.steps} timed steps "
             f"(median), 2 processes x 1 thread, gloo.", "",
             "| schedule | m | step time (s) | bubble, bottleneck stage | theory | x theory | bubble, mean of ranks "
             "| stage imbalance | peak saved activations per rank (MB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = r["schedule"] + (f" (v={r['virtual_stages']})" if r["virtual_stages"] > 1 else "")
        mem = " / ".join(f"{x:.1f}" for x in r["peak_saved_mb_per_rank"])
        lines.append(f"| {name} | {r['microbatches']} | {r['step_time_s']:.3f} | {r['bubble_measured']:.1%} | "
                     f"{r['bubble_theory']:.1%} | {r['bubble_measured'] / r['bubble_theory']:.2f}x | "
                     f"{r['bubble_mean_ranks']:.1%} | {r['stage_imbalance']:.1%} | {mem} |")
    if layouts:
        base = layouts[0]["tokens_per_s"]
        lines += ["", f"| layout (same global batch) | tokens/s | relative to {layouts[0]['layout']} |",
                  "|---|---|---|"]
        for x in layouts:
            lines.append(f"| {x['layout']} | {x['tokens_per_s']:.0f} | {x['tokens_per_s'] / base:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--vstages", type=int, default=1)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--json", default="")
    ap.add_argument("--preset", default="llama-20m")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--skip-layouts", action="store_true", help="only the schedule comparison")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "pipeline_schedules.json"))
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    with tempfile.TemporaryDirectory(prefix="bench-pp-") as d:
        tmp = Path(d)
        rows = []
        for m in (4, 8):
            for schedule, v in SCHEDULES:
                rows.append(schedule_row(a, schedule, v, m, tmp))
                print(f"  {schedule} m={m}: {rows[-1]['step_time_s']:.3f} s", file=sys.stderr, flush=True)
        layouts = []
        if not a.skip_layouts:
            for name, args in [("1 process (2 threads)", []),
                               ("dp=2", ["--parallel.sharding", "ddp"]), ("tp=2", ["--parallel.tp", "2"]),
                               ("pp=2 (1f1b, m=4)", ["--parallel.pp", "2"])]:
                layouts.append(layout_row(a, name, args, tmp))
                print(f"  {name}: {layouts[-1]['tokens_per_s']:.0f} tokens/s", file=sys.stderr, flush=True)
    table = markdown(rows, layouts, a)
    print(table)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(a), "schedules": rows, "layouts": layouts, "markdown": table},
                              indent=2))
    print(f"\nwritten {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
