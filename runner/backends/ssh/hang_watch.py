"""The hang watch of `runner up` (issue 57): every node's heartbeat files read while the job runs,
contract/hang.py's rule applied, a stuck job named in one line and every rank's stacks taken
before anything is stopped; and, from the same files, one warning line per straggler.

Reading: each node's OUTPUT_DIR/heartbeat/rank<R>.json (contract/heartbeat.py) over a dedicated
SFTP session of its own (every answer whole within READ_TIMEOUT_S, or the session is dropped and
opened again at the next round: the link itself is the ping thread's to judge), POLL_S apart,
in a pool as wide as the watcher's; a listing of at most MAX_FILES entries. What a file must be to
be taken, and when it counts as this launch's, is the shared reader's (runner/backends/beat_reader.py,
also the Slurm watch's).

Stacks (contract/stacks.py): `python -m trainer.tools.stacks` as root in every node's container,
all nodes at once, within STACKS_TIMEOUT_S, before the watcher stops the run; they write
OUTPUT_DIR/hang-rank<R>.txt, which `runner collect` brings back.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TextIO

from contract import hang as rule
from contract import heartbeat as fmt
from contract import stacks as names
from runner.backends.beat_reader import POLL_S, STACKS_TIMEOUT_S, BeatReader, watched_sftp
from runner.backends.stragglers import StragglerLines
from runner.core.node_output import visible
from runner.planning.plan import Plan
from runner.transport.sftp import WatchedSFTP, close_quietly
from runner.transport.ssh import Remote

log = logging.getLogger("runner.watch")
__all__ = ["POLL_S", "HangWatch", "take_stacks", "world_of"]


def world_of(plan: Plan) -> tuple[int, dict[int, str]]:
    """The launch's world size and each global rank's node (node ranks in order, their nproc each)."""
    ranks: dict[int, str] = {}
    base = 0
    nproc = getattr(plan, "nproc_per_node", None) or {}
    for np in sorted(plan.nodes, key=lambda n: n.rank):
        for local in range(nproc.get(np.node, 1)):
            ranks[base + local] = np.node
        base += nproc.get(np.node, 1)
    return base, ranks


class HangWatch(BeatReader):
    """One per launch: `poll` reads every node once, `verdict` says whether the job is hung (a
    contract.hang.Verdict), `stragglers` the lines to warn with."""

    def __init__(self, remotes: dict[str, Remote], plan: Plan, hang_timeout_s: float | None,
                 workers: int = 8, clock: Callable[[], float] = time.monotonic):
        world, self.rank_node = world_of(plan)
        super().__init__(world, hang_timeout_s, clock)
        self.remotes, self.plan = remotes, plan
        self.workers = max(1, min(workers, len(plan.nodes)))
        self._sftp: dict[str, WatchedSFTP] = {}
        self.straggle = StragglerLines(self.rank_node)  # the warning lines, shared with Slurm's watch
        self.regrouped = threading.Event()  # set by the watcher: the ranks regrouped in place (a new world)

    # -- reading --------------------------------------------------------------------------------
    def _session(self, node: str) -> WatchedSFTP:
        s = self._sftp.get(node)
        if s is None or s.sock.closed:
            s = self._sftp[node] = watched_sftp(self.remotes[node], node)
        return s

    def read_node(self, node: str) -> list[fmt.Heartbeat]:
        """The heartbeats of one node's run dir that belong to this launch (see the module doc)."""
        return self.take_sftp(f"node {node}", self._session(node), f"{self.plan.node(node).run_dir}/{fmt.DIR}")

    def start_over(self) -> None:
        """After an in-place regroup: a new world of new rank numbers, its size not known here; every
        file is an earlier world's until it moves again, and the rule starts over (start-up budget)."""
        self.regrouped.clear()
        self.restart(None)
        self.straggle.start_over()

    def poll(self, skip: set[str] | frozenset[str] = frozenset()) -> int:
        """Read every node not in `skip` once (in parallel); the Watch updated. How many beats read."""
        nodes = [np.node for np in self.plan.nodes if np.node not in skip]
        got = 0
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="hang-watch") as pool:
            for node, fut in [(n, pool.submit(self.read_node, n)) for n in nodes]:
                try:
                    beats = fut.result()
                except Exception as exc:  # noqa: BLE001 - the link is the ping thread's to judge
                    log.debug("hang watch: %s: %s", node, exc)
                    s = self._sftp.pop(node, None)
                    if s is not None:
                        close_quietly(s.sock)
                    continue
                self.feed(beats)
                got += len(beats)
        return got

    def culprit(self, v: rule.Verdict) -> tuple[str, int]:
        """(node, the node's rank in the plan) of the first rank to blame."""
        r = v.culprits[0] if v.culprits else 0
        seen = self.watch.ranks.get(r)
        node = seen.beat.node if seen is not None and seen.beat.node in self.rank_node.values() else \
            self.rank_node.get(r, self.plan.nodes[0].node)
        return node, self.plan.node(node).rank

    # -- stragglers -----------------------------------------------------------------------------
    def stragglers(self) -> list[str]:
        """Lines for ranks that just became stragglers (runner/backends/stragglers.py)."""
        return self.straggle.lines(self.watch)

    @property
    def warned(self) -> list[str]:
        return self.straggle.warned

    def close(self) -> None:
        for s in self._sftp.values():
            close_quietly(s.sock)
        self._sftp.clear()


def take_stacks(remotes: dict[str, Remote], plan: Plan, skip: set[str] | frozenset[str] = frozenset(),
                timeout: float = STACKS_TIMEOUT_S, out: TextIO | None = None) -> dict[str, str]:
    """`python -m trainer.tools.stacks` as root in every node's container at once, before anything
    is stopped. Node -> one line of what it did (the helper's last line, or why not)."""
    results: dict[str, str] = {}

    def one(np) -> None:
        try:
            c = remotes[np.node].docker().containers.get(np.container)
            res = c.exec_run(list(names.HELPER), user=names.EXEC_FLAGS[1], demux=False)
            text = (res.output or b"")[:1 << 16].decode(errors="replace")
            lines = [visible(ln)[:300] for ln in text.splitlines() if ln.strip()]
            results[np.node] = f"exit {res.exit_code}: " + ("; ".join(lines[-8:]) or "no output")
        except Exception as exc:  # noqa: BLE001 - one node's failure must not keep the others' stacks
            results[np.node] = "not taken: " + visible((str(exc).strip().splitlines() or [type(exc).__name__])[0])[:300]

    threads = [threading.Thread(target=one, args=(np,), daemon=True, name=f"stacks-{np.node}")
               for np in plan.nodes if np.node not in skip]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    for np in plan.nodes:
        if np.node not in skip and np.node not in results:
            results[np.node] = f"not taken: no answer within {timeout:.0f} s"
    stream = out or sys.stderr
    for node, line in results.items():
        log.info("[%s] stacks: %s", node, line)
    taken = sum(1 for v in results.values() if v.startswith("exit 0"))
    stream.write(f"runner: stacks taken on {taken}/{len(results)} node(s) into hang-rank<R>.txt in each run dir "
                 f"(`runner collect {plan.run_id}`)"
                 + "".join(f"; {n}: {v}" for n, v in results.items() if not v.startswith("exit 0")) + "\n")
    stream.flush()
    return results
