"""The runner waiting on the ranks' regroup-status files (contract/regroup.py) during an in-place
switch (runner/backends/ssh/elastic_loop.py): a newcomer's `ready`, then every rank's `resumed`.
Each file is read bounded (STATUS_MAX) and parsed as the contract says; a `failed` ends the wait."""

from __future__ import annotations

import time
from collections.abc import Callable

from contract.regroup import parse_status, status_name
from runner.core.redact import printable
from runner.transport.cluster import Cluster

STATUS_POLL_S = 0.2
READY_TIMEOUT_S = 600.0  # a node back: its container started to every rank `ready` (a Pi imports torch in ~1 min)
CONTAINER_CHECK_S = 2.0  # meanwhile, how often the layout's containers are asked whether they still run
STATUS_MAX = 4096


def wait_ready(cl: Cluster, runs: dict[str, str], epoch: int, procs: dict[str, int], containers: dict[str, str],
               running: set[str], timeout_s: float = READY_TIMEOUT_S,
               news: Callable[[], bool] = lambda: False) -> tuple[str | None, bool]:
    """(None, False) once every newcomer's rank answered `ready` (or later) for `epoch` in its status
    file (contract/regroup.py); else (why not, whether the running job had news meanwhile: one of the
    `running` nodes' containers stopped, or `news()`, the watch's event of it). Also: a newcomer's
    container stopped, or not all within timeout_s."""
    deadline, checked = time.time() + timeout_s, 0.0
    ok = {"ready", "seen", "left", "joined", "resumed"}
    while time.time() < deadline:
        if news():
            return "the running layout has news (a rank ended, failed or hung)", True
        def answered(n: str) -> int | str:
            got = 0
            for lr in range(procs[n]):
                t = cl[n].read_text(f"{runs[n]}/{status_name(lr)}", limit=STATUS_MAX)
                try:
                    st = parse_status(t, f"{n}:{status_name(lr)}") if t else None
                except ValueError:
                    st = None
                if st is not None and st["epoch"] == epoch and st["state"] == "failed":
                    return f"{n} local rank {lr}: {printable(str(st.get('error', ''))[:200])}"
                got += st is not None and st["epoch"] == epoch and st["state"] in ok
            return got
        got = cl.map(list(runs), answered)
        failed = [v for _, v, err in got if err is None and isinstance(v, str)]
        if failed:
            return failed[0], False
        if all(err is None and v == procs[n] for n, v, err in got):
            return None, False
        if time.time() - checked >= CONTAINER_CHECK_S:  # an engine that does not answer: asked again
            checked = time.time()
            for n, state, err in cl.map(list(containers), lambda n: cl[n].docker().containers.get(containers[n]).status):
                if err is None and state != "running":
                    return f"{n}'s container is {state}", n in running
        time.sleep(STATUS_POLL_S)
    return f"no `ready` from every rank within {timeout_s:.0f} s", False


def wait_resumed(cl: Cluster, runs: dict[str, str], spec, procs: dict[str, int]) -> dict | str:
    """Every rank's regroup-status (contract/regroup.py) at `resumed` for spec's epoch: (node, local
    rank) -> its status; or why not (a rank `failed`, or not all within spec.timeout_s)."""
    deadline = time.time() + spec.timeout_s
    got: dict = {}
    while time.time() < deadline:
        def one(n: str) -> list:
            return [cl[n].read_text(f"{runs[n]}/{status_name(lr)}", limit=STATUS_MAX) for lr in range(procs[n])]

        for n, texts, err in cl.map(list(runs), one):
            for lr, t in enumerate(texts if err is None and texts else []):
                try:
                    st = parse_status(t or "", f"{n}:{status_name(lr)}") if t else None
                except ValueError:
                    st = None
                if st is not None and st["epoch"] == spec.epoch:
                    if st["state"] == "failed":
                        return f"{n} local rank {lr}: {printable(str(st.get('error', ''))[:200])}"
                    if st["state"] == "resumed":
                        got[(n, lr)] = st
        if len(got) == sum(procs.values()):
            return got
        time.sleep(STATUS_POLL_S)
    return f"{sum(procs.values()) - len(got)} rank(s) not resumed within {spec.timeout_s:.0f} s"
