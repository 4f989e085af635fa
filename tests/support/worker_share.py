"""Two pytest-xdist workers on one machine (`scripts/test.sh`'s default: `-n 2 --dist loadgroup`).

Why two: a serial run keeps the 2 cores busy only ~63% of its time (a run on 2026-11-27, sampling
/proc/stat: 2966 CPU-seconds in 2358 s); the sandbox tests wait on nodes, links, heartbeats and
grace periods, and the other worker's trainer runs fill those waits.

What keeps them apart:
- `groups` and `GroupScheduling`: every test that uses a cluster (the session sandbox, the
  non-root one, the namespaced one, Slurm) goes to the one worker that holds that cluster, tests
  sharing a cluster together; every other test goes with its module (module fixtures are computed
  once); the longest groups go out first, by their time in tests/durations.json (`longest_first`).
- `alone`: a test marked `alone` runs with the other worker between tests; `machine_alone()` does
  the same for one step of a test (measuring the unequal nodes: their CPU quotas separate speeds
  only while the machine has CPU to spare). A shared/exclusive lock on one file, with a turnstile
  so that a waiting exclusive holder is not starved.
- `serialized`: one worker at a time through a step (the image build's fixed wheel-server port).

xdist's own `--dist loadgroup` cannot do the grouping with pytest 9: it renames each test's nodeid
to carry its group, and pytest 9's nodeid is no longer that attribute (every test was its own
group). So the workers write {nodeid: group} to a file at collection and the controller's
scheduler (`GroupScheduling`, installed by tests/conftest.py for `--dist loadgroup`) reads it.

Without xdist (`TEST_WORKERS=0`) nothing here changes a run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# Fixtures that stand for a cluster of nodes: at most one worker may make each.
CLUSTERS = ("sandbox", "nonroot_sandbox", "netns_sandbox", "slurm")


def under_xdist() -> bool:
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


def _lock_path(name: str) -> Path:
    """Beside the run's groups file (one per controller), removed with it (`remove_files`)."""
    return Path(f"{os.environ[GROUPS_ENV]}.{name}.lock")


def remove_files() -> None:
    base = Path(os.environ[GROUPS_ENV])
    for p in [base, *base.parent.glob(base.name + ".*")]:
        p.unlink(missing_ok=True)


@contextlib.contextmanager
def _flock(name: str, mode: int) -> Iterator[None]:
    with open(_lock_path(name), "a") as fh:
        fcntl.flock(fh, mode)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


_held: list = []  # (the machine lock's file, its mode) while this worker runs a test (machine_share)


def _take(fh, mode: int) -> None:
    with _flock("turnstile", fcntl.LOCK_EX):  # a waiting exclusive holder keeps new sharers out
        fcntl.flock(fh, mode)


@contextlib.contextmanager
def machine_share(alone: bool) -> Iterator[None]:
    """Held for a whole test (setup, call, teardown): exclusive for an `alone` test, shared for the rest."""
    if not under_xdist():
        yield
        return
    with open(_lock_path("machine"), "a") as main:
        mode = fcntl.LOCK_EX if alone else fcntl.LOCK_SH
        _take(main, mode)
        _held.append((main, mode))
        try:
            yield
        finally:
            _held.pop()
            fcntl.flock(main, fcntl.LOCK_UN)


@contextlib.contextmanager
def machine_alone() -> Iterator[None]:
    """One step of a test (or of its fixture) with the other worker idle: the step's own shared
    hold is given up, the exclusive one taken (once the other worker's current test has ended),
    and shared again after it. For the one part of a test that is speed-sensitive (measuring nodes
    made unequal by CPU quotas), so that the rest of it runs beside the other worker."""
    if not under_xdist() or not _held or _held[-1][1] == fcntl.LOCK_EX:
        yield
        return
    fh = _held[-1][0]
    fcntl.flock(fh, fcntl.LOCK_UN)
    _take(fh, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fh, fcntl.LOCK_UN)
        _take(fh, fcntl.LOCK_SH)


@contextlib.contextmanager
def serialized(name: str) -> Iterator[None]:
    if not under_xdist():
        yield
        return
    with _flock(name, fcntl.LOCK_EX):
        yield


