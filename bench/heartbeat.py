"""What the progress heartbeat costs a training step (issue 57: under 1%), on CPU, gloo.

    python -m bench.heartbeat [--reps 3 --steps 200 --block 5]

On a shared 2-core machine two runs of one job differ by tens of percent, so the heartbeat is
switched on and off inside each run instead, every --block steps on every rank at once (each block
on or off by a coin seeded by its index: nothing periodic in the trainer lines up with one mode), and a run's overhead is the median loop iteration (one step, its log
step and its callbacks: from one step's start to the next) of its `on` steps over that of its `off`
ones; the job's figure is the median over --reps runs, each a fresh process group.
- on: the trainer as shipped (its writer every watch.heartbeat_s, --heartbeat-s, default 1 s as shipped);
- off: the process's heartbeat unset for those steps and its writer idle: every mark returns at its
  first test, no log-step gather of the ranks' step times. (The hooks' wrappers still run; their
  call is the `mark_off_ns` part.)
Jobs: `pipeline`, the Pi guide's 3-stage 1F1B pipeline at sandbox size (configs/pi-qwen3-3stage-tiny.yaml,
3 processes: the most marks per step: each microbatch's forward, backward, recv and send), and
`single`, configs/tiny.yaml in one process (the shortest step, where a fixed cost shows most).

Also measured here, in one process: one mark (ns), one mark with no heartbeat set, one write of
the file (us), and the marks each job's step makes (counted in its runs): the arithmetic
overhead beside the measured one. Writes bench/results/heartbeat.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
JOBS = {"pipeline": (3, ["--config", "configs/pi-qwen3-3stage-tiny.yaml"]),
        "single": (1, ["--config", "configs/tiny.yaml", "--data.seq_len", "64"])}
TARGET = 0.01


class Toggle:
    """A trainer callback: the heartbeat on for odd blocks of steps, off for even ones; the start
    time of every step and the marks made, written at the end."""

    def __init__(self, trainer: Any, block: int):
        from trainer.runtime import heartbeat

        self.hb, self.block = heartbeat, block
        self.writer: Any = heartbeat.CURRENT
        self.starts: list[float] = []
        self.modes: list[bool] = []
        self.marks = [0, 0]  # marks made in on steps, on steps
        self.out = Path(trainer.output_dir) / f"bench-rank{trainer.env.rank}.json"
        mark = type(self.writer).mark

        def counted(w: Any, *a: Any, **k: Any) -> None:
            self.marks[0] += 1
            mark(w, *a, **k)

        self.writer.mark = counted.__get__(self.writer)
        write = type(self.writer).write
        self.writer.write = lambda: None if self.hb.CURRENT is None else write(self.writer)

    def on_step_start(self, trainer: Any, step: int) -> None:
        self.starts.append(time.perf_counter())
        on = block_on(step // self.block)
        self.modes.append(on)
        self.marks[1] += on
        self.hb.CURRENT = self.writer if on else None

    def on_train_end(self, trainer: Any) -> None:
        self.starts.append(time.perf_counter())
        self.hb.CURRENT = self.writer
        self.out.write_text(json.dumps({"starts": self.starts, "modes": self.modes, "marks": self.marks}))


def block_on(index: int) -> bool:
    """Whether block `index` runs with the heartbeat on: a coin seeded by the index alone, the same on
    every rank. Strict alternation let anything periodic in the trainer (its gc every N steps, the
    timeout refresh every 50, checkpoints) fall into one mode's blocks every time."""
    return random.Random(index * 1_000_003 + 17).random() < 0.5


def worker(argv: list[str]) -> int:
    """One rank of a run: the trainer's CLI with the Toggle callback."""
    from trainer import cli, train

    train.CALLBACKS.append("bench.heartbeat:make_toggle")
    return cli.main(argv)


def make_toggle(trainer: Any) -> Toggle:
    return Toggle(trainer, int(os.environ["BENCH_BLOCK"]))


def one_run(job: str, steps: int, block: int, warmup: int, interval: float, out: Path) -> dict:
    nproc, args = JOBS[job]
    env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_BLOCK=str(block), PYTHONPATH=str(REPO))
    tail = [*args, "--train.steps", str(steps), "--watch.heartbeat_s", str(interval), "--output-dir", str(out)]
    head = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                f"--nproc-per-node={nproc}"]
    subprocess.run([*head, "-m", "bench.heartbeat", "--worker", *tail], cwd=REPO, env=env, check=True,
                   capture_output=True, timeout=3600)
    rank0 = json.loads((out / "bench-rank0.json").read_text())
    its = [b - a for a, b in zip(rank0["starts"], rank0["starts"][1:], strict=False)]
    on = [t for t, m, i in zip(its, rank0["modes"], range(len(its)), strict=False) if m and i >= warmup]
    off = [t for t, m, i in zip(its, rank0["modes"], range(len(its)), strict=False) if not m and i >= warmup]
    marks = max(json.loads(p.read_text())["marks"][0] / max(json.loads(p.read_text())["marks"][1], 1)
                for p in out.glob("bench-rank*.json"))
    return {"on_s": statistics.median(on), "off_s": statistics.median(off), "marks_per_step": marks,
            "paired": paired(its, rank0["modes"], warmup)}


