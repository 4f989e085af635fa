"""The exactness scenario of tests/support/regroup_harness.py: the real Trainer, a node lost, the survivors
regrouped in place from memory. `_survive` is, step for step, what train.run must do once issue 58 is
integrated (trainer/runtime/regroup.py's module doc and the report of the session that wrote it).

Rank r runs the trainer on CONFIG + ARGS as pp 3 (run dir CTL/node-r, its own "node"), with stage
replicas refreshed at every step's end. After step LOSE_AFTER (its checkpoint written by the
trainer's own checkpointer, the replicas' exchange of that step complete) rank 2 waits to be lost
and ranks 0 and 1 go on into the next step; the parent stops or kills rank 2 and writes the
regroup file. The survivors' step fails, they rejoin as a 2-rank group, build the pp 2 trainer,
assemble its stages from memory and train to the end.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import time
from pathlib import Path

from tests.support.regroup_harness import (
    LOSE_AFTER,
    _child_setup,
    flag,
    free_port,
    spec_for,
    usage,
    wait_flag,
    write_spec,
)


class _Points:
    """Test points on the trainer's callbacks: where each rank is, and rank 2 held for its loss."""

    def __init__(self, ctl: Path, rank: int, replicas, victim: int | None = None):
        self.ctl, self.rank, self.replicas, self.victim = ctl, rank, replicas, victim

    def on_step_start(self, trainer, step: int) -> None:
        flag(self.ctl, f"start{step + 1}.{self.rank}", time.time())

    def on_step_end(self, trainer, record) -> None:
        flag(self.ctl, f"end{trainer.step}.{self.rank}", time.time())
        if trainer.step == LOSE_AFTER and self.rank == self.victim:
            self.replicas.settle(60)  # its step-4 state has reached rank 1 (a loss later in the step: stage_moves)
            flag(self.ctl, "victim-ready")
            while True:
                time.sleep(1)


def _args(cfg_path: str, args: list[str], extra: list[str]):
    from trainer.config.argv import parse_train_args
    from trainer.config.resolve import resolve

    path, overrides = parse_train_args(["--config", cfg_path, *args, *extra])
    return resolve(path, overrides)


def _trainer(cfg, rank: int, world: int, port: int, backend: str):
    import torch

    from trainer.parallel.mesh import ParallelDims
    from trainer.runtime.dist_env import DistEnv
    from trainer.train import Trainer

    env = DistEnv(rank, world, 0, 1, "127.0.0.1", port, "torchrun")
    dims = ParallelDims.from_config(cfg.parallel, world, 1)
    dims.build_mesh("cpu")
    return Trainer(cfg, env, dims, torch.device("cpu"), backend)


def _replicas(trainer, rank: int):
    from trainer.parallel.pipeline import pp_lines
    from trainer.parallel.stage_assembly import ReplicaCallback
    from trainer.parallel.stage_replicas import StageReplicas, make_groups

    group, line, pp_rank = make_groups(pp_lines(trainer.dims.mesh), rank)
    rep = StageReplicas(line, pp_rank, group)
    trainer.callbacks.append(ReplicaCallback(rep))
    return rep


