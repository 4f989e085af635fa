"""Sharded checkpoints (torch.distributed.checkpoint), resume, preemption and the `latest` pointer.

Layout under checkpoint.dir (default OUTPUT_DIR/checkpoints; see docs/checkpoints.md):

    step-6/                      a complete checkpoint (name from checkpoint.name / prefix)
      .metadata, __<rank>_<i>.distcp   DCP shards: model + optimizer, full-model FQNs
      trainer_state.json         step, tokens, epoch, data position, LR schedule, layout, model
      rank<r>.pt                 per-rank RNG (torch, python, numpy, cuda) and data position
      manifest.rank<r>.json      size + crc32 of every file rank r wrote (verified on load)
      config.yaml, config.json, tokenizer files (trainer/models/files.py), [*_state_dict.pt with format: full]
    step-8.preempt/              written on SIGTERM/SIGUSR1 or every preempt_interval steps
    latest                       the name of the newest complete checkpoint

Atomic: everything is written to `.tmp-<name>/`; only after every rank has finished (barrier)
does rank 0 rename it to `<name>` and then rewrite `latest` (write + os.replace). A crash at any
point leaves `latest` naming the previous complete checkpoint.

Only what the trainer wrote is ever removed or replaced (trainer/checkpoint/ownership.py): a
directory of a checkpoint's name that is not the trainer's refuses the save (before the run trains,
when it is there at the start), and pruning passes it over.

Without shared storage (each node's OUTPUT_DIR on its own disk) the same happens per node: the
first rank of each disk renames that node's directory and writes its `latest`, and rank 0's
description files are copied to every node (trainer/checkpoint/storage.py). Resume then needs
the union of all nodes' files on each node (`runner up --resume` syncs them).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer.checkpoint import disk_space, ownership, safe_read
from trainer.checkpoint import state as ckpt_state
from trainer.checkpoint.on_disk import (
    LATEST,
    PREEMPT_SUFFIX,
    STATE_FILE,
    TMP_PREFIX,
    crc32,
    list_checkpoints,
    read_state,
    resolve_resume,
    verify_manifests,
)
from trainer.checkpoint.on_disk import scheduler_error as _scheduler_error
from trainer.checkpoint.on_disk import truncate_metrics as _truncate_metrics
from trainer.checkpoint.preempt import EXIT_PREEMPTED, Preemption
from trainer.checkpoint.replicas import Replicas
from trainer.checkpoint.state import ModelOptimState, merged_model, model_signature, rng_state, set_rng_state
from trainer.checkpoint.storage import MISSING_HINT, StorageLayout, agree_on_latest, probe, share_rank0_files
from trainer.config import ConfigError
from trainer.models import files as model_files
from trainer.optim import restart_schedule_at, schedule_mismatch, schedule_signature
from trainer.runtime import heartbeat, hold

log = logging.getLogger("trainer")

def _dist() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _barrier() -> None:
    if _dist():
        dist.barrier()


def _broadcast(obj: Any) -> Any:
    if not _dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _agree_error(error: str | None) -> None:
    """Raise a ConfigError on every rank if any rank found an error (no rank left waiting): a
    rank's own error, else the first one (per-node storage: each node names its own file)."""
    errors = [error]
    if _dist():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise ConfigError(error or first)


def checkpoint_root(cfg: Any) -> Path:
    out = Path(cfg.output_dir)
    d = cfg.checkpoint.dir
    return out / "checkpoints" if not d else (Path(d) if Path(d).is_absolute() else out / d)


