"""When a stalled rank is a hang, who is to blame, and who straggles: one rule for both wings.

The rule (`phase_budget`): a rank may go without progress (contract/heartbeat.py) for
- in steady state: the larger of MIN_HANG_S (120 s) and STEP_FACTOR (10) x the median step time,
  or the job's own `hang_timeout` (runner `--hang-timeout` / `job.hang_timeout`, trainer
  `watch.hang_timeout_s`) when one is given;
- during the first FIRST_STEPS (3) steps and everything before them (rendezvous, model build,
  resume, torch.compile: phases init, build, resume, compile) and the first eval or checkpoint of
  the process: STARTUP_S (900 s, `watch.startup_timeout_s`), or more when the steps seen so far
  were longer (10 x the longest);
- a checkpoint write or read: the larger of CHECKPOINT_MIN_S (600 s), the steady budget,
  5 x the previous write and the rank's bytes at SLOW_WRITE_BPS (10 MB/s, a slow SD card);
- a phase that holds several steps' work (a log step's device sync: the steps since the last
  one; an evaluation: its batches): 10 x the median step for each.
A long first compile or a large checkpoint is never a hang by this rule: the heartbeat says which
phase the rank is in, and the phase brings its own budget.

The job is hung when no rank has made progress for longer than the largest budget among its
ranks' phases (`Watch.verdict`): a rank waiting in a recv for a peer that compiles is covered by
the peer's budget. The collective timeout (`collective_timeout`) is that budget plus a grace
(half of it, at least GRACE_MIN_S), so where a runner watches, it names the hang and takes
the stacks before any collective gives up; where none watches (compose, Slurm), the collective
ends the job by itself, in minutes rather than torch's default 30.

Pure and torch-free: the trainer computes its heartbeat's `budget_s` and its process groups'
timeouts with it, the runner its hang verdicts and `--dry-run` line.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from contract.heartbeat import ENDED, ORDER, STARTUP, Heartbeat

MIN_HANG_S = 120.0
STEP_FACTOR = 10.0
FIRST_STEPS = 3
STARTUP_S = 900.0
CHECKPOINT_MIN_S = 600.0
CHECKPOINT_FACTOR = 5.0
SLOW_WRITE_BPS = 10e6
GRACE_MIN_S = 60.0
FROZEN_MIN_S = 3.0           # a writer silent this long (and 5 of its intervals) is a stopped process
STRAGGLER_FACTOR = 1.5
STRAGGLER_WINDOWS = 5        # consecutive log steps over the factor before one warning
EXIT_STALLED = 124           # the trainer's exit code when one of its collectives timed out


def steady_budget(median_step_s: float | None, hang_timeout_s: float | None = None,
                  min_hang_s: float = MIN_HANG_S) -> float:
    if hang_timeout_s:
        return float(hang_timeout_s)
    return max(min_hang_s, STEP_FACTOR * (median_step_s or 0.0))


def startup_budget(max_step_s: float | None = None, hang_timeout_s: float | None = None,
                   startup_s: float | None = None) -> float:
    return max(startup_s or STARTUP_S, hang_timeout_s or 0.0, STEP_FACTOR * (max_step_s or 0.0))


def checkpoint_budget(steady_s: float, ckpt_bytes: int | None, last_ckpt_s: float | None) -> float:
    return max(CHECKPOINT_MIN_S, steady_s, CHECKPOINT_FACTOR * (last_ckpt_s or 0.0),
               (ckpt_bytes or 0) / SLOW_WRITE_BPS)


def phase_budget(phase: str, step: int, *, median_step_s: float | None = None, max_step_s: float | None = None,
                 first: bool = False, phase_units: int | None = None, ckpt_bytes: int | None = None,
                 last_ckpt_s: float | None = None, hang_timeout_s: float | None = None,
                 startup_s: float | None = None, min_hang_s: float = MIN_HANG_S) -> float | None:
    """Seconds the rank may spend in `phase` without progress; None once it has ended. `min_hang_s`
    is the steady floor (tests lower it to see the step-time part of the rule at work)."""
    if phase in ENDED:
        return None
    steady = steady_budget(median_step_s, hang_timeout_s, min_hang_s)
    start = startup_budget(max_step_s, hang_timeout_s, startup_s)
    early = phase in STARTUP or step <= FIRST_STEPS or median_step_s is None
    if phase in ("checkpoint", "resume"):
        ckpt = checkpoint_budget(steady, ckpt_bytes, last_ckpt_s)
        return max(ckpt, start) if early or first else ckpt
    budget = start if early or first else steady
    if phase_units and median_step_s:
        budget = max(budget, STEP_FACTOR * median_step_s * phase_units)
    return budget


def budget_of(beat: Heartbeat, hang_timeout_s: float | None = None, startup_s: float | None = None,
              min_hang_s: float = MIN_HANG_S) -> float | None:
    """phase_budget of a heartbeat, with the reader's own hang timeout when it has one."""
    return phase_budget(beat.phase, beat.step, median_step_s=beat.median_step_s, max_step_s=beat.max_step_s,
                        first=beat.first, phase_units=beat.phase_units, ckpt_bytes=beat.ckpt_bytes,
                        last_ckpt_s=beat.last_ckpt_s, hang_timeout_s=hang_timeout_s, startup_s=startup_s,
                        min_hang_s=min_hang_s)


