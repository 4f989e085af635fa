"""`runner ls`, `runner status [RUN]`, `runner logs [RUN]`: everything from container labels and the
nodes' run dirs, so any shell with the inventory can find a run (no local state)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from datetime import datetime, timezone

from rich.console import Console
from rich.table import Table
from rich.text import Text

from contract import bounded_json, metrics
from runner.backends.ssh.node_runs import gather, node_progress, resolve_run, run_doc
from runner.core.errors import UserError
from runner.core.node_output import KeptLog, LineSplitter, cells, visible
from runner.core.redact import printable
from runner.inventory.choice import add_inventory_args
from runner.planning.elastic import ELASTIC_FILE, EVENTS_MAX, parse_events, render_events
from runner.planning.paths import node_paths
from runner.planning.plan import LABEL_RANK, LABEL_ROLE, LABEL_RUN
from runner.transport.cluster import Cluster, open_nodes
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
    rows = []
    for n in cl.inv.ordered():
        if n.name not in data:
            rows.append({"node": n.name, "rank": None, "state": "unreachable", "exit_code": None, "uptime": "-",
                         "last_metrics": None, "progress": None, "error": cl.unreachable.get(n.name)})
            continue
        containers, dirs = data[n.name]
        cs = [c for c in containers if c.labels.get(LABEL_RUN) == run_id and LABEL_ROLE not in c.labels]
        row = {"node": n.name, "rank": None, "state": "absent", "exit_code": None, "uptime": "-", "last_metrics": None,
               "progress": None}
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
    return rows


def _console() -> Console:
    """A terminal's width, or 200 columns into a pipe (rich's 80 would wrap every row)."""
    c = Console()
    return c if c.is_terminal else Console(width=200)


def tail_lines(text: str) -> str | int:
    """argparse type for --tail: `all` or a count of lines."""
    if text == "all":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a number of lines or 'all', got {text!r}")
    return int(text)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="state of a run on every node")
    add_inventory_args(p)
    p.add_argument("run", nargs="?", help="run id or prefix (default: latest)")
    p.add_argument("--json", action="store_true", help="print the run's state per node as JSON")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("ls", help="runs found on the nodes (container labels and run dirs)")
    add_inventory_args(p)
    p.add_argument("--json", action="store_true", help="print the runs as JSON")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("logs", help="a run's container output, prefixed [node/rank]")
    add_inventory_args(p)
    p.add_argument("run", nargs="?", help="run id or prefix (default: latest)")
    p.add_argument("--node", action="append", help="only this node (repeatable)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the run ends")
    p.add_argument("--tail", default="all", type=tail_lines, help="lines from the end per node (default all)")
    p.add_argument("--logs-dir", default="artifacts", help="where `runner up` kept logs (for finished runs)")
    p.set_defaults(func=cmd_logs)


def cmd_status(args) -> int:
    with open_nodes(args) as cl:
        data = gather(cl)
        run_id = resolve_run(data, args.run)
        rows = status_rows(cl, data, run_id)
        history = elastic_history(cl, data, run_id)
    if args.json:
        print(json.dumps({"run_id": run_id, "nodes": rows, "elastic": history}, indent=2))
        return 0
    t = Table(title=Text(f"run {visible(run_id)}"))
    for col in ("node", "rank", "state", "exit", "uptime", "progress"):
        t.add_column(col, overflow="fold")
    for r in rows:
        prog = str(metrics.Progress(**r["progress"])) if r["progress"] else "-"
        t.add_row(*cells(r["node"], r["rank"] if r["rank"] is not None else "-", r["state"],
                          r["exit_code"] if r["exit_code"] is not None else "-", r["uptime"], prog))
    _console().print(t)
    if history:
        print("layout history (elastic):")
        for line in render_events(history):
            print(f"  {visible(line)}")
    return 0


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


def cmd_ls(args) -> int:
    with open_nodes(args) as cl:
        inv = cl.inv
        data = gather(cl, docs=True)
    runs: dict[str, dict] = {}
    for node, (containers, dirs) in data.items():
        for c in containers:
            rid = c.labels.get(LABEL_RUN)
            r = runs.setdefault(rid, {"run_id": rid, "containers": {}, "nodes_with_dir": []})
            r["containers"][node] = c.status
        for rid, doc in dirs.items():
            r = runs.setdefault(rid, {"run_id": rid, "containers": {}, "nodes_with_dir": []})
            r["nodes_with_dir"].append(node)
            if doc:
                r["result"] = doc.get("result")
    rows = sorted(runs.values(), key=lambda r: r["run_id"], reverse=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    t = Table(title=f"runs on {inv.path}")
    for col in ("run", "containers", "result", "run dirs on"):
        t.add_column(col)
    for r in rows:
        states = ", ".join(f"{n}:{s}" for n, s in r["containers"].items()) or "-"
        t.add_row(*cells(r["run_id"], states, r.get("result", "-"), ", ".join(r["nodes_with_dir"]) or "-"))
    _console().print(t)
    return 0


def cmd_logs(args) -> int:
    with open_nodes(args) as cl:
        data = gather(cl)
        run_id = resolve_run(data, args.run)
        targets = []
        for n in cl.reachable():
            if args.node and n.name not in args.node:
                continue
            for c in data[n.name][0]:
                if c.labels.get(LABEL_RUN) == run_id:
                    targets.append((n.name, c))
        if not targets:
            ranks = {node: run_doc(cl[node], run_id).get("rank") for node, (_, dirs) in data.items() if run_id in dirs}
            return _kept_logs(run_id, args, ranks)
        lock = threading.Lock()
        tail = args.tail

        def show(item) -> None:
            node, c = item
            label = c.labels.get(LABEL_RANK, c.labels.get(LABEL_ROLE, "?"))
            prefix = f"[{node}/{visible(str(label))[:20]}]"  # a label: the node's word
            try:
                _show(prefix, c)
            except Exception as exc:  # noqa: BLE001 - a node lost mid-follow ends its stream, not the others
                first = visible((str(exc).strip().splitlines() or [type(exc).__name__])[0])[:300]
                sys.stderr.write(f"runner: warning: {prefix} log stream ended: {first}\n")

        def _show(prefix: str, c) -> None:
            split = LineSplitter()

            def show_chunks(chunks) -> None:
                for chunk in chunks:
                    lines = split.feed(chunk)
                    if lines:
                        with lock:
                            sys.stdout.writelines(f"{prefix} {ln}\n" for ln in lines)
                            sys.stdout.flush()

            if args.follow:  # to the container's exit, then what the engine's follow left out there
                output = FollowedLog(c, tail=tail)
                show_chunks(output.follow())
                show_chunks(output.rest())
            else:
                show_chunks(log_chunks(c, follow=False, tail=tail))
            with lock:
                sys.stdout.writelines(f"{prefix} {ln}\n" for ln in split.end())

        if args.follow:
            threads = [threading.Thread(target=show, args=(t,), daemon=True) for t in targets]
            for t in threads:
                t.start()
            try:
                while any(t.is_alive() for t in threads):
                    time.sleep(0.2)
            except KeyboardInterrupt:
                return 130
        else:
            for t in targets:
                show(t)
    return 0


def _kept_logs(run_id: str, args, ranks: dict[str, int | None]) -> int:
    """Containers are gone (finished or downed): show what `runner up` kept per node, if here.
    The node rank comes from the node's runner-status.json (or the kept/collected copy of it)."""
    from pathlib import Path

    root = Path(args.logs_dir) / run_id
    files = sorted(root.glob("*/container.log"))
    files = [f for f in files if not args.node or f.parent.name in args.node]
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
        prefix = f"[{node}/{rank if isinstance(rank, int) else '?'}]"
        split = LineSplitter()
        for part in KeptLog.files(f):  # container.log.1 (when it rotated), then container.log
            with open(part, "rb") as fh:  # raw bytes as the job wrote them: cut and made visible here
                while chunk := fh.read(1 << 20):
                    sys.stdout.writelines(f"{prefix} {ln}\n" for ln in split.feed(chunk))
        sys.stdout.writelines(f"{prefix} {ln}\n" for ln in split.end())
    return 0
