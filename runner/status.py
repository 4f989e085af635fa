"""`runner ls`, `runner status [RUN]`, `runner logs [RUN]`: everything from container labels and the
nodes' run dirs, so any shell with the inventory can find a run (no local state)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time
from datetime import datetime, timezone

from rich.console import Console
from rich.table import Table

from runner.down import run_containers
from runner.errors import UserError
from runner.plan import LABEL_RANK, LABEL_RUN, LABEL_RUN_DIR
from runner.session import Cluster, add_inventory_args, load, parallel
from runner.ssh import Remote


def _runs_dir(remote: Remote) -> str:
    wd = remote.node.workdir
    return ("$HOME" + shlex.quote(wd[1:]) if wd.startswith("~") else shlex.quote(wd)) + "/runs"


def node_runs(remote: Remote) -> tuple[list, dict[str, dict]]:
    """(containers of any run, {run id: runner-status.json or {}}) on one node."""
    return run_containers(remote, None), node_run_dirs(remote)


def node_run_dirs(remote: Remote) -> dict[str, dict]:
    """{run id: runner-status.json or {}} for the run dirs on one node (one shell, no Docker API)."""
    res = remote.run(["sh", "-c", f"cd {_runs_dir(remote)} 2>/dev/null && for d in */; do d=${{d%/}}; "
                      f"printf '%s\\t' \"$d\"; cat \"$d/runner-status.json\" 2>/dev/null | tr -d '\\n'; echo; done"])
    dirs: dict[str, dict] = {}
    for line in res.out.splitlines():
        rid, _, doc = line.partition("\t")
        if not rid or rid == "*":
            continue
        try:
            dirs[rid] = json.loads(doc) if doc.strip() else {}
        except json.JSONDecodeError:
            dirs[rid] = {}
    return dirs


def gather(cl: Cluster, containers: bool = True) -> dict[str, tuple[list, dict[str, dict]]]:
    """{node: (containers, run dirs)} for every node that answered; the others are named on
    stderr, one line each, and left out (a dead node must not hide the live ones).
    containers=False lists run dirs only (collect: a run with files has a dir; the Docker API
    connection per node cost it a second)."""
    cl.warn_unreachable("left out")
    res = parallel([cl[n.name] for n in cl.reachable()],
                   node_runs if containers else (lambda r: ([], node_run_dirs(r))))
    out = {}
    for r, val, err in res:
        out[r.node.name] = val if err is None else ([], {})
        if err is not None:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            print(f"runner: warning: node {r.node.name}: {first} (left out)", file=sys.stderr)
    return out


def resolve_run(data: dict[str, tuple[list, dict]], run: str | None) -> str:
    ids = {c.labels.get(LABEL_RUN) for cs, _ in data.values() for c in cs} | {r for _, ds in data.values() for r in ds}
    ids.discard(None)
    if run:
        matches = [i for i in ids if i == run or i.startswith(run)]
        if len(matches) == 1 or run in matches:
            return run if run in matches else matches[0]
        raise UserError(f"run {run!r} not found on any node" if not matches else f"run {run!r} is ambiguous: {matches}")
    if not ids:
        raise UserError("no runs found on any node (no runner containers, no run dirs)")
    return max(ids)


def _uptime(c) -> str:
    st = c.attrs.get("State", {})
    if st.get("Running"):
        t = datetime.fromisoformat(st["StartedAt"][:26].rstrip("Z") + "+00:00") if st.get("StartedAt") else None
        return f"{(datetime.now(timezone.utc) - t).total_seconds():.0f}s" if t else "?"
    return "-"


def status_rows(cl: Cluster, data, run_id: str) -> list[dict]:
    rows = []
    for n in cl.inv.ordered():
        if n.name not in data:
            rows.append({"node": n.name, "rank": None, "state": "unreachable", "exit_code": None, "uptime": "-",
                         "last_metrics": None, "error": cl.unreachable.get(n.name)})
            continue
        containers, dirs = data[n.name]
        cs = [c for c in containers if c.labels.get(LABEL_RUN) == run_id]
        row = {"node": n.name, "rank": None, "state": "absent", "exit_code": None, "uptime": "-", "last_metrics": None}
        run_dir = None
        if cs:
            c = cs[0]
            row.update(rank=int(c.labels.get(LABEL_RANK, -1)), state=c.status,
                       exit_code=c.attrs.get("State", {}).get("ExitCode") if c.status == "exited" else None,
                       uptime=_uptime(c))
            run_dir = c.labels.get(LABEL_RUN_DIR)
        elif run_id in dirs:
            doc = dirs[run_id]
            row.update(rank=doc.get("rank"), state="finished" if doc else "no container",
                       exit_code=doc.get("exit_code"))
        if run_dir is None and run_id in dirs:
            run_dir = f"{_runs_dir(cl[n.name])}/{run_id}"
        if run_dir:
            m = cl[n.name].run(["sh", "-c", f"tail -n 1 {run_dir}/metrics.jsonl 2>/dev/null"]).out.strip()
            row["last_metrics"] = m or None
        rows.append(row)
    return rows


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="state of a run on every node")
    add_inventory_args(p)
    p.add_argument("run", nargs="?", help="run id or prefix (default: latest)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("ls", help="runs found on the nodes (container labels and run dirs)")
    add_inventory_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("logs", help="a run's container output, prefixed [node/rank]")
    add_inventory_args(p)
    p.add_argument("run", nargs="?", help="run id or prefix (default: latest)")
    p.add_argument("--node", action="append", help="only this node (repeatable)")
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("--tail", default="all", help="lines from the end per node (default all)")
    p.add_argument("--logs-dir", default="artifacts", help="where `runner up` kept logs (for finished runs)")
    p.set_defaults(func=cmd_logs)


def cmd_status(args) -> int:
    inv = load(args, with_job=False)
    with Cluster(inv, args.accept_new_host_keys, partial=True) as cl:
        data = gather(cl)
        run_id = resolve_run(data, args.run)
        rows = status_rows(cl, data, run_id)
    if args.json:
        print(json.dumps({"run_id": run_id, "nodes": rows}, indent=2))
        return 0
    t = Table(title=f"run {run_id}")
    for col in ("node", "rank", "state", "exit", "uptime", "last metrics"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(r["node"], str(r["rank"] if r["rank"] is not None else "-"), r["state"],
                  str(r["exit_code"] if r["exit_code"] is not None else "-"), r["uptime"], (r["last_metrics"] or "-")[:120])
    Console().print(t)
    return 0


def cmd_ls(args) -> int:
    inv = load(args, with_job=False)
    with Cluster(inv, args.accept_new_host_keys, partial=True) as cl:
        data = gather(cl)
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
        t.add_row(r["run_id"], states, str(r.get("result", "-")), ", ".join(r["nodes_with_dir"]) or "-")
    Console().print(t)
    return 0


def cmd_logs(args) -> int:
    inv = load(args, with_job=False)
    with Cluster(inv, args.accept_new_host_keys, partial=True) as cl:
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
            ranks = {node: doc[run_id].get("rank") for node, (_, doc) in data.items() if doc.get(run_id)}
            return _kept_logs(run_id, args, ranks)
        lock = threading.Lock()
        tail = args.tail if args.tail == "all" else int(args.tail)

        def show(item) -> None:
            node, c = item
            prefix = f"[{node}/{c.labels.get(LABEL_RANK, '?')}]"
            try:
                _show(prefix, c)
            except Exception as exc:  # noqa: BLE001 - a node lost mid-follow ends its stream, not the others
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                sys.stderr.write(f"runner: warning: {prefix} log stream ended: {first}\n")

        def _show(prefix: str, c) -> None:
            buf = b""
            out = c.logs(stream=True, follow=args.follow, tail=tail)
            for chunk in out if args.follow else [out if isinstance(out, bytes) else b"".join(out)]:
                buf += chunk
                *lines, buf = buf.split(b"\n")
                with lock:
                    for ln in lines:
                        sys.stdout.write(f"{prefix} {ln.decode(errors='replace')}\n")
                    sys.stdout.flush()
            if buf:
                sys.stdout.write(f"{prefix} {buf.decode(errors='replace')}\n")

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
            try:
                rank = json.loads((f.parent / "runner-status.json").read_text()).get("rank")
            except (OSError, ValueError):
                rank = None
        prefix = f"[{node}/{rank if rank is not None else '?'}]"
        for line in f.read_text(errors="replace").splitlines():
            sys.stdout.write(f"{prefix} {line}\n")
    return 0
