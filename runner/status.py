"""`runner ls`, `runner status [RUN]`, `runner logs [RUN]`: everything from container labels and the
nodes' run dirs, so any shell with the inventory can find a run (no local state)."""

from __future__ import annotations

import argparse
import json
import posixpath
import stat
import sys
import threading
import time
from datetime import datetime, timezone

from rich.console import Console
from rich.table import Table
from rich.text import Text

from contract import metrics
from runner import runs
from runner.down import run_containers
from runner.errors import UserError
from runner.node_output import LineSplitter, cells, log_chunks, visible
from runner.paths import node_paths
from runner.perseus import LABEL_ROLE
from runner.plan import LABEL_RANK, LABEL_RUN
from runner.session import Cluster, add_inventory_args, load
from runner.ssh import Remote

METRICS_TAIL = 16384  # bytes read from the end of metrics.jsonl: the last records, for progress and ETA


STATUS_FILE = "runner-status.json"


def node_runs(remote: Remote, docs: bool = False) -> tuple[list, dict[str, dict | None]]:
    """(containers of any run, run dirs) on one node."""
    return run_containers(remote, None), node_run_dirs(remote, docs)


def node_run_dirs(remote: Remote, docs: bool = False) -> dict[str, dict | None]:
    """{run id: None} for the run dirs on one node, over SFTP (no shell: an exec costs the node a
    login); docs=True reads each one's runner-status.json ({} when it has none)."""
    try:
        entries = remote.sftp.listdir_attr(node_paths(remote.node, remote.home).runs)
    except OSError:
        return {}
    ids = sorted(e.filename for e in entries if stat.S_ISDIR(e.st_mode or 0) and runs.is_run_name(e.filename))
    return {rid: run_doc(remote, rid) if docs else None for rid in ids}


def run_doc(remote: Remote, run_id: str) -> dict:
    """The run's runner-status.json on the node ({} when it has none, or it does not parse)."""
    text = remote.read_text(posixpath.join(node_paths(remote.node, remote.home).run(run_id), STATUS_FILE))
    try:
        doc = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}
    return doc if isinstance(doc, dict) else {}


def gather(cl: Cluster, containers: bool = True, docs: bool = False) -> dict[str, tuple[list, dict[str, dict | None]]]:
    """{node: (containers, run dirs)} for every node that answered; the others are named on
    stderr, one line each, and left out (a dead node must not hide the live ones).
    containers=False lists run dirs only (collect: a run with files has a dir; the Docker API
    connection per node cost it a second)."""
    cl.warn_unreachable("left out")
    res = cl.map([cl[n.name] for n in cl.reachable()],
                 (lambda r: node_runs(r, docs)) if containers else (lambda r: ([], node_run_dirs(r, docs))))
    out = {}
    for r, val, err in res:
        out[r.node.name] = val if err is None else ([], {})
        if err is not None:
            first = visible((str(err).strip().splitlines() or [type(err).__name__])[0])[:300]
            print(f"runner: warning: node {r.node.name}: {first} (left out)", file=sys.stderr)
    return out


def resolve_run(data: dict[str, tuple[list, dict]], run: str | None) -> str:
    """The run `run` names, or the latest (runner/runs.py), among every container and run dir found."""
    ids = {c.labels.get(LABEL_RUN) for cs, _ in data.values() for c in cs} | {r for _, ds in data.values() for r in ds}
    return runs.resolve({i for i in ids if i}, run, "the nodes' run dirs and containers")


def node_progress(remote: Remote, run_dir: str) -> tuple[str | None, metrics.Progress | None]:
    """(last metrics.jsonl line, progress) of a run dir, over SFTP: no shell, nothing to quote."""
    try:
        with remote.sftp.open(posixpath.join(run_dir, metrics.FILE), "rb") as fh:
            size = fh.stat().st_size or 0
            fh.seek(max(0, size - METRICS_TAIL))
            text = fh.read(METRICS_TAIL).decode(errors="replace")  # however much the node says is there
    except OSError:
        return None, None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if size > METRICS_TAIL:
        lines = lines[1:]  # the first may be cut
    total = metrics.total_steps(plain_yaml(remote.read_text(posixpath.join(run_dir, "config.yaml"))))
    return (lines[-1] if lines else None), metrics.progress(metrics.parse("\n".join(lines)), total)


def plain_yaml(text: str | None) -> str | None:
    """text, unless it holds YAML aliases: a node's file is parsed only without them (a 1 KB alias
    bomb expands to gigabytes in yaml.safe_load). The trainer's own config.yaml has none."""
    import yaml

    if text is None or ("*" not in text and "&" not in text):  # no alias can be written without them
        return text
    try:
        return None if any(isinstance(t, yaml.AliasToken) for t in yaml.scan(text, yaml.SafeLoader)) else text
    except yaml.YAMLError:
        return None


def _label_int(value) -> int | None:
    """A label the node gave: an int, or None for anything else (never a traceback)."""
    return int(value) if isinstance(value, str) and value.isascii() and value.lstrip("-").isdigit() else None


def _uptime(c) -> str:
    st = c.attrs.get("State", {})
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
                       exit_code=c.attrs.get("State", {}).get("ExitCode") if c.status == "exited" else None,
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
    inv = load(args, with_job=False)
    with Cluster(inv, args.accept_new_host_keys, partial=True, workers=args.parallel) as cl:
        data = gather(cl)
        run_id = resolve_run(data, args.run)
        rows = status_rows(cl, data, run_id)
    if args.json:
        print(json.dumps({"run_id": run_id, "nodes": rows}, indent=2))
        return 0
    t = Table(title=Text(f"run {visible(run_id)}"))
    for col in ("node", "rank", "state", "exit", "uptime", "progress"):
        t.add_column(col, overflow="fold")
    for r in rows:
        prog = str(metrics.Progress(**r["progress"])) if r["progress"] else "-"
        t.add_row(*cells(r["node"], r["rank"] if r["rank"] is not None else "-", r["state"],
                          r["exit_code"] if r["exit_code"] is not None else "-", r["uptime"], prog))
    _console().print(t)
    return 0


def cmd_ls(args) -> int:
    inv = load(args, with_job=False)
    with Cluster(inv, args.accept_new_host_keys, partial=True, workers=args.parallel) as cl:
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
    inv = load(args, with_job=False)
    with Cluster(inv, args.accept_new_host_keys, partial=True, workers=args.parallel) as cl:
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
            for chunk in log_chunks(c, follow=args.follow, tail=tail):
                lines = split.feed(chunk)
                if lines:
                    with lock:
                        sys.stdout.writelines(f"{prefix} {ln}\n" for ln in lines)
                        sys.stdout.flush()
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
            try:
                rank = json.loads((f.parent / "runner-status.json").read_text()).get("rank")
            except (OSError, ValueError):
                rank = None
        prefix = f"[{node}/{rank if isinstance(rank, int) else '?'}]"
        split = LineSplitter()
        with open(f, "rb") as fh:  # raw bytes as the job wrote them: cut and made visible here
            while chunk := fh.read(1 << 20):
                sys.stdout.writelines(f"{prefix} {ln}\n" for ln in split.feed(chunk))
        sys.stdout.writelines(f"{prefix} {ln}\n" for ln in split.end())
    return 0
