"""Watch a launched run: stream every container's output prefixed `[node/rank]` (lines cut at 64 KiB,
control characters made visible: runner/core/node_output.py; the raw bytes kept per node, 512 MiB at most), and fail fast: the first container exiting non-zero or node becoming unreachable stops
every other container of the run (one shared event, as Horovod's safe_shell_exec does). A rank that
stops making progress while its node still answers is a hang (runner/backends/ssh/hang_watch.py),
and so is one whose process outlives its last word (`done`) past the teardown budget while its
container runs (runner/backends/ssh/teardown.py): one line, every rank's stacks taken, then the
same failure path (Outcome.hung: exit 5)."""

from __future__ import annotations

import collections
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from runner.backends.beat_reader import stopping_line
from runner.backends.ssh import hang_watch, teardown
from runner.backends.ssh.node_runs import stop_run
from runner.core.fanout import DEFAULT_PARALLEL
from runner.core.node_output import KeptLog, LineSplitter, visible
from runner.planning.plan import Plan
from runner.transport.container_logs import FollowedLog
from runner.transport.ssh import Remote

log = logging.getLogger("runner.watch")
# A failed or lost node must have every other container of the run stopped within STOP_BUDGET_S.
# A lost node is noticed at most HEARTBEAT_S + HEARTBEAT_TIMEOUT_S after its last answer;
# what remains of the budget, less STOP_MARGIN_S for SIGKILL + remove over SSH, is the grace
# between SIGTERM and SIGKILL (at most FAIL_STOP_GRACE_S: after a failure the job is lost anyway).
STOP_BUDGET_S = 10.0
STOP_MARGIN_S = 3.0
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 4.0  # an SFTP stat; a busy Pi still answers in well under a second
FAIL_STOP_GRACE_S = 3


@dataclass
class Outcome:
    node: str
    rank: int
    exit_code: int | None = None
    error: str | None = None          # node unreachable / docker error
    last_lines: list[str] = field(default_factory=list)
    since: float = field(default_factory=time.time)  # when it happened (a lost node: last answer)
    lost: bool = False                # the node itself is unreachable (its container not stopped)
    yielded: bool = False             # not a failure: `yield_to` was set and the run was stopped for it
    detected: float | None = None     # when the watcher took it (time.time())
    hung: bool = False                # no progress past the hang timeout (error: the one line); stacks taken
    teardown: bool = False            # hung after every rank's last word: the training itself had ended

    @property
    def failed(self) -> bool:
        return self.error is not None or (self.exit_code or 0) != 0


