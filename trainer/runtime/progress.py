"""What the training loop calls to be watched (issue 57's trainer side), kept out of train.py:

- `start`: the heartbeat (phase init, before the process group), the stacks handler, on NCCL the
  flight recorder's env, and the process group's first timeout (`initial_timeout`);
- `StepTimes.slots`/`fields`: at a log step, every rank's (step, wait) means since the last one ride
  on the all-reduce that log step already makes for the memory figure (no collective of their own,
  none on any other step): metrics.jsonl's `rank_step_s`/`rank_wait_s`, and rank 0's one-line
  warning when a rank computes watch.straggler_factor x longer than the others' median for
  watch.straggler_steps log steps in a row (contract.hang.Stragglers);
- `stalled`: a collective that timed out becomes one line, the rank's own hang-rank<R>.txt and
  exit code contract.hang.EXIT_STALLED, instead of a traceback after a 30-minute wait.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from contract import hang as rule
from trainer.runtime import heartbeat, stacks

log = logging.getLogger("trainer")

_TIMEOUT_RE = re.compile(r"timed out|timeout", re.I)


def _seconds(value: int | str) -> float | None:
    return None if value == "auto" else float(value)


def start(cfg: Any, env: Any, nccl: bool) -> heartbeat.HeartbeatWriter:
    """This rank's heartbeat (phase init), its stacks handler, and on NCCL the flight recorder."""
    out = Path(cfg.output_dir)
    w = cfg.watch
    writer = heartbeat.HeartbeatWriter(out, env.rank, env.world_size, env.local_rank, w.heartbeat_s,
                                       hang_timeout_s=_seconds(w.hang_timeout_s),
                                       startup_s=_seconds(w.startup_timeout_s),
                                       configured_timeout_s=_seconds(cfg.parallel.timeout_s))
    heartbeat.start(writer)
    stacks.install(out, env.rank)
    if nccl:
        stacks.nccl_flight_recorder(out)
    if cfg.train.compile != "false":
        from trainer.runtime.phase_hooks import hook_compile

        hook_compile()
    return writer


def initial_timeout(writer: heartbeat.HeartbeatWriter) -> float:
    """The process group's timeout at creation: the start-up budget's (contract.hang)."""
    t = writer.timeout_now()
    writer.collective_timeout_s = t
    from trainer.runtime import dist_env

    dist_env.set_collective_timeout(t)  # no group yet: remembered for gloo's point-to-point waits
    return t


def shard_bytes(params: list[Any]) -> int:
    """What a rank writes per checkpoint, roughly: its parameters' bytes, twice more for Adam's
    moments (a checkpoint's budget scales with it: contract.hang.checkpoint_budget)."""
    return 3 * sum(p.numel() * p.element_size() for p in params)


def matmul_params(parts: list[Any]) -> int:
    """A rank's parameters that multiply activations: all but embedding tables (a lookup costs no
    FLOPs; a tied LM head counts, through the module that multiplies by it), each counted once."""
    from torch import nn

    seen: set[int] = set()
    total = 0
    for part in parts:
        for mod in part.modules():
            if isinstance(mod, nn.Embedding):
                continue
            for p in mod.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
    return total


def attention_layers(parts: list[Any]) -> int:
    """A rank's attention blocks: modules whose class is named *Attention and hold no other such
    module (BERT's BertAttention wraps its BertSelfAttention: one; a T5 decoder block's self and
    cross attention: two; a Wide-ResNet: none)."""
    count = 0
    for part in parts:
        for mod in part.modules():
            if type(mod).__name__.endswith("Attention") and not any(
                    type(m).__name__.endswith("Attention") for m in mod.modules() if m is not mod):
                count += 1
    return count


def compute_work(parts: list[Any], attention_width: int = 0, seq_len: int = 0) -> int:
    """What a rank computes per token: its forward + backward FLOPs, the MFU formula of
    trainer/metrics.py (6 N + 12 L a S) applied to the part of the model it holds: 6 per parameter
    that multiplies (matmul_params) plus 12 x its attention blocks x attention width x sequence
    length (the scores and their weighted sum, which hold no parameters). The straggler rule divides
    busy time by it, so it must follow each stage's real cost: counting parameters alone made the
    reduced Pi pipeline's last stage (2 layers and the LM head, whose weights are almost a layer's,
    its matmul a third of one at seq_len 256) look 1.17x cheaper per unit than it runs, and a node
    slowed to a third of a CPU slip under the 1.5x rule (tests/unit/test_stage_work.py)."""
    return round(6 * matmul_params(parts) + 12 * attention_layers(parts) * attention_width * seq_len)


