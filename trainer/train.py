"""The training loop: config -> process group -> mesh -> model -> parallelize -> data -> steps.

Batch semantics: per optimizer step each DP rank processes train.batch_size x train.grad_acc_steps
samples (split into microbatch_num x grad_acc_steps microbatches); the global batch is that times
dp. The loss of a step is the mean over the global batch, identical for every layout.

Nothing in a step waits for the device: the loss, the gradient norm and the running minimum loss
stay device tensors; they are read (and the device synchronised) only at log steps (every
logging.log_interval steps, the last step and eval steps; `auto` = every step on CPU, every 10th
on CUDA, where each read leaves the GPU idle while the host catches up), where step time and
tokens/s are averaged over the steps since the previous read, and memory is the largest over all
ranks. The next batch is built while the device runs.

Other features hook in through callbacks (checkpointing, profiling): objects with any of
on_train_start(trainer), on_step_start(trainer, step), on_step_end(trainer, record),
on_train_end(trainer). `CALLBACKS` lists "module:factory" paths tried at start; a factory takes
the Trainer and returns a callback or None (feature off). Missing modules are skipped.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from trainer.config import Config, ConfigError
from trainer.config.checks import microbatch_tokens, resolve_log_interval, resolve_loss_chunks
from trainer.data.loader import DataStream, build_data, load_texts, load_tokenizer, reads_text
from trainer.metrics import MetricsWriter, StepStats, flops_per_token, format_line, memory_bytes, peak_flops
from trainer.models import files as model_files
from trainer.models.build import build_model, model_spec, task_of
from trainer.optim import build_optimizer, build_scheduler
from trainer.parallel.compile import blocks_running_eager, compile_report, resolve_compile
from trainer.parallel.compose import builds_on_meta, copies_built_here, parallelize
from trainer.parallel.mesh import ParallelDims
from trainer.parallel.ordered_reduce import ordered_mean
from trainer.parallel.parallelized import Parallelized
from trainer.parallel.running_stats import sync_running_stats
from trainer.runtime import dist_env, heartbeat, progress
from trainer.runtime.gc_schedule import GcSchedule, resolve_gc_interval
from trainer.runtime.tracking import Trackers

log = logging.getLogger("trainer")

CALLBACKS = ["trainer.checkpoint.checkpointer:make_callback", "trainer.profiling:make_callback"]


def setup_logging(rank: int, output_dir: Path, console: bool) -> None:
    fmt = logging.Formatter(f"[rank{rank}] %(message)s")
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    out = logging.StreamHandler(sys.stdout)
    out.setFormatter(fmt)
    out.setLevel(logging.INFO if console else logging.WARNING)
    log.addHandler(out)
    (output_dir / "logs").mkdir(parents=True, exist_ok=True)
    file = logging.FileHandler(output_dir / "logs" / f"rank{rank}.log", mode="a")
    file.setFormatter(logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(message)s"))
    log.addHandler(file)


class Trainer:
    """Holds everything a step needs; callbacks read and restore this state."""

    def __init__(self, cfg: Config, env: dist_env.DistEnv, dims: ParallelDims, device: torch.device, backend: str,
                 relayout: bool = False):
        self.cfg, self.env, self.dims, self.device, self.backend = cfg, env, dims, device, backend
        self.output_dir = Path(cfg.output_dir)
        self.step = 0                    # optimizer steps completed
        self._layout_noted = False       # metrics.jsonl's first record of this start names the layout
        self.tokens_seen = 0
        self.stop_requested = False      # a callback (e.g. preemption) may end the run after a step
        self.exit_code = 0               # ... and set the process exit code (trainer/checkpoint/preempt.py)
        t, d = cfg.train, cfg.data

        tokenizer, texts, self._tmp = None, None, None
        if reads_text(d, task_of(cfg.model)):  # an image folder is read by build_data
            self._tmp = tempfile.TemporaryDirectory(prefix="trainer-datasets-")
            texts = load_texts(d, cache_dir=self._tmp.name)
            tokenizer = load_tokenizer(d, texts, cfg.model)
        self.tokenizer = tokenizer
        self.spec = model_spec(cfg.model, tokenizer.vocab_size if tokenizer else None)
        if tokenizer is not None:
            tokenizer.check_fits(int(self.spec.hf_config.vocab_size))
        log.info("model: %s (%s), %d layers, hidden %d, Number of parameters: %.2fM", cfg.model.path or cfg.model.preset,
                 self.spec.family, self.spec.num_layers, self.spec.hidden_size, self.spec.num_params / 1e6)
        # What `auto` means here, recorded in config.yaml as what ran.
        t.loss_chunks = resolve_loss_chunks(t.loss_chunks, self.spec.task, int(getattr(self.spec.hf_config,
                                                                                        "vocab_size", 0) or 0),
                                            microbatch_tokens(cfg))
        t.compile = resolve_compile(t.compile, device.type)
        t.dtype = dist_env.training_dtype(t.dtype, device.type)[0]
        t.param_dtype = dist_env.resolve_param_dtype(t.param_dtype, t.dtype, device.type, self.spec.task)
        cfg.logging.log_interval = resolve_log_interval(cfg.logging.log_interval, device.type)
        t.gc_interval = resolve_gc_interval(t.gc_interval, device.type)
        self.gc = GcSchedule(t.gc_interval)
        log.info("training in %s (parameters %s), compile %s, activation checkpointing %s, loss in %d chunk(s), "
                 "%d microbatch(es) per batch, log every %d step(s)", t.dtype, t.param_dtype, t.compile,
                 t.activation_checkpointing, t.loss_chunks, t.microbatch_num, cfg.logging.log_interval)
        meta = builds_on_meta(dims)
        if meta:
            log.info("model built on the meta device: its weights come from the stage's first rank")
        model = build_model(self.spec, cfg.model, t.seed, meta=meta,
                            copies=copies_built_here(dims, self.env.rank, self.env.local_rank,
                                                     self.env.local_world_size))
        self.par: Parallelized = parallelize(model, self.spec, dims, cfg, device, backend)
        self.optimizer = build_optimizer(self.par.parameters(), cfg, master=self.par.extras.get("master_weights"))
        self.diloco = self.par.extras.get("diloco")  # parallel.dp_sync diloco: the outer loop (diloco.py)
        self.sync_meter = self.par.extras.get("sync_meter")  # data-parallel bytes and time (sync_meter.py)
        # Per-rank step/wait times at log steps, stragglers, the heartbeat's work and checkpoint size.
        self.step_times = progress.StepTimes(cfg, env, device, backend, self.par.model_parts, self.spec)

        self.local_batch = t.batch_size * t.grad_acc_steps
        self.data: DataStream = build_data(d, self.spec.task, self.spec.hf_config, t.seed, self.local_batch,
                                           dims.dp_rank, dims.dp, tokenizer, texts)
        self.data.pin = device.type == "cuda"  # host-to-device copies that do not wait for the host
        steps = t.steps if t.steps is not None else self.data.steps_per_epoch
        if not steps and t.steps is None:
            raise ConfigError("train.steps: the corpus holds less than one global batch; set train.steps")
        self.total_steps = int(steps or 0)
        self.scheduler = build_scheduler(self.optimizer, cfg, self.total_steps)

        self.global_samples = self.local_batch * dims.dp
        self.tokens_per_sample = self.spec.tokens_per_sample(d.seq_len)
        self.flops_per_token = flops_per_token(self.spec.num_params, self.spec.num_layers,
                                               self.spec.attention_width, self.tokens_per_sample)
        if self.spec.train_flops_per_sample:  # convolutions: FLOPs counted per image (ModelSpec)
            self.flops_per_token = self.spec.train_flops_per_sample / self.tokens_per_sample
        self.peak, peak_src = peak_flops(device, t.dtype, cfg.logging.peak_flops)
        log.info("global batch %d samples x %d tokens; %d steps; peak %.3g FLOP/s per device from %s",
                 self.global_samples, self.tokens_per_sample, self.total_steps, self.peak, peak_src)
        self.is_logger = self.par.owns_loss and dims.coord("dp") == 0 and dims.coord("tp") == 0
        if self.is_logger:
            # With pipeline stages the loss lives on the last stage's rank: its step lines go to the
            # console too (as picotron and the minimal 3D script print them), not only to its log file.
            for h in log.handlers:
                if type(h) is logging.StreamHandler:
                    h.setLevel(logging.INFO)
        # A relayout in place (elastic.in_place) appends to the records of the steps before it.
        self.metrics = MetricsWriter(self.output_dir, self.is_logger, resume=bool(cfg.checkpoint.resume) or relayout,
                                     trackers=Trackers(cfg, self.output_dir))
        # The smallest reported loss so far (checkpoints record it), kept on the device.
        self.loss_min = torch.full((), math.inf, device=device)
        self.callbacks = self._load_callbacks()

    def _load_callbacks(self) -> list[Any]:
        out = []
        for target in CALLBACKS:
            module, _, name = target.partition(":")
            try:
                factory = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                continue
            cb = factory(self)
            if cb is not None:
                out.append(cb)
        return out

    def _emit(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(self, *args)

    def _dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.dims.mesh is not None and self.dims.dp > 1:
            # Rank order, not ring order: the logged value must not depend on the bucket layout or
            # anything else but the values (an uninterrupted and a resumed run log the same bits).
            # A collective on the device: nothing waits for it until a log step reads it.
            value = ordered_mean(value, self.dims.dp_mesh.get_group())
        return value

    def train_step(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One optimizer step; returns (DP-mean loss or None, grad norm) as device tensors."""
        t = self.cfg.train
        heartbeat.mark("data")  # the phases of a step (forward/backward/recv/send: the layout's hooks)
        inputs, labels = self.data.next_batch()
        loss = self.par.forward_backward(inputs, labels, t.microbatch_num * t.grad_acc_steps)
        heartbeat.mark("grad_norm")
        grad_norm = self.par.clip_grad_norm(t.grad_clip, self.optimizer)
        heartbeat.mark("optimizer")
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.diloco is not None:  # every inner_steps / fragments steps: a fragment's outer step
            # A sync moves what H steps of all-reduce would have: the hang budget of H steps (contract/hang.py).
            with heartbeat.during("dp_sync", units=self.cfg.parallel.diloco.inner_steps):
                self.diloco.after_inner_step(self.step + 1, last=self.step + 1 == self.total_steps)
        sync_running_stats(self.par.model_parts, self.dims)  # BatchNorm models only
        if self.step + 1 < self.total_steps:
            heartbeat.mark("data", detail="prefetch")
            self.data.prefetch()  # the host builds the next batch while the device runs this one
        return (None if loss is None else self._dp_mean(loss)), grad_norm

    def evaluate(self) -> float | None:
        self.par.train(False)
        total, n = torch.zeros((), device=self.device), 0
        for j in range(self.cfg.train.eval_batches):
            loss = self.par.evaluate(*self.data.eval_batch(j))
            if loss is not None:
                total += loss
                n += 1
        self.par.train(True)
        return None if n == 0 else float(self._dp_mean(total / n))

    def _write_config(self) -> None:
        if self.env.local_rank == 0:
            (self.output_dir / "config.yaml").write_text(self.cfg.to_yaml())
            # config.json and the tokenizer: what `trainer export` needs besides the weights (every checkpoint keeps them)
            model_files.write(self.output_dir, self.spec.hf_config, self.tokenizer, self.cfg.model.path)

    def _elapsed(self, since: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a log step: the steps since `since` have run
        return time.perf_counter() - since

    def _memory(self, slots: list[float]) -> tuple[tuple[int, int | None], list[float]]:
        """(allocated, reserved) bytes, the largest over all ranks, and `slots` assembled over all ranks
        (each rank fills its own, the rest 0: progress.StepTimes): every rank calls it at a log step,
        one all-reduce for both. float64 holds a byte count exactly up to 8 PiB."""
        alloc, reserved = memory_bytes(self.device)
        if not self.env.distributed:
            return (alloc, reserved), slots
        import torch.distributed as dist

        both = torch.tensor([alloc, -1 if reserved is None else reserved, *slots], dtype=torch.float64,
                            device=self.device if self.backend == "nccl" else "cpu")
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        values = both.tolist()
        return (int(values[0]), None if values[1] < 0 else int(values[1])), values[2:]

    def _sync_totals(self) -> dict[str, Any]:
        """metrics.jsonl's dp_sync_bytes and dp_sync_s: cumulative since step 0, the largest over all
        ranks (every rank calls it at a log step; sync_meter.py says what counts)."""
        if self.sync_meter is None:
            return {}
        import torch.distributed as dist

        both = torch.tensor([self.sync_meter.bytes, round(self.sync_meter.seconds * 1e9)], dtype=torch.int64,
                            device=self.device if self.backend == "nccl" else "cpu")
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        return {"dp_sync_bytes": int(both[0]), "dp_sync_s": int(both[1]) / 1e9}

    def _report_compile(self) -> None:
        """After the first step: the graphs torch.compile built (proof that compiled code runs)."""
        if self.cfg.train.compile == "false":
            return
        r = compile_report()
        eager = [b for m in self.par.model_parts for b in blocks_running_eager(m)]
        log.info("torch.compile: %d graph(s) compiled in the first step, %d graph break(s)%s", r["graphs"],
                 r["graph_breaks"], f"; {len(eager)} block(s) run eager (train.compile try)" if eager else "")

    def layout(self) -> dict[str, Any]:
        """The parallel layout of this start, as its first metrics record states it."""
        d = self.dims
        return {"world": self.env.world_size, "nnodes": int(os.environ.get("GROUP_WORLD_SIZE") or os.environ.get("NNODES") or 1),
                "pp": d.pp, "dp": d.dp, "tp": d.tp, "batch_size": self.cfg.train.batch_size,
                "partition": self.cfg.parallel.partition if d.pp > 1 else None}

    def fit(self) -> None:
        self.par.train(True)
        self._emit("on_train_start")
        if heartbeat.CURRENT is not None:
            heartbeat.CURRENT.apply_timeout(force=True)  # the groups the layout and callbacks made, too
        self._write_config()  # only now: a resume refused by its checks leaves the run's files as they were
        with self.gc.active():
            self._loop()
        self._emit("on_train_end")

    def _loop(self) -> None:
        cfg = self.cfg
        since, steps_since = time.perf_counter(), 0
        while self.step < self.total_steps and not self.stop_requested:
            heartbeat.step_start(self.step + 1)
            self._emit("on_step_start", self.step)
            lr = self.scheduler.get_last_lr()[0]
            loss, grad_norm = self.train_step()
            heartbeat.step_end()
            self.step += 1
            if self.step == 1:
                self._report_compile()
            steps_since += 1
            self.tokens_seen += self.global_samples * self.tokens_per_sample
            if loss is not None:
                self.loss_min = torch.minimum(self.loss_min, loss.detach())
            evaluate = bool(cfg.train.eval_interval) and self.step % cfg.train.eval_interval == 0
            log_step = self.step % cfg.logging.log_interval == 0 or self.step == self.total_steps
            record: dict[str, Any] | None = None
            if log_step or evaluate:
                heartbeat.mark("log", units=steps_since)  # waits for the device: steps_since steps' worth
                dt = self._elapsed(since) / steps_since
                steps_since = 0
                memory, gathered = self._memory(self.step_times.slots(dt))  # + every rank's step and wait times
                times = self.step_times.fields(gathered)  # metrics fields, the straggler warning (progress.py)
                sync = self._sync_totals()
                if loss is not None:
                    record = StepStats(self.step, float(loss), lr, float(grad_norm), self.global_samples,
                                       self.global_samples * self.tokens_per_sample, dt, self.tokens_seen,
                                       self.env.world_size, self.flops_per_token, self.peak, *memory).record()
                    record.update(sync)
                    record.update(times)
                if evaluate:
                    with heartbeat.during("eval", units=cfg.train.eval_batches):
                        eval_loss = self.evaluate()
                    if record is not None and eval_loss is not None:
                        record["eval_loss"] = eval_loss
            if record is not None and self.is_logger and log_step:
                if not self._layout_noted:  # the first record of each start: where this layout began
                    record["layout"] = self.layout()
                    self._layout_noted = True
                self.metrics.write(record)
                log.info(format_line(record, cfg.logging.line))
                if cfg.logging.seed_line:
                    log.info("step %d loss %.4f", self.step, record["loss"])
                if "eval_loss" in record:
                    log.info("eval step %d loss %.4f", self.step, record["eval_loss"])
            heartbeat.mark("collective")  # the callbacks' step-end vote (a checkpoint marks its own phase)
            self._emit("on_step_end", record)
            if cfg.train.exit_interval and self.step % cfg.train.exit_interval == 0 and not self.stop_requested \
                    and self.step < self.total_steps:
                # The checkpoint callback saves at train end; exit 0, `--resume latest` continues.
                log.info("train.exit_interval %d: ending this run after step %d", cfg.train.exit_interval, self.step)
                self.stop_requested = True
            self.gc.after_step(self.step)
            if steps_since == 0:
                since = time.perf_counter()  # the next window starts after this step's callbacks

    def close(self) -> None:
        if self.diloco is not None:
            self.diloco.drain()  # a sync still in flight ends before the process group does
        self.metrics.close()
        if self._tmp is not None:
            self._tmp.cleanup()


def _fit_in_place(trainer: Trainer, in_place: Any, device: torch.device) -> Trainer:
    """fit, and after a regroup (a node lost, or a planned switch) fit on in the new layout with the
    stages from memory (trainer/parallel/stage_relayout.py); an error that is no regroup's goes on."""
    build = _builder(device, trainer.backend)
    while True:
        try:
            trainer.fit()
            return trainer
        except Exception as e:  # noqa: BLE001 - recover() tells a regroup's error from any other
            new = in_place.recover(e, trainer, build)
            if new is None:
                raise
            trainer = in_place.current = new  # run() closes this one


def _builder(device: torch.device, backend: str) -> Any:
    """How the in-place regroup makes the Trainer of a new layout (after it joined the new group)."""
    def build(cfg: Config, env: dist_env.DistEnv) -> Trainer:
        dims = ParallelDims.from_config(cfg.parallel, env.world_size, env.local_world_size)
        dims.build_mesh(device.type)
        return Trainer(cfg, env, dims, device, backend, relayout=True)
    return build


def _join_epoch(cfg: Config) -> int | None:
    """The regroup epoch this process was started to join (a node coming back under elastic.in_place:
    the runner sets stage_relayout.JOIN_ENV), or None."""
    value = os.environ.get("ELASTIC_JOIN_EPOCH", "")
    return int(value) if cfg.elastic.in_place and value.isdigit() and int(value) > 0 else None


def _join(in_place: Any, device: torch.device, backend: str) -> Trainer:
    """A node coming back: no group and no weights until it joins the running ranks' next group and
    receives its stages from them (stage_relayout.InPlace.join); then the loop, as for any rank."""
    trainer = in_place.current = in_place.join(backend, _builder(device, backend))
    if trainer is None:
        raise RuntimeError(f"elastic.in_place: node {in_place.node} found no regroup epoch "
                           f"{in_place.join_epoch} to join")
    trainer = in_place.current = _fit_in_place(trainer, in_place, device)
    return trainer


def run(cfg: Config, env: dist_env.DistEnv) -> int:
    from trainer.runtime import tracking

    tracking.check(cfg)  # a tracker without its package: one line, before anything starts
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    setup_logging(env.rank, out, console=env.rank == 0)
    os.environ["PROFILE_BATCH"] = str(cfg.profile.batch)  # the Pi guide writes it back for its recorder
    device = dist_env.pick_device(cfg.parallel.device)
    if device.type == "cuda":
        allocator = dist_env.configure_allocator()  # before the first CUDA allocation
        if allocator and env.rank == 0:
            log.info("CUDA allocator: %s (set PYTORCH_CUDA_ALLOC_CONF to choose another)", allocator)
    cfg.train.dtype, why = dist_env.training_dtype(cfg.train.dtype, device.type)
    if why and env.rank == 0:
        log.warning("%s", why)
    precision = dist_env.configure_matmul_precision(device.type, cfg.train.dtype)
    if precision and env.rank == 0:
        log.info("train.dtype fp32 on CUDA: %s", precision)
    cfg.train.compile = resolve_compile(cfg.train.compile, device.type)
    cfg.train.param_dtype = dist_env.resolve_param_dtype(cfg.train.param_dtype, cfg.train.dtype, device.type,
                                                          task_of(cfg.model))
    cfg.logging.log_interval = resolve_log_interval(cfg.logging.log_interval, device.type)
    join = _join_epoch(cfg)  # a node coming back has no layout until its regroup.json: its dims are made then
    dims = None if join else ParallelDims.from_config(cfg.parallel, env.world_size, env.local_world_size)
    if env.rank == 0:
        log.info("resolved config:\n%s", cfg.to_yaml().rstrip())
    device = dist_env.local_device(device.type, env.local_rank)
    owns_group = not torch.distributed.is_initialized()  # a caller's group outlives this run
    watch = progress.start(cfg, env, nccl=device.type == "cuda" and cfg.parallel.backend != "gloo")
    trainer = None
    in_place = None
    try:  # from the rendezvous on: a timeout anywhere is one line (progress.stalled)
        if cfg.elastic.in_place and (env.distributed or join):
            from trainer.parallel.stage_relayout import InPlace

            in_place = InPlace(cfg, env, join)  # before the first group: the cut spares only what came before
        backend = dist_env.init_process_group(env, device.type, cfg.parallel.backend, progress.initial_timeout(watch))
        if in_place is not None and join:
            trainer = _join(in_place, device, backend)
            return trainer.exit_code
        assert dims is not None  # not joining
        heartbeat.mark("build")
        if env.distributed:
            dims.build_mesh(device.type)
        log.info("launcher %s; %s; device %s, backend %s", env.launcher, dims.describe(), device,
                 backend if env.distributed else "none")
        trainer = Trainer(cfg, env, dims, device, backend)
        if in_place is None:
            trainer.fit()
        else:
            in_place.attach(trainer)
            trainer = _fit_in_place(trainer, in_place, device)
    except BaseException as e:  # noqa: BLE001 - the heartbeat's last word, then the error goes on
        if (code := progress.stalled(e, out, env.rank)) is None:  # a collective that timed out: one line
            progress.finished(e)
            raise
        return code
    finally:
        progress.finished()
        if in_place is not None:
            in_place.close()
            trainer = in_place.current if in_place.current is not False else trainer
        if trainer is not None:
            trainer.close()
        if owns_group:
            dist_env.destroy_process_group()
    return trainer.exit_code if trainer is not None else 0
