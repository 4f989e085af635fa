"""`runner status | logs | ls` for Slurm runs, and the log follower `runner up` uses.

Each node's output is the file `srun --output` writes on the shared filesystem
(`slurm/<job>/node<K>.out`); it is shown prefixed `[node/rank]` as the SSH runner prefixes a
container's output, cut and made visible the same way (runner/core/node_output.py). Followed by polling the files' new bytes (no tail process left behind on a
login node).
"""

from __future__ import annotations

import json
import sys
import time

from runner.backends.slurm.jobs import JobState, job_state, node_names, read_record, resolve_run, workdir
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
    """Prints new lines of the batch output and of every node's output, prefixed."""

    def __init__(self, sh: Shell, run_dir: str, job_id: str, nodes: list[str] | None = None, out=None):
        self.sh, self.run_dir, self.job_id = sh, run_dir, job_id
        self.nodes = nodes
        self.out = out or sys.stdout
        self.offsets: dict[str, int] = {}
        self.split: dict[str, LineSplitter] = {}

    def _files(self) -> list[tuple[str, str]]:
        d = f"{self.run_dir}/slurm"
        files = [("[slurm]", f"{d}/{self.job_id}.out")]
        if not self.nodes:
            self.nodes = node_names(self.sh, self.run_dir, self.job_id) or None
        for k, name in enumerate(self.nodes or []):
            files.append((f"[{visible(name)[:64]}/{k}]", f"{d}/{self.job_id}/node{k}.out"))
        return files

    def poll(self, final: bool = False) -> None:
        """What each file gained since the last poll, READ_PIECE bytes at a time (at most
        MAX_PIECES a file and poll while the job runs: one that writes faster is followed a
        little behind; the final poll reads to the end)."""
        for prefix, path in self._files():
            split = self.split.setdefault(path, LineSplitter())
            pieces = 0
            while final or pieces < MAX_PIECES:  # the job has ended: all that is left
                data = self.sh.read_bytes(path, self.offsets.get(path, 0), READ_PIECE)
                if not data:
                    break
                pieces += 1
                self.offsets[path] = self.offsets.get(path, 0) + len(data)
                self.out.writelines(f"{prefix} {ln}\n" for ln in split.feed(data))
                if len(data) < READ_PIECE:
                    break
            if final:
                self.out.writelines(f"{prefix} {ln}\n" for ln in split.end())
        self.out.flush()

    def follow(self) -> JobState:
        """Until the job has ended (through a requeue, it runs again: the same job id) and left
        COMPLETING for its final state (bounded by COMPLETING_WAIT_S)."""
        last_check, completing_since = 0.0, None
        while True:
            self.poll()
            if time.monotonic() - last_check > 1.0:
                last_check = time.monotonic()
                st = job_state(self.sh, self.job_id, self.run_dir)
                if st.state == "COMPLETING" and completing_since is None:
                    completing_since = last_check
                settling = st.state == "COMPLETING" and last_check - completing_since < COMPLETING_WAIT_S
                if not st.active and not settling:
                    self.poll(final=True)
                    return st
            time.sleep(POLL_S)


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


def cmd_status(args, inv, sh: Shell) -> int:
    run_id, run_dir, job_id, rec = find_run(sh, inv, args.run)
    st = job_state(sh, job_id, run_dir) if job_id else JobState("-", "NOT SUBMITTED", None)
    nodes = node_names(sh, run_dir, job_id) if job_id else []
    last = last_metrics_line(sh, run_dir)
    doc = {"run_id": run_id, "scheduler": "slurm", "job_id": job_id, "state": st.state, "exit_code": st.exit_code,
           "reason": st.reason, "run_time": st.run_time, "nodes": nodes, "submissions": len(rec.get("submissions", [])),
           "last_metrics": last, "run_dir": run_dir}
    if getattr(args, "json", False):
        print(json.dumps(doc, indent=2))
        return 0
    exit_s = f", exit {st.exit_code}" if st.exit_code is not None and not st.active else ""
    why = f" ({st.reason})" if st.reason and st.reason != "None" else ""
    print(visible(f"run {run_id}: Slurm job {job_id} {st.state}{why}{exit_s}" + (f", {st.run_time}" if st.run_time else "")
                  + f"; submission {doc['submissions']}; run dir {run_dir}"))
    for k, n in enumerate(nodes):
        print(f"  [{visible(n)[:64]}/{k}]")
    if doc["last_metrics"]:
        print(f"  last metrics: {visible(doc['last_metrics'][:160])}")
    return 0


def cmd_logs(args, inv, sh: Shell) -> int:
    run_id, run_dir, job_id, _ = find_run(sh, inv, args.run)
    if not job_id:
        print(f"run {run_id}: nothing submitted yet")
        return 0
    f = Follower(sh, run_dir, job_id)
    if args.node:
        names = node_names(sh, run_dir, job_id)
        keep = [f"[{visible(n)[:64]}/{k}]" for k, n in enumerate(names) if n in args.node]
        f.out = _Filter(sys.stdout, tuple(keep))
    if args.follow:
        try:
            f.follow()
        except KeyboardInterrupt:
            return 130
    else:
        f.poll(final=True)
    return 0


def cmd_ls(args, inv, sh: Shell) -> int:
    from runner.backends.slurm.jobs import list_runs

    wd = workdir(sh, inv)
    rows = []
    for run_id in reversed(list_runs(sh, wd)):
        run_dir = f"{wd}/runs/{run_id}"
        job_id, rec = last_job(sh, run_dir)
        st = job_state(sh, job_id, run_dir) if job_id else None
        rows.append({"run_id": run_id, "job_id": job_id, "state": st.state if st else "-",
                     "exit_code": st.exit_code if st else None, "submissions": len(rec.get("submissions", []))})
    if getattr(args, "json", False):
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(visible(f"{r['run_id']}  job {r['job_id']}  {r['state']}"
                      + (f"  exit {r['exit_code']}" if r["exit_code"] is not None else "")
                      + f"  submissions {r['submissions']}"))
    return 0


class _Filter:
    def __init__(self, out, prefixes: tuple[str, ...]):
        self.out, self.prefixes = out, prefixes

    def write(self, s: str) -> None:
        if s.startswith(self.prefixes):
            self.out.write(s)

    def writelines(self, lines) -> None:
        for s in lines:
            self.write(s)

    def flush(self) -> None:
        self.out.flush()
