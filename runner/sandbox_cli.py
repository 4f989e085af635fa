"""`runner sandbox up|down|status`: the local cluster for trying the runner and for tests."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from runner.sandbox import DEFAULT_BASE_ADDR, DEFAULT_PORT, Sandbox


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sandbox", help="local sandbox cluster: N nodes, each its own sshd + dockerd")
    p.add_argument("--dir", default=".sandbox", help="state directory (default: .sandbox)")
    ss = p.add_subparsers(dest="sandbox_cmd", metavar="ACTION", parser_class=type(p))
    ss.required = True
    up = ss.add_parser("up", help="start (or keep) N nodes and write their inventory")
    up.add_argument("--nodes", type=int, default=3, help="number of nodes (default 3)")
    up.add_argument("--inventory", default="hosts/local.yaml", help="inventory to write")
    up.add_argument("--base-addr", default=DEFAULT_BASE_ADDR, help="address of node 0 (127.0.0.x)")
    up.add_argument("--port", type=int, default=DEFAULT_PORT, help="sshd port on every node")
    up.set_defaults(func=_up)
    down = ss.add_parser("down", help="stop every node's sshd, dockerd and containers")
    down.add_argument("--purge", action="store_true", help="also delete node data (images, workdirs)")
    down.set_defaults(func=_down)
    st = ss.add_parser("status", help="show the nodes")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=_status)


def _up(args) -> int:
    sb = Sandbox(args.dir, args.base_addr, args.port)
    nodes = sb.up(args.nodes, Path(args.inventory))
    for nd in nodes:
        print(f"{nd.name}  ssh root@{nd.addr} -p {nd.port}  docker {nd.docker_host}  workdir {nd.workdir}")
    print(f"inventory: {args.inventory}")
    return 0


def _down(args) -> int:
    sb = Sandbox(args.dir)
    stopped = sb.down()
    print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
    if args.purge:
        import shutil
        shutil.rmtree(sb.state, ignore_errors=True)
        shutil.rmtree(sb.run_root, ignore_errors=True)
        print(f"removed {sb.state}")
    return 0


def _status(args) -> int:
    rows = Sandbox(args.dir).status()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no sandbox nodes (run 'runner sandbox up --nodes N')")
        return 0
    table = Table("node", "address", "sshd", "dockerd", "images", "containers", "workdir")
    for r in rows:
        table.add_row(r["node"], r["address"], "up" if r["sshd"] else "down", "up" if r["dockerd"] else "down",
                      str(r["images"] if r["images"] is not None else "-"),
                      str(r["containers"] if r["containers"] is not None else "-"), r["workdir"])
    Console().print(table)
    return 0 if all(r["sshd"] and r["dockerd"] for r in rows) else 1