def collective_timeout(budget_s: float, steady_s: float | None = None, configured_s: float | None = None) -> float:
    """A process group's timeout while a rank's phase has `budget_s`: the budget plus its grace; with a
    configured timeout (`parallel.timeout_s` N), N in steady state and max(N, budget) in longer phases."""
    if configured_s:
        return float(configured_s) if steady_s is not None and budget_s <= steady_s else max(configured_s, budget_s)
    return budget_s + max(GRACE_MIN_S, 0.5 * budget_s)


def describe(hang_timeout_s: float | None = None, startup_s: float | None = None,
             configured_s: float | None = None) -> str:
    """One line for `trainer --dry-run` and `runner up --dry-run`."""
    steady = (f"{hang_timeout_s:g} s (set)" if hang_timeout_s else
              f"auto = max({MIN_HANG_S:g} s, {STEP_FACTOR:g} x the median step)")
    start = startup_budget(None, hang_timeout_s, startup_s)
    coll = (f"{configured_s:g} s (parallel.timeout_s), longer phases max({configured_s:g} s, their budget)"
            if configured_s else f"each budget + max({GRACE_MIN_S:g} s, 50%)")
    return (f"hang timeout {steady} once {FIRST_STEPS} steps are timed; first steps, compile and the first "
            f"eval/checkpoint {start:g} s; checkpoint writes max({CHECKPOINT_MIN_S:g} s, "
            f"{CHECKPOINT_FACTOR:g} x the last, size at {SLOW_WRITE_BPS / 1e6:g} MB/s); collectives give up "
            f"after {coll}")


# ------------------------------------------------------------------ the reader: stalls and blame

@dataclass
class Seen:
    beat: Heartbeat
    alive_seen: float            # the reader's clock when the rank's writer was last seen to move


@dataclass
class Verdict:
    """A hang: the ranks to blame, how long the job made no progress, the budget it exceeded."""
    culprits: list[int]
    stall_s: float
    budget_s: float
    line: str
    waiting: list[int] = field(default_factory=list)


