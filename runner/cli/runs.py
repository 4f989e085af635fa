"""`runner status [RUN]`, `runner ls`, `runner logs [RUN]`: parsers, and the rendering of
runner.api's RunStatus (one schema, `--json`, on every backend: docs/run-status.md) and LogLines."""

from __future__ import annotations

import argparse
import json
import sys

from runner.cli.common import add_inventory_args, console, open_backend


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
    p.add_argument("--json", action="store_true", help="print the run's status as JSON (docs/run-status.md)")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("ls", help="runs found on the nodes (container labels and run dirs) or in the Slurm workdir")
    add_inventory_args(p)
    p.add_argument("--json", action="store_true", help="print the runs as a JSON list of run statuses")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("logs", help="a run's container output, prefixed [node/rank]")
    add_inventory_args(p)
    p.add_argument("run", nargs="?", help="run id or prefix (default: latest)")
    p.add_argument("--node", action="append", help="only this node (repeatable)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the run ends")
    p.add_argument("--tail", default="all", type=tail_lines, help="lines from the end per node (default all)")
    p.add_argument("--logs-dir", default=None,
                   help="(ssh) where `runner up` kept logs, for finished runs (default artifacts)")
    p.set_defaults(func=cmd_logs)


def cmd_status(args) -> int:
    st = open_backend(args, with_job=False).describe(args.run)
    if args.json:
        print(json.dumps(st.as_dict(), indent=2))
        return 0
    if st.backend == "slurm":
        _slurm_status(st)
    else:
        _node_table(st)
    return 0


def _node_table(st) -> None:
    from rich.table import Table
    from rich.text import Text

    from contract.metrics import Progress
    from runner.core.node_output import cells, visible

    t = Table(title=Text(f"run {visible(st.run_id)}"))
    for col in ("node", "rank", "state", "exit", "uptime", "progress", "step (wait)"):
        t.add_column(col, overflow="fold")
    for n in st.nodes:
        prog = str(Progress(**n.progress)) if n.progress else "-"
        t.add_row(*cells(n.node, n.rank if n.rank is not None else "-", n.state,
                         n.exit_code if n.exit_code is not None else "-", n.uptime or "-", prog,
                         _step_cell(n.step_times)))
    console().print(t)
    if st.elastic:
        from runner.planning.elastic import render_events

        print("layout history (elastic):")
        for line in render_events(st.elastic):
            print(f"  {visible(line)}")


def _step_cell(st: dict | None) -> str:
    """`0.412 s, 63% wait` (+ `, straggler 2.9x`): a node's step_times (issue 57); `-` without them."""
    if not st:
        return "-"
    text = f"{st['step_s']:.3f} s, {st['wait_share']:.0%} wait"
    return text + (f", straggler {st['slowness']:.1f}x" if st.get("straggler") else "")


def _slurm_status(st) -> None:
    from runner.core.node_output import visible

    ended = st.state not in ("pending", "running")
    exit_s = f", exit {st.exit_code}" if st.exit_code is not None and ended else ""
    why = f" ({st.reason})" if st.reason and st.reason != "None" else ""
    print(visible(f"run {st.run_id}: Slurm job {st.job_id} {st.native_state}{why}{exit_s}"
                  + (f", {st.run_time}" if st.run_time else "") + f"; submission {st.submissions}; run dir {st.run_dir}"))
    for n in st.nodes:
        print(f"  [{n.node}/{n.rank}]")
    if st.last_metrics:
        print(f"  last metrics: {visible(st.last_metrics[:160])}")


def cmd_ls(args) -> int:
    backend = open_backend(args, with_job=False)
    rows = backend.runs()
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
        return 0
    from rich.table import Table

    from runner.core.node_output import cells

    t = Table(title=f"runs on {backend.path}")
    for col in ("run", "state", "exit", "where"):
        t.add_column(col)
    for r in rows:
        where = (f"Slurm job {r.job_id or '-'} ({r.native_state}), submissions {r.submissions}" if r.backend == "slurm"
                 else ", ".join(f"{n.node}:{n.state}" for n in r.nodes) or "-")
        t.add_row(*cells(r.run_id, r.state, r.exit_code if r.exit_code is not None else "-", where))
    console().print(t)
    return 0


def cmd_logs(args) -> int:
    backend = open_backend(args, with_job=False)
    lines = backend.logs(args.run, nodes=args.node, follow=args.follow, tail=args.tail, logs_dir=args.logs_dir)
    try:
        for line in lines:
            sys.stdout.write(f"{line}\n")
            if args.follow:
                sys.stdout.flush()
    except KeyboardInterrupt:
        if args.follow:
            return 130
        raise
    return 0
