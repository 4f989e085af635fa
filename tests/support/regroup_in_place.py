"""The in-place scenario of tests/support/regroup_harness.py: the trainer's own `train.run` with
`elastic.in_place true`, a node lost, the survivors regrouped by train.run itself (issue 58).

Rank r is node-r (NODE_NAME, run dir CTL/node-r) of a pp 3 run. A test callback (added to
train.CALLBACKS in the forked rank only) flags each step's start and end per node and holds the
VICTIM at the start of step LOSE_AFTER + 1, once its step-4 replica has reached its predecessor. The
parent (playing the runner) stops or kills it, and writes the regroup file with a new port into the
survivors' run dirs; nothing else tells the survivors what to do. Each rank's exit code, its
regroup-status file and the step flags go to CTL/result.json.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from tests.support.regroup_harness import (
    LOSE_AFTER,
    _child_setup,
    flag,
    free_port,
    spec_for,
    wait_flag,
    write_spec,
)

POINTS = "tests.support.regroup_in_place:make_points"


class _Points:
    def __init__(self, ctl: Path, node: str, victim: str):
        self.ctl, self.node, self.victim = ctl, node, victim

    def on_step_start(self, trainer: Any, step: int) -> None:
        if step == LOSE_AFTER and self.node == self.victim:
            from trainer.parallel.stage_assembly import ReplicaCallback

            rep = next(cb.replicas for cb in trainer.callbacks if isinstance(cb, ReplicaCallback))
            rep.settle(60)  # its step-4 state has reached its predecessor
            flag(self.ctl, "victim-ready", time.time())
            while True:
                time.sleep(1)
        flag(self.ctl, f"start{step + 1}.{self.node}", time.time())

    def on_step_end(self, trainer: Any, record: dict | None) -> None:
        flag(self.ctl, f"end{trainer.step}.{self.node}", {"t": time.time(), "pp": trainer.dims.pp})


def make_points(trainer: Any) -> _Points:
    return _Points(Path(os.environ["IN_PLACE_CTL"]), os.environ["NODE_NAME"], os.environ["IN_PLACE_VICTIM"])


def _rank(r: int, ctl: Path, port: int, victim: int, cfg_path: str, args: list[str]) -> None:
    _child_setup()
    node = f"node-{r}"
    os.environ.update({"NODE_NAME": node, "IN_PLACE_CTL": str(ctl), "IN_PLACE_VICTIM": f"node-{victim}",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    from tests.support.regroup_exact import _args
    from trainer import train
    from trainer.runtime.dist_env import DistEnv

    train.CALLBACKS.append(POINTS)
    cfg = _args(cfg_path, args, ["--output-dir", str(ctl / node), "--elastic.in_place", "true"])
    code = 1
    try:
        code = train.run(cfg, DistEnv(r, 3, 0, 1, "127.0.0.1", port, "torchrun"))
    except BaseException as e:  # noqa: BLE001 - the result names it
        (ctl / f"error{r}.txt").write_text(f"{type(e).__name__}: {e}"[:2000])
    os._exit(code)


def in_place(ctl: Path, how: str, victim: int, cfg_path: str, args: list[str]) -> dict:
    """The parent: see the module doc."""
    import multiprocessing as mp

    for r in range(3):
        (ctl / f"node-{r}").mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = [mp.get_context("fork").Process(target=_rank, args=(r, ctl, port, victim, cfg_path, args))
             for r in range(3)]
    for p in procs:
        p.start()
    out: dict = {"how": how, "victim": victim}
    survivors = [r for r in range(3) if r != victim]
    nodes = [f"node-{r}" for r in survivors]
    try:
        wait_flag(ctl, "victim-ready", 300, procs)
        for n in nodes:
            wait_flag(ctl, f"start{LOSE_AFTER + 1}.{n}", 60, procs)
        time.sleep(0.5)  # the survivors wait in step 5 on the victim
        os.kill(procs[victim].pid, signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        out["t_lost"] = time.time()
        time.sleep(0.5)  # a runner takes its time to notice
        out["t_write"] = write_spec(ctl, nodes, spec_for(1, free_port(), nodes, 2, why=f"lost node-{victim}"))
        for r in survivors:
            procs[r].join(300)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    out["exitcodes"] = [p.exitcode for p in procs]
    out["errors"] = {r: (ctl / f"error{r}.txt").read_text() for r in range(3) if (ctl / f"error{r}.txt").exists()}
    out["status"] = {n: json.loads((ctl / n / "regroup-status.local0.json").read_text()) for n in nodes
                     if (ctl / n / "regroup-status.local0.json").exists()}
    out["flags"] = {f.name: json.loads(f.read_text() or '""') for f in ctl.iterdir()
                    if f.is_file() and f.name.startswith(("start", "end"))}
    (ctl / "result.json").write_text(json.dumps(out, indent=1))
    return out
