"""A pipeline stage's memory before anything runs: weights, gradients, optimizer state, the
activations its in-flight microbatches keep for backward, and transient scratch. Torch-free: the
trainer's `--dry-run` measures a stage's activations on the meta device and calls `stage_memory`;
the runner (which never imports torch) sizes a job from a model's shape with
`transformer_activation_bytes` and the same `stage_memory`.

What is counted (the trainer's training loop, AdamW):
- weights: fp32 parameters (bf16 runs keep fp32 master weights and compute in bf16 through
  autocast or FSDP's cast), divided over dp under ZeRO-3;
- gradients: fp32, divided over dp under ZeRO-2/3;
- optimizer: AdamW's exp_avg and exp_avg_sq, fp32, divided over dp under ZeRO-2/3;
- activations: one microbatch's saved tensors times the microbatches in flight (GPipe: all of
  them; 1F1B: pp - stage, as the first stage runs that many forwards before its first backward),
  plus the received/sent boundary tensors of those microbatches;
- transient: scratch beyond that (the chunked LM loss's logits, ZeRO-3's gathered blocks).
Everything is divided over tp where tensor parallelism shards it. Allocator fragmentation, CUDA
context and library workspaces are not included: leave 10-20 % headroom.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32 = 4
ADAM_STATES = 2  # exp_avg, exp_avg_sq


@dataclass(frozen=True)
class StageLoad:
    """What one pipeline stage holds and keeps, independent of the parallel layout."""

    params: int                 # parameters it holds (tied copies included)
    activation_bytes: int       # saved for backward by ONE microbatch, at the training dtype
    boundary_bytes: int = 0     # what one microbatch passes to the next stage (and receives)
    transient_bytes: int = 0    # peak scratch of one microbatch beyond its saved activations
    largest_unit_params: int = 0  # the biggest FSDP unit (ZeRO-3 gathers about two at a time)


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    gradients: int
    optimizer: int
    activations: int
    transient: int
    in_flight: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.transient

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


def in_flight(schedule: str, stage: int, num_stages: int, microbatches: int) -> int:
    """Microbatches whose activations a stage holds at its peak."""
    if num_stages <= 1:
        return 1  # microbatches run forward then backward one after another
    if schedule in ("gpipe", "afab"):
        return microbatches
    return max(1, min(num_stages - stage, microbatches))


def stage_memory(load: StageLoad, *, in_flight: int, dtype: str = "fp32", sharding: str = "ddp", dp: int = 1,
                 tp: int = 1) -> MemoryEstimate:
    """The estimate for one rank of a stage (see the module doc)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPE_BYTES)}")
    params = load.params / max(tp, 1)
    zero3 = sharding.startswith("zero3") and dp > 1
    zero2 = sharding.startswith(("zero2", "zero3")) and dp > 1
    weights = FP32 * params / (dp if zero3 else 1)
    grads = FP32 * params / (dp if zero2 else 1)
    optim = ADAM_STATES * FP32 * params / (dp if zero2 else 1)
    acts = (load.activation_bytes + 2 * load.boundary_bytes) * in_flight / max(tp, 1)
    transient = load.transient_bytes / max(tp, 1)
    if zero3:  # the unsharded copies of the block being computed and the one prefetched
        transient += 2 * load.largest_unit_params * DTYPE_BYTES[dtype] / max(tp, 1)
    return MemoryEstimate(int(weights), int(grads), int(optim), int(acts), int(transient), in_flight)


LOSS_CHUNK_ELEMENTS = 2 ** 28  # train.loss_chunks auto: logits elements (tokens x vocab) per chunk at most


def auto_loss_chunks(tokens: int, vocab: int) -> int:
    """train.loss_chunks auto: the fewest chunks of a microbatch's `tokens` whose logits hold at most
    LOSS_CHUNK_ELEMENTS each, rounded up to a divisor of `tokens` (equal chunks: one compiled graph)."""
    if tokens <= 0:
        return 1
    need = -(-tokens * max(vocab, 1) // LOSS_CHUNK_ELEMENTS)
    if need <= 1:
        return 1
    return next(n for n in range(need, tokens + 1) if tokens % n == 0)


def loss_scratch_bytes(tokens: int, vocab: int, dtype: str, chunks: int) -> int:
    """The LM loss's scratch on the last stage, per chunk: the fp32 logits and their gradient, and
    the logits in the compute dtype where that is not fp32 (the log-softmax the loss keeps for
    backward is in the stage's activations)."""
    per = 8 + (DTYPE_BYTES[dtype] if dtype != "fp32" else 0)
    return tokens * vocab * per // max(chunks, 1)


def sizing_dtype(train_dtype: str, *, gpu: bool) -> str:
    """The compute dtype a launch gets: train.dtype auto is bf16 on a (bf16-capable) CUDA GPU and fp32
    on a CPU, as trainer/runtime/dist_env.py resolves it at start."""
    if train_dtype == "auto":
        return "bf16" if gpu else "fp32"
    return train_dtype


def component_dtypes(dtype: str) -> dict[str, str]:
    """What each part of the estimate is held in, for the printed plan."""
    return {"weights": "fp32", "gradients": "fp32", "optimizer": f"{ADAM_STATES} x fp32 (AdamW)",
            "activations": dtype, "transient": f"{dtype} + fp32"}


def transformer_activation_bytes(tokens: int, hidden: int, ffn: int, layers: int, dtype: str = "bf16", *,
                                 gated: bool = False, heads: int = 0, seq: int = 0,
                                 attention_scores: bool = False) -> int:
    """Saved activations of `layers` transformer blocks for `tokens` tokens (one microbatch:
    batch x seq), without recomputation: per token about 10 hidden-sized tensors (norm inputs and
    outputs, q/k/v, attention output, residuals) and 2 of the MLP's width (before and after the
    activation; 3 for a gated MLP: gate, up and the activation), plus the heads x seq attention
    probabilities when the attention materialises them (eager; SDPA/flash keep a log-sum-exp).
    Korthikanti et al. 2022 count 34 h bytes per token at 16 bits with ffn = 4h; this gives 36 h."""
    per_token = 10 * hidden + (3 if gated else 2) * ffn + (heads * seq if attention_scores else 0)
    return int(tokens * per_token * layers * DTYPE_BYTES[dtype])


DISK_KEEP_FREE = 1 << 30       # what a disk keeps free when the runner or the trainer fills it ...
DISK_KEEP_FREE_SHARE = 0.05    # ... at most this share of it: a small disk keeps 5%


def disk_keep_free(total: int) -> int:
    """Bytes a disk of `total` bytes keeps free of what a run writes (collect here, checkpoints on a
    node): 1 GiB, or 5% of a disk under 20 GiB (a Pi's SD card keeps room for its logs and engine)."""
    return min(DISK_KEEP_FREE, int(total * DISK_KEEP_FREE_SHARE))


def size_text(n: float) -> str:
    """A byte count as people read it, binary units: `512 B`, `153.6 KiB`, `3.0 MiB`, `1.25 GiB`."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.{2 if shift >= 30 else 1}f} {unit}"
    return f"{int(n)} B"


def gib(n: float) -> str:
    """`12.30 GiB` / `512.0 MiB` for a byte count."""
    if abs(n) >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"
