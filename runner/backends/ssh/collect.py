"""collect (`runner collect [RUN]`): mirror each node's run dir to artifacts/<run-id>/<node>/.

Incremental: a file whose size and mtime match the manifest and the local copy is skipped (mtimes
are copied). Verified: every transferred file's size and sha256 must equal what the node had
(runner/transport/digest.py); a file that does not match fails the collect naming node and file, and never
replaces a good local copy (it is unpacked into a staging dir and moved only once verified).
Files arrive as plain files of the caller's: owners, setuid/setgid and sticky bits from the node
are dropped (a container's root could otherwise plant a setuid-root file under artifacts/).

The bytes travel as one OpenSSH tar stream per batch (runner/transport/stream.py, watched for stalls: a node
that freezes mid-stream costs only its own files). Then runner/delivery/collect_report.py merges timelines, draws the
plots and prints a summary. None of that imports torch: the host has none.
"""

from __future__ import annotations

from pathlib import Path

from runner.backends.results import CollectReport
from runner.backends.ssh.node_runs import gather, resolve_run
from runner.delivery.collect_files import (
    NodeCollect,
    admit,
    fetch_listed,
    finish,
    list_node,
)
from runner.transport import stream
from runner.transport.cluster import Cluster


def collect(cl: Cluster, run_id: str, dest: Path, quiet: bool = False) -> tuple[list[NodeCollect], list[str]]:
    """Every node that answers, --parallel at a time: (results, one error string per failure). A
    node's failure never costs another node's files, nor the files this node already delivered.
    Every node lists first; the nodes whose files fit where they go together (keeping its reserve:
    runner/delivery/disk_room.py) are collected, and each other node is named with what it needs,
    nothing of it written."""
    out, errors, listed = [], [], []
    for r, val, err in cl.map([cl[n.name] for n in cl.reachable()], lambda r: list_node(r, run_id, dest)):
        if err is not None:
            errors.append(_failed(r.node.name, err))
        else:
            listed.append(val)
    admitted, refused = admit(listed, dest)
    errors += refused
    listings = {ls.remote.node.name: ls for ls in admitted}
    with stream.transfer_progress(quiet, eta=False) as progress:
        res = cl.map([cl[n] for n in listings], lambda r: fetch_listed(listings[r.node.name], progress))
    for r, val, err in res:
        if err is not None:
            errors.append(_failed(r.node.name, err))
        else:
            out.append(val)
            errors += [f"{val.node}: {e}" for e in val.errors]
    errors += [f"{node}: not reachable, nothing collected from it (rerun collect when it answers)"
               for node in cl.unreachable]
    return out, errors


def _failed(node: str, err: BaseException) -> str:
    return f"{node}: {str(err).removeprefix(f'node {node}: ')}"


def collect_run(backend, run: str | None, dest: str, plots: bool, quiet: bool) -> CollectReport:
    """collect of the run (id, prefix or the latest): every node's files, then merged and plotted
    (runner/delivery/collect_report.py) and summarised, what arrived even when a node did not."""
    with backend.cluster() as cl:
        run_id = resolve_run(gather(cl, containers=False), run)
        results, errors = collect(cl, run_id, Path(dest), quiet)
    return CollectReport(run_id=run_id, dest=Path(dest) / run_id, nodes=results, errors=errors,
                         summary=finish(Path(dest) / run_id, plots))