def groups(items: list[pytest.Item]) -> None:
    """Mark each item with its xdist_group: the clusters it uses, joined with every cluster a test
    uses together with them (so no cluster is made by two workers), else its module."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    used = {item.nodeid: [c for c in CLUSTERS if c in getattr(item, "fixturenames", ())] for item in items}
    for names in used.values():
        for other in names[1:]:
            parent[find(other)] = find(names[0])
    for item in items:
        names = used[item.nodeid]
        if names:
            root = find(names[0])
            group = "nodes-" + "-".join(sorted(c for c in CLUSTERS if c in parent and find(c) == root))
        else:
            group = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
    path = os.environ.get(GROUPS_ENV)
    if path and under_xdist():  # every worker writes the same; the controller reads it to schedule
        tmp = f"{path}.{os.getpid()}"
        Path(tmp).write_text(json.dumps({item.nodeid: _group(item) for item in items}))
        os.replace(tmp, path)


GROUPS_ENV = "RUNNER_TESTS_GROUPS"


def _group(item: pytest.Item) -> str:
    return next(m.args[0] for m in item.iter_markers("xdist_group"))


def groups_file() -> str:
    """Set in the controller before the workers start (they inherit it): where they write the groups."""
    path = os.environ.setdefault(GROUPS_ENV, str(Path(tempfile.gettempdir()) / f"runner-tests-{os.getpid()}-groups.json"))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return path


def make_scheduler(config, log):
    """LoadScope scheduling with the workers' groups as scopes (tests/conftest.py's hook)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        _groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                self._groups = json.loads(Path(os.environ[GROUPS_ENV]).read_text())
            return self._groups.get(nodeid, nodeid)

        def _assign_work_unit(self, node) -> None:
            if not self._ordered:  # once, before the first unit goes out: see longest_first
                self._ordered = True
                queue = longest_first(self.workqueue, load_durations())
                self.workqueue.clear()
                self.workqueue.update(queue)
            super()._assign_work_unit(node)

        _ordered = False

    return GroupScheduling(config, log)


# Seconds each group took (setup, call and teardown of its tests) in a two-worker run of the whole
# suite on a CI-like machine (2 cores): `TEST_TIMES=FILE scripts/test.sh`, then
# `python -m tests.support.worker_share FILE` rewrites it. A group it does not name (a new module) is
# counted at the mean seconds per test of those it does.
DURATIONS = (Path(__file__).resolve().parents[1] / "durations.json")
TIMES_ENV = "TEST_TIMES"


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    groups = doc.get("groups") if isinstance(doc, dict) else None
    return {k: float(v) for k, v in (groups or {}).items() if isinstance(v, (int, float))}


def longest_first(queue: dict[str, dict], durations: dict[str, float],
                  tests_per_group: dict[str, int] | None = None) -> list[tuple[str, dict]]:
    """The work queue's groups, longest first (LPT: a worker takes the next group when its own is
    nearly done, so a long group taken last leaves the other worker idle at the end; the Slurm
    module once did, for ~15 min). A group's length is its recorded seconds; one without a record
    is its number of tests times the recorded mean per test (the cluster groups, whose tests start
    node runs, first among those when nothing is recorded at all)."""
    counts = tests_per_group or {k: len(v) for k, v in queue.items()}
    known = [k for k in queue if k in durations]
    per_test = (sum(durations[k] for k in known) / max(1, sum(counts[k] for k in known))) if known else None

    def length(kv: tuple[str, dict]) -> tuple:
        k = kv[0]
        if k in durations:
            return (0, -durations[k])
        if per_test is not None:
            return (0, -counts[k] * per_test)
        return (1, not k.startswith("nodes-"), -counts[k])

    return sorted(queue.items(), key=length)


@contextlib.contextmanager
def record_time(item: pytest.Item) -> Iterator[None]:
    """With TEST_TIMES set: one JSON line per test (its group, worker, start and end) appended there."""
    path = os.environ.get(TIMES_ENV)
    t0 = time.time()
    try:
        yield
    finally:
        if path:
            line = json.dumps({"test": item.nodeid, "group": _group(item), "worker": os.environ.get("PYTEST_XDIST_WORKER", "-"),
                               "start": t0, "end": time.time()})
            with open(path, "a") as fh:  # one short write per line: lines of two workers do not interleave
                fh.write(line + "\n")


def write_durations(times: Path, out: Path = DURATIONS) -> dict:
    """Fold a TEST_TIMES file into durations.json: seconds per group, and each worker's busy span."""
    groups: dict[str, float] = {}
    workers: dict[str, list[float]] = {}
    for line in times.read_text().splitlines():
        r = json.loads(line)
        groups[r["group"]] = groups.get(r["group"], 0.0) + r["end"] - r["start"]
        w = workers.setdefault(r["worker"], [r["start"], r["end"], 0.0])
        w[0], w[1], w[2] = min(w[0], r["start"]), max(w[1], r["end"]), w[2] + r["end"] - r["start"]
    t0 = min(w[0] for w in workers.values())
    doc = {"note": "seconds per test group in one two-worker run (tests/support/worker_share.py DURATIONS)",
           "groups": {k: round(v, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
           "workers": {k: {"busy_s": round(w[2], 1), "ended_at_s": round(w[1] - t0, 1)} for k, w in sorted(workers.items())}}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    print(json.dumps(write_durations(Path(sys.argv[1]))["workers"]))
