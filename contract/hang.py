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

Two hangs the phase budgets do not see:
- a frozen rank (`Watch.frozen`: its heartbeat writer silent past max(FROZEN_MIN_S, 5 of its
  intervals) while another rank's still moves: SIGSTOP, a process in D state, a C call holding the
  GIL) is a hang once the reader has seen it silent for the steady budget (`steady_budget`: the
  job's hang timeout, 120 s by default), whatever longer phase the other ranks are in. A frozen
  process writes no checkpoint: a rank inside one keeps its writer going (I/O releases the GIL),
  and a writer that is only starved (a 0.2-CPU container, swap) still runs once per
  `heartbeat_s`, far inside the steady budget. Silence counts only between reads that found the
  file unchanged (`Seen.read_at`): a node the reader cannot reach is no frozen rank.
- a teardown hang (`Watch.teardown`): every rank has said its last word (`done`/`failed`, or its
  process is known to have exited: `Watch.exited`) and a rank's process, or its container, or its
  Slurm job, as the reader sees it, still runs `teardown_budget` after the last rank's last word:
  max(TEARDOWN_MIN_S, the steady budget). The floor: torchrun's closing barrier may wait up to
  30 s for its agents (runner/agents/torchrun.py) and an interpreter exit on a swapping board takes
  seconds more; a final drain (a DiLoCo outer sync in flight) is one step's work, inside the steady
  budget. Ranks that end early wait for the others (a final barrier, the exit barrier): the clock
  starts at the last one's end.

Pure and torch-free: the trainer computes its heartbeat's `budget_s` and its process groups'
timeouts with it, the runner its hang verdicts and `--dry-run` line.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
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
TEARDOWN_MIN_S = 60.0        # least time from the last rank's `done` to its process's exit (module doc)
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


def teardown_budget(median_step_s: float | None, hang_timeout_s: float | None = None,
                    min_hang_s: float = MIN_HANG_S, floor_s: float = TEARDOWN_MIN_S) -> float:
    """Seconds a rank's process may live on after every rank's last word (module doc)."""
    return max(floor_s, steady_budget(median_step_s, hang_timeout_s, min_hang_s))


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
    read_at: float = 0.0         # ... when its file was last read (moved or not)
    ended_at: float | None = None  # ... when its last word (ENDED) was first read


@dataclass
class Verdict:
    """A hang: the ranks to blame, how long the job made no progress, the budget it exceeded."""
    culprits: list[int]
    stall_s: float
    budget_s: float
    line: str
    waiting: list[int] = field(default_factory=list)
    teardown: bool = False       # every rank had ended; the culprits' processes had not exited


class Watch:
    """Feed it every heartbeat read (`update`, with the reader's clock); `verdict` says whether the
    job is hung and whom to blame. Stall times combine the writer's own difference (alive_at -
    progress_at, one clock) with the reader's clock since the writer last moved: no clock of two
    machines is ever compared."""

    def __init__(self, hang_timeout_s: float | None = None, startup_s: float | None = None,
                 world_size: int | None = None, started: float = 0.0, min_hang_s: float = MIN_HANG_S,
                 teardown_min_s: float = TEARDOWN_MIN_S):
        self.hang_timeout_s, self.startup_s, self.min_hang_s = hang_timeout_s, startup_s, min_hang_s
        self.teardown_min_s = teardown_min_s  # tests lower it, as min_hang_s
        self.world_size, self.started = world_size, started
        self.ranks: dict[int, Seen] = {}
        self.gone: set[int] = set()   # ranks whose process is known to have exited (`exited`)

    def update(self, beat: Heartbeat, now: float) -> None:
        old = self.ranks.get(beat.rank)
        moved = old is None or (beat.seq, beat.alive_at, beat.pid) != (old.beat.seq, old.beat.alive_at, old.beat.pid)
        same = old is not None and old.beat.ended and old.beat.pid == beat.pid  # its last word, read again
        ended_at = old.ended_at if same and old is not None else None
        if beat.ended and ended_at is None:
            ended_at = now
        self.ranks[beat.rank] = Seen(beat, now if moved or old is None else old.alive_seen, now, ended_at)
        self.world_size = max(self.world_size or 0, beat.world_size)

    def exited(self, ranks: Iterable[int]) -> None:
        """Ranks whose process has ended (their node's container exited; its last word may never have
        been read): judged as ended from now on, by `verdict` and `teardown` alike."""
        self.gone.update(ranks)

    def ended(self, rank: int) -> bool:
        return rank in self.gone or (rank in self.ranks and self.ranks[rank].beat.ended)

    def silent_s(self, rank: int, now: float) -> float:
        return max(0.0, now - self.ranks[rank].alive_seen)

    def stall_s(self, rank: int, now: float) -> float:
        s = self.ranks[rank]
        return max(0.0, s.beat.alive_at - s.beat.progress_at) + self.silent_s(rank, now)

    def frozen(self, rank: int, now: float) -> bool:
        """Its writer stopped while another rank's still moves: the process itself is stopped."""
        limit = max(FROZEN_MIN_S, 5 * self.ranks[rank].beat.heartbeat_s)
        others = [r for r in self.ranks if r != rank and not self.ended(r)]
        return self.silent_s(rank, now) > limit and any(self.silent_s(r, now) <= limit for r in others)

    def budget(self, rank: int) -> float | None:
        return budget_of(self.ranks[rank].beat, self.hang_timeout_s, self.startup_s, self.min_hang_s)

    def steady(self, rank: int) -> float:
        return steady_budget(self.ranks[rank].beat.median_step_s, self.hang_timeout_s, self.min_hang_s)

    def verdict(self, now: float) -> Verdict | None:
        """None while the job progresses somewhere or every stall is within its budget, and no rank's
        process has been frozen for its steady budget (module doc)."""
        live = [r for r in self.ranks if not self.ended(r)]
        missing = [r for r in range(self.world_size or 0) if r not in self.ranks and r not in self.gone]
        if not live and not missing:
            return None
        budgets = [b for r in live if (b := self.budget(r)) is not None]
        budget = max(budgets + ([startup_budget(None, self.hang_timeout_s, self.startup_s)] if missing else []))
        stalls = [self.stall_s(r, now) for r in live] + ([now - self.started] if missing else [])
        stall = min(stalls)
        if stall <= budget:
            return self._stopped(live, now)
        culprits, why = self._blame(live, missing, now)
        waiting = sorted(r for r in live if r not in culprits and self.ranks[r].beat.waiting)
        return Verdict(culprits, stall, budget, self._line(culprits, why, waiting, stall, budget), waiting)

    def _stopped(self, live: list[int], now: float) -> Verdict | None:
        """Frozen ranks seen silent for their steady budget, however long the others' phases may
        last: the reader's own reads span the silence (read_at), so a node it could not read is none."""
        stopped = [r for r in live if self.frozen(r, now)
                   and self.ranks[r].read_at - self.ranks[r].alive_seen > self.steady(r)]
        if not stopped:
            return None
        stall = max(self.stall_s(r, now) for r in stopped)
        budget = min(self.steady(r) for r in stopped)
        silent = max(self.ranks[r].read_at - self.ranks[r].alive_seen for r in stopped)
        why = (f"its process is stopped or frozen (its heartbeat writer silent for {silent:.0f} s while the "
               f"others' run: a stopped process gets the steady budget, whatever phase the others are in)")
        waiting = sorted(r for r in live if r not in stopped and self.ranks[r].beat.waiting)
        return Verdict(stopped, stall, budget, self._line(stopped, why, waiting, stall, budget), waiting)

    def teardown(self, now: float, running: Iterable[int]) -> Verdict | None:
        """A teardown hang (module doc): every rank ended, and the ranks of `running` (whose process,
        container or job the reader sees still running) past `teardown_budget` since the last one
        ended. None otherwise; the phase rule (`verdict`) judges every rank not ended."""
        world = range(self.world_size or 0)
        if not world or not all(self.ended(r) for r in world):
            return None
        ends = [s.ended_at for r, s in self.ranks.items() if s.ended_at is not None and r not in self.gone]
        stuck = sorted(r for r in set(running) if r in self.ranks and r not in self.gone
                       and self.ranks[r].ended_at is not None)
        if not stuck or not ends:
            return None
        budget = max(teardown_budget(self.ranks[r].beat.median_step_s, self.hang_timeout_s, self.min_hang_s,
                                     self.teardown_min_s) for r in self.ranks)
        stall = now - max(ends)
        if stall <= budget:
            return None
        first = self.ranks[stuck[0]]
        since = now - (first.ended_at if first.ended_at is not None else now)
        parts = [f"rank {r} ({self.ranks[r].beat.node}, pid {self.ranks[r].beat.pid})" for r in stuck[:4]]
        more = f" and {len(stuck) - 4} more" if len(stuck) > 4 else ""
        did = "finished" if first.beat.phase == "done" else f"{first.beat.phase} at"
        whose = "its process has" if len(stuck) == 1 else "their processes have"
        line = (f"hang: {', '.join(parts)}{more} {did} step {first.beat.step} but {whose} not exited for "
                f"{since:.0f} s (teardown; budget {budget:.0f} s)")
        return Verdict(stuck, stall, budget, line, teardown=True)

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
    nothing to compare). `work`: what each rank computes (the trainer: its forward + backward FLOPs
    per token, trainer/runtime/progress.py compute_work), so pipeline stages of different sizes (the
    Pi guide's 7:14:7 layers, a last stage with the LM head) compare fairly and a slow node stands
    out; None: equal work (data-parallel replicas)."""
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
