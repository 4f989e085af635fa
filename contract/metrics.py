"""metrics.jsonl: one JSON object per logged step, written by the trainer's logging rank
(trainer/metrics.py) with at least {step, loss, tokens_per_s, step_time_s, time}. Readers here:
`runner status` (progress and ETA), `runner collect` (summary, plot), `trainer plot`."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeGuard

import yaml

from contract.bounded_json import tail_lines

FILE = "metrics.jsonl"
ETA_WINDOW = 10  # recent steps whose mean step time predicts the rest


MAX_READ = 64 << 20   # the newest 64 MiB of a metrics.jsonl are read (a real record: ~300 bytes a logged step)
MAX_LINE = 64 << 10   # a longer line is no record of ours: left out unparsed


def parse(text: str) -> list[dict[str, Any]]:
    """Every record that parses (a line being written when read is skipped, and one nested past
    Python's recursion limit: RecursionError is not a ValueError)."""
    return [r for line in text.splitlines() if (r := _record(line)) is not None]


def _record(line: str | bytes) -> dict[str, Any] | None:
    if len(line) > MAX_LINE:
        return None
    try:
        r = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return r if isinstance(r, dict) else None


def read(path: Path, max_bytes: int = MAX_READ) -> list[dict[str, Any]]:
    """The records in the newest max_bytes of the file, read a piece at a time (a job's file of any
    size, or one line of gigabytes without a newline, costs at most max_bytes)."""
    lines, _ = tail_lines(Path(path), max_bytes, MAX_LINE)
    return [r for line in lines if (r := _record(line)) is not None]


def number(x: object) -> TypeGuard[int | float]:
    """x is a number a float holds and is finite: a job's NaN, 1e308 step time or 400-digit loss is
    not one (they ended `runner status` in a traceback)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def is_step(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62


def loss_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records with a numeric loss and an integer step (what a loss curve plots)."""
    return [r for r in records if number(r.get("loss")) and is_step(r.get("step"))]


def total_steps(config_text: str | None) -> int | None:
    """train.steps from the run's config.yaml (the trainer writes the resolved one); None for
    anything but a step count (a node's file: nested past the recursion limit, or a count no
    float holds, which ended `runner status` in a traceback)."""
    try:
        cfg = yaml.safe_load(config_text or "") or {}
        steps = (cfg.get("train") or {}).get("steps")
    except (yaml.YAMLError, AttributeError, RecursionError):
        return None
    return steps if is_step(steps) and steps > 0 else None


@dataclass
class Progress:
    step: int
    total: int | None
    loss: float | None
    tokens_per_s: float | None
    eta_s: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        parts = [f"step {self.step}" + (f"/{self.total}" if self.total else "")]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.tokens_per_s is not None:
            parts.append(f"{si(self.tokens_per_s)} tok/s")
        if self.eta_s is not None:
            parts.append(f"ETA {clock(self.eta_s)}")
        return "  ".join(parts)


def progress(records: list[dict[str, Any]], total: int | None) -> Progress | None:
    """Where a run is, from its latest records; the ETA from the mean of recent step times."""
    steps = loss_records(records)
    if not steps:
        return None
    total = total if is_step(total) and total > 0 else None  # what a float's ETA arithmetic holds
    last = steps[-1]
    times = [r["step_time_s"] for r in steps[-ETA_WINDOW:] if number(r.get("step_time_s")) and 0 <= r["step_time_s"] < 1e7]
    eta = None
    if total and times:
        eta = round(max(0, total - last["step"]) * sum(times) / len(times), 1)
    tps = last.get("tokens_per_s")
    return Progress(last["step"], total, float(last["loss"]), float(tps) if number(tps) else None,
                    eta if eta is not None and math.isfinite(eta) else None)


def summary(records: list[dict[str, Any]]) -> str | None:
    """`final loss X at step N, tokens/s mean M` (collect's summary line)."""
    losses = loss_records(records) or [r for r in records if number(r.get("loss"))]
    if not losses:
        return None
    last = losses[-1]
    tps = [r["tokens_per_s"] for r in losses if number(r.get("tokens_per_s"))]
    step = last.get("step") if is_step(last.get("step")) else "?"  # a string step is the job's text, not a step
    return (f"final loss {float(last['loss']):.4f} at step {step}"
            + (f", tokens/s mean {sum(tps) / len(tps):.1f}" if tps else ""))


def si(x: float) -> str:
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{suffix}"
    return f"{x:.0f}"


def clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
