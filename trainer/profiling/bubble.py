"""Pipeline bubble of one profiled batch: measured per-stage busy/idle beside the theory.

Window: from the first pipeline action (compute or p2p) of any rank to the last one, on rank
0's clock; data loading, gradient clipping and the optimizer step are outside it. Busy = time
in forward/backward/backward-input/backward-weight slices; idle = window - busy, which holds
the waits for activations/gradients and the warm-up/cool-down bubbles. The measured bubble is
the mean idle fraction over ranks. Theory assumes equal stages and free communication:
(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for interleaved 1F1B with v stages per rank;
zero-bubble schedules depend on how W fills the gaps and have no closed form here (null).
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer.profiling.recorder import COMPUTE

PIPELINE = (*COMPUTE, "send_F", "recv_F", "send_B", "recv_B")


def theoretical_bubble(schedule: str, p: int, m: int, v: int = 1) -> float | None:
    if p <= 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved1f1b":
        return (p - 1) / (v * m + p - 1)
    return None


def summarize(payloads: list[dict], batch: int, schedule: str, p: int, m: int, v: int) -> dict:
    spans = [(e["start_ns"], e["end_ns"]) for pl in payloads for e in pl["events"] if e["action"] in PIPELINE]
    t0 = min((s for s, _ in spans), default=0)
    t1 = max((e for _, e in spans), default=0)
    window = max(t1 - t0, 1)
    rows = []
    for pl in payloads:
        per: dict[str, int] = {}
        for e in pl["events"]:
            per[e["action"]] = per.get(e["action"], 0) + e["end_ns"] - e["start_ns"]
        busy = sum(per.get(a, 0) for a in COMPUTE)
        comm = sum(per.get(a, 0) for a in ("send_F", "recv_F", "send_B", "recv_B"))
        rows.append({"rank": pl["rank"], "stages": pl["stages"], "busy_ms": busy / 1e6,
                     "idle_ms": (window - busy) / 1e6, "comm_wait_ms": comm / 1e6,
                     "bubble_fraction": (window - busy) / window,
                     "action_ms": {a: t / 1e6 for a, t in sorted(per.items())}})
    measured = sum(r["bubble_fraction"] for r in rows) / max(len(rows), 1)
    return {"batch": batch, "schedule": schedule, "pp": p, "microbatches": m, "virtual_stages": v,
            "window_ms": window / 1e6, "measured_bubble": measured,
            "theoretical_bubble": theoretical_bubble(schedule, p, m, v), "ranks": rows}


def format_summary(s: dict) -> str:
    theory = "n/a" if s["theoretical_bubble"] is None else f"{s['theoretical_bubble']:.3f}"
    lines = [f"batch {s['batch']} {s['schedule']} p={s['pp']} m={s['microbatches']} v={s['virtual_stages']}: "
             f"window {s['window_ms']:.2f} ms, bubble measured {s['measured_bubble']:.3f} vs theory {theory}"]
    for r in s["ranks"]:
        lines.append(f"  rank {r['rank']} stage {'+'.join(map(str, r['stages']))}: busy {r['busy_ms']:.2f} ms, "
                     f"idle {r['idle_ms']:.2f} ms (comm wait {r['comm_wait_ms']:.2f} ms), "
                     f"bubble {r['bubble_fraction']:.3f}")
    return "\n".join(lines)


def write_summary(out_dir: Path, s: dict) -> Path:
    path = out_dir / f"timeline_batch{s['batch']}_summary.json"
    path.write_text(json.dumps(s, indent=2))
    return path