def paired(its: list[float], modes: list[bool], warmup: int) -> list[float]:
    """Each `on` block's median step over the mean of its two `off` neighbours' medians, minus 1: a
    change in the machine's load slower than two blocks (a few seconds) cancels in each ratio, so
    the median of these ratios is the overhead with the neighbours' drift taken out."""
    blocks: list[tuple[bool, list[float]]] = []
    for i, (t, m) in enumerate(zip(its, modes, strict=False)):
        if i < warmup:
            continue
        if not blocks or blocks[-1][0] != m:
            blocks.append((m, []))
        blocks[-1][1].append(t)
    meds = [(m, statistics.median(ts)) for m, ts in blocks]
    return [on / ((a + b) / 2) - 1 for (ma, a), (m, on), (mb, b) in zip(meds, meds[1:], meds[2:], strict=False)
            if m and not ma and not mb]


def parts() -> dict:
    """In this process: ns per mark (set and unset), us per write of the file."""
    from trainer.runtime import heartbeat
    from trainer.runtime.heartbeat import HeartbeatWriter

    def per_call(fn: Any, n: int = 200_000) -> float:
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for i in range(n):
                fn("forward", 1, i)
            best = min(best, (time.perf_counter() - t) / n)
        return best * 1e9

    with tempfile.TemporaryDirectory() as d:
        w = HeartbeatWriter(d, rank=0, world_size=3, interval_s=3600)
        w.path.parent.mkdir(parents=True)
        heartbeat.CURRENT = w
        on = per_call(heartbeat.mark)
        heartbeat.CURRENT = None
        off = per_call(heartbeat.mark)
        writes = []
        for _ in range(2000):
            t = time.perf_counter()
            w.write()
            writes.append(time.perf_counter() - t)
    return {"mark_ns": on, "mark_off_ns": off, "write_us": statistics.median(writes) * 1e6}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        return worker(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m bench.heartbeat")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--jobs", nargs="*", default=list(JOBS))
    ap.add_argument("--heartbeat-s", type=float, default=1.0, help="the writer's interval (default: as shipped)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "heartbeat.json"))
    args = ap.parse_args(argv)
    p = parts()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for job in args.jobs:
            runs = [one_run(job, args.steps, args.block, args.warmup, args.heartbeat_s, Path(tmp) / f"{job}-{rep}")
                    for rep in range(args.reps)]
            for i, r in enumerate(runs):
                print(f"{job} run {i + 1}: step {r['off_s'] * 1e3:.2f} ms off, {r['on_s'] * 1e3:.2f} ms on", flush=True)
            ratios = [r["on_s"] / r["off_s"] - 1 for r in runs]
            pairs = [x for r in runs for x in r["paired"]]
            off = statistics.median(r["off_s"] for r in runs)
            marks = statistics.median(r["marks_per_step"] for r in runs)
            by_parts = (marks * (p["mark_ns"] - p["mark_off_ns"]) * 1e-9 + p["write_us"] * 1e-6 * off / args.heartbeat_s) / off
            results[job] = {"nproc": JOBS[job][0], "args": JOBS[job][1], "runs": runs, "step_off_s": off,
                            "step_on_s": statistics.median(r["on_s"] for r in runs), "overheads": ratios,
                            "overhead": statistics.median(ratios), "marks_per_step": marks,
                            "overhead_paired": statistics.median(pairs), "pairs": len(pairs),
                            "paired_quartiles": statistics.quantiles(pairs, n=4),
                            "overhead_by_parts": by_parts}
    out = {"what": "loop iteration with the heartbeat on vs off, interleaved every block of steps in one run",
           "steps": args.steps, "block": args.block, "warmup": args.warmup, "reps": args.reps,
           "heartbeat_s": args.heartbeat_s, "target": TARGET, "cpu": platform.processor() or platform.machine(),
           "cores": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()], "parts": p,
           "results": results}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print("| job | step, off | step, on | overhead (median of runs) | each run | paired blocks (median, IQR) "
          "| by its parts |\n|---|---|---|---|---|---|---|")
    for job, r in results.items():
        each = ", ".join(f"{100 * x:+.2f}%" for x in r["overheads"])
        print(f"| {job} | {r['step_off_s'] * 1e3:.2f} ms | {r['step_on_s'] * 1e3:.2f} ms | {100 * r['overhead']:+.2f}% "
              f"| {each} | {100 * r['overhead_paired']:+.2f}% ({100 * r['paired_quartiles'][0]:+.2f}.."
              f"{100 * r['paired_quartiles'][2]:+.2f}%, {r['pairs']} pairs) | {100 * r['overhead_by_parts']:.3f}% |")
    print(f"one mark {p['mark_ns']:.0f} ns ({p['mark_off_ns']:.0f} ns unset), one write {p['write_us']:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
