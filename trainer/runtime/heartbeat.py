"""This rank's progress heartbeat (format and rule: contract/heartbeat.py, contract/hang.py).

The training loop and the layout's hooks call `mark(phase, ...)` as the rank moves through a step:
a tuple stored and a clock read, nothing else on the hot path (no file, no collective, no device
sync; on CUDA the phase is the host's view). A daemon thread rewrites OUTPUT_DIR/heartbeat/rank<R>.json
every `watch.heartbeat_s` from that tuple (temporary file + os.replace), also while the main thread
is blocked in C (a collective, a read: they release the GIL), so a reader tells a rank that waits
(its writer moves, its progress does not) from a stopped process (neither moves).

Time spent in waiting phases (contract.heartbeat.WAITING: pipeline recv/send, the step's
collectives, the end of a data-parallel backward where DDP/FSDP wait for their reductions) is
summed per step: a step's wait, the rest its compute, what the straggler report compares.

The same object sizes the process groups' timeouts (contract.hang.collective_timeout): the
start-up budget until the first steps are timed, then the steady one, and each checkpoint and
evaluation its own while it runs (dist_env.set_collective_timeout).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from contract import hang as rule
from contract import heartbeat as fmt

log = logging.getLogger("trainer")

WINDOWS = 20            # log windows whose median is the rank's step time
LONG_PHASES = ("checkpoint", "resume", "eval", "compile")


def _pid_start() -> int:
    """This process's start time in clock ticks since boot (how a reader knows a pid was not reused)."""
    try:
        return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


