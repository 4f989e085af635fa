"""A rank stuck after its last word, on the SSH backend (issue 57; the rule: contract/hang.py,
`Watch.teardown`). A rank whose heartbeat says `done` and whose process never exits (a
destroy_process_group that does not return, a thread joined for ever, NCCL's known teardown hangs)
keeps its container running, and `runner up` waited for it for ever: the heartbeats say ended, so
the phase rule has nothing to judge.

What the watch knows: which nodes' containers still run (runner/backends/ssh/watch.py: a node
whose container exited has its outcome). With several nodes that is not enough to blame a rank:
torchrun's agents meet at an exit barrier, so a node whose ranks all exited keeps its container
running while it waits for the stuck one's (up to torchrun's exit_barrier_timeout, 300 s). So once
the rule finds ranks of running containers ended past the budget, each running container is asked,
once, which of its ranks' processes still run: PROBE (`python -c`, the image's python, as the
container's user) reads /proc/<pid>/stat in the container's own pid namespace, where the
heartbeat's pid lives, and matches the start time the heartbeat recorded (a pid reused since is not
the rank). A container that does not answer within PROBE_TIMEOUT_S keeps all its ranks blamed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from contract import hang as rule
from contract import heartbeat as fmt
from runner.core.node_output import visible

log = logging.getLogger("runner.watch")
PROBE_TIMEOUT_S = 20.0
# argv: RANK:PID:START ...; prints the ranks whose process runs (not a zombie) with that start time.
PROBE = r"""
import sys
for arg in sys.argv[1:]:
    rank, pid, start = arg.split(":")
    try:
        with open("/proc/%s/stat" % pid) as f:
            st = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        continue
    if st[0] not in ("Z", "X") and (start == "0" or st[19] == start):
        print(rank)
"""


def pid_start(pid: int) -> int | None:
    """A process's start time as the heartbeat records it (/proc/<pid>/stat field 22), None when gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _planned(hw: Any) -> dict[int, str]:
    """The launch's rank -> node, while its world is the planned one (after an in-place regroup the
    ranks are numbered anew: only their heartbeats say where they run)."""
    return hw.rank_node if hw.world is not None else {}


def node_of(hw: Any, rank: int) -> str | None:
    """The node a rank runs on: its heartbeat's (NODE_NAME, the inventory's name), else the plan's."""
    seen, planned = hw.watch.ranks.get(rank), _planned(hw)
    if seen is not None and (seen.beat.node in hw.rank_node.values() or rank not in planned):
        return seen.beat.node
    return planned.get(rank)


def ranks_on(hw: Any, nodes: Iterable[str]) -> set[int]:
    """The ranks (seen, or planned) that run on `nodes`."""
    want = set(nodes)
    return {r for r in set(hw.watch.ranks) | set(_planned(hw)) if node_of(hw, r) in want}


def alive(remote: Any, container: str, beats: list[fmt.Heartbeat]) -> set[int] | None:
    """Ranks of `beats` whose process still runs in `container` (PROBE); None: the probe failed."""
    c = remote.docker().containers.get(container)
    res = c.exec_run(["python", "-c", PROBE, *(f"{b.rank}:{b.pid}:{b.pid_start}" for b in beats)], demux=False)
    text = (res.output or b"")[:1 << 16].decode(errors="replace")
    if res.exit_code != 0:
        log.info("teardown probe in %s: exit %s: %s", container, res.exit_code, visible(text.strip())[:300])
        return None
    asked = {b.rank for b in beats}
    return {int(x) for x in text.split() if x.isdigit()} & asked


def check(hw: Any, remotes: dict[str, Any], running: list[Any]) -> rule.Verdict | None:
    """The teardown verdict of the ranks in the `running` containers (NodePlans), their blame
    narrowed by the probe to the ranks whose processes still run (module doc)."""
    now = hw.clock()
    nodes = {np.node: np for np in running}
    v = hw.watch.teardown(now, ranks_on(hw, nodes))
    if v is None:
        return None
    found: dict[str, set[int] | None] = {}

    def one(node: str, beats: list[fmt.Heartbeat]) -> None:
        try:
            found[node] = alive(remotes[node], nodes[node].container, beats)
        except Exception as exc:  # noqa: BLE001 - not asked: its ranks stay blamed
            log.info("teardown probe on %s: %s", node, visible(str(exc))[:300])

    by_node: dict[str, list[fmt.Heartbeat]] = {}
    for r in v.culprits:
        node = node_of(hw, r)
        if node is not None and node in nodes:
            by_node.setdefault(node, []).append(hw.watch.ranks[r].beat)
    threads = [threading.Thread(target=one, args=item, daemon=True, name=f"teardown-{item[0]}")
               for item in by_node.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PROBE_TIMEOUT_S)
    blamed: set[int] = set()
    for node, beats in by_node.items():
        got = found.get(node)
        blamed |= {b.rank for b in beats} if got is None else got
    # No rank process left in any running container: torchrun itself did not end; its ranks stay blamed.
    return (hw.watch.teardown(now, blamed) if blamed else None) or v
