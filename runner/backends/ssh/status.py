"""describe, runs and logs of SSH runs (`runner status`, `ls`, `logs`): everything from container
labels and the nodes' run dirs, so any shell with the inventory can find a run (no local state).
The results are runner/backends/results.py's RunStatus and LogLine; the CLI renders them."""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from contract import bounded_json
from runner.backends.results import LogLine, NodeStatus, RunStatus, run_state
from runner.backends.ssh.node_runs import gather, node_progress, resolve_run, run_doc
from runner.core.errors import UserError
from runner.core.node_output import KeptLog, LineSplitter, visible
from runner.core.redact import printable
from runner.planning.elastic import ELASTIC_FILE, EVENTS_MAX, parse_events
from runner.planning.paths import node_paths
from runner.planning.plan import LABEL_RANK, LABEL_ROLE, LABEL_RUN
from runner.transport.cluster import Cluster
from runner.transport.container_logs import FollowedLog, log_chunks


def _label_int(value) -> int | None:
    """A label the node gave: an int, or None for anything else (never a traceback)."""
    return int(value) if isinstance(value, str) and value.isascii() and value.lstrip("-").isdigit() else None


def _uptime(c) -> str:
    st = c.state
    if st.get("Running"):
        try:
            t = datetime.fromisoformat(str(st.get("StartedAt"))[:26].rstrip("Z") + "+00:00")
        except ValueError:  # no time, or not one: the engine's word
            return "?"
        return f"{(datetime.now(timezone.utc) - t).total_seconds():.0f}s"
    return "-"


def status_rows(cl: Cluster, data, run_id: str) -> list[dict]:
    """One row per inventory node (NodeStatus's fields): its container's state, else how its run
    dir says the run ended, its last metrics record and progress."""
    rows = []
    for n in cl.inv.ordered():
        if n.name not in data:
            rows.append({"node": n.name, "rank": None, "state": "unreachable", "exit_code": None, "uptime": "-",
                         "last_metrics": None, "progress": None, "error": cl.unreachable.get(n.name)})
            continue
        containers, dirs = data[n.name]
        cs = [c for c in containers if c.labels.get(LABEL_RUN) == run_id and LABEL_ROLE not in c.labels]
        row = {"node": n.name, "rank": None, "state": "absent", "exit_code": None, "uptime": "-", "last_metrics": None,
               "progress": None, "error": None}
        if cs:
            c = cs[0]
            row.update(rank=_label_int(c.labels.get(LABEL_RANK)), state=c.status,
                       exit_code=c.exit_code if c.status == "exited" else None,
                       uptime=_uptime(c))
        elif run_id in dirs:
            doc = dirs[run_id] if dirs[run_id] is not None else run_doc(cl[n.name], run_id)
            row.update(rank=doc.get("rank"), state="finished" if doc else "no container",
                       exit_code=doc.get("exit_code"))
        if cs or run_id in dirs:
            # The run dir from the inventory's workdir, never from a label (data from the node).
            last, prog = node_progress(cl[n.name], node_paths(n, cl[n.name].home).run(run_id))
            row["last_metrics"] = last
            row["progress"] = prog.as_dict() if prog else None
        rows.append(row)
    from runner.backends.ssh.step_times import add_to_rows  # issue 57: per-node step time, wait share

    add_to_rows(cl, rows, {n.name: node_paths(n, cl[n.name].home).run(run_id) for n in cl.inv.ordered() if n.name in data})
    return rows


def _int_or_none(x) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def describe(backend, run: str | None) -> RunStatus:
    with backend.cluster() as cl:
        data = gather(cl)
        run_id = resolve_run(data, run)
        rows = status_rows(cl, data, run_id)
        history = elastic_history(cl, data, run_id)
    nodes = [NodeStatus(node=r["node"], rank=_int_or_none(r["rank"]), state=str(r["state"]),
                        exit_code=_int_or_none(r["exit_code"]), uptime=r["uptime"], last_metrics=r["last_metrics"],
                        progress=r["progress"], error=r.get("error"), step_times=r.get("step_times")) for r in rows]
    state, native, code = run_state((n.state, n.exit_code) for n in nodes)
    last = next((n.last_metrics for n in nodes if n.last_metrics), None)
    return RunStatus(backend="ssh", inventory=backend.path, run_id=run_id, state=state, native_state=native,
                     exit_code=code, nodes=nodes, last_metrics=last, elastic=history)


def elastic_history(cl: Cluster, data, run_id: str) -> list[dict]:
    """An elastic run's events (elastic.jsonl), from the node whose copy is the longest: every
    node of the last layout holds the whole history; a node left out since holds less."""
    best: list[dict] = []
    for n in cl.inv.ordered():
        if n.name not in data or run_id not in data[n.name][1]:
            continue
        try:
            text = cl[n.name].read_text(f"{node_paths(n, cl[n.name].home).run(run_id)}/{ELASTIC_FILE}", limit=EVENTS_MAX)
        except UserError as exc:  # a node's oversized file: its history is not read, the status is still shown
            sys.stderr.write(f"runner: warning: {printable(str(exc))}\n")  # its path holds the node's home
            continue
        events = parse_events(text or "")
        if len(events) > len(best):
            best = events
    return best


