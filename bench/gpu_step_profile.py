"""Where one training step's time goes, the trainer's against the plain per-layer compiled loop, on
one CUDA GPU: a diagnostic beside bench/gpu_throughput.py (same rows, same seeded weights and batches).

    PYTHONPATH=. python3 -m bench.gpu_step_profile --out DIR [--preset smollm-360m --batch 8]
        [--loops trainer,plain-layers] [--steps 6]

For each loop, in its own process (clean compile caches and memory counters), into DIR/profile-LOOP.txt:
- every step's wall time after warm-up, each step ended by a device sync (host gaps show as a
  wall time above the device time);
- the device's busy time within one profiled step against that step's wall time (idle share);
- the CUDA synchronisations one profiled step made (cudaStreamSynchronize, cudaDeviceSynchronize,
  blocking cudaMemcpy), and the Python stack of each call that torch's sync debug mode reported
  in two unprofiled steps (a step between two log steps should report none);
- the top operators by host time and by device time.
Needs only torch (CUDA) and transformers, like the throughput bench.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from bench.gpu_throughput import LOOPS, SEQ, _config, _plain_step, _trainer_step

REPO = Path(__file__).resolve().parents[1]
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ",
               "cudaMemcpy", "cudaStreamWaitEvent")


def _stack() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "/warnings.py" not in f.filename]
    return " <- ".join(f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno} {f.name}" for f in reversed(frames[-10:]))


def host_syncs(run) -> list[str]:
    """Each synchronising CUDA call `run()` makes, as torch's sync debug mode reports it, with the
    Python stack that made it ("MESSAGE AT file:line fn <- ..."); tests/gpu/test_gpu.py uses it too."""
    import torch

    found: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" in str(message):  # not the mode's own "prototype" notice
            found.append(f"{str(message)[:120]} AT {_stack()}")

    with warnings.catch_warnings():  # restores warnings.showwarning on the way out
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found


def profile_loop(loop: str, preset: str, batch: int, steps: int) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda", 0)
    if loop == "trainer":
        from trainer.runtime.dist_env import configure_allocator

        configure_allocator()
    overrides = dict(next(o for n, (lp, o) in LOOPS.items() if lp == loop))
    job = {"loop": loop, "preset": preset, "batch": batch, "seq": SEQ, "overrides": overrides, "device": "cuda:0",
           "backend": "inductor"}
    lines = [f"loop {loop}, preset {preset}, batch {batch}, seq {SEQ}, torch {torch.__version__}"]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(job, tmp)
        _, step = _trainer_step(cfg, device) if loop == "trainer" else _plain_step(cfg, job, device)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        walls = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        lines.append("step wall ms (each ended by a sync): " + ", ".join(f"{w * 1e3:.1f}" for w in walls))

        # Unsynchronised steps, as a run makes them between log steps: the host's own time per step
        # (when it is below the device's, the host runs ahead and the GPU never waits).
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        host = (time.perf_counter() - t0) / steps
        torch.cuda.synchronize()
        lines.append(f"host ms per step without syncs: {host * 1e3:.1f} "
                     f"(all {steps} steps done: {(time.perf_counter() - t0) / steps * 1e3:.1f} ms each)")

        def two_steps():
            for _ in range(2):
                step()

        reports = host_syncs(two_steps)
        torch.cuda.synchronize()
        lines.append(f"sync debug mode, 2 steps: {len(reports)} synchronising call(s)")
        lines += [f"  {r}" for r in dict.fromkeys(reports)]

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        events = prof.events()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 1e3  # ms, kernels may overlap (rare here)
        lines.append(f"profiled step: wall {wall * 1e3:.1f} ms, device busy {busy:.1f} ms "
                     f"(idle {max(0.0, 1 - busy / (wall * 1e3)):.0%}), {len(kernels)} kernels")
        syncs: dict[str, int] = {}
        for e in events:
            if any(e.name.startswith(s) for s in SYNC_EVENTS):
                syncs[e.name] = syncs.get(e.name, 0) + 1
        lines.append(f"sync-like runtime calls in the profiled step: {json.dumps(syncs)}")
        avg = prof.key_averages()
        lines.append("top operators by self host time:")
        lines.append(avg.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
        lines.append("top operators by device time:")
        lines.append(avg.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="smollm-360m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--loops", default="trainer,plain-layers")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=200)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        try:
            text = profile_loop(args.worker, args.preset, args.batch, args.steps)
        except Exception:  # noqa: BLE001 - the file says what failed
            text = traceback.format_exc()
        (out / f"profile-{args.worker}.txt").write_text(text + "\n")
        return 0
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for loop in args.loops.split(","):
        t0 = time.time()
        try:
            subprocess.run([sys.executable, "-m", "bench.gpu_step_profile", "--worker", loop, "--out", str(out),
                            "--preset", args.preset, "--batch", str(args.batch), "--steps", str(args.steps)],
                           cwd=REPO, env=env, timeout=args.timeout, check=False)
        except subprocess.TimeoutExpired:
            (out / f"profile-{loop}.txt").write_text(f"timed out after {args.timeout:.0f} s\n")
        print(f"gpu_step_profile: {loop} in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
