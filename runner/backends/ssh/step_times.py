"""Per-node step time and wait share for `runner status` (issue 57's stragglers): the trainer's last
metrics.jsonl record holds every rank's mean step and wait of the last log window (`rank_step_s`,
`rank_wait_s`, gathered on the log step's own all-reduce) and the ranks it currently calls
stragglers (`stragglers`: watch.straggler_factor x the others' median per unit of work for
watch.straggler_steps log steps in a row, contract/hang.py); which global ranks run on which node
comes from the names of each node's heartbeat files (OUTPUT_DIR/heartbeat/rank<R>.json; a listing,
bounded, no file read). Nothing here is trusted: numbers only, lists of the world's length."""

from __future__ import annotations

import json
import statistics
from typing import Any

from contract import hang as rule
from contract import heartbeat as fmt
from runner.transport.sftp import listdir_within

MAX_RANKS = 4096


def node_ranks(remote: Any, run_dir: str) -> list[int]:
    """The global ranks whose heartbeat files are in this node's run dir ([] when none or unreadable)."""
    try:
        entries = listdir_within(remote.sftp, f"{run_dir}/{fmt.DIR}", MAX_RANKS) or []
    except Exception:  # noqa: BLE001 - no heartbeat dir (an old run, a job.command): no figures
        return []
    return sorted(int(m[1]) for a in entries if (m := fmt.NAME_RE.fullmatch(a.filename)))


def _numbers(v: Any, n: int | None = None) -> list[float] | None:
    ok = isinstance(v, list) and 0 < len(v) <= MAX_RANKS and (n is None or len(v) == n) and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1e7 for x in v)
    return [float(x) for x in v] if ok else None


def record_times(last_metrics: list[str | None]) -> dict[str, Any] | None:
    """{step_s, wait_s, stragglers} from the first metrics line that has rank_step_s/rank_wait_s."""
    for line in last_metrics:
        try:
            rec = json.loads(line) if line else None
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        step = _numbers(rec.get("rank_step_s"))
        wait = _numbers(rec.get("rank_wait_s"), len(step) if step else None)
        if step and wait:
            flagged = rec.get("stragglers")
            stragglers = [r for r in flagged if isinstance(r, int)] if isinstance(flagged, list) else []
            return {"step_s": step, "wait_s": wait, "stragglers": stragglers}
    return None


def per_node(times: dict[str, Any], ranks: dict[str, list[int]]) -> dict[str, dict[str, Any]]:
    """Node -> {ranks, step_s, wait_share, slowness, straggler}: its ranks' mean step, the share of it
    spent waiting, its busiest rank's busy time over the others' median (1.0: as the rest; without
    the per-rank work the trainer weighs by, pipeline stages of unequal size differ here), and
    whether the trainer calls one of its ranks a straggler now."""
    step, wait = times["step_s"], times["wait_s"]
    busy = rule.busy_times(step, wait)
    slow = rule.slowness(busy)
    out = {}
    for node, rs in ranks.items():
        rs = [r for r in rs if r < len(step)]
        if not rs:
            continue
        s = statistics.fmean(step[r] for r in rs)
        w = statistics.fmean(wait[r] for r in rs)
        out[node] = {"ranks": rs, "step_s": round(s, 6), "wait_share": round(w / s, 4) if s > 0 else 0.0,
                     "slowness": round(max(slow[r] for r in rs), 3),
                     "straggler": any(r in times["stragglers"] for r in rs)}
    return out


def add_to_rows(cl: Any, rows: list[dict], run_dirs: dict[str, str]) -> None:
    """rows' `step_times` (None where there is nothing to say): `runner status` per node."""
    times = record_times([r.get("last_metrics") for r in rows])
    for r in rows:
        r["step_times"] = None
    if times is None:
        return
    ranks = {}
    for r in rows:
        if r["node"] in run_dirs and r.get("state") != "unreachable":
            ranks[r["node"]] = node_ranks(cl[r["node"]], run_dirs[r["node"]])
    figures = per_node(times, ranks)
    for r in rows:
        r["step_times"] = figures.get(r["node"])

