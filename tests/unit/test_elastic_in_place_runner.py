"""The runner's side of `elastic.in_place` (issue 58), decided without a node: the regroup.json it
writes for the layout chosen over the survivors, when it takes that path at all, how it waits for
every rank's `resumed` (and gives up to the restart path), the torchrun agent's exit barrier after a
regroup, and the watcher handing a lost node to it. End to end: tests/sandbox/test_elastic_in_place_sandbox.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from contract import regroup as contract
from runner.agents.torchrun import regrouped
from runner.backends.ssh import elastic_loop, regroup_wait
from runner.backends.ssh.elastic_loop import ElasticRun
from runner.backends.ssh.regroup_wait import wait_resumed
from runner.inventory import load_inventory
from runner.planning.elastic import choose, in_place_on, job_layout, regroup_spec
from tests.unit.test_elastic_plan import _no_profiles, inventory  # noqa: F401 - the fixture, autouse here too


def test_the_file_places_each_node_s_processes_in_the_new_layout_s_order(tmp_path):
    inv = load_inventory(str(inventory(tmp_path, nodes=3, slots=2)))
    lay = choose(inv, ["node-1", "node-2"], job_layout(inv))
    spec = regroup_spec(inv, lay, 3, 29777, "tok", "uniform_transformer", "lost node-0")
    assert spec.ranks == {"node-1": [0, 1], "node-2": [2, 3]} and spec.world_size == 4
    assert (spec.master_addr, spec.master_port, spec.store_prefix) == ("127.33.241.2", 29777, "regroup/3/tok")
    assert (spec.layout.pp * spec.layout.dp, spec.layout.batch_size * spec.layout.dp) == (4, lay.global_batch)
    assert contract.parse(contract.dumps(spec), "f") == spec  # what a rank reads back


@pytest.mark.parametrize("args, on", [
    ([], False), (["--elastic.in_place", "true"], True), (["--elastic.in_place=true"], True),
    (["--elastic.in_place", "true", "--elastic.in_place", "false"], False), (["--elastic.in_place"], False)])
def test_the_in_place_path_is_the_job_s_choice_and_off_by_default(tmp_path, args, on):
    inv = load_inventory(str(inventory(tmp_path, args=["--parallel.partition", "uniform_transformer", *args])))
    assert in_place_on(inv) is on


class FakeNode:
    """A node's run dir for the runner's reads and writes (what Remote offers over SFTP)."""

    def __init__(self, root: Path):
        self.root = root

    def read_text(self, path: str, limit: int) -> str | None:
        p = self.root / path.lstrip("/")
        return p.read_text()[:limit] if p.is_file() else None

    def put_bytes(self, path: str, data: bytes) -> None:
        p = self.root / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)

    def listening_ports(self) -> set[int]:
        return set()

    def abandon(self) -> None:
        self.abandoned = True


class FakeCluster:
    def __init__(self, nodes: dict[str, FakeNode]):
        self.nodes = nodes

    def __getitem__(self, name: str) -> FakeNode:
        return self.nodes[name]

    def map(self, items, fn):
        out = []
        for x in items:
            try:
                out.append((x, fn(x), None))
            except Exception as e:  # noqa: BLE001 - as Cluster.map reports it
                out.append((x, None, e))
        return out


def _status(root: Path, run: str, epoch: int, state: str, step: int | None = 4, local: int = 0) -> None:
    p = root / run.lstrip("/") / contract.status_name(local)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(contract.status_text(epoch, state, {"resumed": 5.0}, rank=0, step=step, error="boom" * (state == "failed")))


def test_the_runner_waits_for_every_rank_resumed_and_names_a_failed_or_late_one(tmp_path, monkeypatch):
    monkeypatch.setattr(regroup_wait, "STATUS_POLL_S", 0.01)
    cl = FakeCluster({n: FakeNode(tmp_path / n) for n in ("a", "b")})
    runs = {"a": "/run", "b": "/run"}
    spec = SimpleNamespace(epoch=2, timeout_s=0.2)
    _status(tmp_path / "a", "/run", 2, "resumed")
    _status(tmp_path / "b", "/run", 1, "resumed")  # an older epoch's: not this one
    assert wait_resumed(cl, runs, spec, {"a": 1, "b": 1}) == "1 rank(s) not resumed within 0 s"
    _status(tmp_path / "b", "/run", 2, "failed")
    assert wait_resumed(cl, runs, spec, {"a": 1, "b": 1}) == "b local rank 0: boom"
    _status(tmp_path / "b", "/run", 2, "resumed")
    got = wait_resumed(cl, runs, spec, {"a": 1, "b": 1})
    assert isinstance(got, dict) and sorted(got) == [("a", 0), ("b", 0)] and got[("b", 0)]["step"] == 4


def test_a_lost_node_s_survivors_get_the_file_and_the_history_says_in_place(tmp_path, monkeypatch):
    monkeypatch.setattr(regroup_wait, "STATUS_POLL_S", 0.01)
    inv = load_inventory(str(inventory(tmp_path, args=["--parallel.partition", "uniform_transformer",
                                                       "--elastic.in_place", "true"])))
    el = ElasticRun(inv, inv.job.elastic, False, tmp_path / "logs")
    el._watch = lambda cl, run_id: None  # no retry thread here
    cl = FakeCluster({n: FakeNode(tmp_path / n) for n in ("node-0", "node-1", "node-2")})
    homes = {n: "/home" for n in cl.nodes}
    run = "/home/runs/r1"
    ev = SimpleNamespace(node="node-2", error="node unreachable", since=1.0, detected=2.0)
    for n in ("node-0", "node-1"):  # the ranks answer at once
        _status(tmp_path / n, run, 1, "resumed")
    monkeypatch.setattr(elastic_loop, "node_paths", lambda node, home: SimpleNamespace(run=lambda rid: f"{home}/runs/{rid}"))
    assert el.regroup_in_place(cl, "r1", homes, ev) is True
    spec = contract.read(tmp_path / "node-0" / "home/runs/r1" / contract.REGROUP_FILE)
    assert (spec.epoch, spec.ranks, spec.layout.pp, spec.why) == (1, {"node-0": [0], "node-1": [1]}, 2, "lost node-2")
    assert not (tmp_path / "node-2" / "home/runs/r1" / contract.REGROUP_FILE).exists()  # the lost node is told nothing
    assert el.layout.nodes == ("node-0", "node-1") and el.epoch == 1 and "node-2" in el.lost
    events = [json.loads(x) for x in (tmp_path / "logs" / "elastic.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("in_place"), e.get("from_step")) for e in events] == [("lost", None, None),
                                                                                      ("layout", True, 4)]
    # Another loss, and a rank fails to regroup: False, and nothing changed (the restart path goes on).
    monkeypatch.setattr(elastic_loop, "IN_PLACE_TIMEOUT_S", 0.2)
    el.spec = SimpleNamespace(min_nodes=1, rejoin=False)
    _status(tmp_path / "node-0", run, 2, "failed")
    ev2 = SimpleNamespace(node="node-1", error="node unreachable", since=3.0, detected=4.0)
    assert el.regroup_in_place(cl, "r1", homes, ev2) is False
    assert el.layout.nodes == ("node-0", "node-1") and el.epoch == 1 and "node-1" not in el.lost
    # `up --resume` of this run: the next file's epoch is above every one its ranks have seen.
    again = ElasticRun(inv, inv.job.elastic, False, tmp_path / "logs2")
    master = SimpleNamespace(read_text=lambda path, limit: (tmp_path / "logs" / "elastic.jsonl").read_text())
    again.load_history(master, "/run")  # type: ignore[arg-type]
    assert again.epoch == 1 and len(again.events) == 2


def test_the_torchrun_agents_skip_their_exit_barrier_once_the_workers_regrouped(tmp_path):
    assert not regrouped(str(tmp_path))
    (tmp_path / contract.REGROUP_FILE).write_text('{"epoch": 0}')
    assert not regrouped(str(tmp_path))
    (tmp_path / contract.REGROUP_FILE).write_text("[" * 100000)  # someone else's file: no barrier skipped
    assert not regrouped(str(tmp_path))
    (tmp_path / contract.REGROUP_FILE).write_text('{"epoch": 1}')
    assert regrouped(str(tmp_path))


def test_the_watcher_hands_a_lost_node_to_the_in_place_path_and_stops_the_run_when_it_declines():
    from runner.backends.ssh.watch import Outcome, Watcher

    plan = SimpleNamespace(nodes=[SimpleNamespace(node="a"), SimpleNamespace(node="b")], run_id="r")
    w = Watcher({}, plan, None, watch_hangs=False)  # type: ignore[arg-type]
    w._node_threads = {"a": threading.Thread(target=int), "b": threading.Thread(target=int)}  # no streams here
    for t in w._node_threads.values():
        t.start()
    w._heartbeat = lambda: None  # type: ignore[method-assign]
    asked: list[str] = []
    w.on_lost = lambda ev: asked.append(ev.node) or True
    w.events.put(Outcome("b", 1, error="node unreachable", lost=True))
    w.events.put(Outcome("a", 0, exit_code=0))
    assert w.run() is None and asked == ["b"]  # the others went on to the end without it
    w2 = Watcher({}, plan, None, watch_hangs=False)  # type: ignore[arg-type]
    w2._node_threads = dict(w._node_threads)
    w2._heartbeat = lambda: None  # type: ignore[method-assign]
    w2.on_lost = lambda ev: False
    w2._fail = lambda ev: ev  # type: ignore[method-assign]  # stopping the others: not here
    w2.events.put(Outcome("b", 1, error="node unreachable", lost=True))
    got = w2.run()
    assert got is not None and got.node == "b"


def test_the_watcher_hands_a_hung_rank_to_the_in_place_path_but_never_a_teardown_hang(monkeypatch, capsys):
    """A hang the watch named (its stacks taken first) goes to on_hung like a loss (the others regroup
    without that node, stack line saying so); one after every rank's last word (teardown) stops the run."""
    from runner.backends.ssh import hang_watch
    from runner.backends.ssh.watch import Outcome, Watcher

    stacks: list[str] = []
    monkeypatch.setattr(hang_watch, "take_stacks", lambda remotes, plan, skip: stacks.append("taken") or {})
    plan = SimpleNamespace(nodes=[SimpleNamespace(node="a"), SimpleNamespace(node="b")], run_id="r")
    threads = {"a": threading.Thread(target=int), "b": threading.Thread(target=int)}  # no streams here
    for t in threads.values():
        t.start()

    def watcher(on_hung):
        w = Watcher({}, plan, None, watch_hangs=False)  # type: ignore[arg-type]
        w._node_threads = dict(threads)
        w._heartbeat = lambda: None  # type: ignore[method-assign]
        w._fail = lambda ev: ev  # type: ignore[method-assign]  # stopping the others: not here
        w.on_hung = on_hung
        return w

    asked: list[str] = []
    w = watcher(lambda ev: asked.append(ev.node) or True)
    w.events.put(Outcome("b", 1, error="hang: rank 1 (b, pid 7) at step 5", hung=True))
    w.events.put(Outcome("a", 0, exit_code=0))
    assert w.run() is None and asked == ["b"] and stacks == ["taken"]
    assert "taking every rank's stacks, then going on without b (elastic.in_place)" in capsys.readouterr().err
    declined = watcher(lambda ev: False)
    declined.events.put(Outcome("b", 1, error="hang: rank 1", hung=True))
    got = declined.run()
    assert got is not None and got.node == "b" and got.hung
    teardown = watcher(lambda ev: asked.append("teardown") or True)
    teardown.events.put(Outcome("b", 1, error="hang: rank 1 ended", hung=True, teardown=True))
    got = teardown.run()
    assert got is not None and got.teardown and "teardown" not in asked
    assert "then stopping the run" in capsys.readouterr().err
