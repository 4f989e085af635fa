"""Timeline files of one profiled batch, as both wings read and write them.

- `timeline_batch{k}_all.json`: Chrome trace-event format (Perfetto, chrome://tracing). One process
  per rank named `node/rank/stage`, one complete ("X") slice per action with args {stage,
  microbatch, peer, bytes}; network rates as counter ("C") events; times in microseconds from the
  batch's first event, on rank 0's clock.
- The Pi guide's seed format: a JSON array of {rank, action, stage_idx, mb_idx, start_ns, end_ns,
  net_series}, rank after rank. It takes the guide's file names (`timeline_batch{k}_all.json`,
  `_rank0.json` for one process, `_rank{r}.json` for one rank's piece); the Chrome trace then
  moves to `timeline_batch{k}_all.trace.json`.

A rank's *payload* (what the trainer gathers on rank 0) is {rank, node, stages, events, net,
offset_ns, error_ns}; events are {action, stage, mb, peer, bytes, start_ns, end_ns[, posted_ns, tid]}.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from contract import bounded_json

SEED_ACTIONS = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W",
                "send_F": "SEND_F", "recv_F": "RECV_F", "send_B": "SEND_B", "recv_B": "RECV_B",
                "dp_reduce": "ALL_REDUCE"}
SEED_NAMES = {v: k for k, v in SEED_ACTIONS.items()}
SEED_KEYS = {"rank", "action", "stage_idx", "mb_idx", "start_ns", "end_ns"}
CATEGORY = {"forward": "compute", "backward": "compute", "backward_input": "compute",
            "backward_weight": "compute", "send_F": "p2p", "recv_F": "p2p", "send_B": "p2p",
            "recv_B": "p2p", "send": "p2p", "recv": "p2p", "dp_reduce": "collective",
            "grad_norm": "collective", "optimizer": "optimizer", "batch_input": "data"}
# One rank's piece of a batch, and a batch merged over every rank (seed, or its Chrome trace).
PIECE_RE = re.compile(r"timeline_batch(\d+)_rank(\d+)\.json")
MERGED_RE = re.compile(r"timeline_batch(\d+)_all(\.trace)?\.json")


def process_name(p: dict[str, Any]) -> str:
    stages = "+".join(map(str, sorted(p["stages"]))) if p["stages"] else "-"
    return f"{p['node']}/rank{p['rank']}/stage{stages}"


def net_rates(net: list[tuple[int, int, int]]) -> list[tuple[int, float, float]]:
    """(ts_ns, up Mbit/s, down Mbit/s) between consecutive cumulative byte samples, at the later one."""
    out = []
    for (t0, s0, r0), (t1, s1, r1) in zip(net, net[1:], strict=False):
        dt = max(t1 - t0, 1) / 1e9
        out.append((t1, (s1 - s0) * 8 / 1e6 / dt, (r1 - r0) * 8 / 1e6 / dt))
    return out


def chrome_trace(payloads: list[dict[str, Any]], batch: int, meta: dict[str, Any]) -> dict[str, Any]:
    """Every rank's payload as one Chrome trace. A payload may carry `rates` (ts, up, down) in
    place of cumulative `net` samples (what the seed format keeps)."""
    starts = [e["start_ns"] for p in payloads for e in p["events"]]
    origin = min(starts) if starts else 0
    out: list[dict[str, Any]] = []
    for p in payloads:
        pid = p["rank"]
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process_name(p)}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "actions"}})
        if any(e.get("tid", 0) for e in p["events"]):
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1,
                        "args": {"name": "gradient reduction (overlaps backward)"}})
        for e in sorted(p["events"], key=lambda e: e["start_ns"]):
            args = {"stage": e["stage"], "microbatch": e["mb"], "peer": e.get("peer"), "bytes": e.get("bytes", 0)}
            if e.get("posted_ns") is not None:
                args["posted_us"] = round((e["posted_ns"] - origin) / 1e3, 3)
            name = e["action"] if e["mb"] is None else f"{e['action']} mb{e['mb']}"
            out.append({"ph": "X", "name": name, "cat": CATEGORY.get(e["action"], "other"), "pid": pid,
                        "tid": e.get("tid", 0),
                        "ts": round((e["start_ns"] - origin) / 1e3, 3),
                        "dur": round((e["end_ns"] - e["start_ns"]) / 1e3, 3), "args": args})
        rates = p["rates"] if "rates" in p else net_rates(p.get("net", []))
        for t, up, down in rates:
            if t >= origin:
                out.append({"ph": "C", "name": "net Mbit/s", "pid": pid, "tid": 0, "ts": round((t - origin) / 1e3, 3),
                            "args": {"up": round(up, 3), "down": round(down, 3)}})
    other = dict(meta, batch=batch, origin_ns=origin,
                 clock_offsets_ns={str(p["rank"]): p.get("offset_ns", 0) for p in payloads},
                 clock_error_ns={str(p["rank"]): p.get("error_ns", 0) for p in payloads})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}


def seed_records(payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
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


def is_seed(data: Any) -> bool:
    return isinstance(data, list) and all(isinstance(r, dict) and SEED_KEYS <= set(r) for r in data)


def seed_to_chrome(records: list[dict[str, Any]], nodes: dict[int, str] | None = None, batch: int = -1,
                   meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Seed records as a Chrome trace shaped like the trainer's; `nodes` names each rank's node
    (the seed format does not say), and otherData gets pp and microbatches counted from them."""
    payloads: dict[int, dict[str, Any]] = {}
    for r in records:
        p = payloads.setdefault(r["rank"], {"rank": r["rank"], "node": (nodes or {}).get(r["rank"], ""),
                                            "stages": [], "events": [], "rates": [], "offset_ns": 0, "error_ns": 0})
        if r["stage_idx"] is not None and r["stage_idx"] not in p["stages"]:
            p["stages"].append(r["stage_idx"])
        p["events"].append({"action": SEED_NAMES.get(r["action"], str(r["action"]).lower()), "stage": r["stage_idx"],
                            "mb": r["mb_idx"], "peer": None, "bytes": 0, "start_ns": r["start_ns"],
                            "end_ns": r["end_ns"]})
        p["rates"] += [tuple(s) for s in r.get("net_series") or []]
    stages = {r["stage_idx"] for r in records if r["stage_idx"] is not None}
    mbs = {r["mb_idx"] for r in records if r["mb_idx"] is not None}
    meta = {"pp": len(stages) or "?", "microbatches": len(mbs) or "?", **(meta or {})}
    return chrome_trace([payloads[k] for k in sorted(payloads)], batch, meta)


