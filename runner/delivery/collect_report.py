"""What `runner collect` makes of the files it brought: timelines merged across nodes, plots, and a
summary. All of it through the contract (contract/): the same formats and drawing as the trainer.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from contract import bounded_json, metrics
from contract.timeline import MERGED_RE, PIECE_RE, is_seed, seed_to_chrome, timeline_files, write_atomic

log = logging.getLogger("runner.collect")


def merge_timelines(run_dir: Path) -> list[Path]:
    """Merge per-rank seed pieces of a batch found on several nodes, unless a merged file exists.
    Writes timeline_batch{k}_all.json (seed, as the trainer would) and its Chrome trace
    timeline_batch{k}_all.trace.json into run_dir. Times are kept as the ranks wrote them."""
    done = {int(m[1]) for p in run_dir.glob("*/timeline_batch*.json") if (m := MERGED_RE.fullmatch(p.name))}
    pieces: dict[int, dict[int, Path]] = {}
    for p in sorted(run_dir.glob("*/timeline_batch*_rank*.json")):
        m = PIECE_RE.fullmatch(p.name)
        if m and int(m[1]) not in done:
            pieces.setdefault(int(m[1]), {}).setdefault(int(m[2]), p)
    out = []
    for k, ranks in sorted(pieces.items()):
        if len({p.parent for p in ranks.values()}) < 2:
            continue  # one node's own timeline (a single process writes _rank0.json): nothing spans nodes
        seed = run_dir / f"timeline_batch{k}_all.json"
        if seed.exists() and seed.stat().st_mtime >= max(p.stat().st_mtime for p in ranks.values()):
            continue  # merged by an earlier collect from these very pieces
        records, nodes = _read_pieces(ranks)
        if not records:
            continue
        write_atomic(seed, json.dumps(records, indent=2))
        meta = {"merged_by": "runner collect", "sources": sorted(str(p.relative_to(run_dir)) for p in ranks.values())}
        trace = seed_to_chrome(records, nodes, k, meta)
        out += [seed, write_atomic(run_dir / f"timeline_batch{k}_all.trace.json", json.dumps(trace))]
    return out


def _read_pieces(ranks: dict[int, Path]) -> tuple[list[dict], dict[int, str]]:
    records, nodes = [], {}
    for rank, p in sorted(ranks.items()):
        try:
            data = bounded_json.read(p)  # a node's file: at most 64 MiB and 2,000,000 values
            if not is_seed(data):
                raise ValueError("not a list of seed-format records")
        except (OSError, ValueError) as exc:
            log.warning("timeline piece %s not merged: %s", p, exc)
            return [], {}
        nodes[rank] = p.parent.name
        records += sorted(data, key=lambda r: (r["rank"], r["start_ns"]))
    return records, nodes


def render_plots(run_dir: Path) -> list[Path]:
    """Gantt per timeline (run dir and node dirs), metrics.png per metrics.jsonl. A plot newer than
    its input is kept, so a second collect renders nothing. Problems are warnings: the files
    themselves were collected and verified."""
    try:
        from contract import plots
    except ImportError as exc:
        log.warning("plots skipped: %s (pip install matplotlib)", exc)
        return []
    made = []
    merged_here = {int(m[1]) for p in run_dir.glob("timeline_batch*.json") if (m := MERGED_RE.fullmatch(p.name))}
    for d in [run_dir, *sorted(p for p in run_dir.iterdir() if p.is_dir())]:
        for f in timeline_files(d):
            named = re.match(r"timeline_batch(\d+)", f.name)
            assert named is not None  # timeline_files lists timeline_batch* files only
            k = int(named[1])
            if d != run_dir and k in merged_here and PIECE_RE.fullmatch(f.name):
                continue  # one rank's piece: its Gantt is the merged one in run_dir
            out = d / f"timeline_batch{k}_gantt.png"
            made += _render(f, out, _gantt, plots, f, d, k, out)
        mpath = d / metrics.FILE
        if mpath.is_file():
            out = d / "metrics.png"
            made += _render(mpath, out, _metrics_plot, plots, mpath, out)
    return [p for p in made if p is not None]


def _render(src: Path, out: Path, fn, *args) -> list[Path | None]:
    if out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        return []
    try:
        return [fn(*args)]
    except Exception as exc:  # noqa: BLE001 - a bad plot input must not fail a verified collect
        log.warning("plot %s not rendered from %s: %s", out.name, src, exc)
        return []


def _gantt(plots, f: Path, d: Path, k: int, out: Path) -> Path:
    data = bounded_json.read(f)
    trace = data if isinstance(data, dict) else seed_to_chrome(data, batch=k)
    return plots.gantt(trace, out, plots.gantt_title(trace, k, d / f"timeline_batch{k}_summary.json"))


def _metrics_plot(plots, mpath: Path, out: Path) -> Path | None:
    recs = metrics.loss_records(metrics.read(mpath))
    return plots.metrics_plot(recs, out) if recs else None


def summarize(run_dir: Path) -> list[str]:
    """Final loss, tokens/s, where the timelines, plots and checkpoints are."""
    lines = []
    for mp in sorted(run_dir.glob(f"*/{metrics.FILE}")):
        line = metrics.summary(metrics.read(mp))
        if line:
            lines.append(f"{line}  ({mp.relative_to(run_dir.parent)})")

    def found(pattern: str) -> list[Path]:
        return sorted([*run_dir.glob(pattern), *run_dir.glob(f"*/{pattern}")])

    for p in found("timeline_batch*.json"):
        if MERGED_RE.fullmatch(p.name):
            lines.append(f"timeline: {p}" + ("  (merged here from the nodes' pieces)" if p.parent == run_dir else ""))
    for p in found("*.png"):
        lines.append(f"plot: {p}")
    for p in found("profile.csv"):
        lines.append(f"profile: {p}")
    ckpts = sorted({p.parent for p in run_dir.glob("*/checkpoints/**/*") if p.is_file()})
    if ckpts:
        lines.append(f"checkpoints: {len(ckpts)} dir(s), e.g. {ckpts[-1]}")
    return lines
