"""`runner sandbox up|down|status`: the local cluster for trying the runner and for tests."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from runner.core.errors import UserError
from runner.sandbox.defaults import DEFAULT_BASE_ADDR, DEFAULT_PORT, DEFAULT_SLURM_BASE_ADDR, ROOT

SLURM_INVENTORY = "hosts/slurm-local.yaml"


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
    up.add_argument("--cpus", metavar="C0,C1,...",
                    help="CPUs per node (Docker --cpus of the job's container, e.g. 0.3,0.6,1.0; one value for all): "
                         "nodes of unequal speed")
    up.add_argument("--user", default=ROOT, metavar="NAME",
                    help="log in as this non-root account (made if missing; its group may use each node's engine, "
                         "as a Pi's pi user in the docker group); default root")
    up.add_argument("--netns", action="store_true",
                    help="each node in its own network namespace on a bridge (a real link: shapeable, cuttable)")
    up.add_argument("--link", metavar="RATE[,DELAY]",
                    help="shape every node's link, e.g. 100mbit or 1gbit (implies --netns; DELAY needs netem)")
    up.add_argument("--uplink", metavar="RATE[,DELAY]",
                    help="shape this machine's own link to the nodes, e.g. 100mbit (implies --netns)")
    up.add_argument("--light", action="store_true",
                    help="sshd-only nodes sharing this machine's engine (to measure many nodes; up to 128)")
    up.add_argument("--slurm", action="store_true",
                    help="a Slurm cluster instead (slurmctld + N slurmd + a login sshd; inventory "
                         f"{SLURM_INVENTORY}, login at {DEFAULT_SLURM_BASE_ADDR} unless --base-addr)")
    up.set_defaults(func=_up)
    down = ss.add_parser("down", help="stop every node's sshd, dockerd and containers")
    down.add_argument("--purge", action="store_true", help="also delete node data (images, workdirs)")
    down.set_defaults(func=_down)
    ln = ss.add_parser("link", help="cut or restore one node's link (--netns sandboxes): a real partition")
    ln.add_argument("node", help="node name, e.g. node-1")
    ln.add_argument("state", choices=("down", "up"), help="down: cut the link; up: restore it")
    ln.set_defaults(func=_link)
    st = ss.add_parser("status", help="show the nodes")
    st.add_argument("--json", action="store_true", help="print the nodes as JSON")
    st.set_defaults(func=_status)


def _up(args) -> int:
    if args.slurm:
        if args.user != ROOT:
            raise UserError("--user is for SSH sandbox nodes, not --slurm (its jobs run as root)")
        return _up_slurm(args)
    from runner.inventory.choice import remember_inventory
    from runner.sandbox.cluster import Sandbox

    cpus = parse_cpus(args.cpus, args.nodes)  # before anything starts
    net = {"link": args.link, "uplink": args.uplink} if (args.netns or args.link or args.uplink) else None
    sb = Sandbox(args.dir, args.base_addr, args.port, light=args.light, user=args.user, net=net)
    nodes = sb.up(args.nodes, Path(args.inventory), cpus)
    remember_inventory(args.inventory)
    for nd in nodes:
        print(f"{nd.name}  ssh {sb.user}@{nd.addr} -p {nd.port}  docker {nd.docker_host}  workdir {nd.workdir}")
    print(f"inventory: {args.inventory} (the default inventory of runner commands run here)")
    return 0


def _link(args) -> int:
    from runner.sandbox.cluster import Sandbox

    Sandbox(args.dir).set_link(args.node, args.state == "up")
    print(f"{args.node}: link {args.state}")
    return 0


def parse_cpus(text: str | None, nodes: int) -> list[float] | None:
    """`--cpus 0.3,0.6,1.0` -> one value per node (a single value is every node's)."""
    if text is None:
        return None
    try:
        vals = [float(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--cpus {text}: give numbers of CPUs separated by commas, e.g. 0.3,0.6,1.0") from None
    if len(vals) == 1:
        vals = vals * nodes
    if len(vals) != nodes:
        raise UserError(f"--cpus {text}: {len(vals)} values for {nodes} nodes; give one per node or one for all")
    most = os.cpu_count() or 1
    bad = [v for v in vals if not 0.01 <= v <= most]
    if bad:
        raise UserError(f"--cpus {text}: {bad[0]:g} is outside 0.01..{most} (Docker allows up to this machine's "
                        f"{most} CPUs)")
    return vals


def _up_slurm(args) -> int:
    from runner.inventory.choice import remember_inventory
    from runner.sandbox.slurm import SlurmSandbox

    base = DEFAULT_SLURM_BASE_ADDR if args.base_addr == DEFAULT_BASE_ADDR else args.base_addr
    inventory = SLURM_INVENTORY if args.inventory == "hosts/local.yaml" else args.inventory
    meta = SlurmSandbox(args.dir, base, args.port).up(args.nodes, Path(inventory))
    remember_inventory(inventory)
    print(f"slurm login  ssh root@{meta['login']} -p {meta['port']}  (SLURM_CONF={meta['conf']})")
    for i, addr in enumerate(meta["node_addrs"]):
        print(f"slurm node-{i}  NodeAddr {addr}  slurmd port {meta['slurmd_ports'][i]}")
    print(f"shared workdir: {meta['shared']}")
    print(f"inventory: {inventory} (the default inventory of runner commands run here)")
    return 0


def _down(args) -> int:
    from runner.sandbox.cluster import Sandbox
    from runner.sandbox.slurm import SlurmSandbox

    sb = Sandbox(args.dir)
    stopped = sb.down()
    if SlurmSandbox(args.dir).down():
        stopped.append("slurm cluster")
    print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
    if args.purge:
        import shutil
        from concurrent.futures import ThreadPoolExecutor

        # Each node's directory holds its engine's copy of the images (GBs of small files): removed
        # side by side, then what is left.
        node_dirs = [p for p in sb.state.glob("node-*") if p.is_dir()] if sb.state.is_dir() else []
        with ThreadPoolExecutor(max_workers=max(1, min(len(node_dirs), 8))) as pool:
            list(pool.map(lambda p: shutil.rmtree(p, ignore_errors=True), node_dirs))
        shutil.rmtree(sb.state, ignore_errors=True)
        shutil.rmtree(sb.run_root, ignore_errors=True)
        print(f"removed {sb.state}")
    return 0


def _status(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from runner.sandbox.cluster import Sandbox
    from runner.sandbox.slurm import SlurmSandbox

    rows = Sandbox(args.dir).status()
    slurm_rows = SlurmSandbox(args.dir).status()
    if args.json:
        print(json.dumps(rows + [{**r, "slurm": True} for r in slurm_rows], indent=2))
        return 0
    if slurm_rows:
        for r in slurm_rows:
            print(f"slurm {r['node']}  {r['address']}  {r['state']}")
        if not rows:
            return 0 if all(r["state"] not in ("down", "unknown") for r in slurm_rows) else 1
    if not rows:
        print("no sandbox nodes (run 'runner sandbox up --nodes N')")
        return 0
    netns = any("link" in r for r in rows)
    table = Table("node", "address", "user", "sshd", "dockerd", "images", "containers",
                  *(("link", "shaping") if netns else ()), "workdir")
    for r in rows:
        table.add_row(r["node"], r["address"], r["user"], "up" if r["sshd"] else "down",
                      r["dockerd"] if isinstance(r["dockerd"], str) else "up" if r["dockerd"] else "down",
                      str(r["images"] if r["images"] is not None else "-"),
                      str(r["containers"] if r["containers"] is not None else "-"),
                      *((r.get("link", "-"), r.get("shaping") or "-") if netns else ()), r["workdir"])
    Console().print(table)
    return 0 if all(r["sshd"] and r["dockerd"] for r in rows) else 1
