"""The hang watch of an attached `runner up --scheduler slurm` (issue 57), the SSH watch's rule on
Slurm: while the runner follows the job, every rank's OUTPUT_DIR/heartbeat/rank<R>.json is read
from the run dir on the shared filesystem, POLL_S apart, and judged by contract/hang.py with the
job's hang timeout (`--hang-timeout`, job.hang_timeout: runner/planning/hang_budget.py). What a
file must be and when it counts is the shared reader's (runner/backends/beat_reader.py).

Reading: from this machine, the heartbeat dir opened without following a link, at most MAX_FILES
entries listed (lstat), each file opened with O_NOFOLLOW | O_NONBLOCK and read only if it is a
regular file, MAX_BYTES + 1 at most (as slurm/collect.py reads the run dir); through the login
node, over a dedicated SFTP session whose every answer must come whole within READ_TIMEOUT_S.
Judged only while the job is RUNNING, and from the start again whenever it starts running (a
requeue: a new world; the start-up budget counts from the start, not from the submission).
A job still RUNNING when every rank has said its last word (`done`) and the teardown budget has
passed is a teardown hang (contract/hang.py Watch.teardown), stopped the same way.
From the same files, one warning line per straggler, the SSH watch's (runner/backends/stragglers.py).

On a hang: one line (the SSH watch's: beat_reader.stopping_line), every rank's stacks taken by
`python -m trainer.tools.stacks` in one `srun --overlap` step of the job's allocation, one task a
node, beside the stuck ranks (container none: slurm.venv's python, outside any container; pyxis:
in a new container of the job's image with the run dir at /out, which shares the node's pids;
oci: not taken, its ranks live in a pid namespace no new step can enter), into hang-rank<R>.txt in
the run dir; then the `down` mark (no requeue) and scancel. `runner up` exits 5 (EXIT_HUNG).
"""

from __future__ import annotations

import logging
import os
import re
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from contract import hang as rule
from contract import heartbeat as fmt
from contract import stacks as names
from runner.backends.beat_reader import (
    MAX_FILES,
    POLL_S,
    STACKS_TIMEOUT_S,
    BeatReader,
    Entry,
    stopping_line,
    watched_sftp,
)
from runner.backends.slurm.jobs import JobState, node_names
from runner.backends.slurm.plan import DOWN_MARK, SlurmPlan, container_flags, resolve
from runner.backends.slurm.shell import LoginShell, Shell
from runner.backends.stragglers import StragglerLines
from runner.core.node_output import visible
from runner.inventory.slurm import SlurmInventory
from runner.planning.plan import OUT
from runner.transport.sftp import WatchedSFTP, close_quietly

log = logging.getLogger("runner.watch")
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO cannot hang the open
# The stacks helper on a node: NODE_NAME as the job's probe sets it (the helper takes its node's
# ranks by it), the python's own bin/ first on PATH (py-spy for a stopped rank is installed there).
HELPER_SH = ('NODE_NAME=${SLURMD_NODENAME:-$(hostname)}; export NODE_NAME; '
             'PATH="$(dirname "$1"):$PATH"; export PATH; exec "$1" -m trainer.tools.stacks --out "$2"')
TAKEN_RE = re.compile(r"\s*\d+: rank (\d+) \(pid \d+, state \S+\): \d+ frame lines by ")  # srun --label's "K: "


@dataclass
class Hang:
    """What the watch found: the rule's verdict, the node and node rank to blame, the stacks' line."""

    verdict: rule.Verdict
    node: str
    node_rank: int
    stacks: str = ""


