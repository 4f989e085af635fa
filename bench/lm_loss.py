"""The LM head + cross-entropy, forward and backward, three ways, side by side in one run.

    python -m bench.lm_loss [--tokens 2048 --hidden 960 --vocab 49152 --chunks 4 --reps 5]
    PYTHONPATH=. python3 -m bench.lm_loss --device cuda --tokens 16384 --hidden 1024 --vocab 151936 --chunks 16

- full logits: `F.cross_entropy(head(h).float(), y)` through autograd (what transformers' loss does;
  the [tokens, vocab] logits and their fp32 copy live until the backward);
- chunks, recomputed: the trainer's loss before 2026-11-27 (still what a pipeline stage runs): each
  chunk under activation checkpointing, its logits computed again in the backward;
- chunks, head gradient in forward: trainer/models/head_loss_grad.py, what the trainer runs now
  (each chunk's logits used once, 3 head matmuls instead of 4).

One shape per run (default: smollm-360m's head, 2048 tokens, fp32 on CPU); on CUDA bf16 and compiled
with inductor as the trainer runs it (`--device cuda`). Per way: the median wall time of `--reps`
forward + backward passes after one warm-up (device-synchronised on CUDA), the peak memory above the
inputs (CUDA allocator, or the CPU allocator's profiler events), and the loss and gradient against the
full-logits way. Writes bench/results/lm_loss[-cuda].json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
WAYS = ("full logits", "chunks, recomputed", "chunks, head gradient in forward")


def peak_cpu_bytes(fn) -> int:
    """Peak bytes the CPU allocator held above its level at the start of `fn` (the profiler's memory
    events); tests/distributed/test_trainer_compile.py and tests/unit/test_head_loss_grad.py use it too."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    mem = [e["args"] for e in events if e.get("name") == "[memory]"]
    start = mem[0]["Total Allocated"] - mem[0]["Bytes"]
    return max(m["Total Allocated"] for m in mem) - start


def measure(way: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    from trainer.models.lm_loss import compile_loss, lm_loss_sum

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False).to(device, dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(args.vocab, args.hidden, generator=g) * args.hidden ** -0.5)
    h = (torch.randn(args.tokens, args.hidden, generator=g)).to(device, dtype).requires_grad_()
    y = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    if device.type == "cuda" and way != WAYS[0]:
        compile_loss(head, "inductor")

    def once() -> torch.Tensor:
        if way == WAYS[0]:
            loss = F.cross_entropy(head(h).float(), y, reduction="sum")
        else:
            loss = lm_loss_sum(head, h, y, args.chunks, fuse=way == WAYS[2])
        loss.backward()
        return loss.detach()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    once()  # warm-up (and compilation)
    times = []
    for _ in range(args.reps):
        h.grad = head.weight.grad = None
        sync()
        t = time.perf_counter()
        loss = once()
        sync()
        times.append(time.perf_counter() - t)
    h.grad = head.weight.grad = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        once()
        sync()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = peak_cpu_bytes(once)
    return {"time_s": statistics.median(times), "times_s": times, "peak_bytes": peak, "loss": float(loss),
            "grad_h": h.grad.float().cpu(), "grad_w": head.weight.grad.float().cpu()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=960)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench lm_loss: --device cuda but torch sees no CUDA device; nothing measured", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = {way: measure(way, args, device, dtype) for way in WAYS}
    ref = results[WAYS[0]]
    where = (f"fp32 on cpu ({torch.get_num_threads()} threads)" if device.type == "cpu" else
             f"bf16 on {torch.cuda.get_device_name()}, compiled (inductor)")
    print(f"\nLM head + loss, forward + backward: {args.tokens} tokens x hidden {args.hidden} -> vocab {args.vocab}, "
          f"{args.chunks} chunks, {where}\n")
    print("| way | time (ms) | vs full logits | peak memory (MiB) | loss rel. diff | grad max rel. diff |")
    print("|---|---:|---:|---:|---:|---:|")
    out = {}
    for way, r in results.items():
        dl = abs(r["loss"] - ref["loss"]) / abs(ref["loss"])
        dg = max(float((r[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ("grad_h", "grad_w"))
        print(f"| {way} | {1e3 * r['time_s']:.1f} | {ref['time_s'] / r['time_s']:.2f}x | {r['peak_bytes'] / 2**20:.0f} | "
              f"{dl:.1e} | {dg:.1e} |")
        out[way] = {"time_s": r["time_s"], "times_s": r["times_s"], "peak_bytes": r["peak_bytes"], "loss": r["loss"],
                    "speed_vs_full_logits": ref["time_s"] / r["time_s"], "loss_rel_diff": dl, "grad_max_rel_diff": dg}
    path = Path(args.json or REPO / "bench" / "results" / f"lm_loss{'-cuda' if device.type == 'cuda' else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": args.device if device.type == "cpu" else torch.cuda.get_device_name(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "dtype": str(dtype), "tokens": args.tokens, "hidden": args.hidden,
            "vocab": args.vocab, "chunks": args.chunks, "reps": args.reps}
    path.write_text(json.dumps({**meta, "results": out}, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