def runs(backend) -> list[RunStatus]:
    """Every run found on the nodes (containers by label, run dirs with their runner-status.json),
    newest first: a node per container or run dir, no progress read (one listing per node)."""
    with backend.cluster() as cl:
        order = [n.name for n in cl.inv.ordered()]
        data = gather(cl, docs=True)
    found: dict[str, dict[str, NodeStatus]] = {}
    for node in order:
        containers, dirs = data.get(node, ([], {}))
        for c in containers:
            rid = c.labels.get(LABEL_RUN)
            if LABEL_ROLE in c.labels and rid in found and node in found[rid]:
                continue  # a run's second container on the node (its Perseus server): the rank's state stands
            found.setdefault(rid, {})[node] = NodeStatus(
                node=node, rank=_label_int(c.labels.get(LABEL_RANK)), state=str(c.status),
                exit_code=c.exit_code if c.status == "exited" else None)
        for rid, doc in dirs.items():
            if node in found.setdefault(rid, {}):
                continue
            doc = doc or {}
            found[rid][node] = NodeStatus(node=node, rank=_int_or_none(doc.get("rank")),
                                          state="finished" if doc else "no container",
                                          exit_code=_int_or_none(doc.get("exit_code")))
    out = []
    for rid in sorted(found, key=str, reverse=True):
        nodes = [found[rid][n] for n in order if n in found[rid]]
        state, native, code = run_state((n.state, n.exit_code) for n in nodes)
        out.append(RunStatus(backend="ssh", inventory=backend.path, run_id=str(rid), state=state, native_state=native,
                             exit_code=code, nodes=nodes))
    return out


def logs(backend, run: str | None, nodes: list[str] | None, follow: bool, tail: int | str,
         logs_dir: str) -> Iterator[LogLine]:
    """The run's container output per node, prefixed [node/rank]; follow: every node's at once, to
    the containers' exit. Containers gone: what `up` kept under logs_dir (kept_logs)."""
    with backend.cluster() as cl:
        data = gather(cl)
        run_id = resolve_run(data, run)
        targets = [(n.name, c) for n in cl.reachable() if not nodes or n.name in nodes
                   for c in data[n.name][0] if c.labels.get(LABEL_RUN) == run_id]
        if not targets:
            ranks = {node: run_doc(cl[node], run_id).get("rank") for node, (_, dirs) in data.items() if run_id in dirs}
            yield from kept_logs(run_id, logs_dir, nodes, ranks)
            return
        if not follow:
            for node, c in targets:
                yield from _guarded(node, c, lambda c: log_chunks(c, follow=False, tail=tail))
            return
        yield from _followed(targets, tail)


def _stream_of(node: str, c, chunks) -> Iterator[LogLine]:
    label = visible(str(c.labels.get(LABEL_RANK, c.labels.get(LABEL_ROLE, "?"))))[:20]  # a label: the node's word
    split = LineSplitter()
    for chunk in chunks:
        for ln in split.feed(chunk):
            yield LogLine(node, label, ln)
    for ln in split.end():
        yield LogLine(node, label, ln)


def _guarded(node: str, c, open_chunks) -> Iterator[LogLine]:
    """A container's lines; a node lost mid-stream ends its stream (one warning), not the others'."""
    try:
        yield from _stream_of(node, c, open_chunks(c))
    except Exception as exc:  # noqa: BLE001
        label = visible(str(c.labels.get(LABEL_RANK, c.labels.get(LABEL_ROLE, "?"))))[:20]
        first = visible((str(exc).strip().splitlines() or [type(exc).__name__])[0])[:300]
        sys.stderr.write(f"runner: warning: [{node}/{label}] log stream ended: {first}\n")


def _followed(targets: list, tail: int | str) -> Iterator[LogLine]:
    """Every container followed in its own thread, to its exit and then what the engine's follow
    left out there; their lines as they come."""
    lines: queue.Queue = queue.Queue()
    done = object()

    def follow(item) -> None:
        node, c = item

        def chunks(c):
            output = FollowedLog(c, tail=tail)
            yield from output.follow()
            yield from output.rest()

        try:
            for ln in _guarded(node, c, chunks):
                lines.put(ln)
        finally:
            lines.put(done)

    threads = [threading.Thread(target=follow, args=(t,), daemon=True) for t in targets]
    for t in threads:
        t.start()
    left = len(threads)
    while left:
        item = lines.get()
        if item is done:
            left -= 1
        else:
            yield item


def kept_logs(run_id: str, logs_dir: str, nodes: list[str] | None, ranks: dict[str, int | None]) -> Iterator[LogLine]:
    """Containers are gone (finished or downed): what `runner up` kept per node, if here. The node
    rank comes from the node's runner-status.json (or the kept/collected copy of it)."""
    root = Path(logs_dir) / run_id
    files = sorted(root.glob("*/container.log"))
    files = [f for f in files if not nodes or f.parent.name in nodes]
    if not files:
        raise UserError(f"run {run_id}: no containers left and no kept logs under {root}/; "
                        "per-rank logs are in the run dir: `runner collect`")
    for f in files:
        node = f.parent.name
        rank = ranks.get(node)
        if rank is None:
            try:  # the run dir's copy: the job could have written it, any shape and size
                doc = bounded_json.read(f.parent / "runner-status.json", max_bytes=1 << 20)
            except (OSError, ValueError):
                doc = None
            rank = doc.get("rank") if isinstance(doc, dict) else None
        shown = rank if isinstance(rank, int) and not isinstance(rank, bool) else "?"
        split = LineSplitter()
        for part in KeptLog.files(f):  # container.log.1 (when it rotated), then container.log
            with open(part, "rb") as fh:  # raw bytes as the job wrote them: cut and made visible here
                while chunk := fh.read(1 << 20):
                    for ln in split.feed(chunk):
                        yield LogLine(node, shown, ln)
        for ln in split.end():
            yield LogLine(node, shown, ln)
