"""`runner status | logs | ls` for Slurm runs, and the log follower `runner up` uses.

Each node's output is the file `srun --output` writes on the shared filesystem
(`slurm/<job>/node<K>.out`); it is shown prefixed `[node/rank]` as the SSH runner prefixes a
container's output, cut and made visible the same way (runner/core/node_output.py). Followed by polling the files' new bytes (no tail process left behind on a
login node).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator

from runner.backends.results import LogLine, NodeStatus, RunStatus, slurm_state
from runner.backends.slurm.jobs import JobState, job_state, node_names, read_record, resolve_run, workdir
from runner.backends.slurm.plan import DOWN_MARK
from runner.backends.slurm.shell import Shell
from runner.core.node_output import LineSplitter, visible

POLL_S = 0.5
# COMPLETING: the job's tasks have exited and its nodes run the epilog; the final state (COMPLETED,
# FAILED, ...) comes after. An epilog may take a while, but not for ever: after this long the
# follow ends with COMPLETING, which `runner up` does not call a success.
COMPLETING_WAIT_S = 120.0
READ_PIECE = 1 << 20   # bytes of a node's output file read at once
MAX_PIECES = 16        # ... and at most this many per file and poll
METRICS_TAIL = 16384   # bytes read from the end of metrics.jsonl (runner/backends/ssh/node_runs.py reads as many)


class Follower:
    """New lines of the batch output ([slurm]) and of every node's output ([node/rank]): written
    to `out` (poll, follow: `runner up`) or yielded (lines: runner.api's logs)."""

    def __init__(self, sh: Shell, run_dir: str, job_id: str, nodes: list[str] | None = None, out=None):
        self.sh, self.run_dir, self.job_id = sh, run_dir, job_id
        self.nodes = nodes
        self.out = out or sys.stdout
        self.keep: set[str] | None = None  # the prefixes shown (None: every file's)
        self.offsets: dict[str, int] = {}
        self.split: dict[str, LineSplitter] = {}
        self.state: JobState | None = None  # the job's, as the last round saw it

    def _files(self) -> list[tuple[str, int | None, str]]:
        d = f"{self.run_dir}/slurm"
        files: list[tuple[str, int | None, str]] = [("slurm", None, f"{d}/{self.job_id}.out")]
        if not self.nodes:
            self.nodes = node_names(self.sh, self.run_dir, self.job_id) or None
        for k, name in enumerate(self.nodes or []):
            files.append((visible(name)[:64], k, f"{d}/{self.job_id}/node{k}.out"))
        return files

    def read(self, final: bool = False) -> Iterator[LogLine]:
        """What each file gained since the last read, READ_PIECE bytes at a time (at most
        MAX_PIECES a file and read while the job runs: one that writes faster is followed a
        little behind; the final read goes to the end), line by line as they come."""
        for node, rank, path in self._files():
            shown = self.keep is None or LogLine(node, rank, "").prefix in self.keep
            split = self.split.setdefault(path, LineSplitter())
            pieces = 0
            while final or pieces < MAX_PIECES:  # the job has ended: all that is left
                data = self.sh.read_bytes(path, self.offsets.get(path, 0), READ_PIECE)
                if not data:
                    break
                pieces += 1
                self.offsets[path] = self.offsets.get(path, 0) + len(data)
                lines = split.feed(data)
                if shown:
                    yield from (LogLine(node, rank, ln) for ln in lines)
                if len(data) < READ_PIECE:
                    break
            if final and shown:
                yield from (LogLine(node, rank, ln) for ln in split.end())

    def poll(self, final: bool = False) -> None:
        self.out.writelines(f"{ln}\n" for ln in self.read(final))
        self.out.flush()

    def rounds(self) -> Generator[Iterator[LogLine], None, JobState]:
        """One read per round until the job has ended (through a requeue, it runs again: the same
        job id) and left COMPLETING for its final state (bounded by COMPLETING_WAIT_S), then the
        final read; returns that state. Each round's read is used up before the next round."""
        last_check, completing_since = 0.0, None
        while True:
            yield self.read()
            if time.monotonic() - last_check > 1.0:
                last_check = time.monotonic()
                st = self.state = job_state(self.sh, self.job_id, self.run_dir)
                if st.state == "COMPLETING" and completing_since is None:
                    completing_since = last_check
                settling = st.state == "COMPLETING" and last_check - completing_since < COMPLETING_WAIT_S
                if not st.active and not settling:
                    yield self.read(final=True)
                    return st
            time.sleep(POLL_S)

    def follow(self, tick: Callable[[JobState | None], None] | None = None) -> JobState:
        """Write every round's lines to out until the job has ended; its final state. `tick`: called
        after each round with the job's state as last seen (the hang watch: runner/backends/slurm/hang.py)."""
        rounds = self.rounds()
        while True:
            try:
                lines = next(rounds)
            except StopIteration as end:
                return end.value
            self.out.writelines(f"{ln}\n" for ln in lines)
            self.out.flush()
            if tick is not None:
                tick(self.state)

    def lines(self, follow: bool, tail: int | str = "all") -> Iterator[LogLine]:
        """Every line there is (follow: and then as they come, until the job ends); tail: only
        the last so many of each file's lines there are at the start."""
        first = self.read(final=not follow)
        yield from (first if tail == "all" else _last(first, int(tail)))
        if follow:
            for lines in self.rounds():
                yield from lines


def _last(lines: Iterator[LogLine], n: int) -> list[LogLine]:
    """The last n lines of each source, in the order they came (memory: n lines a source)."""
    kept: dict[str, deque] = {}
    for ln in lines:
        kept.setdefault(ln.prefix, deque(maxlen=n)).append(ln)
    return [ln for q in kept.values() for ln in q]


def last_job(sh: Shell, run_dir: str) -> tuple[str | None, dict]:
    rec = read_record(sh, run_dir)
    subs = rec.get("submissions") or []
    return (subs[-1]["job_id"] if subs else None), rec


def last_metrics_line(sh: Shell, run_dir: str) -> str | None:
    """The run's last metrics.jsonl line, from the file's last METRICS_TAIL bytes."""
    tail = sh.read_bytes(f"{run_dir}/metrics.jsonl", -METRICS_TAIL) or b""
    lines = [ln for ln in tail.decode(errors="replace").splitlines()[1 if len(tail) == METRICS_TAIL else 0:]
             if ln.strip()]  # the first line of a tail may be cut
    return lines[-1] if lines else None


def find_run(sh: Shell, inv, run: str | None) -> tuple[str, str, str | None, dict]:
    """(run id, run dir, its last Slurm job id or None, the run's record) of the run `run` names
    (or the latest) in the workdir on the cluster: what status, logs and down start from."""
    wd = workdir(sh, inv)
    run_id = resolve_run(sh, wd, run)
    run_dir = f"{wd}/runs/{run_id}"
    job_id, rec = last_job(sh, run_dir)
    return run_id, run_dir, job_id, rec


def _status(sh: Shell, inv, backend_path: str, run_id: str, run_dir: str, job_id: str | None, rec: dict,
            full: bool) -> RunStatus:
    st = job_state(sh, job_id, run_dir) if job_id else JobState("-", "NOT SUBMITTED", None)
    downed = sh.read_bytes(f"{run_dir}/slurm/{DOWN_MARK}", 0, 1) is not None
    state = slurm_state(st.state, st.exit_code, downed)
    names = node_names(sh, run_dir, job_id) if job_id and full else []
    nodes = [NodeStatus(node=visible(n)[:64], rank=k, state=st.state) for k, n in enumerate(names)]
    return RunStatus(backend="slurm", inventory=backend_path, run_id=run_id, state=state, native_state=st.state,
                     exit_code=st.exit_code, nodes=nodes, job_id=job_id, submissions=len(rec.get("submissions", [])),
                     run_dir=run_dir, reason=(st.reason or None) if full else None,
                     run_time=(st.run_time or None) if full else None,
                     last_metrics=last_metrics_line(sh, run_dir) if full else None)


def describe(backend, run: str | None) -> RunStatus:
    sh = backend.shell()
    try:
        run_id, run_dir, job_id, rec = find_run(sh, backend.inventory, run)
        return _status(sh, backend.inventory, backend.path, run_id, run_dir, job_id, rec, full=True)
    finally:
        sh.close()


def runs(backend) -> list[RunStatus]:
    """Every Slurm run in the workdir, newest first (its job's state, no node list or metrics)."""
    from runner.backends.slurm.jobs import list_runs

    sh = backend.shell()
    try:
        wd = workdir(sh, backend.inventory)
        out = []
        for run_id in reversed(list_runs(sh, wd)):
            run_dir = f"{wd}/runs/{run_id}"
            job_id, rec = last_job(sh, run_dir)
            out.append(_status(sh, backend.inventory, backend.path, run_id, run_dir, job_id, rec, full=False))
        return out
    finally:
        sh.close()


def logs(backend, run: str | None, nodes: list[str] | None, follow: bool, tail: int | str) -> Iterator[LogLine]:
    """The batch script's output ([slurm]) and every node's ([node/rank]); follow: until the job
    ends. tail: the last lines of each (of what is there when a follow starts)."""
    sh = backend.shell()
    try:
        run_id, run_dir, job_id, _ = find_run(sh, backend.inventory, run)
        if not job_id:
            sys.stderr.write(f"runner: note: run {run_id}: nothing submitted yet\n")
            return
        f = Follower(sh, run_dir, job_id)
        if nodes:
            names = node_names(sh, run_dir, job_id)
            f.keep = {f"[{visible(n)[:64]}/{k}]" for k, n in enumerate(names) if n in nodes}
        yield from f.lines(follow, tail)
    finally:
        sh.close()
