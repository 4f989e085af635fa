"""The rejoin scenario of tests/support/regroup_harness.py: a node coming back joins a running
`elastic.in_place` job in place (issue 58): the running ranks switch layout at a step boundary in
their own processes, and the newcomer, started with no group and no weights, receives its stage
from them over the new group.

node-0 and node-1 train as pp 2 (train.run itself, `elastic.in_place true`). Once both are in step
2, this process (playing the runner) writes regroup.json for node-0, node-1 and node-2 as pp 3 with
`at_step` AT_STEP into the three run dirs, and forks node-2's trainer with ELASTIC_JOIN_EPOCH 1
(trainer/parallel/stage_relayout.py JOIN_ENV). Each rank's step ends are flagged (pid, layout) by a
test callback; the exit codes, pids, status files and flags go to CTL/result.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from tests.support.regroup_harness import _child_setup, flag, free_port, spec_for, wait_flag, write_spec

POINTS = "tests.support.regroup_rejoin:make_points"
AT_STEP = 4


class _Points:
    def __init__(self, ctl: Path, node: str):
        self.ctl, self.node = ctl, node

    def on_step_start(self, trainer: Any, step: int) -> None:
        flag(self.ctl, f"start{step + 1}.{self.node}", time.time())

    def on_step_end(self, trainer: Any, record: dict | None) -> None:
        flag(self.ctl, f"end{trainer.step}.{self.node}",
             {"t": time.time(), "pp": trainer.dims.pp, "pid": os.getpid(), "rank": trainer.env.rank})


def make_points(trainer: Any) -> _Points:
    return _Points(Path(os.environ["IN_PLACE_CTL"]), os.environ["NODE_NAME"])


def _rank(r: int, world: int, ctl: Path, port: int, cfg_path: str, args: list[str], join: int | None) -> None:
    _child_setup()
    node = f"node-{r}"
    os.environ.update({"NODE_NAME": node, "IN_PLACE_CTL": str(ctl), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    if join is not None:
        os.environ["ELASTIC_JOIN_EPOCH"] = str(join)
    from tests.support.regroup_exact import _args
    from trainer import train
    from trainer.runtime.dist_env import DistEnv

    train.CALLBACKS.append(POINTS)
    cfg = _args(cfg_path, args, ["--output-dir", str(ctl / node), "--elastic.in_place", "true",
                                 "--parallel.pp", "2", "--parallel.dp", "1", "--train.batch_size", "16"])
    code = 1
    try:
        code = train.run(cfg, DistEnv(0 if join is not None else r, world, 0, 1, "127.0.0.1", port, "torchrun"))
    except BaseException as e:  # noqa: BLE001 - the result names it
        (ctl / f"error{r}.txt").write_text(f"{type(e).__name__}: {e}"[:2000])
    os._exit(code)


def rejoin(ctl: Path, cfg_path: str, args: list[str]) -> dict:
    """The parent: see the module doc."""
    import multiprocessing as mp

    for r in range(3):
        (ctl / f"node-{r}").mkdir(parents=True, exist_ok=True)
    port = free_port()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(r, 2, ctl, port, cfg_path, args, None)) for r in range(2)]
    for p in procs:
        p.start()
    out: dict = {"pids": {f"node-{r}": p.pid for r, p in enumerate(procs)}}
    nodes = ["node-0", "node-1", "node-2"]
    try:
        for n in nodes[:2]:
            wait_flag(ctl, f"start2.{n}", 300, procs)
        spec = spec_for(1, free_port(), nodes, 3, why="node-2 back")
        spec = dataclasses.replace(spec, at_step=AT_STEP)
        out["t_write"] = write_spec(ctl, nodes, spec)
        newcomer = ctx.Process(target=_rank, args=(2, 1, ctl, free_port(), cfg_path, args, 1))
        newcomer.start()
        procs.append(newcomer)
        out["pids"]["node-2"] = newcomer.pid
        out["t_started"] = time.time()
        for p in procs:
            p.join(300)
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
