"""tests/support/worker_share.py: which worker runs what when the suite runs on two (TEST_WORKERS=2).
Checked on the suite's own collection: a cluster is made by one worker only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests import REPO
from tests.support.worker_share import (
    CLUSTERS,
    DURATIONS,
    groups,
    load_durations,
    longest_first,
    record_time,
    write_durations,
)


class _Item:
    """What groups() reads of a pytest item, and the marker it adds."""

    def __init__(self, nodeid: str, *fixtures: str):
        self.nodeid, self.fixturenames, self.markers = nodeid, fixtures, []

    def add_marker(self, marker):
        self.markers.append(marker)

    @property
    def group(self) -> str:
        return self.markers[-1].args[0]


def test_tests_sharing_a_cluster_share_a_group_and_the_rest_go_by_module(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    items = [_Item("tests/a.py::t1", "sandbox", "tmp_path"), _Item("tests/a.py::t2", "tmp_path"),
             _Item("tests/b.py::t1", "nonroot_sandbox"), _Item("tests/b.py::t2", "slurm"),
             _Item("tests/c.py::t1", "slurm", "nonroot_sandbox"), _Item("tests/c.py::t2")]
    groups(items)
    assert [i.group for i in items] == ["nodes-sandbox", "tests/a.py", "nodes-nonroot_sandbox-slurm",
                                        "nodes-nonroot_sandbox-slurm", "nodes-nonroot_sandbox-slurm", "tests/c.py"]


def test_the_longest_work_goes_out_first_by_recorded_seconds_and_the_rest_at_the_mean_per_test():
    queue = {"tests/a.py": dict.fromkeys("abc"), "nodes-slurm": dict.fromkeys("ab"), "tests/b.py": dict.fromkeys("a"),
             "nodes-sandbox": dict.fromkeys("abcd"), "tests/c.py": dict.fromkeys("abcde")}
    # Nothing recorded: the cluster groups first, then by number of tests.
    assert [k for k, _ in longest_first(queue, {})] == ["nodes-sandbox", "nodes-slurm", "tests/c.py", "tests/a.py",
                                                        "tests/b.py"]
    # Recorded: by seconds. b.py's one test outlasts c.py's five; a.py, unrecorded, counts at the mean
    # per recorded test, (100 + 40 + 10 + 400) / (1 + 5 + 2 + 4) = 45.8 s a test: 137.5 s.
    durations = {"tests/b.py": 100.0, "tests/c.py": 40.0, "nodes-slurm": 10.0, "nodes-sandbox": 400.0}
    assert [k for k, _ in longest_first(queue, durations)] == ["nodes-sandbox", "tests/a.py", "tests/b.py", "tests/c.py",
                                                               "nodes-slurm"]


def test_recorded_times_fold_into_seconds_per_group_and_each_workers_span(tmp_path, monkeypatch):
    times = tmp_path / "times.jsonl"
    monkeypatch.setenv("TEST_TIMES", str(times))

    class _Timed(_Item):
        def iter_markers(self, name):
            return iter(self.markers)

    for worker, nodeid in [("gw0", "tests/a.py::t1"), ("gw1", "tests/b.py::t1"), ("gw0", "tests/a.py::t2")]:
        item = _Timed(nodeid)
        groups([item])
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        with record_time(item):
            pass
    rows = [json.loads(line) for line in times.read_text().splitlines()]
    assert [(r["test"], r["group"], r["worker"]) for r in rows] == [
        ("tests/a.py::t1", "tests/a.py", "gw0"), ("tests/b.py::t1", "tests/b.py", "gw1"), ("tests/a.py::t2", "tests/a.py", "gw0")]
    # Made-up spans: a.py 3 s + 2 s on gw0, b.py 4 s on gw1 from t=1.
    for r, (start, end) in zip(rows, [(100.0, 103.0), (101.0, 105.0), (103.0, 105.0)], strict=True):
        r["start"], r["end"] = start, end
    times.write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = write_durations(times, tmp_path / "durations.json")
    assert doc["groups"] == {"tests/a.py": 5.0, "tests/b.py": 4.0}
    assert doc["workers"] == {"gw0": {"busy_s": 5.0, "ended_at_s": 5.0}, "gw1": {"busy_s": 4.0, "ended_at_s": 5.0}}
    assert load_durations(tmp_path / "durations.json") == {"tests/a.py": 5.0, "tests/b.py": 4.0}
    assert load_durations(tmp_path / "none.json") == {}


def test_the_committed_durations_name_the_suites_cluster_groups():
    """tests/durations.json is read by the scheduler (a group it lacks, such as a new module, counts
    at the mean per test; one it names that is gone is never looked up)."""
    rec = load_durations(DURATIONS)
    assert len(rec) > 50 and all(v >= 0 for v in rec.values())
    assert {"nodes-sandbox", "nodes-netns_sandbox", "nodes-nonroot_sandbox", "nodes-slurm"} <= rec.keys()


def test_the_suites_clusters_each_on_one_worker_and_slurm_apart_from_the_sandbox(tmp_path):
    """The suite's real collection, as a worker writes it: four cluster groups, one per cluster.
    The Slurm module apart from the session sandbox (~260 s the sandbox's worker does not carry)."""
    path = tmp_path / "groups.json"
    env = {**os.environ, "PYTEST_XDIST_WORKER": "gw9", "RUNNER_TESTS_GROUPS": str(path)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "-p", "no:randomly",
                           "-p", "no:cacheprovider", "tests"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads(path.read_text())
    assert len(got) == int(proc.stdout.rstrip().splitlines()[-1].split()[0]) > 1000
    assert sorted({g for g in got.values() if g.startswith("nodes-")}) == sorted(f"nodes-{c}" for c in CLUSTERS)
    assert {g for n, g in got.items() if n.startswith("tests/slurm/test_slurm_cluster.py::")} == {"nodes-slurm"}
    assert got["tests/sandbox/test_runner_sandbox.py::test_pipeline_trainer_job_three_nodes"] == "nodes-sandbox"
    assert all(g == n.split("::")[0] for n, g in got.items() if not g.startswith("nodes-"))


_SHARER = """
import sys, time
from pathlib import Path
from tests.support.worker_share import machine_share
d = Path(sys.argv[1])
with machine_share(alone=False):
    (d / sys.argv[2]).write_text("in")
    while not (d / "go").exists():
        time.sleep(0.01)
    (d / (sys.argv[2] + ".out")).write_text("out")  # its test's last step, before it lets go
"""


def test_one_step_alone_waits_for_the_other_workers_test_then_shares_again(tmp_path, monkeypatch):
    """machine_alone() inside a test holding the shared lock: it gives that up, takes the machine
    once the other worker's test (here another process holding the lock shared) has ended, keeps new
    sharers out meanwhile (the turnstile), and shares again after."""
    import fcntl
    import threading

    from tests.support import worker_share

    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setenv(worker_share.GROUPS_ENV, str(tmp_path / "groups.json"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def sharer(name: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", _SHARER, str(tmp_path), name], cwd=REPO, env=env)

    def turnstile_taken() -> bool:
        with open(worker_share._lock_path("turnstile"), "a") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fh, fcntl.LOCK_UN)
            return False

    from tests.support.runner_helpers import wait_for

    outer = list(worker_share._held)  # under xdist, this test's own hold (tests/conftest.py)
    with worker_share.machine_share(alone=False):
        other = sharer("first")
        wait_for(lambda: (tmp_path / "first").exists(), 60, interval=0.01)  # both share the machine
        seen: dict[str, bool] = {}

        def step() -> None:
            with worker_share.machine_alone():
                seen["other ended first"] = (tmp_path / "first.out").exists()

        t = threading.Thread(target=step)
        t.start()
        wait_for(turnstile_taken, 60, interval=0.01)  # waiting for the other's test, new sharers kept out
        assert not seen
        (tmp_path / "go").write_text("")
        t.join(60)
        assert seen == {"other ended first": True}
        assert other.wait(60) == 0
        again = sharer("second")  # shared again: another worker's test runs beside the rest of this one
        wait_for(lambda: (tmp_path / "second").exists(), 60, interval=0.01)
        assert again.wait(60) == 0
    assert worker_share._held == outer