class StepTimes:
    """Per-rank step and wait times gathered at log steps; the straggler warning on rank 0."""

    def __init__(self, cfg: Any, env: Any, device: Any, backend: str, parts: list[Any], spec: Any = None):
        """`env`: the rank's (rank, world_size); `spec`: the model's ModelSpec, whose attention width
        and tokens per sample size the work this rank's parts compute per token (compute_work,
        counted once, here; without it, the parameters' share alone)."""
        self.rank, self.world, self.device, self.backend = env.rank, env.world_size, device, backend
        w = cfg.watch
        self.stragglers = rule.Stragglers(w.straggler_factor, w.straggler_steps) if w.straggler_steps else None
        width, seq = (spec.attention_width, spec.tokens_per_sample(cfg.data.seq_len)) if spec is not None else (0, 0)
        self.work = compute_work(parts, width, seq)
        if heartbeat.CURRENT is not None:
            heartbeat.CURRENT.work = self.work
            heartbeat.CURRENT.ckpt_bytes = shard_bytes([p for m in parts for p in m.parameters()])

    def slots(self, mean_step_s: float) -> list[float]:
        """At a log step: this rank's (step, wait, work) in its slots of a 3 x world vector, zeros
        elsewhere, for the log step's one MAX all-reduce (Trainer._memory); [] without a heartbeat
        (every rank alike: none runs one) or with one rank."""
        w = heartbeat.CURRENT
        if w is None:
            return []
        step, wait = w.log_window(mean_step_s)
        if self.world < 2:
            return []
        n = self.world
        out = [0.0] * (3 * n)
        out[self.rank], out[n + self.rank], out[2 * n + self.rank] = step, wait, float(self.work)
        return out

    def fields(self, gathered: list[float]) -> dict[str, Any]:
        """metrics.jsonl's per-rank fields from the gathered slots; rank 0's straggler warning."""
        n = self.world
        if len(gathered) != 3 * n:
            return {}
        steps, waits, work = gathered[:n], gathered[n:2 * n], gathered[2 * n:]
        out: dict[str, Any] = {"rank_step_s": [round(x, 6) for x in steps], "rank_wait_s": [round(x, 6) for x in waits]}
        if self.stragglers is not None:
            busy = rule.busy_times(steps, waits)
            new = self.stragglers.update(busy, work)
            if self.stragglers.current():
                out["stragglers"] = self.stragglers.current()
            if self.rank == 0:
                for r, ratio in new:
                    log.warning("straggler: rank %d computes %.1fx slower than the other ranks' median, per FLOP "
                                "it computes (%.3f s busy of its %.3f s step), for %d log steps in a row: it holds the "
                                "others back", r, ratio, busy[r], steps[r], self.stragglers.windows)
        return out


def is_collective_timeout(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and bool(_TIMEOUT_RE.search(str(e)))


def stalled(e: BaseException, output_dir: str | Path, rank: int) -> int | None:
    """A collective that gave up: one line, this rank's hang-rank<R>.txt, heartbeat `failed`, and
    EXIT_STALLED; None for any other error (it goes on as it would)."""
    if not is_collective_timeout(e):
        return None
    w = heartbeat.CURRENT
    beat = w.snapshot() if w is not None else None
    where = beat.where() if beat is not None else "unknown"
    timeout = (f"{w.collective_timeout_s:.0f} s" if w is not None and w.collective_timeout_s else "its timeout")
    path = stacks.write_own(output_dir, rank, e, where)
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    log.error("rank %d: a collective gave up after %s at %s: a peer stopped making progress (%s); stacks in %s; "
              "exit %d", rank, timeout, where, first[:200], path or "-", rule.EXIT_STALLED)
    heartbeat.stop("failed", f"collective timeout after {timeout} at {where}")
    return rule.EXIT_STALLED


def finished(error: BaseException | None = None) -> None:
    """The heartbeat's last word (done, or failed with the error's first line); the writer stops."""
    if heartbeat.CURRENT is not None:
        if error is None:
            heartbeat.stop("done")
        else:
            heartbeat.stop("failed", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
    stacks.uninstall()

