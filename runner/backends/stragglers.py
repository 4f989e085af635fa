"""The straggler warning every backend's watch prints (issue 57), from the heartbeats its hang watch
already reads (runner/backends/beat_reader.py): the SSH watch (runner/backends/ssh/hang_watch.py)
and an attached Slurm run's (runner/backends/slurm/hang.py) print the same one line.

Each heartbeat carries its rank's last step time, the part of it spent waiting for other ranks and
its work (forward + backward FLOPs per token of the part of the model it holds): once every rank
has ended a step since the last look, their busy times per unit of work go to
contract.hang.Stragglers (1.5x the others' median for 5 steps in a row). A rank is named once per
run, however often it lags again.
"""

from __future__ import annotations

from collections.abc import Mapping

from contract import hang as rule
from contract import heartbeat as fmt


class StragglerLines:
    """One per launch (a new world: `start_over`); `lines(seen)` after every read of the heartbeats."""

    def __init__(self, rank_node: Mapping[int, str] | None = None):
        # global rank -> node where the plan says it (SSH); else the node its heartbeat names (Slurm)
        self.rank_node = rank_node if rank_node is not None else {}
        self.start_over()
        self.warned: list[str] = []
        self._warned_ranks: set[int] = set()  # one line per straggler and run, however often it lags again

    def start_over(self) -> None:
        """A new world (an in-place regroup, a requeue): its ranks' steps count from the start again."""
        self.rule, self._step = rule.Stragglers(), 0

    def lines(self, watch: rule.Watch) -> list[str]:
        """Lines (without the `runner: warning: ` prefix) for the ranks that just became stragglers,
        from each rank's last heartbeat as the hang watch's rule keeps them."""
        world = watch.world_size or 0
        if world < 2 or sorted(watch.ranks) != list(range(world)):
            return []
        last: list[fmt.Heartbeat] = [watch.ranks[r].beat for r in range(world)]
        step = min(b.step for b in last)
        if step <= self._step or any(b.step_s is None or b.wait_s is None for b in last):
            return []
        self._step = step
        busy = rule.busy_times([b.step_s or 0.0 for b in last], [b.wait_s or 0.0 for b in last])
        work = [float(b.work or 0) for b in last] if all(b.work for b in last) else None
        out = []
        for r, ratio in self.rule.update(busy, work):
            if r in self._warned_ranks:
                continue
            self._warned_ranks.add(r)
            b = last[r]
            per = " per FLOP it computes" if work else ""
            out.append(f"straggler: rank {r} ({self.rank_node.get(r, b.node)}) computes {ratio:.1f}x slower "
                       f"than the other ranks' median{per} ({busy[r]:.3f} s busy of its {b.step_s or 0:.3f} s "
                       f"step) for {self.rule.windows} steps in a row: it holds the others back")
        self.warned += out
        return out
