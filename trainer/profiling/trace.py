"""Merge every rank's events on rank 0 and write the timeline files of one batch.

The formats (Chrome trace, the Pi guide's seed records, their file names) are the contract's
(contract/timeline.py), read back by `runner collect` and `trainer plot`; this module adds what
needs the recorder: a rank's payload on rank 0's clock, and writing a batch's files.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from contract.timeline import (  # noqa: F401 - the trainer-side names of the contract's formats
    CATEGORY,
    SEED_ACTIONS,
    chrome_trace,
    load_trace,
    net_rates,
    process_name,
    seed_records,
    timeline_paths,
    write_atomic,
)
from trainer.profiling.recorder import Event


def node_name() -> str:
    return os.environ.get("NODE_NAME") or socket.gethostname()


def rank_payload(rank: int, stages: list[int], events: list[Event], net: list[tuple[int, int, int]],
                 to_ref: Any, offset_ns: int, error_ns: int) -> dict:
    """What one rank contributes to the merge: events and net samples already on rank 0's clock."""
    evs = []
    for e in events:
        d = e.to_dict()
        d["start_ns"], d["end_ns"] = to_ref(e.start_ns), to_ref(e.end_ns)
        if e.posted_ns is not None:
            d["posted_ns"] = to_ref(e.posted_ns)
        evs.append(d)
    return {"rank": rank, "node": node_name(), "stages": stages, "events": evs,
            "net": [(to_ref(t), s, r) for t, s, r in net], "offset_ns": offset_ns, "error_ns": error_ns}


def write_timeline(out_dir: Path, batch: int, payloads: list[dict], fmt: str, meta: dict) -> Path:
    chrome, seed = timeline_paths(out_dir, batch, fmt, len(payloads))
    write_atomic(chrome, json.dumps(chrome_trace(payloads, batch, meta)))
    if seed is not None:
        write_atomic(seed, json.dumps(seed_records(payloads), indent=2))
    return chrome
