"""The trainer against a plain transformers loop, eager and with torch.compile, on one CUDA GPU.

    PYTHONPATH=. python3 -m bench gpu_throughput          (or: python -m bench.gpu_throughput [--quick])

Presets (seq 2048, bf16, synthetic tokens, the same batches for every loop): smollm-360m batch 8,
qwen3-0.6b batch 8, smollm-1.7b batch 4. Loops:
- plain eager: `model(input_ids=x, labels=x).loss` under bf16 autocast, fused AdamW, grad clip 1.0;
- plain compiled: the same with `torch.compile(model)`;
- trainer: `Trainer.train_step` with its defaults (compiled blocks, loss in chunks, bf16), reading the
  loss and grad norm back every step as its default log_interval 1 does;
- the trainer with one feature switched off or on (compile false, loss_chunks 1, activation
  checkpointing selective / full), so the table shows where the gain comes from;
- the largest smollm-1.7b batch that fits (trainer defaults, then selective checkpointing).

Each measurement runs in its own process: clean peak-memory counters and compile caches, and an
out-of-memory ends only that measurement. Tokens/s over `--steps` steps after `--warmup` (compile
happens there), MFU = tokens/s x (6N + 12 L a S) / peak (a = heads x head_dim), peak memory =
torch.cuda.max_memory_allocated over the whole run (weights, optimizer state, activations).
Writes bench/results/gpu_throughput.json with the device name and the torch version. Needs only
torch (CUDA) and transformers: `datasets` is never imported (synthetic tokens).

`--smoke` runs the whole harness on CPU with a tiny model (seconds; numbers meaningless): a check
that the script works on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEQ = 2048
CASES = [("smollm-360m", 8), ("qwen3-0.6b", 8), ("smollm-1.7b", 4)]
# name -> (loop, trainer config overrides)
VARIANTS = {
    "plain eager": ("plain", {}),
    "plain compiled": ("plain-compile", {}),
    "trainer (defaults)": ("trainer", {}),
    "trainer, compile false": ("trainer", {"train.compile": "false"}),
    "trainer, loss_chunks 1": ("trainer", {"train.loss_chunks": 1}),
    "trainer, AC selective": ("trainer", {"train.activation_checkpointing": "selective"}),
    "trainer, AC full": ("trainer", {"train.activation_checkpointing": "full"}),
}
QUICK = ("plain compiled", "trainer (defaults)")
SEARCH = ("smollm-1.7b", [(8, {}), (12, {}), (16, {}), (16, {"train.activation_checkpointing": "selective"}),
                          (24, {"train.activation_checkpointing": "selective"}),
                          (32, {"train.activation_checkpointing": "selective"})])
# Targets of issue 18 (trainer defaults vs the compiled plain loop at equal batch).
SPEED_TARGET = 1.10
MEMORY_TARGET = {"smollm-360m": 0.8, "qwen3-0.6b": 0.8, "smollm-1.7b": 1.0}
MFU_TARGET = 0.50


# ------------------------------------------------------------------ one measurement (worker process)


def _config(preset: str, batch: int, seq: int, steps: int, overrides: dict, out_dir: str):
    from trainer.config import resolve

    pairs = [("model.preset", preset), ("data.seq_len", seq), ("train.steps", steps), ("train.batch_size", batch),
             ("train.seed", 0), ("optim.lr", 3e-4), ("train.grad_clip", 1.0), ("profile.batch", "none"),
             ("checkpoint.on_signal", False), ("output_dir", out_dir), *overrides.items()]
    return resolve(None, pairs, environ={})


def _plain_step(cfg, compiled: bool, device):
    import torch

    from trainer.data import build_data
    from trainer.models import build_model, model_spec

    spec = model_spec(cfg.model)
    model = build_model(spec, cfg.model, cfg.train.seed).to(device)
    model.train()
    run = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), fused=True)
    data = build_data(cfg.data, spec.task, spec.hf_config, cfg.train.seed, cfg.train.batch_size, 0, 1)
    data.pin = device.type == "cuda"

    def step() -> None:
        x, _ = data.next_batch()
        x = x.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = run(input_ids=x, labels=x).loss  # transformers shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return spec, step


def _trainer_step(cfg, device):
    from trainer.dist_env import DistEnv
    from trainer.parallel.mesh import ParallelDims
    from trainer.train import Trainer, setup_logging

    setup_logging(0, Path(cfg.output_dir), console=False)
    trainer = Trainer(cfg, DistEnv(), ParallelDims.from_config(cfg.parallel, 1, 1), device, "nccl")
    trainer.par.train(True)

    def step() -> None:
        loss, norm = trainer.train_step()
        trainer.step += 1
        float(loss), float(norm)  # what a log step reads (logging.log_interval 1, the default)

    return trainer.spec, step


def measure(job: dict) -> dict:
    import torch

    from trainer.metrics import flops_per_token, peak_flops

    device = torch.device(job["device"])
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    steps, warmup, seq = job["steps"], job["warmup"], job["seq"]
    overrides = dict(job["overrides"], **({} if cuda else {"train.dtype": "bf16"}))  # bf16 for every loop
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(job["preset"], job["batch"], seq, steps + warmup + 1, overrides, tmp)
        loop = job["loop"]
        spec, step = (_trainer_step(cfg, device) if loop == "trainer"
                      else _plain_step(cfg, loop == "plain-compile", device))
        for _ in range(warmup):
            step()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        dt = time.perf_counter() - t0
    tps = steps * job["batch"] * seq / dt
    fpt = flops_per_token(spec.num_params, spec.num_layers, spec.attention_width, seq)
    peak, _ = peak_flops(device, "bf16")
    memory = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    return {"tokens_per_s": tps, "mfu": tps * fpt / peak, "peak_memory_gib": memory,
            "step_time_s": dt / steps, "params": spec.num_params, "flops_per_token": fpt, "peak_flops": peak}


def worker(job: dict) -> int:
    import torch

    try:
        out = measure(job)
    except torch.cuda.OutOfMemoryError:
        out = {"oom": True}
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# ------------------------------------------------------------------ orchestration


def run_one(name: str, loop: str, preset: str, batch: int, overrides: dict, args: argparse.Namespace) -> dict:
    job = {"loop": loop, "preset": preset, "batch": batch, "overrides": overrides, "steps": args.steps,
           "warmup": args.warmup, "seq": args.seq, "device": "cpu" if args.smoke else "cuda"}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_throughput", "--worker", json.dumps(job)], cwd=REPO,
                          capture_output=True, text=True, timeout=args.timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    res = json.loads(line[len("RESULT "):]) if line else {"error": (proc.stderr or proc.stdout)[-1500:]}
    res.update({"variant": name, "loop": loop, "preset": preset, "batch": batch, "overrides": overrides,
                "wall_s": round(time.time() - t0, 1)})
    state = "OOM" if res.get("oom") else ("FAILED" if "error" in res else
                                           f"{res['tokens_per_s'] / 1e3:.1f}K tok/s, {100 * res['mfu']:.1f}% MFU, "
                                           f"{res['peak_memory_gib']:.1f} GiB")
    print(f"  {preset} batch {batch} {name}: {state}", flush=True)
    return res


def _row(r: dict, base: dict | None) -> str:
    if r.get("oom") or "error" in r:
        return f"| {r['preset']} | {r['batch']} | {r['variant']} | {'OOM' if r.get('oom') else 'failed'} | | | | |"
    speed = mem = ""
    if base and "tokens_per_s" in base:
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x"
        mem = f"{r['peak_memory_gib'] / base['peak_memory_gib']:.2f}x" if base["peak_memory_gib"] else ""
    return (f"| {r['preset']} | {r['batch']} | {r['variant']} | {r['tokens_per_s'] / 1e3:.1f}K | {100 * r['mfu']:.1f}% | "
            f"{r['peak_memory_gib']:.1f} GiB | {speed} | {mem} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="only the compiled plain loop and the trainer's defaults")
    ap.add_argument("--no-search", action="store_true", help="skip the largest-batch search for smollm-1.7b")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per measurement")
    ap.add_argument("--json", default=str(REPO / "bench" / "results" / "gpu_throughput.json"))
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.seq = SEQ
    if args.worker:
        return worker(json.loads(args.worker))

    import torch

    cases = CASES
    if args.smoke:  # the harness on CPU, tiny: proves the script runs, measures nothing of interest
        cases, args.seq, args.steps, args.warmup, args.no_search = [("tiny-llama", 2)], 64, 2, 1, True
        args.json = str(Path(tempfile.gettempdir()) / "gpu_throughput_smoke.json")
    elif not torch.cuda.is_available():
        print("gpu_throughput: no CUDA device visible; nothing measured (run it on a GPU host)")
        return 0
    import transformers

    device = "CPU (smoke run)" if args.smoke else torch.cuda.get_device_name(0)
    print(f"{device}, torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
          f"seq {args.seq}, bf16", flush=True)
    rows: list[dict] = []
    for preset, batch in cases:
        for name, (loop, overrides) in VARIANTS.items():
            if args.quick and name not in QUICK:
                continue
            rows.append(run_one(name, loop, preset, batch, overrides, args))
    search: list[dict] = []
    if not args.no_search:
        preset, tries = SEARCH
        stopped: set[str] = set()
        for batch, overrides in tries:
            key = json.dumps(overrides, sort_keys=True)
            if key in stopped:
                continue
            r = run_one("trainer, largest batch" + (", AC selective" if overrides else ""), "trainer", preset, batch,
                        overrides, args)
            search.append(r)
            if r.get("oom") or "error" in r:
                stopped.add(key)

    print("\n| preset | batch | loop | tokens/s | MFU | peak memory | tokens/s vs compiled plain | memory vs compiled plain |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    verdict = {}
    for preset, _ in cases:
        mine = [r for r in rows if r["preset"] == preset]
        base = next((r for r in mine if r["variant"] == "plain compiled"), None)
        for r in mine:
            print(_row(r, base))
        ours = next((r for r in mine if r["variant"] == "trainer (defaults)"), None)
        if base and ours and "tokens_per_s" in base and "tokens_per_s" in ours:
            speed = ours["tokens_per_s"] / base["tokens_per_s"]
            mem = ours["peak_memory_gib"] / base["peak_memory_gib"] if base["peak_memory_gib"] else float("nan")
            verdict[preset] = {"speed_vs_compiled": speed, "speed_met": speed >= SPEED_TARGET,
                               "memory_vs_compiled": mem, "memory_met": mem <= MEMORY_TARGET.get(preset, 1.0)}
    ok = [r for r in search + [r for r in rows if r["preset"] == SEARCH[0] and r["loop"] == "trainer"]
          if "mfu" in r]
    best = max(ok, key=lambda r: r["mfu"]) if ok else None
    for r in search:
        print(_row(r, None))
    if best:
        verdict["smollm-1.7b best MFU"] = {"batch": best["batch"], "variant": best["variant"], "mfu": best["mfu"],
                                           "met": best["mfu"] >= MFU_TARGET}
    print("\ntargets:", json.dumps(verdict, indent=1))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "seq_len": args.seq, "dtype": "bf16", "steps": args.steps,
        "warmup": args.warmup, "rows": rows, "largest_batch_search": search, "targets": verdict}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
