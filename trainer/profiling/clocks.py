"""Per-rank clocks and their offsets to rank 0, estimated by the trainer itself.

Each rank reads `time.perf_counter_ns()` (monotonic, fine-grained) mapped onto a wall-clock
epoch taken once at start-up. Different machines' epochs disagree (NTP is often off by
milliseconds on Raspberry Pis, sometimes by seconds), so at start-up every rank plays a
ping-pong with rank 0 over a gloo group and keeps the round with the smallest round trip
(NTP's estimate: the server's stamp sits halfway between the client's send and receive). The
error of that estimate is at most half the minimum round trip; it is logged.

Test hook: TRAINER_TEST_CLOCK_SKEW_NS="rank:ns[,rank:ns]" shifts the named rank's epoch, as a
badly synchronised node would be; the estimated offset then cancels it. Read only where the tests
switched their hooks on (trainer/runtime/hold.py test_env).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.runtime.hold import test_env

log = logging.getLogger("trainer")

SKEW_ENV = "TRAINER_TEST_CLOCK_SKEW_NS"
ROUNDS = 24


def injected_skew_ns(rank: int, environ: dict[str, str] | None = None) -> int:
    spec = test_env(SKEW_ENV, environ)
    for item in filter(None, (s.strip() for s in spec.split(","))):
        r, _, ns = item.partition(":")
        if int(r) == rank:
            return int(ns)
    return 0


@dataclass
class RankClock:
    """Local nanosecond clock; `offset_ns` maps it onto rank 0's clock (ref = local + offset)."""

    epoch_ns: int        # wall time at `perf0` (plus any injected skew)
    perf0: int
    offset_ns: int = 0
    error_ns: int = 0    # half the best round trip: bound on |estimated - true| offset

    @classmethod
    def start(cls, rank: int) -> RankClock:
        return cls(time.time_ns() + injected_skew_ns(rank), time.perf_counter_ns())

    def now(self) -> int:
        return self.epoch_ns + time.perf_counter_ns() - self.perf0

    def to_ref(self, local_ns: int) -> int:
        return local_ns + self.offset_ns


def estimate_offsets(clock: RankClock, group: dist.ProcessGroup | None, rounds: int = ROUNDS) -> None:
    """Ping-pong every rank against rank 0 (one at a time) and set `clock.offset_ns`.

    `group` must be a CPU-capable (gloo) group spanning the world; collective: every rank calls it.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    me, world = dist.get_rank(), dist.get_world_size()
    buf = torch.zeros(1, dtype=torch.int64)
    for peer in range(1, world):
        if me == 0:
            for _ in range(rounds):
                dist.recv(buf, src=peer, group=group)
                buf[0] = clock.now()
                dist.send(buf, dst=peer, group=group)
        elif me == peer:
            best_rtt, best_off = None, 0
            for _ in range(rounds):
                t0 = clock.now()
                dist.send(buf, dst=0, group=group)
                dist.recv(buf, src=0, group=group)
                t2 = clock.now()
                rtt, server = t2 - t0, int(buf[0])
                if best_rtt is None or rtt < best_rtt:
                    best_rtt, best_off = rtt, server - (t0 + t2) // 2
            clock.offset_ns, clock.error_ns = best_off, (best_rtt or 0) // 2
    offsets = [None] * world
    dist.all_gather_object(offsets, (clock.offset_ns, clock.error_ns), group=group)
    if me == 0:
        log.info("clock offsets to rank 0 (ms, +-error): %s", ", ".join(
            f"rank{r} {o / 1e6:+.3f}+-{e / 1e6:.3f}" for r, (o, e) in enumerate(offsets)))