class Watcher:
    """One thread per node (its log stream, then its exit code) and one heartbeat thread for all
    (pings go through a pool `workers` wide): ~2 threads a watched node with its SSH connection,
    where a thread each for logs, wait and heartbeat plus the Docker socket forwarders made ~11."""

    def __init__(self, remotes: dict[str, Remote], plan: Plan, log_dir: Path | None,
                 out: TextIO | None = None, tail_lines: int = 20, workers: int = DEFAULT_PARALLEL,
                 yield_to: threading.Event | None = None, hang_timeout_s: float | None = None,
                 watch_hangs: bool = True):
        self.remotes, self.plan, self.log_dir = remotes, plan, log_dir
        # Set from outside (an elastic run's lost node is back): stop the run with its grace period,
        # so the trainer writes its preempt checkpoint, and return an Outcome with yielded=True.
        self.yield_to = yield_to
        self.out = out or sys.stdout
        self.workers = workers
        self.tail: dict[str, collections.deque[str]] = {n.node: collections.deque(maxlen=tail_lines) for n in plan.nodes}
        self.events: queue.Queue[Outcome] = queue.Queue()
        self.stop = threading.Event()
        self.done: dict[str, Outcome] = {}
        self._print_lock = threading.Lock()
        self._node_threads: dict[str, threading.Thread] = {}
        self.last_ok: dict[str, float] = {}
        self.stopped_in: float | None = None  # seconds from the failure to the others stopped
        self.hang = hang_watch.HangWatch(remotes, plan, hang_timeout_s, workers) if watch_hangs else None
        self.stacks: dict[str, str] = {}      # a hang's stacks: node -> what the helper did
        # Set from outside (an elastic run whose trainer regroups in place): a lost node's outcome;
        # True when the others went on without it (watched on), False: stop the run as for any failure.
        self.on_lost: Callable[[Outcome], bool] | None = None
        # The same for a rank the hang watch named hung (its stacks taken): True when the others went on
        # without its node; False: stop the run as before.
        self.on_hung: Callable[[Outcome], bool] | None = None
        # Set from outside (the same, a lost node back): the NodePlans of the containers that joined the
        # running ranks, watched from then on; None: yield as without it (the restart path).
        self.on_back: Callable[[], list | None] | None = None
        self._gen: dict[str, int] = {}  # a node's container generation: the old one's late outcome is dropped

    # -- threads ---------------------------------------------------------------------------
    def _emit(self, prefix: str, node: str, line: str) -> None:
        self.tail[node].append(line)
        with self._print_lock:
            self.out.write(f"{prefix} {line}\n")
            self.out.flush()

    def _follow(self, np) -> None:
        """Stream the container's output until it ends (the container exited), then its exit code."""
        prefix = f"[{np.node}/{np.rank}]"
        fh, gen = None, self._gen.get(np.node, 0)
        if self.log_dir:
            kept = self.log_dir / np.node / "container.log"
            try:
                kept.parent.mkdir(parents=True, exist_ok=True)
                fh = KeptLog(kept)  # the bytes as the job wrote them, 2 x 256 MiB at most
            except OSError as exc:
                # This disk is full: the run goes on, its output shown. Before, the thread ended
                # here without an outcome and `up` waited on the node for ever.
                log.warning("%s: not kept (%s); the run goes on, and its output is still shown here and "
                            "kept on the node (`runner logs`)", kept, exc.strerror or exc)
        try:
            c = self.remotes[np.node].docker().containers.get(np.container)
            split = LineSplitter()
            output = FollowedLog(c)

            def show(chunks) -> None:
                for chunk in chunks:
                    if fh:
                        fh.write(chunk)
                    for line in split.feed(chunk):
                        self._emit(prefix, np.node, line)

            show(output.follow())
            res = c.wait(timeout=None)  # at once: the stream ends when the container does
            try:  # what the engine's follow left out at the exit (docker 20.10: runner/transport/container_logs.py)
                show(output.rest())
            except Exception as exc:  # noqa: BLE001 - the exit code is the outcome; the output may be short
                log.warning("[%s/%d] the end of its output may be missing here (%s); the trainer's own log, "
                            "logs/rank<r>.log, is in the node's run dir: `runner collect`", np.node, np.rank,
                            visible(str(exc).strip())[:300])
            for line in split.end():
                self._emit(prefix, np.node, line)
            if gen == self._gen.get(np.node, 0):
                self.events.put(Outcome(np.node, np.rank, exit_code=int(res.get("StatusCode", 1))))
        except Exception as exc:  # noqa: BLE001
            if not self.stop.is_set() and gen == self._gen.get(np.node, 0):
                first = visible((str(exc).strip().splitlines() or [type(exc).__name__])[0])[:300]
                self.events.put(Outcome(np.node, np.rank, error=f"lost contact with the engine: {first}",
                                        since=self.last_ok.get(np.node, time.time()), lost=True))
        finally:
            if fh:
                fh.close()

    def _heartbeat(self) -> None:
        """Every HEARTBEAT_S, a ping to each node still running whose last ping has answered."""
        now = time.time()
        for np in self.plan.nodes:
            self.last_ok[np.node] = now
        inflight: set[str] = set()
        lock = threading.Lock()

        def ping(np) -> None:
            r = self.remotes[np.node]
            try:
                if not r.alive:
                    raise ConnectionError("SSH connection closed")
                r.ping(HEARTBEAT_TIMEOUT_S)
                self.last_ok[np.node] = time.time()
            except Exception as exc:  # noqa: BLE001
                if not self.stop.is_set():
                    why = visible(str(exc).strip())[:300] or f"no answer within {HEARTBEAT_TIMEOUT_S:.0f}s"
                    self.events.put(Outcome(np.node, np.rank, error=f"node unreachable ({why})",
                                            since=self.last_ok[np.node], lost=True))
            finally:
                with lock:
                    inflight.discard(np.node)

        with ThreadPoolExecutor(max_workers=max(1, min(self.workers, len(self.plan.nodes))),
                                thread_name_prefix="heartbeat") as pool:
            while not self.stop.wait(HEARTBEAT_S):
                for np in self.plan.nodes:
                    with lock:
                        if np.node in self.done or np.node in inflight:
                            continue
                        inflight.add(np.node)
                    pool.submit(ping, np)

    def _watch_hangs(self) -> None:
        """Every hang_watch.POLL_S: every running node's heartbeats read, a straggler warned about
        once, and a hang handed to run() as an Outcome (it takes the stacks, then stops the run).
        The ranks of a node whose container has exited are ended for the rule (their last word may
        not have been read); a rank ended while its container still runs past the teardown budget
        is a hang too (runner/backends/ssh/teardown.py)."""
        hw = self.hang
        assert hw is not None
        try:
            while not self.stop.wait(hang_watch.POLL_S):
                if hw.regrouped.is_set():
                    hw.start_over()
                exited = set(self.done)
                hw.poll(skip=exited)
                hw.watch.exited(teardown.ranks_on(hw, exited))
                for line in hw.stragglers():
                    self._say(f"runner: warning: {line}")
                v = hw.verdict() or teardown.check(hw, self.remotes,
                                                   [np for np in self.plan.nodes if np.node not in exited])
                if v is not None and not self.stop.is_set():
                    node, rank = hw.culprit(v)
                    self.events.put(Outcome(node, rank, error=v.line, hung=True, teardown=v.teardown))
                    # the run stops, or (on_hung) goes on without that node: watched again from its new world
                    while not hw.regrouped.wait(hang_watch.POLL_S):
                        if self.stop.is_set():
                            return
        except Exception as exc:  # noqa: BLE001 - the watch is an aid: the run goes on without it
            log.warning("hang watch stopped: %s", visible(str(exc))[:300])
        finally:
            hw.close()

    def _say(self, line: str) -> None:
        with self._print_lock:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    # -- main loop -------------------------------------------------------------------------
    def start_streams(self) -> None:
        for np in self.plan.nodes:
            t = threading.Thread(target=self._follow, args=(np,), daemon=True, name=f"watch-{np.node}")
            t.start()
            self._node_threads[np.node] = t

    def run(self) -> Outcome | None:
        """Block until every container exits 0 (returns None) or one fails (returns it, after
        stopping every other container of the run). KeyboardInterrupt propagates to the caller."""
        if not self._node_threads:
            self.start_streams()
        threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat").start()
        if self.hang is not None:
            threading.Thread(target=self._watch_hangs, daemon=True, name="hang-watch").start()
        try:
            while len(self.done) < len(self.plan.nodes):
                if self.yield_to is not None and self.yield_to.is_set() and not self._take_back():
                    return self._yield()
                try:
                    ev = self.events.get(timeout=0.2)  # also how soon a node back is taken (yield_to)
                except queue.Empty:
                    continue
                if ev.node in self.done:
                    continue
                ev.detected = time.time()
                self.done[ev.node] = ev
                in_place = ev.hung and not ev.teardown and self.on_hung is not None
                if ev.hung:  # the stacks first, while every rank is still where it stuck
                    self._say(stopping_line(ev.error or "hang", f"going on without {ev.node} (elastic.in_place)"
                                            if in_place else "stopping the run"))
                    self.stacks = hang_watch.take_stacks(self.remotes, self.plan, skip=set(self.done) - {ev.node})
                if (ev.failed and ev.lost and self.on_lost is not None and self.on_lost(ev)) or \
                        (in_place and self.on_hung is not None and self.on_hung(ev)):
                    if self.hang is not None:  # a new world: the hang watch starts over on its files
                        self.hang.regrouped.set()
                    continue
                if ev.failed:
                    return self._fail(ev)
                log.info("[%s/%d] exited 0", ev.node, ev.rank)
            self._drain()
            return None
        finally:
            self.stop.set()

    def news(self) -> bool:
        """An outcome waiting in the queue for a node still watched (not one the loop has taken: a lost
        node's late word is none): what an in-place rejoin's wait for its newcomer gives way to."""
        with self.events.mutex:
            return any(ev.node not in self.done for ev in self.events.queue)

    def _take_back(self) -> bool:
        """Lost nodes back, joined in place by `on_back`: their new containers watched in the lost
        ones' places. False: none joined (yield)."""
        added = self.on_back() if self.on_back is not None else None
        if added is None:
            return False
        for np in added:
            self._gen[np.node] = self._gen.get(np.node, 0) + 1
            at = [i for i, old in enumerate(self.plan.nodes) if old.node == np.node]
            if at:
                self.plan.nodes[at[0]] = np
            else:
                self.plan.nodes.append(np)
            self.tail.setdefault(np.node, collections.deque(maxlen=20))
            self.last_ok[np.node] = time.time()
            self.done.pop(np.node, None)
            t = threading.Thread(target=self._follow, args=(np,), daemon=True, name=f"watch-{np.node}")
            t.start()
            self._node_threads[np.node] = t
        if self.hang is not None:  # a new world: the hang watch starts over on its files
            self.hang.regrouped.set()
        return True

    def _drain(self, timeout: float = 3.0) -> None:
        end = time.time() + timeout
        for t in self._node_threads.values():
            t.join(max(0.0, end - time.time()))

    def _yield(self) -> Outcome:
        self.stop.set()
        stopped, errors = stop_run(self.remotes, self.plan.run_id, grace=self.plan.grace_period, workers=self.workers)
        log.info("run %s: stopped on %s for a new layout (grace %.0fs)", self.plan.run_id, ", ".join(stopped),
                 self.plan.grace_period)
        for e in errors:
            log.warning("could not stop: %s", e)
        self._drain(1.0)
        return Outcome("", -1, yielded=True)

    def _fail(self, ev: Outcome) -> Outcome:
        self.stop.set()
        t0 = time.time()
        reachable = {k: v for k, v in self.remotes.items() if k != ev.node or not ev.lost}
        grace = fail_grace(t0 - ev.since)
        stopped, errors = stop_run(reachable, self.plan.run_id, grace=grace, workers=self.workers)
        self.stopped_in = time.time() - ev.since
        log.info("run %s: stopped the other containers on %s in %.1fs (grace %.0fs; %.1fs after the failure)",
                 self.plan.run_id, ", ".join(stopped) or "no node", time.time() - t0, grace, self.stopped_in)
        for e in errors:
            log.warning("could not stop: %s", e)
        self._drain(1.0)
        ev.last_lines = list(self.tail[ev.node])
        return ev


def fail_grace(elapsed: float) -> float:
    """SIGTERM-to-SIGKILL grace that still ends the stop within STOP_BUDGET_S of the failure."""
    return float(max(0, min(FAIL_STOP_GRACE_S, int(STOP_BUDGET_S - STOP_MARGIN_S - elapsed))))