class SlurmHangWatch(BeatReader):
    """One per attached `up`: `tick(state)` after every round of the log follower; `hung` once a
    hang was found and the job cancelled. Its lines (a straggler's warning, a hang's) go to `out`
    (stderr when None, as the SSH watch's)."""

    def __init__(self, sh: Shell, inv: SlurmInventory, plan: SlurmPlan, job_id: str,
                 clock: Callable[[], float] = time.monotonic, out: TextIO | None = None):
        self.nproc = inv.job.nproc_per_node or inv.slurm.gpus_per_node or 1
        super().__init__(inv.slurm.nodes * self.nproc, inv.job.hang_timeout, clock)
        self.sh, self.inv, self.plan, self.job_id = sh, inv, plan, job_id
        self.hung: Hang | None = None
        self._running = False
        self._next = 0.0
        self._sftp: WatchedSFTP | None = None
        self.out = out
        self.straggle = StragglerLines()  # nodes as each rank's heartbeat names them (SLURMD_NODENAME)

    # -- reading --------------------------------------------------------------------------------
    def read(self) -> list[fmt.Heartbeat]:
        """This launch's heartbeats in the run dir (see the module doc)."""
        if isinstance(self.sh, LoginShell):
            return self._read_sftp(self.sh)
        return self._read_local()

    def _read_local(self) -> list[fmt.Heartbeat]:
        try:
            run_fd = os.open(self.plan.run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return []
        try:
            d = os.open(fmt.DIR, _DIR, dir_fd=run_fd)  # the job's own dir: never through a link
        except OSError:  # none yet
            return []
        finally:
            os.close(run_fd)
        try:
            entries: list[Entry] = []
            with os.scandir(d) as it:
                for e in it:
                    if len(entries) == MAX_FILES:
                        return []  # not a heartbeat dir: nothing of it read
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    entries.append((e.name, st.st_mode, st.st_size))

            def read(name: str) -> bytes:
                fd = os.open(name, _FILE, dir_fd=d)
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        raise OSError(f"{name}: not a regular file")
                    data = b""
                    while len(data) <= fmt.MAX_BYTES and (chunk := os.read(fd, fmt.MAX_BYTES + 1 - len(data))):
                        data += chunk
                    return data
                finally:
                    os.close(fd)

            return self.take("run dir", entries, read)
        finally:
            os.close(d)

    def _read_sftp(self, sh: LoginShell) -> list[fmt.Heartbeat]:
        if self._sftp is None or self._sftp.sock.closed:
            self._sftp = watched_sftp(sh.remote, sh.where)
        return self.take_sftp("run dir", self._sftp, f"{self.plan.run_dir}/{fmt.DIR}")

    # -- judging --------------------------------------------------------------------------------
    def tick(self, state: JobState | None) -> None:
        """After a round of the follower: every POLL_S, while the job runs, the heartbeats read and
        judged; on a hang, the stacks taken and the job cancelled (once)."""
        if self.hung is not None or state is None:
            return
        if state.state != "RUNNING":
            self._running = False
            return
        if not self._running:  # it (re)started: a new world, and the start-up budget from now
            self._running = True
            self.restart(self.world)
            self.straggle.start_over()
        if self.clock() < self._next:
            return
        self._next = self.clock() + POLL_S
        try:
            self.feed(self.read())
        except Exception as exc:  # noqa: BLE001 - the watch is an aid: the job goes on without it this round
            log.debug("hang watch: %s", exc)
            self.close()
            return
        self._say([f"runner: warning: {line}" for line in self.straggle.lines(self.watch)])
        # A job still RUNNING after every rank's last word, past the teardown budget: a rank's process
        # (or its step) that does not exit (contract/hang.py Watch.teardown); Slurm shows the job, not
        # which process, so every ended rank is named and the stacks say which one still runs.
        v = self.verdict() or self.watch.teardown(self.clock(), self.watch.ranks)
        if v is not None:
            self.stop(v)

    def culprit(self, v: rule.Verdict, nodes: list[str]) -> tuple[str, int]:
        """(node, its node rank) of the first rank to blame: the node its heartbeat names, else the
        allocation's node that holds that rank (node rank = index in the node list)."""
        r = v.culprits[0] if v.culprits else 0
        seen = self.watch.ranks.get(r)
        k = r // self.nproc
        node = seen.beat.node if seen is not None else (nodes[k] if k < len(nodes) else f"node-{k}")
        return node, nodes.index(node) if node in nodes else k

    def _say(self, lines: list[str]) -> None:
        if lines:
            stream = self.out or sys.stderr
            stream.write("".join(ln + "\n" for ln in lines))
            stream.flush()

    def stop(self, v: rule.Verdict, out=None) -> Hang:
        """The line, every rank's stacks, the `down` mark, scancel."""
        stream = out or self.out or sys.stderr
        stream.write(stopping_line(v.line) + "\n")
        stream.flush()
        nodes = node_names(self.sh, self.plan.run_dir, self.job_id)
        node, k = self.culprit(v, nodes)
        self.hung = Hang(v, node, k, take_stacks(self.sh, self.inv, self.plan, self.job_id, len(nodes) or
                                                 self.inv.slurm.nodes, self.world or 0))
        stream.write(self.hung.stacks + "\n")
        stream.flush()
        self.sh.put_bytes(f"{self.plan.run_dir}/slurm/{DOWN_MARK}", b"")  # a --requeue job must not come back
        cancel(self.sh, self.job_id)
        return self.hung

    def close(self) -> None:
        if self._sftp is not None:
            close_quietly(self._sftp.sock)
            self._sftp = None


def cancel(sh: Shell, job_id: str) -> None:
    """scancel: Slurm sends the job's processes SIGCONT (the stopped rank too) and SIGTERM, and
    SIGKILL after the cluster's KillWait; the log follower sees the job end. (`scancel
    --signal=KILL` was tried: Slurm cancels the job just the same.)"""
    res = sh.run(["scancel", job_id])
    if res.rc != 0:
        log.warning("scancel %s: %s", job_id, visible((res.err or res.out).strip())[:300])


def stacks_argv(inv: SlurmInventory, plan: SlurmPlan, job_id: str, nnodes: int, home: str | None) -> list[str] | None:
    """One task a node in the job's allocation, beside its tasks, running the stacks helper; None
    where no step can reach the ranks (container oci)."""
    s = inv.slurm
    step = ["srun", f"--jobid={job_id}", "--overlap", f"--nodes={nnodes}", f"--ntasks={nnodes}",
            "--ntasks-per-node=1", "--kill-on-bad-exit=0", "--label"]
    if s.container == "oci":
        return None
    if s.container == "pyxis":
        return [*step, *container_flags(inv, plan), "/bin/sh", "-c", HELPER_SH, "runner-stacks", "python", OUT]
    python = f"{resolve(s.venv, home)}/bin/python" if s.venv else "python3"
    chdir = resolve(s.chdir, home) if s.chdir else plan.run_dir
    return [*step, f"--chdir={chdir}", "/bin/sh", "-c", HELPER_SH, "runner-stacks", python, plan.run_dir]


def take_stacks(sh: Shell, inv: SlurmInventory, plan: SlurmPlan, job_id: str, nnodes: int, world: int,
                timeout: float = STACKS_TIMEOUT_S) -> str:
    """The helper on every node at once (stacks_argv), within `timeout`; one line: how many ranks'
    hang-rank<R>.txt the run dir holds now, and what went wrong where something did."""
    argv = stacks_argv(inv, plan, job_id, nnodes, sh.home() if (inv.slurm.venv or inv.slurm.chdir) else None)
    why, taken = "", set()
    if argv is None:
        why = "container oci: its ranks run in a pid namespace of their own, which no new step can enter"
    else:
        try:
            res = sh.run(argv, timeout=timeout)
            lines = [visible(ln)[:300] for ln in (res.out + res.err).splitlines() if ln.strip()]
            for ln in lines:
                log.info("stacks: %s", ln)
                if m := TAKEN_RE.match(ln):  # the helper's line for a rank whose stacks it wrote
                    taken.add(int(m[1]))
            if res.rc != 0:
                why = f"srun exit {res.rc}: " + ("; ".join(lines[-4:]) or "no output")
        except Exception as exc:  # noqa: BLE001 - the run is stopped all the same
            why = visible((str(exc).strip().splitlines() or [type(exc).__name__])[0])[:300]
    return (f"runner: stacks of {len(taken)}/{world} rank(s) in {names.HANG_FILE.format(rank='<R>')} in the run dir "
            f"(`runner collect {plan.run_id} -i {inv.path}`)" + (f"; {why}" if why else ""))


def watch_for(sh: Shell, inv: SlurmInventory, plan: SlurmPlan, job_id: str) -> SlurmHangWatch | None:
    """The watch of an attached run of the trainer; None for a job.command (no heartbeats)."""
    if getattr(inv.job, "command", None) is not None:
        return None
    return SlurmHangWatch(sh, inv, plan, job_id)