class Checkpointer:
    """The trainer callback: periodic/final/preempt saves, resume at start (see module doc)."""

    def __init__(self, trainer: Any):
        self.cfg = trainer.cfg.checkpoint
        self.root = checkpoint_root(trainer.cfg)
        self.output_dir = trainer.output_dir
        self.active = (self.cfg.enabled or self.cfg.interval > 0 or self.cfg.preempt_interval > 0
                       or trainer.cfg.train.exit_interval > 0)
        # The per-step preemption vote goes over gloo on the host: on NCCL it would wait for the GPU.
        cpu_group = None
        if self.cfg.on_signal and _dist() and dist.get_backend() != "gloo":
            cpu_group = dist.new_group(backend="gloo")
        self.preemption = Preemption(cpu_group) if self.cfg.on_signal else None
        self.model = merged_model(trainer.par.model_parts)
        self.app = ModelOptimState(self.model, trainer.optimizer, diloco=getattr(trainer, "diloco", None))
        self.saved_step = -1
        self.preempted = False
        self.pending: Any = None          # async save waiting to be finalized
        self._layout: StorageLayout | None = None
        self.async_pg = None
        self.replicas = Replicas(self.cfg.replicas)
        self.names = ownership.name_pattern(self.cfg.name, self.cfg.prefix)
        self._passed_over: set[Path] = set()  # foreign look-alikes pruning left, warned about once
        if self.cfg.async_save and _dist():
            self.async_pg = dist.new_group(backend="gloo")  # background writes never share the training pg

    def layout(self) -> StorageLayout:
        """Who finalizes which directory (collective on first use; see checkpoint_storage.py)."""
        if self._layout is None:
            self._layout = probe(self.root) if _dist() else StorageLayout((0,))
            if not self._layout.shared:
                log.warning("checkpoint dir %s is not shared by all ranks (%s see the same files): each node "
                            "keeps its own copy of every checkpoint, finalized by its first rank", self.root,
                            self._layout.describe())
        return self._layout

    def _resume_path(self) -> Path | None:
        error, path = None, None
        try:
            path = resolve_resume(self.cfg.resume, self.root)
        except ConfigError as e:
            error = str(e)
        _agree_error(error)
        if self.cfg.resume != "latest" or not _dist() or self.layout().shared:
            return path
        return self._agree_latest(path)

    def _agree_latest(self, path: Path | None) -> Path | None:
        """Per-node storage: every node has its own `latest`; see checkpoint_storage.agree_on_latest."""
        mine = (None if path is None else path.name, [(s, d.name) for s, d in list_checkpoints(self.root)])
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        name, warning = agree_on_latest(everyone, self.root / LATEST)  # the same answer on every rank
        if warning:
            log.warning("%s", warning)
        return None if name is None else self.root / name

    # ------------------------------------------------------------------ trainer hooks
    def on_train_start(self, trainer: Any) -> None:
        if self.preemption is not None:
            self.preemption.install()
        if self.cfg.resume:
            path = self._resume_path()
            if path is None:
                log.warning("checkpoint.resume latest: no checkpoint under %s yet; starting from step 0", self.root)
            else:
                self.load(trainer, path)
        if self.active:
            self._check_room_to_save(trainer)

    def _check_room_to_save(self, trainer: Any) -> None:
        """Collective: refuse the run before it trains when something not the trainer's stands where
        one of its saves would go (the save itself checks again: ownership.in_the_way)."""
        root_error = None
        if os.path.lexists(self.root) and not self.root.is_dir():
            root_error = f"checkpoint.dir: '{self.root}' exists and is not a directory; {ownership.MOVE_AWAY}"
        _agree_error(root_error)  # before the probe, which makes the directory
        leader = self.layout().is_leader(_rank())
        _agree_error(ownership.future_problem(self.root, self.names, trainer.step, trainer.total_steps)
                     if leader else None)

    def on_step_end(self, trainer: Any, record: dict | None) -> None:
        self._finish_pending()
        step = trainer.step
        if self.preemption is not None and self.preemption.agree():
            path = self.save(trainer, preempt=True)
            log.warning("%s received: stopped after step %d, preempt checkpoint %s; exiting with %d "
                        "(continue with --resume latest)", self.preemption.signal_name, step, path, EXIT_PREEMPTED)
            self.preempted = True
            trainer.stop_requested = True
            trainer.exit_code = EXIT_PREEMPTED
            return
        if self.cfg.interval > 0 and step % self.cfg.interval == 0 and step < trainer.total_steps:
            self.save(trainer)
        elif self.cfg.preempt_interval > 0 and step % self.cfg.preempt_interval == 0 and step < trainer.total_steps:
            self.save(trainer, preempt=True)
        hold.hold("step", step, self.output_dir, _rank(),  # tests only (trainer/runtime/hold.py)
                       lambda: self.preemption is not None and self.preemption.received is not None)

    def on_train_end(self, trainer: Any) -> None:
        if not self.preempted and self.active and self.saved_step != trainer.step:
            self.save(trainer)
        self._finish_pending()
        if self.preemption is not None:
            self.preemption.uninstall()

    # ------------------------------------------------------------------ save
    def _name(self, step: int, preempt: bool) -> str:
        suffix = PREEMPT_SUFFIX if preempt else ""
        if not self.cfg.prefix:
            return self.cfg.name.replace("{step}", str(step)) + suffix  # never str.format (config/resolve.py)
        # FSDP stub: <prefix>.<timestamp>, named by rank 0 for all ranks. The stamp has one-second
        # resolution: a second save within the same second becomes <stamp>-1 (-2, ...) instead of
        # silently replacing the first (names still sort by time).
        name = None
        if _rank() == 0:
            stamp = f"{self.cfg.prefix}.{time.strftime('%Y_%m%d_%H%M_%S')}"
            name, n = stamp + suffix, 0
            while os.path.lexists(self.root / name) or os.path.lexists(self.root / (TMP_PREFIX + name)):
                n += 1
                name = f"{stamp}-{n}{suffix}"
        return _broadcast(name)

    def _train_state(self, trainer: Any) -> dict:
        data = trainer.data
        blocks = data.blocks.shape[0] if data.blocks is not None else None
        loss_min = trainer.loss_min.detach().reshape(1).clone()  # on the training device (NCCL or gloo)
        if _dist():  # only the loss-owning ranks saw losses
            dist.all_reduce(loss_min, op=dist.ReduceOp.MIN)
        loss_min = float(loss_min)
        d = trainer.dims
        return {
            "step": trainer.step, "tokens_seen": trainer.tokens_seen, "total_steps": trainer.total_steps,
            "epoch": data.consumed // blocks if blocks else 0,
            "data": data.state_dict(), "scheduler": trainer.scheduler.state_dict(),
            "lr_schedule": schedule_signature(trainer.cfg, trainer.total_steps),
            "loss_min": loss_min if math.isfinite(loss_min) else None,
            "world_size": trainer.env.world_size,
            "layout": {"dp": d.dp, "tp": d.tp, "pp": d.pp, "sharding": trainer.cfg.parallel.sharding},
            "model": model_signature(trainer.spec), "format": self.cfg.format,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    @heartbeat.during_calls("checkpoint")  # its own hang budget (contract/hang.py)
    def save(self, trainer: Any, preempt: bool = False) -> Path:
        self._finish_pending()
        rank, step = _rank(), trainer.step
        name = self._name(step, preempt)
        tmp, final = self.root / (TMP_PREFIX + name), self.root / name
        leader = self.layout().is_leader(rank)  # rank 0, plus the first rank of every unshared disk
        # Nothing is written when something not the trainer's stands where this save goes.
        _agree_error((ownership.in_the_way(tmp) or ownership.in_the_way(final)
                      or ownership.pointer_problem(self.root, self.names)) if leader else None)
        # Room for it on every disk, measured by the newest checkpoint there (disk_space.py).
        if problem := disk_space.agree(disk_space.room_problem(self.root, self._newest()) if leader else None):
            raise disk_space.refusal(step, problem, self._newest_name())
        state = self._train_state(trainer)  # collective (loss_min)
        future, t0 = None, time.perf_counter()
        with disk_space.catching_full(self.root) as full:  # ends the block on this rank: no collective follows
            if leader:
                ownership.remove(tmp)  # leftovers of a crashed save (the trainer's: checked above)
                self.root.mkdir(parents=True, exist_ok=True)
                ownership.make(tmp)  # the marker first: only a marked directory is ever removed
            _barrier()
            if self.cfg.async_save and _dist():
                future = dcp.async_save({"app": self.app}, checkpoint_id=str(tmp), process_group=self.async_pg)
            else:
                dcp.save({"app": self.app}, checkpoint_id=str(tmp))  # collective: a failure raises on every rank
            if self.cfg.format == "full":
                from trainer.checkpoint.full import write_full

                write_full(trainer, self.model, tmp, state, rank)  # its collective first, then rank 0 writes
            torch.save({"rng": rng_state(), "data": trainer.data.state_dict(),
                        "dp_sync": ckpt_state.dp_sync_state(trainer),  # dp_sync_bytes go on after a resume
                        "coords": {k: trainer.dims.coord(k) for k in ("dp", "tp", "pp")}}, tmp / f"rank{rank}.pt")
            if rank == 0:
                (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
                (tmp / "config.yaml").write_text(trainer.cfg.to_yaml())
                model_files.copy(trainer.output_dir, tmp)  # config.json, tokenizer: `trainer export` reads them
        self._settle(full, tmp, step)
        self.saved_step = step
        self.pending = (future, tmp, final, preempt, step, t0)
        if future is None:
            self._finish_pending()
        return final

    def _write_manifest(self, tmp: Path, rank: int) -> None:
        mine = [p for p in tmp.iterdir() if p.is_file() and (p.name.startswith(f"__{rank}_") or p.name == f"rank{rank}.pt")]
        if rank == 0:
            mine += [p for p in tmp.iterdir() if p.is_file() and not p.name.startswith(("__", "rank", "manifest."))]
        files = {p.name: (p.stat().st_size, crc32(p) if self.cfg.verify else None) for p in sorted(mine)}
        (tmp / f"manifest.rank{rank}.json").write_text(json.dumps(files, indent=1))

    @heartbeat.during_calls("checkpoint", when=lambda self: self.pending is not None)
    def _finish_pending(self) -> None:
        if self.pending is None:
            return
        future, tmp, final, preempt, step, t0 = self.pending
        self.pending = None
        rank, layout = _rank(), self.layout()
        with disk_space.catching_full(self.root) as full:
            if future is not None:
                future.result()  # an async save's failure: on every rank
            share_rank0_files(tmp, layout, rank)  # per-node storage: .metadata etc. on every node
            self._write_manifest(tmp, rank)
        self._settle(full, tmp, step)
        if self.replicas.copies and not layout.shared:
            with disk_space.catching_full(self.root) as full:
                self.replicas.copy(tmp, layout, rank, step)  # checkpoint.replicas: other nodes' files kept here too
            self._settle(full, tmp, step)
        hold.hold("save", step, self.output_dir, rank)  # tests only (trainer/runtime/hold.py)
        _barrier()  # every rank's files are on disk, on every node
        _agree_error(self._install(tmp, final) if layout.is_leader(rank) else None)  # every node renamed
        # Pruned only once every node has renamed: a crash between two nodes' renames leaves the
        # previous checkpoint on every node (what _agree_latest falls back to).
        if layout.is_leader(rank):
            self._prune(final, preempt)
        log.info("checkpoint step %d -> %s (%.2fs)", step, final, time.perf_counter() - t0)

    def _install(self, tmp: Path, final: Path) -> str | None:
        """A disk's leader: `tmp` renamed to `final` (an earlier checkpoint of that name, the
        trainer's, swapped out: a preempt at the same step), then `latest` rewritten. Why not, in one
        line, when something not the trainer's took the place since the save began, or the disk
        refused (every rank then raises it: none waits at a barrier for the collective timeout)."""
        old = final.with_name(TMP_PREFIX + final.name + ".old")
        why = (ownership.in_the_way(final) or ownership.in_the_way(old)
               or ownership.pointer_problem(self.root, self.names))
        if why:
            return why
        try:
            ownership.remove(old)
            if os.path.lexists(final):
                final.rename(old)
            tmp.rename(final)
            ownership.remove(old)
            ownership.write_pointer(self.root, final.name)
        except OSError as e:
            return f"checkpoint {final} not put in place: {e}"
        return None

    def _newest(self) -> Path | None:
        ckpts = list_checkpoints(self.root)
        return ckpts[-1][1] if ckpts else None

    def _newest_name(self) -> str | None:
        newest = self._newest()
        return newest.name if newest else None

    def _settle(self, full: disk_space.Outcome, tmp: Path, step: int) -> None:
        """Collective: when any rank's disk was full, the first rank of each disk removes its
        unfinished `tmp` and every rank raises the same one line; another error is raised again."""
        problem = disk_space.settle(full)
        if problem is None:
            return
        if self.layout().is_leader(_rank()):
            ownership.remove(tmp)
        raise disk_space.refusal(step, problem, self._newest_name())

    def _prune(self, newest: Path, preempt: bool) -> None:
        """Older checkpoints beyond keep_last (one .preempt at a time), the trainer's only: a
        directory that looks like one but is not the trainer's is named once and left."""
        ckpts = [d for _, d in list_checkpoints(self.root)]
        for d in ckpts:
            if d not in self._passed_over and not ownership.is_ours(d):
                self._passed_over.add(d)
                log.warning("%s looks like a checkpoint but the trainer did not write it: never pruned", d)
        ckpts = [d for d in ckpts if d not in self._passed_over]
        if preempt:  # one preempt checkpoint at a time: the new one replaces the others
            for d in ckpts:
                if d.name.endswith(PREEMPT_SUFFIX) and d != newest:
                    ownership.remove(d)
            return
        regular = [d for d in ckpts if not d.name.endswith(PREEMPT_SUFFIX)]
        if self.cfg.keep_last > 0:
            for d in regular[: max(len(regular) - self.cfg.keep_last, 0)]:
                if d != newest:
                    ownership.remove(d)

    # ------------------------------------------------------------------ load
    def _check(self, trainer: Any, path: Path) -> tuple[dict | None, str | None]:
        try:
            state = read_state(path)
        except ConfigError as e:
            return None, str(e)
        mine, theirs = model_signature(trainer.spec), state.get("model", {})
        for key in sorted(set(mine) | set(theirs)):
            if key != "num_params" and mine.get(key) != theirs.get(key):
                return None, (f"{path / STATE_FILE}: model key '{key}' is {theirs.get(key)!r} in the checkpoint "
                              f"but {mine.get(key)!r} in this run's model config")
        saved_schedule = state.get("lr_schedule")  # absent in checkpoints of older versions
        if saved_schedule is not None and not trainer.cfg.checkpoint.override_schedule:
            diff = schedule_mismatch(saved_schedule, schedule_signature(trainer.cfg, trainer.total_steps))
            if diff:
                return None, (f"{path / STATE_FILE}: this run's LR schedule differs from the checkpoint's: {diff}; "
                              f"resuming would train step {state['step'] + 1} at the old schedule's LR. Keep the "
                              f"schedule, or pass --checkpoint.override_schedule true to take the new schedule's LR "
                              f"from step {state['step'] + 1} on")
        err = _scheduler_error(state["scheduler"], trainer.scheduler.state_dict())
        if err:
            return None, f"{path / STATE_FILE}: corrupt ({err}); resume from another checkpoint"
        data, g_new = state["data"], trainer.data.global_batch
        if data.get("seed", trainer.data.seed) != trainer.data.seed:
            return None, (f"{path / STATE_FILE}: data seed {data['seed']} differs from train.seed "
                          f"{trainer.data.seed}; use the run's seed to resume")
        if data["global_batch"] != g_new and data["consumed"] % g_new != 0:
            return None, (f"{path / STATE_FILE}: {data['consumed']} samples consumed is not a multiple of this run's "
                          f"global batch {g_new} (was {data['global_batch']}); choose train.batch_size x "
                          f"grad_acc_steps x dp dividing {data['consumed']}")
        layout, rank, saved_world = self.layout() if _dist() else None, _rank(), int(state["world_size"])
        err = None
        if layout is not None and not layout.shared:
            group = layout.group(rank)  # this node's ranks split the checksums of this node's copy
            err = verify_manifests(path, saved_world, group.index(rank), len(group), all_present=True,
                                   crc=self.cfg.verify, hint=MISSING_HINT)
        elif self.cfg.verify:
            err = verify_manifests(path, saved_world, rank, dist.get_world_size() if _dist() else 1)
        if err:
            return None, err
        return state, None

    @heartbeat.during_calls("resume")
    def load(self, trainer: Any, path: Path) -> None:
        t0 = time.perf_counter()
        state, err = self._check(trainer, path)
        _agree_error(err)
        assert state is not None
        # DiLoCo: which replicas the checkpoint holds (a rejoining one starts from the anchors)
        self.app.saved_replicas = ckpt_state.saved_replicas(safe_read.read_metadata(path / ".metadata")
                                                            .state_dict_metadata)
        try:
            safe_read.load({"app": self.app}, path)
        except Exception as e:  # noqa: BLE001 - DCP wraps per-rank failures (safe_read.load): one line
            msg = " ".join(str(e).split())[:400]
            raise ConfigError(f"{path}: cannot load model/optimizer shards: {msg}") from None
        finally:
            self.app.saved_replicas = None  # what the next save writes is this replica's own state again
        trainer.scheduler.load_state_dict(state["scheduler"])
        trainer.step = int(state["step"])
        trainer.tokens_seen = int(state["tokens_seen"])
        trainer.data.load_state_dict(state["data"])
        if trainer.cfg.checkpoint.override_schedule:
            lr = restart_schedule_at(trainer.optimizer, trainer.scheduler, trainer.cfg, trainer.total_steps,
                                     trainer.step)
            log.info("checkpoint.override_schedule: LR %.6g at step %d from this run's schedule", lr, trainer.step + 1)
        loss_min = state.get("loss_min")
        trainer.loss_min.fill_(math.inf if loss_min is None else float(loss_min))
        self.saved_step = trainer.step
        rank_file = path / f"rank{_rank()}.pt"
        same_layout = int(state["world_size"]) == trainer.env.world_size
        if same_layout and rank_file.is_file():
            rng = ckpt_state.restore_dp_sync(trainer, safe_read.load_rank_file(rank_file))["rng"]
            try:
                set_rng_state(rng)
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise ConfigError(f"{rank_file}: not a trainer RNG state ({e}); delete it to resume without "
                                  "restoring RNG states") from None
        else:
            log.warning("checkpoint written by %s ranks, %d now: RNG states not restored (model, optimizer, "
                        "LR schedule and data position are)", state["world_size"], trainer.env.world_size)
        if state["data"]["global_batch"] != trainer.data.global_batch:
            log.warning("global batch %d -> %d: data continues at sample %d", state["data"]["global_batch"],
                        trainer.data.global_batch, trainer.data.consumed)
        if trainer.is_logger:
            _truncate_metrics(trainer.output_dir / "metrics.jsonl", trainer.step)
        log.info("resumed from %s at step %d (%.2fs)", path, trainer.step, time.perf_counter() - t0)


def make_callback(trainer: Any) -> Checkpointer:
    return Checkpointer(trainer)
