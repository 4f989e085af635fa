"""Inside a node's container: torchrun, whose closing barrier does not race its own store.

    python -m runner.agents.torchrun torchrun-args...

torchrun's agents meet once more when their workers are done (`_exit_barrier`): each adds itself
to a counter in the master agent's TCPStore, the last one sets a key, and all wait for that key.
The master agent hosts the store and leaves as soon as its own wait returns, so a worker node
whose wait reached the store a moment later (typically the last one in, which sets the key and
then waits) reads a closed connection: 40 lines of a C++ stack trace and "Error waiting on exit
barrier" at the end of a run that went well (pytorch/pytorch#69520; 4 of 20 runs of 3 agents here).

Mended: every agent says so in the store before it checks in at that barrier, and adds itself
to a second counter after it; the master agent (group rank 0, the store's host under the static
rendezvous every backend here uses) waits, at most ACK_TIMEOUT_S, until every agent that said so
has: by then none has a request left at the store. The barrier's end orders it: all who said so
did before the barrier let anyone through, so an agent of plain torchrun beside them (an older
image on one node) is not waited for. One that does not answer in time only costs that wait (the
old race, never a hang), and an agent whose store is already gone stays as quiet as it was.

Standard library only until torchrun starts (runs in the trainer image; see runner/agents/__init__.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

MENDED_KEY = "runner/exit-mended"  # agents that will acknowledge (added before the barrier)
ACK_KEY = "runner/exit-acks"       # agents that have (added after it)
ACK_TIMEOUT_S = 30.0
POLL_S = 0.01
log = logging.getLogger("runner.agents.torchrun")


def announce(store) -> None:
    """Before the exit barrier: this agent will acknowledge after it."""
    try:
        store.add(MENDED_KEY, 1)
    except Exception as e:  # noqa: BLE001 - no store, no barrier: the barrier reports it
        log.debug("runner: exit announcement: %s", e)


def acknowledge(store, rank: int, timeout: float = ACK_TIMEOUT_S,
                passthrough: tuple[type[BaseException], ...] = ()) -> bool:
    """After the exit barrier: count this agent in; the store's host (rank 0) waits for every agent
    that announced. True when all were counted (always, for the others). `passthrough`: what is
    raised on (torchrun's SignalException: `runner down` during the wait stops the agent as it
    would have stopped it in the barrier)."""
    try:
        count = store.add(ACK_KEY, 1)
        expected = store.add(MENDED_KEY, 0) if rank == 0 else 0
        deadline = time.monotonic() + timeout
        while count < expected:
            if time.monotonic() > deadline:
                log.warning("runner: %d of %d agents closed the exit barrier within %.0f s; leaving",
                            count, expected, timeout)
                return False
            time.sleep(POLL_S)
            count = store.add(ACK_KEY, 0)
    except passthrough:
        raise
    except Exception as e:  # noqa: BLE001 - the store's host left (it was not ours to keep)
        log.debug("runner: exit acknowledgement: %s", e)
        return rank != 0
    return True


def regrouped(run_dir: str | None = None) -> bool:
    """The workers left the layout the agents started in (trainer elastic.in_place: regroup.json of
    epoch 1 or later in OUTPUT_DIR): a lost node's agent never reaches the exit barrier, and one
    that waited for it would hold a finished run for exit_barrier_timeout (300 s)."""
    path = os.path.join(run_dir or os.environ.get("OUTPUT_DIR", "/out"), "regroup.json")
    try:
        with open(path, "rb") as fh:
            doc = json.loads(fh.read(1 << 16))
    except (OSError, ValueError, RecursionError):
        return False
    epoch = doc.get("epoch") if isinstance(doc, dict) else None
    return type(epoch) is int and epoch >= 1


def mend_exit_barrier() -> bool:
    """Wrap torchrun's agent's exit barrier with `acknowledge`. False where this torch has no such
    barrier (nothing changed)."""
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.multiprocessing import SignalException

    agent = getattr(api, "SimpleElasticAgent", None)
    original = getattr(agent, "_exit_barrier", None)
    if agent is None or original is None:
        return False
    if getattr(original, "mended_by_runner", False):
        return True

    def _exit_barrier(self) -> None:
        if regrouped():
            log.warning("runner: the workers regrouped in place (regroup.json); the agents' exit barrier "
                        "counts the old layout's nodes: not waited for")
            return
        announce(self._store)
        original(self)
        acknowledge(self._store, self._worker_group.group_rank, passthrough=(SignalException,))

    _exit_barrier.mended_by_runner = True  # type: ignore[attr-defined]  # a mark on the function: mended once
    agent._exit_barrier = _exit_barrier
    return True


def main(argv: list[str]) -> int:
    from torch.distributed import run as torchrun

    mend_exit_barrier()
    sys.argv = ["torchrun", *argv]
    torchrun.main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