def load_trace(path: Path) -> dict[str, Any]:
    """A Chrome trace, or the seed flat format converted to the same shape."""
    data = bounded_json.read(Path(path))  # a node's file when `runner collect` plots it: bounded, ValueError if not
    if isinstance(data, dict):
        return data
    return seed_to_chrome(data)


def timeline_paths(out_dir: Path, batch: int, fmt: str, world: int) -> tuple[Path, Path | None]:
    """Where the trainer writes batch k: (chrome trace path, seed path or None)."""
    if fmt != "seed":
        return out_dir / f"timeline_batch{batch}_all.json", None
    if world == 1:
        return out_dir / f"timeline_batch{batch}_all.json", out_dir / f"timeline_batch{batch}_rank0.json"
    return out_dir / f"timeline_batch{batch}_all.trace.json", out_dir / f"timeline_batch{batch}_all.json"


def timeline_files(out_dir: Path) -> list[Path]:
    """One timeline per batch found in out_dir: the Chrome trace where both it and the seed file exist."""
    chosen: dict[int, Path] = {}
    for p in sorted(out_dir.glob("timeline_batch*.json")):
        m = re.fullmatch(r"timeline_batch(\d+)_(all|all\.trace|rank0)\.json", p.name)
        if m is None:
            continue
        k = int(m.group(1))
        if m.group(2) == "all.trace" or k not in chosen:
            chosen[k] = p
    return [chosen[k] for k in sorted(chosen)]


def write_atomic(path: Path, text: str) -> Path:
    """Write under a temporary name, then rename: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path
