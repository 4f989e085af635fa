"""runner.agents.torchrun: three torchrun agents (real processes, static rendezvous on loopback)
whose last agent reaches the store late at the exit barrier (tests/support/late_agent.py makes the race of
pytorch/pytorch#69520 happen every time). Plain torchrun's master leaves with its store and that
agent logs "Error waiting on exit barrier"; the mended one waits for every agent first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.trainer_run import REPO, free_port, trainer_env

LATE_NODE = 1
# Node 1's worker ends last (so its agent checks in last, sets the barrier's key, then waits).
WORKER = ["--no-python", "sh", "-c", f'[ "$GROUP_RANK" != {LATE_NODE} ] || sleep 1; echo "worker $GROUP_RANK done"']
ERROR = "Error waiting on exit barrier"


def three_agents(way: str | list[str], late_s: float) -> list[subprocess.CompletedProcess]:
    """Each agent's exit and output; `way` per node, or one for all. A master port another test
    took between picking and binding is picked again."""
    ways = [way] * 3 if isinstance(way, str) else way
    for _ in range(3):
        port = free_port()
        procs = []
        for node in range(3):
            env = trainer_env({"LATE_AGENT_S": str(late_s) if node == LATE_NODE else "", "PYTHONPATH": str(REPO)})
            argv = [sys.executable, str(Path(__file__).resolve().parents[1] / "support" / "late_agent.py"), ways[node],
                    "--nnodes", "3", "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                    "--master-port", str(port), "--rdzv-backend", "static", "--max-restarts", "0", *WORKER]
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          cwd=REPO, env=env))
        done = []
        for p in procs:
            out, _ = p.communicate(timeout=240)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out))
        if "EADDRINUSE" not in done[0].stdout and "address already in use" not in done[0].stdout:
            return done
    pytest.fail(f"no free master port in 3 tries: {done[0].stdout[-2000:]}")


def test_plain_torchrun_loses_its_store_under_a_late_agent():
    """The control: the race is real with the stock agent (so the test below can fail)."""
    runs = three_agents("plain", 0.5)
    assert [r.returncode for r in runs] == [0, 0, 0], [r.stdout[-2000:] for r in runs]
    assert [ERROR in r.stdout for r in runs] == [False, True, False], [r.stdout[-2000:] for r in runs]


def test_mended_torchrun_waits_for_every_agent_before_its_store_goes():
    runs = three_agents("mended", 0.5)
    for node, r in enumerate(runs):
        assert r.returncode == 0, r.stdout[-2000:]
        assert f"worker {node} done" in r.stdout
        assert ERROR not in r.stdout, r.stdout[-2000:]
        assert "Failed to recv" not in r.stdout, r.stdout[-2000:]


def test_an_agent_of_plain_torchrun_beside_them_is_not_waited_for():
    """One node on an older image (plain torchrun, here the late one): the mended master waits only
    for the agents that announced themselves, so it does not sit out ACK_TIMEOUT_S for it."""
    runs = three_agents(["mended", "plain", "mended"], 0.0)
    assert [r.returncode for r in runs] == [0, 0, 0], [r.stdout[-2000:] for r in runs]
    assert "agents closed the exit barrier within" not in runs[0].stdout, runs[0].stdout[-2000:]


class _Store:
    """A TCPStore's add, as announce and acknowledge use it; `fail` raises as a store whose host left does."""

    def __init__(self, fail: BaseException | None = None, **values: int):
        self.values, self.fail, self.adds = {f"runner/exit-{k}": v for k, v in values.items()}, fail, 0

    def add(self, key: str, n: int) -> int:
        if self.fail:
            raise self.fail
        self.adds += 1
        self.values[key] = self.values.get(key, 0) + n
        return self.values[key]


def test_acknowledge_counts_in_and_only_the_host_waits_for_those_that_announced():
    from runner.agents.torchrun import acknowledge, announce

    worker = _Store(mended=3)
    assert acknowledge(worker, rank=2, timeout=0.2) is True
    assert (worker.values["runner/exit-acks"], worker.adds) == (1, 1)  # counted in once, no waiting

    host = _Store(mended=3, acks=2)  # both others already in
    assert acknowledge(host, rank=0, timeout=5) is True
    assert host.values["runner/exit-acks"] == 3 and host.adds == 2

    beside_plain = _Store(mended=2, acks=1)  # a third agent of plain torchrun never announced
    assert acknowledge(beside_plain, rank=0, timeout=5) is True

    alone = _Store(mended=3)  # one that announced never comes: the host leaves after its timeout, no hang
    assert acknowledge(alone, rank=0, timeout=0.1) is False
    assert alone.values["runner/exit-acks"] == 1 and alone.adds > 3

    fresh = _Store()
    announce(fresh)
    assert fresh.values == {"runner/exit-mended": 1}
    gone = RuntimeError("Failed to recv, got 0 bytes")
    announce(_Store(fail=gone))                               # quiet: the barrier reports a lost store
    assert acknowledge(_Store(fail=gone), rank=1) is True     # the host had gone: quiet
    assert acknowledge(_Store(fail=gone), rank=0) is False

    class Signal(Exception):  # torchrun's SignalException: a signal during the wait stops the agent
        pass

    with pytest.raises(Signal):
        acknowledge(_Store(fail=Signal("SIGTERM")), rank=0, passthrough=(Signal,))


def test_the_mend_wraps_this_torch_once():
    """This torch has the barrier the mend wraps (else the mend would do nothing, silently), and a
    second call leaves the one wrapper in place."""
    code = ("from runner.agents.torchrun import mend_exit_barrier as mend\n"
            "from torch.distributed.elastic.agent.server import api\n"
            "stock = api.SimpleElasticAgent._exit_barrier\n"
            "assert mend(); once = api.SimpleElasticAgent._exit_barrier\n"
            "assert mend(); twice = api.SimpleElasticAgent._exit_barrier\n"
            "assert once is twice and once is not stock and once.mended_by_runner\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=trainer_env({"PYTHONPATH": str(REPO)}), timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