def _rank(r: int, ctl: Path, port: int, victim: int, cfg_path: str, args: list[str]) -> None:
    _child_setup()
    from trainer.runtime import dist_env
    from trainer.runtime.regroup import ConnectionCut, Watcher
    from trainer.train import setup_logging

    node, out = f"node-{r}", ctl / f"node-{r}"
    cfg = _args(cfg_path, args, ["--output-dir", str(out)])
    cut = ConnectionCut()  # before any group: what it spares is not a group's
    watcher = Watcher(out, node, 0, cut).start()
    setup_logging(r, out, console=False)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    env = dist_env.DistEnv(r, 3, 0, 1, "127.0.0.1", port, "torchrun")
    backend = dist_env.init_process_group(env, "cpu", "gloo", 600)
    trainer = _trainer(cfg, r, 3, port, backend)
    rep = _replicas(trainer, r)
    trainer.callbacks.append(_Points(ctl, r, rep, victim))
    res: dict = {"rank": r}
    try:
        trainer.fit()
        res["outcome"] = "finished"  # not expected of a survivor
    except Exception as e:  # noqa: BLE001 - the step the loss interrupted: what train.run will catch
        res["outcome"], res["t_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}", time.time()
    res.update(_survive(r, ctl, node, cfg_path, args, trainer, rep, watcher, backend))
    (ctl / f"result{r}.json").write_text(json.dumps(res))
    os._exit(0)


def _survive(r, ctl, node, cfg_path, args, trainer, rep, watcher, backend) -> dict:  # long: the integration, in order
    """After the step failed: wait for the runner's word, rejoin, rebuild, assemble, train on."""
    import torch.distributed as dist

    from trainer.parallel.stage_assembly import assemble, load_stage, restore_run_state
    from trainer.runtime.regroup import rejoin, write_status

    out: dict = {}
    spec = watcher.wait(120)
    if spec is None:
        raise RuntimeError("no regroup file within 120 s: the restart path takes over")
    times = dict(watcher.times)
    rep.settle(10)  # the replica exchange in flight has ended (its connections were cut too)
    old_pp = trainer.dims.pp
    trainer.close()
    del trainer
    gc.collect()  # the old stages, schedule and groups go before the new ones come
    new_rank = spec.rank_of(node, 0)
    out["rejoin_s"] = rejoin(spec, new_rank, backend)
    times["joined"] = time.time()
    watcher.done(spec)
    lay = spec.layout
    cfg2 = _args(cfg_path, args, ["--output-dir", str(ctl / node), "--parallel.pp", str(lay.pp), "--parallel.dp",
                                  str(lay.dp), "--train.batch_size", str(lay.batch_size), "--parallel.partition",
                                  lay.partition])
    # A fresh Trainer truncates metrics.jsonl unless it resumes; an in-place regroup must append
    # (train.py: MetricsWriter(resume=True) for a relayout). Kept aside and put back here.
    metrics = ctl / node / "metrics.jsonl"
    before = metrics.read_bytes() if metrics.exists() else b""
    t0 = time.perf_counter()
    trainer2 = _trainer(cfg2, new_rank, spec.world_size, spec.master_port, backend)
    if before:
        metrics.write_bytes(before)
    out["build_s"] = time.perf_counter() - t0
    need = [n for part in trainer2.par.model_parts for n, _ in getattr(part, "module", part).named_parameters()]
    asm = assemble(rep, old_pp, need)
    out["loaded"] = load_stage(trainer2.par.model_parts, trainer2.optimizer, asm.state)
    restore_run_state(trainer2, asm.run_state)
    rep.close()
    out.update({"from_step": asm.step, "moves": asm.moves, "bytes_in": asm.bytes_in, "bytes_out": asm.bytes_out,
                "assemble_s": asm.seconds, "held": rep.held()})
    rep2 = _replicas(trainer2, new_rank)  # the new layout keeps replicas too
    trainer2.callbacks.append(_Points(ctl, 10 + new_rank, rep2))
    times["resumed"] = time.time()
    write_status(ctl / node, 0, spec.epoch, "resumed", times, rank=new_rank, step=asm.step)
    trainer2.fit()
    rep2.settle(30)
    out.update({"times": times, "new_rank": new_rank, "replica_copy_s": rep2.copy_s,
                "replica_exchange_s": rep2.exchange_s, "held_after": rep2.held(), "threads_fds": usage()})
    trainer2.close()
    rep2.close()
    dist.destroy_process_group()
    return out


def exact(ctl: Path, how: str, victim: int, cfg_path: str, args: list[str]) -> dict:
    import multiprocessing as mp

    for r in range(3):
        (ctl / f"node-{r}").mkdir(parents=True, exist_ok=True)
    port = free_port()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(r, ctl, port, victim, cfg_path, args)) for r in range(3)]
    for p in procs:
        p.start()
    out: dict = {"how": how, "victim": victim}
    survivors = [r for r in range(3) if r != victim]
    try:
        wait_flag(ctl, "victim-ready", 300, procs)
        for r in survivors:
            wait_flag(ctl, f"start{LOSE_AFTER + 1}.{r}", 60, procs)
        time.sleep(0.5)  # the survivors wait in step 5 on rank 2
        os.kill(procs[victim].pid, signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        out["t_lost"] = time.time()
        time.sleep(0.5)
        nodes = [f"node-{r}" for r in survivors]
        out["t_write"] = write_spec(ctl, nodes, spec_for(1, free_port(), nodes, 2, why=f"lost node-{victim}"))
        for r in survivors:
            procs[r].join(300)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    out["exitcodes"] = [p.exitcode for p in procs]
    out["ranks"] = [json.loads((ctl / f"result{r}.json").read_text()) for r in survivors
                    if (ctl / f"result{r}.json").exists()]
    (ctl / "result.json").write_text(json.dumps(out, indent=1))
    return out
