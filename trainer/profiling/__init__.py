"""Profiling: clock-aligned pipeline timelines, bubble analysis, Perseus/Merak CSVs (docs/profiling.md).

clocks.py (per-rank clock, offsets to rank 0), recorder.py (events from stage/p2p hooks),
trace.py (merge on rank 0, Chrome trace + seed format), bubble.py, energy.py, timing_csv.py,
batches.py (profile.batch parsing), callback.py (ties them to the training loop).

May import: torch, contract, trainer.config; never the loop (callback.py is handed the trainer).
"""

from __future__ import annotations

from typing import Any


def make_callback(trainer: Any) -> Any:
    """Factory listed in train.CALLBACKS; None when nothing is to be recorded."""
    from trainer.profiling.callback import make_callback as make

    return make(trainer)
