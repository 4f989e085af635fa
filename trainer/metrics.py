"""Throughput, MFU and memory, written once; the console line and OUTPUT_DIR/metrics.jsonl.

MFU = tokens/s per device x flops_per_token / peak flops per device,
flops_per_token = 6 N + 12 L a S (picotron's formula: N params, L layers, S sequence, and a the
attention width, heads x head_dim: the hidden size for most families, 2048 for Qwen3-0.6B whose
16 heads of 128 span more than its hidden 1024).
Peak: a table for known GPUs (dense bf16 tensor-core; tf32 for fp32 runs), or on CPU a matmul
probe measured once per process with the threads this process uses; `logging.peak_flops` wins.

Memory, in GiB (2^30 bytes), the largest over all ranks (the trainer all-reduces it at log steps):
on CUDA the peak allocated since the start (`max_memory_allocated`: weights, optimizer state,
activations) and beside it the peak reserved by the caching allocator (what the device lends the
process); on CPU the process's resident set size, with no reserved figure.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.runtime.full_disk import naming

log = logging.getLogger("trainer")

# name fragment -> (bf16 dense, tf32 dense) peak FLOP/s per device
GPU_PEAK_FLOPS: dict[str, tuple[float, float]] = {
    "H200": (989e12, 494e12), "H100": (989e12, 494e12), "H800": (989e12, 494e12),
    "A100": (312e12, 156e12), "A800": (312e12, 156e12), "A10G": (70e12, 35e12), "A10": (125e12, 62.5e12),
    "A40": (149.7e12, 74.8e12), "L40S": (362e12, 183e12), "L40": (181e12, 90.5e12), "L4": (121e12, 60e12),
    "V100": (125e12, 15.7e12), "T4": (65e12, 8.1e12), "RTX 4090": (165e12, 82.6e12),
    "RTX 3090": (71e12, 35.6e12), "MI300X": (1307e12, 654e12), "MI250X": (383e12, 95.7e12),
}

_PROBE_CACHE: dict[tuple[str, int], float] = {}


def flops_per_token(num_params: int, num_layers: int, attention_width: int, seq_len: int) -> float:
    """attention_width = query heads x head_dim (ModelSpec.attention_width)."""
    return 6.0 * num_params + 12.0 * num_layers * attention_width * seq_len


def measure_cpu_peak(dtype: torch.dtype = torch.float32, n: int = 1024, reps: int = 5) -> float:
    """Best observed FLOP/s of an n x n matmul on this process's threads (cached per dtype)."""
    key = (str(dtype), torch.get_num_threads())
    if key not in _PROBE_CACHE:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)  # warm-up: thread pool and caches
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t)
        _PROBE_CACHE[key] = 2.0 * n ** 3 / best
    return _PROBE_CACHE[key]


def peak_flops(device: torch.device, dtype: str, override: float | None = None) -> tuple[float, str]:
    """(peak FLOP/s per device, where it came from)."""
    if override:
        return float(override), "config logging.peak_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for frag, (bf16, tf32) in GPU_PEAK_FLOPS.items():
            if frag in name:
                return (bf16 if dtype == "bf16" else tf32), f"table ({name})"
        log.warning("unknown GPU %r: MFU uses the A100 peak; set logging.peak_flops", name)
        return GPU_PEAK_FLOPS["A100"][0 if dtype == "bf16" else 1], "table (A100 fallback)"
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    return measure_cpu_peak(tdtype), f"CPU matmul probe ({torch.get_num_threads()} threads, {dtype})"


def memory_bytes(device: torch.device) -> tuple[int, int | None]:
    """(peak allocated, peak reserved) bytes of this process on CUDA; (resident set size, None) on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), int(torch.cuda.max_memory_reserved(device))
    import psutil

    return int(psutil.Process(os.getpid()).memory_info().rss), None


def gib(x: float) -> str:
    return f"{x / 2**30:.2f}GiB"


def human(x: float, unit: str = "") -> str:
    for suffix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{suffix}{unit}"
    return f"{int(x)}{unit}" if float(x).is_integer() else f"{x:.2f}{unit}"


@dataclass
class StepStats:
    step: int
    loss: float
    lr: float
    grad_norm: float
    global_batch_samples: int
    global_batch_tokens: int
    step_time_s: float
    tokens_seen: int
    world_size: int
    flops_per_token: float
    peak_flops: float
    memory_bytes: int
    memory_reserved_bytes: int | None = None

    def record(self) -> dict[str, Any]:
        tps = self.global_batch_tokens / self.step_time_s
        tps_dev = tps / self.world_size
        return {
            "step": self.step, "loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm,
            "global_batch_samples": self.global_batch_samples, "global_batch_tokens": self.global_batch_tokens,
            "tokens_per_s": tps, "tokens_per_s_per_device": tps_dev,
            "samples_per_s": self.global_batch_samples / self.step_time_s,
            "mfu": tps_dev * self.flops_per_token / self.peak_flops,
            "memory_bytes": self.memory_bytes, "memory_gib": self.memory_bytes / 2**30,
            "memory_reserved_gib": None if self.memory_reserved_bytes is None else self.memory_reserved_bytes / 2**30,
            "step_time_s": self.step_time_s, "tokens": self.tokens_seen, "time": time.time(),
        }


def console_line(r: dict[str, Any]) -> str:
    """picotron's line, plus LR."""
    return (f"Step: {r['step']:<5d} | Loss: {r['loss']:.4f} | Global batch size: {human(r['global_batch_tokens']):>7s} | "
            f"Tokens/s: {human(r['tokens_per_s']):>7s} | Tokens/s/GPU: {human(r['tokens_per_s_per_device']):>7s} | "
            f"Tokens: {human(r['tokens']):>7s} | MFU: {100 * r['mfu']:5.2f}% | "
            f"Memory usage: {gib(r['memory_bytes']):>8s}{_reserved(r)} | LR: {r['lr']:.2e}")


def _reserved(r: dict[str, Any]) -> str:
    res = r.get("memory_reserved_gib")
    return "" if res is None else f" ({res:.2f}GiB reserved)"


def minimal3d_line(r: dict[str, Any]) -> str:
    """The minimal 3D pretrain's line (seed 002), digit for digit."""
    return (f"Step {r['step']} | Loss: {r['loss']:.4f} | LR: {r['lr']:.2e} | "
            f"Throughput: {r['samples_per_s']:.2f} samples/s")


def format_line(r: dict[str, Any], style: str = "picotron") -> str:
    """logging.line: which seed system's console line a run prints."""
    return minimal3d_line(r) if style == "minimal-3d" else console_line(r)


class MetricsWriter:
    """Appends one JSON object per line to OUTPUT_DIR/metrics.jsonl (only on the logging rank), and
    hands each record to the trackers (trainer/runtime/tracking.py: TensorBoard, W&B), if any."""

    def __init__(self, output_dir: str | Path, enabled: bool, resume: bool = False, trackers=None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.trackers = trackers if enabled and trackers is not None and trackers.wanted else None
        if enabled and not resume and self.path.exists():
            self.path.unlink()  # a fresh run starts a fresh file; a resumed run appends

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:  # a full disk at write or close names no file
            raise naming(e, self.path) from None
        if self.trackers is not None:
            self.trackers.write(record)

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
