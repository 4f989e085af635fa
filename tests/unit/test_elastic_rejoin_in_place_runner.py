"""The runner's side of a node coming back under `elastic.in_place` (issue 58), decided without a node:
one container started on it, regroup.json of the larger layout (at_step 0: the next step boundary)
written to every node of it, every rank's `resumed` waited for, the history; where it cannot apply,
the restart path with one line; the watcher watching the new container in the lost one's place.
End to end: tests/sandbox/test_elastic_rejoin_in_place_sandbox.py."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

from contract import regroup as contract
from runner.backends.ssh import elastic_loop, regroup_wait
from runner.backends.ssh.elastic_loop import ElasticRun
from runner.inventory import load_inventory
from tests.unit.test_elastic_in_place_runner import FakeCluster, FakeNode, _status
from tests.unit.test_elastic_plan import _no_profiles, inventory  # noqa: F401 - the fixture, autouse here too


def _after_a_loss(tmp_path, monkeypatch, args=("--parallel.partition", "uniform_transformer")):
    monkeypatch.setattr(regroup_wait, "STATUS_POLL_S", 0.01)
    monkeypatch.setattr(elastic_loop, "node_paths", lambda node, home: SimpleNamespace(run=lambda rid: f"{home}/runs/{rid}"))
    inv = load_inventory(str(inventory(tmp_path, args=[*args, "--elastic.in_place", "true"])))
    el = ElasticRun(inv, inv.job.elastic, False, tmp_path / "logs")
    el._watch = lambda cl, run_id: None  # no retry thread here
    cl = FakeCluster({n: FakeNode(tmp_path / n) for n in ("node-0", "node-1", "node-2")})
    homes = {n: "/home" for n in cl.nodes}
    for n in ("node-0", "node-1"):
        _status(tmp_path / n, "/home/runs/r1", 1, "resumed")
    ev = SimpleNamespace(node="node-2", error="node unreachable", since=1.0, detected=2.0)
    assert el.regroup_in_place(cl, "r1", homes, ev) is True and el.layout.pp == 2
    del el.lost["node-2"]  # what the retry thread does once it answers (rejoin on)
    el.returned.append("node-2")
    el.back.set()
    return el, cl, homes


def test_a_node_back_gets_one_container_and_every_node_the_larger_layout_s_file(tmp_path, monkeypatch):
    el, cl, homes = _after_a_loss(tmp_path, monkeypatch)
    started: list[tuple[str, int]] = []
    for n in ("node-0", "node-1", "node-2"):
        _status(tmp_path / n, "/home/runs/r1", 2, "resumed", step=8)
    plans = el.rejoin_in_place(cl, "r1", homes, lambda n, e: started.append((n, e)) or SimpleNamespace(node=n))
    assert started == [("node-2", 2)]  # one container, on the node back only, told the epoch it joins
    assert [p.node for p in plans or []] == ["node-2"]
    for n in ("node-0", "node-1", "node-2"):
        spec = contract.read(tmp_path / n / "home/runs/r1" / contract.REGROUP_FILE)
        assert (spec.epoch, spec.at_step, spec.layout.pp, spec.why) == (2, 0, 3, "node-2 back")
        assert spec.ranks == {"node-0": [0], "node-1": [1], "node-2": [2]}
    assert el.layout.pp == 3 and el.epoch == 2 and el.returned == [] and not el.back.is_set()
    events = [json.loads(x) for x in (tmp_path / "logs" / "elastic.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("in_place"), e.get("from_step"), e.get("epoch")) for e in events][-1] == \
        ("layout", True, 8, 2)


def test_where_the_rejoin_cannot_be_in_place_the_restart_path_says_why_in_one_line(tmp_path, monkeypatch, capsys):
    el, cl, homes = _after_a_loss(tmp_path, monkeypatch)
    started: list[str] = []
    # the newcomer fails before it is ready: no file written, the restart path takes over
    _status(tmp_path / "node-2", "/home/runs/r1", 2, "failed")
    assert el.rejoin_in_place(cl, "r1", homes, lambda n, e: started.append(n) or SimpleNamespace(node=n)) is None
    assert started == ["node-2"] and el.layout.pp == 2 and el.returned == ["node-2"] and el.back.is_set()
    assert contract.read(tmp_path / "node-0" / "home/runs/r1" / contract.REGROUP_FILE).epoch == 1  # the loss's
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("runner: run r1: node-2 not ready to join in place (node-2 local rank 0: boom); "
                       "restarting every node instead"), err
    # a running layout without stage replicas (pp 1): nothing started, nothing written
    el.layout = SimpleNamespace(pp=1, tp=1, nodes=("node-0", "node-1"))
    started.clear()
    assert el.rejoin_in_place(cl, "r1", homes, lambda n, e: started.append(n)) is None and started == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not joined in place (the running layout (pp 1, tp 1) keeps no stage replicas" in err[0]


def test_the_watcher_watches_the_joined_container_in_the_lost_one_s_place_or_yields():
    from runner.backends.ssh.watch import Outcome, Watcher

    plan = SimpleNamespace(nodes=[SimpleNamespace(node="a"), SimpleNamespace(node="b")], run_id="r")
    back = threading.Event()
    w = Watcher({}, plan, None, yield_to=back, watch_hangs=False)  # type: ignore[arg-type]
    w._node_threads = {"a": threading.Thread(target=int)}
    w._node_threads["a"].start()
    w._heartbeat = lambda: None  # type: ignore[method-assign]
    w.on_lost = lambda ev: True
    joined = SimpleNamespace(node="b", rank=2)
    w._follow = lambda np: w.events.put(Outcome(np.node, np.rank, exit_code=0))  # type: ignore[method-assign]

    def on_back():
        back.clear()
        w.events.put(Outcome("a", 0, exit_code=0))
        return [joined]

    w.on_back = on_back
    w.events.put(Outcome("b", 1, error="node unreachable", lost=True))
    threading.Timer(0.7, back.set).start()  # b back after its loss was handled
    assert w.run() is None  # a, and b's new container, exited 0
    assert plan.nodes[1] is joined and w.done["b"].exit_code == 0 and w._gen == {"b": 1}
    w2 = Watcher({}, SimpleNamespace(nodes=[SimpleNamespace(node="a")], run_id="r"), None, yield_to=back,
                 watch_hangs=False)  # type: ignore[arg-type]
    w2._node_threads = dict(w._node_threads)  # no streams here
    w2._heartbeat = lambda: None  # type: ignore[method-assign]
    w2.on_back = lambda: None
    w2._yield = lambda: "yielded"  # type: ignore[method-assign,assignment]
    back.set()
    assert w2.run() == "yielded"


def test_news_from_the_running_layout_ends_the_wait_for_a_newcomer_at_once(tmp_path, monkeypatch, capsys):
    """A running rank that ends, fails or hangs while the newcomer starts (the watch's event queue not
    empty): the wait for its `ready` ends at the next poll, not after READY_TIMEOUT_S (600 s), the
    newcomer is stopped and the watch takes the event; before, the watch loop was held meanwhile."""
    el, cl, homes = _after_a_loss(tmp_path, monkeypatch)
    stopped: list[str] = []
    monkeypatch.setattr(elastic_loop, "stop_node", lambda remote, run_id, grace: stopped.append(run_id) or [])
    polls: list[int] = []
    news = lambda: polls.append(1) or len(polls) >= 3  # noqa: E731 - news on the third poll
    got = el.rejoin_in_place(cl, "r1", homes, lambda n, e: SimpleNamespace(node=n), news=news)
    assert got == [] and len(polls) == 3 and stopped == ["r1"]
    assert el.returned == [] and not el.back.is_set() and el.layout.pp == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "runner: run r1: node-2 not joined: the running layout has news (a rank ended, failed or hung) " \
                      "before it was ready", err


def test_the_watch_s_news_is_an_outcome_of_a_node_it_still_watches():
    """A lost node's late word (its old container's stream ending) is no news; a running node's is."""
    from runner.backends.ssh.watch import Outcome, Watcher

    plan = SimpleNamespace(nodes=[SimpleNamespace(node="a"), SimpleNamespace(node="b")], run_id="r")
    w = Watcher({}, plan, None, watch_hangs=False)  # type: ignore[arg-type]
    w.done["b"] = Outcome("b", 1, error="node unreachable", lost=True)
    assert not w.news()
    w.events.put(Outcome("b", 1, error="lost contact with the engine"))
    assert not w.news()
    w.events.put(Outcome("a", 0, exit_code=1))
    assert w.news()
