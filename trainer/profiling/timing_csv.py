"""Perseus/Merak CSVs: instructions-{rank}.csv, time-energy-{rank}.csv and profile.csv.

instructions-{rank}.csv keeps Merak's header `instruction,start,end` (seconds, floats, on rank
0's clock so that ranks line up) and adds `stage,microbatch`, which Merak left implied by row
order. Instruction names: Merak's `batch_input`, `forward_microstep`, `backward_microstep`,
plus the ones it did not record (send/recv, split backward, reductions, optimizer).
time-energy-{rank}.csv: `time,energy` (seconds, cumulative Joules) from a real sensor, or a
single comment line saying why there is none. profile.csv: per stage and instruction
(forward/backward/load), the mean time and energy of one instance over the profiled steps;
energy is empty without a sensor. Under a Perseus server (perseus_rounds.py) each plan's window
is labelled: `stage,instruction,frequency,time,energy,plan` (Perseus' columns, plus the plan).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path

from trainer.profiling.energy import EnergySampler
from trainer.profiling.recorder import Event

INSTRUCTIONS = {"batch_input": "batch_input", "forward": "forward_microstep", "backward": "backward_microstep",
                "backward_input": "backward_input_microstep", "backward_weight": "backward_weight_microstep",
                "send_F": "send_activation", "recv_F": "recv_activation", "send_B": "send_grad",
                "recv_B": "recv_grad", "send": "send", "recv": "recv", "dp_reduce": "reduce_grads",
                "grad_norm": "grad_norm", "optimizer": "optimizer_step"}
PROFILE_KINDS = {"forward": "forward", "backward": "backward", "backward_input": "backward",
                 "backward_weight": "backward", "batch_input": "load"}


def _fmt(v: int | None) -> str:
    return "" if v is None else str(v)


def write_instructions(path: Path, events: list[Event], to_ref: Callable[[int], int]) -> int:
    rows = sorted(events, key=lambda e: e.start_ns)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["instruction", "start", "end", "stage", "microbatch"])
        for e in rows:
            w.writerow([INSTRUCTIONS.get(e.action, e.action), f"{to_ref(e.start_ns) / 1e9:.9f}",
                        f"{to_ref(e.end_ns) / 1e9:.9f}", _fmt(e.stage), _fmt(e.mb)])
    return len(rows)


def write_time_energy(path: Path, sampler: EnergySampler | None, reason: str, to_ref: Callable[[int], int]) -> None:
    with path.open("w", newline="") as f:
        if sampler is None:
            f.write(f"# no energy sensor: {reason}\n")
            return
        w = csv.writer(f)
        w.writerow(["time", "energy"])
        for t, e in sampler.rows:
            w.writerow([f"{to_ref(t) / 1e9:.9f}", f"{e:.6f}"])


def profile_rows(events: list[Event], sampler: EnergySampler | None,
                 label: Callable[[Event], dict] | None = None) -> list[dict]:
    """Per (stage, kind[, label]): summed time/energy and the number of instances (microbatches or
    batches). `label(event)` adds fields that split the rows (a Perseus plan and frequency).

    A split backward's input and weight parts add up to one backward instance of its microbatch.
    """
    acc: dict[tuple, dict] = {}
    for e in events:
        kind = PROFILE_KINDS.get(e.action)
        if kind is None or e.stage is None:
            continue
        extra = label(e) if label is not None else {}
        a = acc.setdefault((e.stage, kind, *sorted(extra.items())),
                           {"stage": e.stage, "instruction": kind, "time": 0.0, **extra,
                            "energy": 0.0, "instances": set(), "has_energy": sampler is not None})
        a["time"] += (e.end_ns - e.start_ns) / 1e9
        a["instances"].add((e.batch, e.mb))
        if sampler is not None:
            e0, e1 = sampler.energy_at(e.start_ns), sampler.energy_at(e.end_ns)
            if e0 is None or e1 is None:
                a["has_energy"] = False
            else:
                a["energy"] += e1 - e0
    return [dict(a, instances=len(a["instances"])) for a in acc.values()]


def write_profile(path: Path, rows: list[dict]) -> None:
    """Merge rows of all ranks (DP replicas of a stage are averaged) into stage,instruction,time,energy;
    rows labelled with a Perseus plan give stage,instruction,frequency,time,energy,plan."""
    plans = any("plan" in r for r in rows)
    merged: dict[tuple, list[dict]] = {}
    for r in rows:
        merged.setdefault((r.get("plan", 0), r["stage"], r["instruction"], r.get("frequency")), []).append(r)
    order = {"load": 0, "forward": 1, "backward": 2}
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["stage", "instruction", "frequency", "time", "energy", "plan"] if plans
                   else ["stage", "instruction", "time", "energy"])
        for (plan, stage, kind, freq), rs in sorted(merged.items(), key=lambda kv: (
                kv[0][0], kv[0][1], order[kv[0][2]], -(kv[0][3] or 0))):
            t = sum(r["time"] / r["instances"] for r in rs) / len(rs)
            energy = (sum(r["energy"] / r["instances"] for r in rs) / len(rs)
                      if all(r["has_energy"] for r in rs) else math.nan)
            e = "" if math.isnan(energy) else f"{energy:.6f}"
            w.writerow([stage, kind, _fmt(freq), f"{t:.9f}", e, plan] if plans else [stage, kind, f"{t:.9f}", e])
