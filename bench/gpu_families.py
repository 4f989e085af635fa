"""The Perseus families on one CUDA GPU: time and memory of the tiny presets, and one full-size
single-stage run per new family, each next to the dry run's memory estimate for it.

    PYTHONPATH=. python3 bench/gpu_families.py --out DIR      (or: python3 -m bench gpu_families)

Rows: tiny-t5, tiny-bloom, tiny-wide-resnet (the test sizes), then t5-large (737.67M, 512/512
tokens), bloom-560m (559.21M, 1024 tokens) and wide-resnet101_2 (126.89M, 224 x 224 images), one
process (one stage) each. Every row is the trainer's own step (`Trainer.train_step`: bf16, loss
in chunks, synthetic data) with train.compile false, so a row takes seconds instead of a compile's
minute: `--steps` timed steps after `--warmup`. Reported: samples/s and tokens/s, step time, MFU
(the trainer's FLOP count: 6N + attention per token; convolutions per image for Wide-ResNet),
peak memory (torch.cuda.max_memory_allocated over the run) and `trainer --dry-run`'s estimate of
the same configuration (contract/memory.py) with their ratio.

Each row runs in its own process with a timeout (clean memory counters; an out-of-memory or a hang
ends only that row), all within `--budget` seconds (default 120: rows that would start after it are
recorded as skipped), so the whole run ends within about 130 s. DIR/gpu_families.json (default
bench/results/) is rewritten after every row, so a run cut short keeps what it measured. Needs only
torch (CUDA) and transformers and what they install (`datasets` is never imported: synthetic data);
each row lists the modules it imported from any other distribution (`foreign_modules`: optional
ones, such as pynvml or PIL, that the code uses where present).

`--smoke` runs the harness on CPU with one tiny row (numbers meaningless), its worker unable to
import any distribution that torch and transformers do not install (`absent`): a check that the
script works on a GPU host with just those two, from a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (preset, batch, seq or None for images, kind, per-row timeout s)
ROWS = [
    ("tiny-t5", 32, 128, "tiny", 25),
    ("tiny-bloom", 32, 128, "tiny", 25),
    ("tiny-wide-resnet", 64, None, "tiny", 25),
    ("t5-large", 8, 512, "full", 45),
    ("bloom-560m", 4, 1024, "full", 45),
    ("wide-resnet101_2", 32, None, "full", 45),
]
# Harness tools that may ride along in a worker (coverage's .pth under COVER_SUBPROCESSES) and the
# project's own packages: not something a GPU host has to install.
NOT_FOREIGN = {"coverage", "_pytest", "pytest", "trainer", "contract", "bench", "runner", "tests"}
SMOKE_ROWS = [("tiny-t5", 4, 16, "tiny", 120)]


# ------------------------------------------------------------------ one row (worker process)


def _config(job: dict, out_dir: str):
    from trainer.config import resolve

    pairs = [("model.preset", job["preset"]), ("train.steps", job["steps"] + job["warmup"] + 1),
             ("train.batch_size", job["batch"]), ("train.seed", 0), ("train.compile", "false"),
             ("train.dtype", job["dtype"]), ("profile.batch", "none"), ("checkpoint.on_signal", False),
             ("output_dir", out_dir)]
    if job["seq"]:
        pairs.append(("data.seq_len", job["seq"]))
    return resolve(None, pairs, environ={})


def measure(job: dict) -> dict:
    import torch

    from trainer.parallel.mesh import ParallelDims
    from trainer.runtime.dist_env import DistEnv
    from trainer.tools.dry_run import make_plan
    from trainer.train import Trainer, setup_logging

    device = torch.device(job["device"])
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(job, tmp)
        estimate = make_plan(cfg)["stages"][0]["memory"]["total"]  # before anything is allocated
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        setup_logging(0, Path(tmp), console=False)
        trainer = Trainer(cfg, DistEnv(), ParallelDims.from_config(cfg.parallel, 1, 1), device,
                          "nccl" if cuda else "gloo")
        trainer.par.train(True)

        def step() -> None:
            loss, norm = trainer.train_step()
            trainer.step += 1
            float(loss), float(norm)  # what a log step reads

        for _ in range(job["warmup"]):
            step()
        sync()
        t0 = time.perf_counter()
        for _ in range(job["steps"]):
            step()
        sync()
        dt = (time.perf_counter() - t0) / job["steps"]
        samples = job["batch"] / dt
        tokens = samples * trainer.tokens_per_sample
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        return {"step_time_s": dt, "samples_per_s": samples, "tokens_per_s": tokens,
                "mfu": tokens * trainer.flops_per_token / trainer.peak, "peak_memory_gib": peak / 2**30,
                "estimate_gib": estimate / 2**30, "estimate_vs_peak": (estimate / peak) if peak else None,
                "params": trainer.spec.num_params, "dtype": cfg.train.dtype,
                "datasets_imported": "datasets" in sys.modules, "foreign_modules": foreign_modules()}


def _requirements(roots: tuple[str, ...]) -> set[str]:
    """The distributions `pip install torch transformers` brings (their non-extra requirements, transitively)."""
    import importlib.metadata as md
    import re

    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop().lower())
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [re.split(r"[ <>=!~\[;(]", r, maxsplit=1)[0] for r in reqs
                 if ";" not in r or "extra" not in r.split(";", 1)[1]]
    return seen


def _foreign() -> tuple[set[str], dict[str, list[str]]]:
    """(distributions torch and transformers install, importable top-level module -> its distributions)."""
    import importlib.metadata as md

    return _requirements(("torch", "transformers")), md.packages_distributions()


def _norm(dist: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", dist.lower())


def foreign_modules() -> list[str]:
    """Top-level modules this process imported from a distribution outside torch's and transformers'
    requirements: what a GPU host with only those would not have."""
    allowed, owners = _foreign()
    return sorted(f"{mod} ({dist})" for mod in list(sys.modules) if "." not in mod and mod not in NOT_FOREIGN
                  for dist in owners.get(mod, []) if _norm(dist) not in allowed)


def make_foreign_absent() -> list[str]:
    """Make every top-level module of a distribution outside torch's and transformers' requirements
    unimportable in this process, as on a host where only those two were installed; returns them."""
    import importlib.abc

    allowed, owners = _foreign()
    absent = {mod for mod, dists in owners.items()
              if mod not in NOT_FOREIGN and not any(_norm(d) in allowed for d in dists)}

    class Hiding(importlib.abc.MetaPathFinder):
        """Finds what `inner` finds, except the absent modules: importing one raises
        ModuleNotFoundError and importlib.util.find_spec says None, as when not installed."""

        def __init__(self, inner) -> None:  # noqa: ANN001 (any finder)
            self.inner = inner

        def find_spec(self, name, path=None, target=None):  # noqa: ANN001 (the finder protocol)
            if name.partition(".")[0] in absent or not hasattr(self.inner, "find_spec"):
                return None
            return self.inner.find_spec(name, path, target)

        def find_distributions(self, *args, **kwargs):  # noqa: ANN002, ANN003 (importlib.metadata's protocol)
            found = getattr(self.inner, "find_distributions", None)
            return found(*args, **kwargs) if found else iter(())

        def invalidate_caches(self) -> None:
            if hasattr(self.inner, "invalidate_caches"):
                self.inner.invalidate_caches()

    sys.meta_path[:] = [Hiding(f) for f in sys.meta_path]
    return sorted(absent)


def worker(job: dict) -> int:
    absent = make_foreign_absent() if job.get("absent") else []
    import torch

    try:
        out = measure(job)
    except torch.cuda.OutOfMemoryError:
        out = {"oom": True}
    print("RESULT " + json.dumps({**out, "absent": absent}), flush=True)
    return 0


# ------------------------------------------------------------------ orchestration


def run_row(row: tuple, args: argparse.Namespace, timeout: float) -> dict:
    preset, batch, seq, kind, _ = row
    job = {"preset": preset, "batch": batch, "seq": seq, "steps": args.steps, "warmup": args.warmup,
           "device": "cpu" if args.smoke else "cuda", "dtype": "fp32" if args.smoke else "bf16",
           "absent": args.smoke}
    res: dict = {"preset": preset, "kind": kind, "batch": batch, "seq": seq}
    t0 = time.time()
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-m", "bench.gpu_families", "--worker", json.dumps(job)], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=timeout)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        res.update(json.loads(line[len("RESULT "):]) if line else {"error": (proc.stderr or proc.stdout)[-1500:]})
    except subprocess.TimeoutExpired:
        res["error"] = f"timed out after {timeout:.0f} s"
    res["wall_s"] = round(time.time() - t0, 1)
    print(f"  {_state(res)}", flush=True)
    return res


def _state(r: dict) -> str:
    head = f"{r['preset']} batch {r['batch']}"
    if r.get("skipped"):
        return f"{head}: skipped ({r['skipped']})"
    if r.get("oom") or "error" in r:
        return f"{head}: {'OOM' if r.get('oom') else 'failed: ' + r['error'].splitlines()[-1][:200]}"
    unit = f"{r['tokens_per_s'] / 1e3:.1f}K tok/s" if r["seq"] else f"{r['samples_per_s']:.0f} img/s"
    return (f"{head}: {unit}, {1e3 * r['step_time_s']:.0f} ms/step, {100 * r['mfu']:.1f}% MFU, peak "
            f"{r['peak_memory_gib']:.2f} GiB, dry-run estimate {r['estimate_gib']:.2f} GiB ({r['wall_s']} s)")


def _row_md(r: dict) -> str:
    if r.get("skipped") or r.get("oom") or "error" in r:
        return f"| {r['preset']} | {r['batch']} | {_state(r).split(': ', 1)[1]} | | | | | |"
    size = f"{r['seq']} tok" if r["seq"] else "image"
    ratio = f"{r['estimate_vs_peak']:.2f}" if r.get("estimate_vs_peak") else ""
    return (f"| {r['preset']} | {r['batch']} x {size} | {r['samples_per_s']:.1f} | {1e3 * r['step_time_s']:.1f} | "
            f"{100 * r['mfu']:.1f}% | {r['peak_memory_gib']:.2f} GiB | {r['estimate_gib']:.2f} GiB | {ratio} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget", type=float, default=120.0, help="seconds for all rows together")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"), help="directory for gpu_families.json")
    ap.add_argument("--presets", default="", help="comma-separated presets: only these rows (default: all)")
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))

    import torch

    rows_todo = ROWS
    if args.presets:
        wanted = args.presets.split(",")
        unknown = sorted(set(wanted) - {r[0] for r in ROWS})
        if unknown:
            print(f"gpu_families: --presets {','.join(unknown)}: not a row here; rows: {', '.join(r[0] for r in ROWS)}",
                  file=sys.stderr)
            return 2
        rows_todo = [r for r in ROWS if r[0] in wanted]
    if args.smoke:  # the harness on CPU, tiny: proves the script runs, measures nothing of interest
        rows_todo, args.steps, args.warmup, args.budget = SMOKE_ROWS, 1, 1, 600.0
    elif not torch.cuda.is_available():
        print("gpu_families: no CUDA device visible; nothing measured (run it on a GPU host)")
        return 0
    import transformers

    device = "CPU (smoke run)" if args.smoke else torch.cuda.get_device_name(0)
    print(f"{device}, torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
          f"{'fp32' if args.smoke else 'bf16'}, compile off, {args.steps} steps after {args.warmup}, "
          f"budget {args.budget:.0f} s", flush=True)
    out = Path(args.out) / "gpu_families.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    start, rows = time.time(), []
    for row in rows_todo:
        left = args.budget - (time.time() - start)
        if left < 5:
            rows.append({"preset": row[0], "kind": row[3], "batch": row[1], "seq": row[2],
                         "skipped": f"budget of {args.budget:.0f} s spent"})
            print(f"  {_state(rows[-1])}", flush=True)
        else:
            rows.append(run_row(row, args, min(row[4], left)))
        out.write_text(json.dumps({  # after every row: a run cut short keeps what it measured
            "device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "compile": False, "steps": args.steps,
            "warmup": args.warmup, "budget_s": args.budget, "rows": rows}, indent=2))
    print("\n| preset | batch | samples/s | ms/step | MFU | peak memory | dry-run estimate | estimate / peak |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(_row_md(r))
    print(f"\nwrote {out} ({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
