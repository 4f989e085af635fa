"""Merge every rank's events on rank 0 and write the timeline files of one batch.

- `timeline_batch{k}_all.json`: Chrome trace-event format (Perfetto, chrome://tracing). One
  process per rank named `node/rank/stage`, one complete ("X") slice per action with args
  {stage, microbatch, peer, bytes}; network rates as counter ("C") events. Times are on rank 0's
  clock (offsets estimated at start-up), in microseconds from the batch's first event.
- `profile.format: seed` also writes the Pi guide's flat format, a JSON array (indent 2) of
  {rank, action, stage_idx, mb_idx, start_ns, end_ns, net_series}, in rank order. It takes the
  guide's file name (`timeline_batch{k}_all.json`, `_rank0.json` for one process) so that its
  analysis scripts keep working; the Chrome trace then moves to `timeline_batch{k}_all.trace.json`.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from trainer.profiling.recorder import Event

SEED_ACTIONS = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W",
                "send_F": "SEND_F", "recv_F": "RECV_F", "send_B": "SEND_B", "recv_B": "RECV_B",
                "dp_reduce": "ALL_REDUCE"}
CATEGORY = {"forward": "compute", "backward": "compute", "backward_input": "compute",
            "backward_weight": "compute", "send_F": "p2p", "recv_F": "p2p", "send_B": "p2p",
            "recv_B": "p2p", "send": "p2p", "recv": "p2p", "dp_reduce": "collective",
            "grad_norm": "collective", "optimizer": "optimizer", "batch_input": "data"}


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


def process_name(p: dict) -> str:
    stages = "+".join(map(str, p["stages"])) if p["stages"] else "-"
    return f"{p['node']}/rank{p['rank']}/stage{stages}"


def net_rates(net: list[tuple[int, int, int]]) -> list[tuple[int, float, float]]:
    """(ts_ns, up Mbit/s, down Mbit/s) between consecutive samples, stamped at the later one."""
    out = []
    for (t0, s0, r0), (t1, s1, r1) in zip(net, net[1:], strict=False):
        dt = max(t1 - t0, 1) / 1e9
        out.append((t1, (s1 - s0) * 8 / 1e6 / dt, (r1 - r0) * 8 / 1e6 / dt))
    return out


def chrome_trace(payloads: list[dict], batch: int, meta: dict) -> dict:
    starts = [e["start_ns"] for p in payloads for e in p["events"]]
    origin = min(starts) if starts else 0
    out: list[dict] = []
    for p in payloads:
        pid = p["rank"]
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process_name(p)}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "actions"}})
        if any(e.get("tid", 0) for e in p["events"]):
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1,
                        "args": {"name": "gradient reduction (overlaps backward)"}})
        for e in sorted(p["events"], key=lambda e: e["start_ns"]):
            args = {"stage": e["stage"], "microbatch": e["mb"], "peer": e["peer"], "bytes": e["bytes"]}
            if e.get("posted_ns") is not None:
                args["posted_us"] = round((e["posted_ns"] - origin) / 1e3, 3)
            name = e["action"] if e["mb"] is None else f"{e['action']} mb{e['mb']}"
            out.append({"ph": "X", "name": name, "cat": CATEGORY.get(e["action"], "other"), "pid": pid,
                        "tid": e.get("tid", 0),
                        "ts": round((e["start_ns"] - origin) / 1e3, 3),
                        "dur": round((e["end_ns"] - e["start_ns"]) / 1e3, 3), "args": args})
        for t, up, down in net_rates(p["net"]):
            if t >= origin:
                out.append({"ph": "C", "name": "net Mbit/s", "pid": pid, "tid": 0, "ts": round((t - origin) / 1e3, 3),
                            "args": {"up": round(up, 3), "down": round(down, 3)}})
    other = dict(meta, batch=batch, origin_ns=origin,
                 clock_offsets_ns={str(p["rank"]): p["offset_ns"] for p in payloads},
                 clock_error_ns={str(p["rank"]): p["error_ns"] for p in payloads})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}


def seed_records(payloads: list[dict]) -> list[dict]:
    """The Pi guide's flat records, rank after rank; net_series holds the samples inside each action."""
    out = []
    for p in payloads:
        rates = net_rates(p["net"])
        for e in sorted(p["events"], key=lambda e: e["start_ns"]):
            series = [[t, round(up, 4), round(down, 4)] for t, up, down in rates
                      if e["start_ns"] <= t <= e["end_ns"]]
            out.append({"rank": p["rank"], "action": SEED_ACTIONS.get(e["action"], e["action"].upper()),
                        "stage_idx": e["stage"], "mb_idx": e["mb"], "start_ns": e["start_ns"],
                        "end_ns": e["end_ns"], "net_series": series})
    return out


def timeline_paths(out_dir: Path, batch: int, fmt: str, world: int) -> tuple[Path, Path | None]:
    """(chrome trace path, seed path or None)."""
    if fmt != "seed":
        return out_dir / f"timeline_batch{batch}_all.json", None
    if world == 1:
        return out_dir / f"timeline_batch{batch}_all.json", out_dir / f"timeline_batch{batch}_rank0.json"
    return out_dir / f"timeline_batch{batch}_all.trace.json", out_dir / f"timeline_batch{batch}_all.json"


def write_timeline(out_dir: Path, batch: int, payloads: list[dict], fmt: str, meta: dict) -> Path:
    chrome, seed = timeline_paths(out_dir, batch, fmt, len(payloads))
    _atomic_write(chrome, json.dumps(chrome_trace(payloads, batch, meta)))
    if seed is not None:
        _atomic_write(seed, json.dumps(seed_records(payloads), indent=2))
    return chrome


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def load_trace(path: Path) -> dict:
    """A Chrome trace written here, or the seed flat format converted to the same shape."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        return data
    payloads: dict[int, dict] = {}
    names = {v: k for k, v in SEED_ACTIONS.items()}
    for r in data:
        p = payloads.setdefault(r["rank"], {"rank": r["rank"], "node": "", "stages": [], "events": [], "net": [],
                                            "offset_ns": 0, "error_ns": 0})
        if r["stage_idx"] is not None and r["stage_idx"] not in p["stages"]:
            p["stages"].append(r["stage_idx"])
        p["events"].append({"action": names.get(r["action"], r["action"].lower()), "stage": r["stage_idx"],
                            "mb": r["mb_idx"], "peer": None, "bytes": 0, "start_ns": r["start_ns"],
                            "end_ns": r["end_ns"]})
    return chrome_trace(list(payloads.values()), -1, {})