class HeartbeatWriter:
    """One per rank process (module-level CURRENT): the phase in memory, the file from a thread."""

    def __init__(self, output_dir: str | Path, rank: int, world_size: int, local_rank: int = 0,
                 interval_s: float = 1.0, hang_timeout_s: float | None = None, startup_s: float | None = None,
                 configured_timeout_s: float | None = None):
        self.path = fmt.path_of(output_dir, rank)
        self.rank, self.world_size, self.local_rank, self.interval = rank, world_size, local_rank, interval_s
        self.hang_timeout_s, self.startup_s, self.configured_timeout_s = hang_timeout_s, startup_s, configured_timeout_s
        self.node = (os.environ.get("NODE_NAME") or socket.gethostname())[:255]
        self.host, self.pid, self.pid_start = socket.gethostname()[:255], os.getpid(), _pid_start()
        now = time.perf_counter()
        self._state: tuple = ("init", None, None, None, "", now)  # phase, stage, mb, peer, detail, since
        self._progress = now
        self._waiting, self._wait_mark, self._wait_acc = False, now, 0.0
        self.step, self.mb = 0, 0
        self._step_t0: float | None = None
        self._wait_t0 = 0.0
        self.step_s: float | None = None
        self.wait_s: float | None = None
        self._win: list[float] = [0.0, 0.0, 0.0]   # step seconds, wait seconds, steps since the last log window
        self.window_step_s: float | None = None  # the last window's means (what log steps gather)
        self.window_wait_s: float | None = None
        self._windows: deque[float] = deque(maxlen=WINDOWS)
        self.windows_seen = 0
        self.median_step_s: float | None = None
        self.max_step_s: float | None = None
        self.first = False
        self.phase_units: int | None = None
        self._done_kinds: set[str] = set()
        self.ckpt_bytes: int | None = None
        self.work: int | None = None
        self.last_ckpt_s: float | None = None
        self.collective_timeout_s: float | None = None
        self.error, self.seq = "", 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False
        self._steady = False
        self._off = time.time() - time.perf_counter()

    # ------------------------------------------------------------ the hot path
    def mark(self, phase: str, stage: int | None = None, mb: int | None = None, peer: int | None = None,
             detail: str = "", units: int | None = None) -> None:
        now = time.perf_counter()
        if self._waiting:
            self._wait_acc += now - self._wait_mark
        self._waiting = phase in fmt.WAITING
        self._wait_mark = self._progress = now
        self.first, self.phase_units = False, units
        self._state = (phase, stage, mb, peer, detail, now)

    def restore(self, state: tuple) -> None:
        """Back to a phase saved from `_state` (after a wait or a nested phase): progress too."""
        self.mark(*state[:5])

    def step_start(self, step: int) -> None:
        self.step, self.mb = step, 0
        self._step_t0 = time.perf_counter()
        self._wait_t0 = self._current_wait(self._step_t0)

    def _current_wait(self, now: float) -> float:
        return self._wait_acc + (now - self._wait_mark if self._waiting else 0.0)

    def step_end(self) -> None:
        if self._step_t0 is None:
            return
        now = time.perf_counter()
        self.step_s = now - self._step_t0
        self.wait_s = self._current_wait(now) - self._wait_t0
        self._progress = now
        self._win[0] += self.step_s
        self._win[1] += self.wait_s
        self._win[2] += 1
        if self.step > rule.FIRST_STEPS and (not self._steady or self.step % 50 == 0):
            self.apply_timeout()  # leaving the first steps (once a median is known); then as it moves
            self._steady = self.median_step_s is not None

    def log_window(self, mean_step_s: float) -> tuple[float, float]:
        """At a log step (every rank): the device-synchronised mean step time of the window since
        the last one feeds the median; returns this window's host (step, wait) means per step."""
        self.windows_seen += 1
        self.max_step_s = max(self.max_step_s or 0.0, mean_step_s)
        if self.windows_seen > 1:  # the first window holds the compile
            self._windows.append(mean_step_s)
            self.median_step_s = statistics.median(self._windows)
        n = self._win[2]
        self.window_step_s = self._win[0] / n if n else None
        self.window_wait_s = self._win[1] / n if n else None
        self._win = [0.0, 0.0, 0.0]
        return self.window_step_s or 0.0, self.window_wait_s or 0.0

    # ------------------------------------------------------------ phases with their own budget
    @contextlib.contextmanager
    def during(self, phase: str, units: int | None = None) -> Iterator[None]:
        """A phase with its own budget (checkpoint, eval, resume, log, compile) around a block; the
        previous phase after it. Nested blocks of the same phase count once."""
        prev, prev_first, prev_units = self._state, self.first, self.phase_units
        outer = prev[0] != phase
        if outer:
            self.mark(phase, units=units)
            self.first = phase not in self._done_kinds
            if phase in LONG_PHASES:
                self.apply_timeout()
        t0 = time.perf_counter()
        yield  # an error leaves the phase as it is: where the rank was when it failed
        if outer:
            if phase == "checkpoint":
                self.last_ckpt_s = time.perf_counter() - t0
            self._done_kinds.add(phase)
            self.restore(prev)
            self.first, self.phase_units = prev_first, prev_units
            if phase in LONG_PHASES:
                self.apply_timeout()

    # ------------------------------------------------------------ budgets and timeouts
    def budget(self, phase: str | None = None) -> float | None:
        return rule.phase_budget(phase or self._state[0], self.step, median_step_s=self.median_step_s,
                                 max_step_s=self.max_step_s, first=self.first, phase_units=self.phase_units,
                                 ckpt_bytes=self.ckpt_bytes, last_ckpt_s=self.last_ckpt_s,
                                 hang_timeout_s=self.hang_timeout_s, startup_s=self.startup_s)

    def timeout_now(self) -> float:
        """The collective timeout the current phase calls for."""
        phase = self._state[0]
        budget = self.budget(phase if phase in LONG_PHASES else "forward") or 0.0
        steady = rule.steady_budget(self.median_step_s, self.hang_timeout_s) if self.median_step_s else None
        return rule.collective_timeout(budget, steady, self.configured_timeout_s)

    def apply_timeout(self, force: bool = False) -> None:
        """Every process group's timeout to timeout_now(), when it moved by more than 10% (or
        `force`: groups made since, which torch gives its own default)."""
        want = self.timeout_now()
        cur = self.collective_timeout_s
        if not force and cur is not None and abs(want - cur) <= 0.1 * cur:
            return
        from trainer.runtime import dist_env

        if dist_env.set_collective_timeout(want):
            self.collective_timeout_s = want

    # ------------------------------------------------------------ the file
    def record(self) -> dict[str, Any]:
        """The file's fields (contract.heartbeat.Heartbeat), built directly: the writer's thread
        holds the GIL for as short a time as it can."""
        phase, stage, mb, peer, detail, since = self._state
        wall = time.time()
        off = wall - time.perf_counter()
        if abs(off - self._off) > 0.01:  # the wall clock was set: follow it; else one offset, so an
            self._off = off              # unchanged progress time reads the same in every write
        off = self._off
        self.seq += 1
        return {"v": fmt.VERSION, "rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank,
                "node": self.node, "host": self.host, "pid": self.pid, "pid_start": self.pid_start, "step": self.step,
                "phase": phase, "phase_since": since + off, "progress_at": max(since, self._progress) + off,
                "alive_at": wall, "seq": self.seq, "stage": stage, "mb": mb, "peer": peer, "detail": detail,
                "first": self.first, "budget_s": self.budget(phase), "collective_timeout_s": self.collective_timeout_s,
                "steps_timed": len(self._windows), "step_s": self.step_s, "wait_s": self.wait_s,
                "median_step_s": self.median_step_s, "max_step_s": self.max_step_s, "phase_units": self.phase_units,
                "work": self.work, "ckpt_bytes": self.ckpt_bytes, "last_ckpt_s": self.last_ckpt_s,
                "heartbeat_s": self.interval, "error": self.error}

    def snapshot(self) -> fmt.Heartbeat:
        return fmt.Heartbeat(**self.record())

    def write(self) -> None:
        try:
            data = json.dumps(self.record()).encode()
            tmp = self.path.with_name(self.path.name + ".tmp")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except OSError as e:  # a full disk must not end the training; say it once
            if not self._warned:
                self._warned = True
                log.warning("heartbeat: cannot write %s (%s); the runner cannot follow this rank's progress",
                            self.path, e.strerror or e)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.write()

    def start(self) -> None:
        """The file and its writer (none with interval 0: phases, step times and timeouts still kept)."""
        if self.interval <= 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def stop(self, phase: str = "done", error: str = "") -> None:
        """The last word: done, or failed with one line of why; the writer thread ends."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.error = " ".join(error.split())[:300]
        self.mark(phase)
        if self.interval > 0:
            self.write()


# ---------------------------------------------------------------- the process's heartbeat

CURRENT: HeartbeatWriter | None = None


def start(writer: HeartbeatWriter) -> HeartbeatWriter:
    global CURRENT
    if CURRENT is not None:
        CURRENT.stop()
    CURRENT = writer
    writer.start()
    return writer


def stop(phase: str = "done", error: str = "") -> None:
    global CURRENT
    if CURRENT is not None:
        CURRENT.stop(phase, error)
        CURRENT = None


def mark(phase: str, stage: int | None = None, mb: int | None = None, peer: int | None = None,
         detail: str = "", units: int | None = None) -> None:
    hb = CURRENT
    if hb is not None:
        hb.mark(phase, stage, mb, peer, detail, units)


def step_start(step: int) -> None:
    if CURRENT is not None:
        CURRENT.step_start(step)


def step_end() -> None:
    if CURRENT is not None:
        CURRENT.step_end()


@contextlib.contextmanager
def during(phase: str, units: int | None = None) -> Iterator[None]:
    hb = CURRENT
    if hb is None:
        yield
        return
    with hb.during(phase, units):
        yield


def during_calls(phase: str, when: Callable[..., bool] | None = None) -> Callable:
    """Decorator: the function runs in `phase` (a checkpoint's save, a resume's load), or only
    those calls for which `when(*args, **kwargs)` is true (a finalize with something pending)."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if CURRENT is None or (when is not None and not when(*args, **kwargs)):
                return fn(*args, **kwargs)
            with during(phase):
                return fn(*args, **kwargs)
        return inner
    return wrap
