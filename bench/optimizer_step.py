"""The optimizer phase of one bf16 step (clip + AdamW + the weights the next forward reads), three
ways over the same parameters, side by side in one run.

    python -m bench.optimizer_step [--preset llama-20m --reps 5]
    PYTHONPATH=. python3 -m bench.optimizer_step --device cuda --preset smollm-1.7b

Each way starts where a backward left bf16 gradients and ends when the next forward's weights exist:
- plain loop: fp32 weights under autocast (what bench/gpu_throughput.py's plain loop runs): fp32
  gradients, `clip_grad_norm_` (norm, then a multiply), torch's fused AdamW, then the next
  forward's autocast casts every weight to bf16 (timed here as one `_foreach_copy_`);
- cast + fused AdamW: the trainer before master_adamw.py: bf16 copies' gradients cast into fp32
  master gradients, the norm over those, torch's fused AdamW with the clip as its grad_scale, then
  the copies cast from the masters before the next forward;
- MasterAdamW: the trainer now (trainer/parallel/master_adamw.py): the norm over the bf16
  gradients, one pass per parameter that writes master, moments and copy (compiled by inductor
  with `--compile`, the default on CUDA, as the trainer does).

Parameters: every tensor of `--preset`'s model (shapes from the model built on the meta device).
Per way the median of `--reps` timed steps after two warm-up steps (device-synchronised), the
bytes a step must move by the way's own count and what that makes per second, the weights after
the steps against those of cast + fused AdamW (they must agree to rounding; the clip never clips). Writes
bench/results/optimizer_step[-cuda].json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
WAYS = ("plain loop", "cast + fused AdamW", "MasterAdamW")
BYTES_PER_PARAM = {"plain loop": 4 + 8 + 32 + 6, "cast + fused AdamW": 6 + 4 + 36 + 6, "MasterAdamW": 2 + 28}
# A max norm no gradient here reaches: every clip pass runs (norm, factor, multiply or grad_scale) but
# scales by 1, so the gradients stay as made and every way steps over the same ones.
LR, MAX_NORM = 1e-4, 1e6


def shapes(preset: str) -> list[torch.Size]:
    from trainer.config import ModelConfig
    from trainer.models import build_model, model_spec

    mc = ModelConfig(preset=preset)
    with torch.device("meta"):
        model = build_model(model_spec(mc), mc, 0)
    return [p.shape for p in model.parameters()]


def measure(way: str, sizes: list[torch.Size], args: argparse.Namespace, device: torch.device,
            ref: list[torch.Tensor] | None = None) -> dict:
    """One way's timed steps; its weights after them (kept only without `ref`, else their largest
    difference from `ref`'s, on the device: smollm-1.7b's weights are 6.8 GB)."""
    from trainer.parallel.grad_norm import fp32_norm, scale_for_clip, total_grad_norm
    from trainer.parallel.master_adamw import MasterAdamW
    from trainer.parallel.master_weights import MasterWeights

    g = torch.Generator(device=device).manual_seed(0)
    module = torch.nn.Module()
    for i, s in enumerate(sizes):
        module.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(s, generator=g, device=device) * 0.02))
    params = list(module.parameters())
    grads16 = [(torch.randn(s, generator=g, device=device) * 1e-3).bfloat16() for s in sizes]
    grads32 = [gr.float() for gr in grads16] if way == "plain loop" else []  # autograd's, in that loop
    kw = dict(lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if way == "MasterAdamW":
        mw = MasterWeights(module, compile_mode="true" if args.compile else "false")
        mw.keep_copies()
        opt = MasterAdamW(params, mw, compile_backend="inductor" if args.compile else None, **kw)
        copies = mw.computes
    else:
        opt = torch.optim.AdamW(params, fused=True, **kw)
        copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]

    def step() -> None:
        if way == "MasterAdamW":
            for c, gr in zip(copies, grads16, strict=True):
                c.grad = gr  # where the backward leaves them
            scale_for_clip(opt, [], fp32_norm(mw.gradients()), MAX_NORM)
            opt.step()
            opt.zero_grad()
            return
        if way == "plain loop":
            for p, gr in zip(params, grads32, strict=True):
                p.grad = gr
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        else:
            for p, gr in zip(params, grads16, strict=True):
                p.grad = gr.float()  # the cast into the masters' fp32 gradients
            scale_for_clip(opt, params, total_grad_norm(params), MAX_NORM)
        opt.step()
        opt.zero_grad()
        torch._foreach_copy_(copies, [p.detach() for p in params])

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(2):
        step()
    times = []
    for _ in range(args.reps):
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    n = sum(p.numel() for p in params)
    t = statistics.median(times)
    out = {"time_s": t, "times_s": times, "params": n, "bytes_per_param": BYTES_PER_PARAM[way],
           "gb_per_s": BYTES_PER_PARAM[way] * n / t / 1e9}
    if ref is None:
        return out | {"weights": [p.detach().clone() for p in params]}
    return out | {"weights_max_abs_diff": max(float((p.detach() - w).abs().max()) for p, w in zip(params, ref, strict=True))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--preset", default="llama-20m")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="compile MasterAdamW's update (default: on CUDA)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench optimizer_step: --device cuda but torch sees no CUDA device; nothing measured", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if args.compile is None:
        args.compile = device.type == "cuda"
    sizes = shapes(args.preset)
    first = measure(WAYS[1], sizes, args, device)  # the reference: the trainer's step before MasterAdamW
    first["weights_max_abs_diff"] = 0.0
    results = {way: first if way == WAYS[1] else measure(way, sizes, args, device, first["weights"]) for way in WAYS}
    del first["weights"]
    ref = results[WAYS[1]]
    where = (f"cpu ({torch.get_num_threads()} threads)" if device.type == "cpu" else torch.cuda.get_device_name())
    n = ref["params"]
    print(f"\noptimizer phase of a bf16 step: {args.preset}, {n / 1e6:.1f} M parameters in {len(sizes)} tensors, "
          f"{where}, MasterAdamW {'compiled (inductor)' if args.compile else 'eager'}\n")
    print("| way | time (ms) | vs cast + fused AdamW | bytes/param | GB/s | weights max diff |")
    print("|---|---:|---:|---:|---:|---:|")
    out = {}
    for way, r in results.items():
        diff = r["weights_max_abs_diff"]
        print(f"| {way} | {1e3 * r['time_s']:.1f} | {ref['time_s'] / r['time_s']:.2f}x | {r['bytes_per_param']} | "
              f"{r['gb_per_s']:.0f} | {diff:.1e} |")
        out[way] = r | {"speed_vs_cast_fused": ref["time_s"] / r["time_s"]}
    path = Path(args.json or REPO / "bench" / "results" / f"optimizer_step{'-cuda' if device.type == 'cuda' else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": where, "torch": torch.__version__, "preset": args.preset, "params": n, "tensors": len(sizes),
            "compiled": args.compile, "reps": args.reps, "lr": LR, "max_norm": MAX_NORM}
    path.write_text(json.dumps({**meta, "results": out}, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
