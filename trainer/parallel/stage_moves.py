"""After a regroup: from which step the new layout resumes, and which rank sends which tensors where.
Pure (no torch): decided from what every survivor says it holds, the same on every rank.

Every pipeline rank keeps its own stage's state and a replica of the next stage's (ring order: the
last stage's replica is on the first), each in the last two versions (step numbers) that are whole
(trainer/parallel/stage_replicas.py). After a loss:

- `agree_step`: the newest step of which every OLD stage still has a whole copy somewhere among the
  survivors (its owner's, or the replica on the rank before it). None: some stage survived nowhere
  (two neighbours lost at once, a replica still in flight): the disk checkpoint is the fallback.
- `plan_moves`: what each NEW rank must hold (its new stage's tensor names) against what each holds
  whole at that step: a name it holds stays, any other comes from one holder, spread so that no
  holder sends much more than the others (by bytes where known).

Names are the full model's parameter names (stages.py keeps them whatever the split), so one name
means the same tensor in the old layout and the new.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class NoCopy(Exception):
    """Some state survived nowhere in memory: resume from the disk checkpoint instead."""


@dataclass(frozen=True)
class Held:
    """`rank` (in the new group) holds old stage `stage` whole as of `step`."""

    rank: int
    stage: int
    step: int


@dataclass(frozen=True)
class Move:
    """`src` sends the tensors of parameter `name` (and its optimizer state) to `dst` (new ranks)."""

    name: str
    src: int
    dst: int


def agree_step(held: Iterable[Held], stages: int) -> int | None:
    """The newest step at which each of the old layout's `stages` is held whole by someone, or None."""
    by_stage: dict[int, set[int]] = {s: set() for s in range(stages)}
    for h in held:
        if h.stage in by_stage:
            by_stage[h.stage].add(h.step)
    common = set.intersection(*by_stage.values()) if by_stage else set()
    return max(common) if common else None


def holdings_at(held: Iterable[Held], step: int, stage_names: Mapping[int, Iterable[str]]) -> dict[int, set[str]]:
    """Rank -> the names it holds whole at `step` (old stage s holds stage_names[s])."""
    out: dict[int, set[str]] = {}
    for h in held:
        if h.step == step:
            out.setdefault(h.rank, set()).update(stage_names[h.stage])
    return out


def plan_moves(need: Mapping[int, Iterable[str]], have: Mapping[int, set[str]],
               sizes: Mapping[str, int] | None = None) -> list[Move]:
    """The transfers that give every rank in `need` all its names: none for a name it has; else one
    from the holder that has sent the fewest bytes so far (ties: the lowest rank). Deterministic:
    every rank computes the same list. NoCopy names what no one holds."""
    sent: dict[int, int] = {r: 0 for r in have}
    moves: list[Move] = []
    missing: list[str] = []
    for dst in sorted(need):
        mine = have.get(dst, set())
        for name in sorted(set(need[dst])):
            if name in mine:
                continue
            holders = sorted(r for r, names in have.items() if name in names)
            if not holders:
                missing.append(name)
                continue
            src = min(holders, key=lambda r: (sent[r], r))
            sent[src] += (sizes or {}).get(name, 1)
            moves.append(Move(name, src, dst))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise NoCopy(f"no survivor holds {shown} in memory")
    return moves


def pairs(moves: Iterable[Move]) -> dict[tuple[int, int], list[str]]:
    """(src, dst) -> the names it carries, in one order both ends agree on (one message per pair)."""
    out: dict[tuple[int, int], list[str]] = {}
    for m in moves:
        out.setdefault((m.src, m.dst), []).append(m.name)
    return {k: sorted(v) for k, v in sorted(out.items())}