class Watch:
    """Feed it every heartbeat read (`update`, with the reader's clock); `verdict` says whether the
    job is hung and whom to blame. Stall times combine the writer's own difference (alive_at -
    progress_at, one clock) with the reader's clock since the writer last moved: no clock of two
    machines is ever compared."""

    def __init__(self, hang_timeout_s: float | None = None, startup_s: float | None = None,
                 world_size: int | None = None, started: float = 0.0, min_hang_s: float = MIN_HANG_S):
        self.hang_timeout_s, self.startup_s, self.min_hang_s = hang_timeout_s, startup_s, min_hang_s
        self.world_size, self.started = world_size, started
        self.ranks: dict[int, Seen] = {}

    def update(self, beat: Heartbeat, now: float) -> None:
        old = self.ranks.get(beat.rank)
        moved = old is None or (beat.seq, beat.alive_at, beat.pid) != (old.beat.seq, old.beat.alive_at, old.beat.pid)
        self.ranks[beat.rank] = Seen(beat, now if moved or old is None else old.alive_seen)
        self.world_size = max(self.world_size or 0, beat.world_size)

    def silent_s(self, rank: int, now: float) -> float:
        return max(0.0, now - self.ranks[rank].alive_seen)

    def stall_s(self, rank: int, now: float) -> float:
        s = self.ranks[rank]
        return max(0.0, s.beat.alive_at - s.beat.progress_at) + self.silent_s(rank, now)

    def frozen(self, rank: int, now: float) -> bool:
        """Its writer stopped while another rank's still moves: the process itself is stopped."""
        limit = max(FROZEN_MIN_S, 5 * self.ranks[rank].beat.heartbeat_s)
        others = [r for r in self.ranks if r != rank and not self.ranks[r].beat.ended]
        return self.silent_s(rank, now) > limit and any(self.silent_s(r, now) <= limit for r in others)

    def budget(self, rank: int) -> float | None:
        return budget_of(self.ranks[rank].beat, self.hang_timeout_s, self.startup_s, self.min_hang_s)

    def verdict(self, now: float) -> Verdict | None:
        """None while the job progresses somewhere or every stall is within its budget."""
        live = [r for r, s in self.ranks.items() if not s.beat.ended]
        missing = [r for r in range(self.world_size or 0) if r not in self.ranks]
        if not live and not missing:
            return None
        budgets = [b for r in live if (b := self.budget(r)) is not None]
        budget = max(budgets + ([startup_budget(None, self.hang_timeout_s, self.startup_s)] if missing else []))
        stalls = [self.stall_s(r, now) for r in live] + ([now - self.started] if missing else [])
        stall = min(stalls)
        if stall <= budget:
            return None
        culprits, why = self._blame(live, missing, now)
        waiting = sorted(r for r in live if r not in culprits and self.ranks[r].beat.waiting)
        return Verdict(culprits, stall, budget, self._line(culprits, why, waiting, stall, budget), waiting)

    def _blame(self, live: list[int], missing: list[int], now: float) -> tuple[list[int], str]:
        if missing:
            return missing, "it never wrote a heartbeat"
        frozen = [r for r in live if self.frozen(r, now)]
        if frozen:
            return frozen, "its process is stopped or frozen (its heartbeat writer stopped too)"
        busy = [r for r in live if not self.ranks[r].beat.waiting]
        pool = busy or live
        def place(r: int) -> tuple[int, int]:
            b = self.ranks[r].beat
            return b.step, ORDER.get(b.phase, 5)
        behind = min(place(r) for r in pool)
        culprits = sorted(r for r in pool if place(r) == behind)
        if busy:
            return culprits, "it has not left this phase while the others wait for it"
        return culprits, "every rank waits (a link, or ranks in different collectives); these are furthest behind"

    def _line(self, culprits: list[int], why: str, waiting: list[int], stall: float, budget: float) -> str:
        parts = []
        for r in culprits[:4]:
            s = self.ranks.get(r)
            parts.append(f"rank {r} ({s.beat.node}, pid {s.beat.pid}) at {s.beat.where()}" if s
                         else f"rank {r}")
        more = f" and {len(culprits) - 4} more" if len(culprits) > 4 else ""
        wait = f" (waiting: ranks {_ranges(waiting)})" if waiting and len(culprits) < 2 else ""
        return (f"hang: {', '.join(parts)}{more}: no progress for {stall:.0f} s (budget {budget:.0f} s); "
                f"{why}{wait}")


def _ranges(ranks: list[int]) -> str:
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


# ------------------------------------------------------------------ stragglers

def busy_times(step_s: list[float], wait_s: list[float]) -> list[float]:
    """Per rank, the part of a step it spent computing (its step time less its waits)."""
    return [max(0.0, s - w) for s, w in zip(step_s, wait_s, strict=True)]


def slowness(busy: list[float], work: list[float] | None = None) -> list[float]:
    """Each rank's busy time per unit of its work over the median of the other ranks' (1.0 with
    nothing to compare). `work`: what each rank computes (the trainer: its parameters outside
    embedding tables), so pipeline stages of different sizes (the Pi guide's 7:14:7 layers) compare
    fairly and a slow node stands out; None: equal work (data-parallel replicas)."""
    rate = [b / w if w and w > 0 else b for b, w in zip(busy, work or [1.0] * len(busy), strict=True)]
    out = []
    for r, x in enumerate(rate):
        others = [y for i, y in enumerate(rate) if i != r and y > 0]
        med = statistics.median(others) if others else 0.0
        out.append(x / med if med > 0 else 1.0)
    return out


class Stragglers:
    """A rank `factor` x slower than the median of the others for `windows` log steps in a row is a
    straggler: `update` returns the ranks that just became one (warn once), `current` all of them."""

    def __init__(self, factor: float = STRAGGLER_FACTOR, windows: int = STRAGGLER_WINDOWS):
        self.factor, self.windows = factor, windows
        self.runs: dict[int, int] = {}

    def update(self, busy: list[float], work: list[float] | None = None) -> list[tuple[int, float]]:
        new = []
        for r, x in enumerate(slowness(busy, work)):
            self.runs[r] = self.runs.get(r, 0) + 1 if x >= self.factor else 0
            if self.runs[r] == self.windows:
                new.append((r, x))
        return new

    def current(self) -> list[int]:
        return sorted(r for r, n in self.runs.items() if n >= self.windows)
