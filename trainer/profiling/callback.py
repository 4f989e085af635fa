"""The profiling callback: records the batches named by profile.batch (`--profile_batch`, env
PROFILE_BATCH) and writes timelines, bubble summaries and the Perseus/Merak CSVs. With
profile.perseus_url it also runs the Perseus frequency-plan rounds (perseus_rounds.py), recording
every step while they go on.

Found by train.py through CALLBACKS ("trainer.profiling:make_callback"). Every rank records;
rank 0 merges. See docs/profiling.md for the files and what each number means.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainer.config import ConfigError
from trainer.config.batches import parse_batches
from trainer.profiling import bubble, timing_csv, trace
from trainer.profiling.clocks import RankClock, estimate_offsets
from trainer.profiling.energy import EnergySampler, probe
from trainer.profiling.perseus_rounds import PerseusRounds
from trainer.profiling.recorder import Recorder
from trainer.profiling.reduce_timing import DDPReduceTimer

log = logging.getLogger("trainer")

WARMUP_STEPS = 1  # batches at the start of a run that profile.csv never averages in


class ProfilingCallback:
    def __init__(self, trainer: Any, timelines: list[int], prof_steps: list[int]):
        self.cfg = trainer.cfg
        self.rank = trainer.env.rank
        self.world = trainer.env.world_size if dist.is_initialized() else 1
        self.out: Path = trainer.output_dir
        self.timelines, self.prof_steps = set(timelines), prof_steps
        self.record = self.timelines | set(prof_steps)
        perseus = self.cfg.profile.perseus_url is not None
        # Under Perseus the rounds decide how long recording goes on: the CSVs are written at the end.
        self.last_recorded = None if perseus else max(self.record)
        self.clock = RankClock.start(self.rank)
        # Clock sync and merges go over gloo with CPU objects, whatever the training backend.
        self.group = dist.new_group(backend="gloo") if self.world > 1 else None
        sync, cuda_index = None, 0
        if trainer.device.type == "cuda":
            import torch

            sync = functools.partial(torch.cuda.synchronize, trainer.device)
            # torch's numbering (cuda:i among the visible devices); energy.probe maps it to NVML's.
            cuda_index = trainer.device.index if trainer.device.index is not None else torch.cuda.current_device()
        self.rec = Recorder(self.clock, self.rank, sync)
        self.rec.install_trainer(trainer)
        runner = getattr(trainer.par, "runner", None)
        self.stages = list(runner.stage_ids) if runner is not None else [0]
        self.ddp_timer = None if runner is not None else self._time_ddp(trainer.par.model_parts[0],
                                                                         trainer.device.type == "cuda")
        self.csv = self.cfg.profile.export_timing_csv
        self.energy: EnergySampler | None = None
        self.energy_reason = ""
        if self.csv or perseus:
            reader, why = probe(cuda_index, trainer.device.type == "cuda")
            if reader is None:
                self.energy_reason = why
                log.warning("no energy sensor: %s; time-energy-%d.csv says so instead of energies", why, self.rank)
            else:
                self.energy = EnergySampler(self.clock, reader)
                log.info("energy sensor: %s", why)
        self._csv_done = False
        self.rounds: PerseusRounds | None = None
        if perseus:
            self.rounds = PerseusRounds(trainer, self.rank, self.world, self.group, self.rec, self.energy, sync,
                                        cuda_index if trainer.device.type == "cuda" else None, self.csv)

    def _time_ddp(self, model: Any, cuda: bool) -> DDPReduceTimer | None:
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel) or not hasattr(model, "grad_reduce"):
            return None
        return DDPReduceTimer(self.rec, model, cuda=cuda)

    # ---------------------------------------------------------------- hooks

    def on_train_start(self, trainer: Any) -> None:
        estimate_offsets(self.clock, self.group)
        if self.world > 1:
            # Every recorded batch ends in a collective merge: ranks that disagree would hang there.
            plans = [None] * self.world
            dist.all_gather_object(plans, (sorted(self.timelines), self.prof_steps, self.csv,
                                           self.cfg.profile.perseus_url), group=self.group)
            if any(p != plans[0] for p in plans):
                raise ConfigError(f"profile.batch / num_prof_steps / export_timing_csv / perseus_url differ between "
                                  f"ranks ({plans[0]} on rank 0, {next(p for p in plans if p != plans[0])} elsewhere); "
                                  f"set the same PROFILE_BATCH and PERSEUS_URL on every node")
        if self.rounds is not None:
            self.rounds.start(trainer)

    def _now(self) -> int:
        if self.rec.sync is not None:
            self.rec.sync()  # a step's time is the device's, not the launches'
        return self.clock.now()

    def on_step_start(self, trainer: Any, step: int) -> None:
        rounds = self.rounds is not None and self.rounds.records(step)
        if step in self.record or rounds:
            if self.energy is not None:
                self.energy.start()
            if self.ddp_timer is not None:
                self.ddp_timer.attach()
            self.rec.begin(step)
            if rounds:
                self.rounds.step_started(step, self._now())

    def on_step_end(self, trainer: Any, record: dict | None) -> None:
        batch = self.rec.active
        if batch is None:
            return
        t_end = self._now()  # before the sampler's last reading, so the step's energy interpolates
        if self.ddp_timer is not None:
            self.ddp_timer.flush()  # CUDA event pairs -> events, while the batch is still active
            self.ddp_timer.detach()
        self.rec.end()
        if self.energy is not None:
            self.energy.stop()
        if self.rounds is not None and batch in self.rounds.spans:
            self.rounds.step_ended(trainer, batch, t_end)
        if batch in self.timelines:
            # Re-measured right after the batch, so slow drift since start-up does not enter it.
            estimate_offsets(self.clock, self.group)
            self._write_timeline(batch)
        if batch == self.last_recorded:
            self._write_csvs()

    def on_train_end(self, trainer: Any) -> None:
        if self.rec.active is not None:
            self.rec.end()
        if self.rounds is not None:
            self.rounds.clocks.reset()
            self._write_csvs()
        elif not self._csv_done and self.rec.events:
            log.warning("profiling: training ended before batch %d; CSVs hold the batches recorded so far",
                        self.last_recorded)
            self._write_csvs()
        elif not self.rec.events and self.rank == 0:
            log.warning("profiling: no batch recorded (profile.batch %s is beyond the %d steps run)",
                        self.cfg.profile.batch, trainer.step)

    # ---------------------------------------------------------------- outputs

    def _gather(self, obj: Any) -> list[Any] | None:
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def _schedule(self) -> tuple[str, int, int, int]:
        p, t = self.cfg.parallel, self.cfg.train
        name = "none"
        if p.pp > 1:
            from trainer.parallel.pipeline import schedule_spec

            name = schedule_spec(p.pp_schedule).name
        return name, p.pp, t.microbatch_num * t.grad_acc_steps, p.virtual_stages

    def _write_timeline(self, batch: int) -> None:
        payload = trace.rank_payload(self.rank, self.stages, self.rec.batch_events(batch),
                                     self.rec.net_series.get(batch, []), self.clock.to_ref,
                                     self.clock.offset_ns, self.clock.error_ns)
        payloads = self._gather(payload)
        if self.rank != 0:
            return
        name, p, m, v = self._schedule()
        meta = {"schedule": name, "pp": p, "microbatches": m, "virtual_stages": v, "world_size": self.world}
        path = trace.write_timeline(self.out, batch, payloads, self.cfg.profile.format, meta)
        summary = bubble.summarize(payloads, batch, name, p, m, v)
        bubble.write_summary(self.out, summary)
        log.info("timeline of batch %d: %s\n%s", batch, path, bubble.format_summary(summary))

    def _write_csvs(self) -> None:
        self._csv_done = True
        if self.rounds is not None:
            gathered = self._gather(self.rounds.profile)
            if self.rank == 0 and any(gathered):
                timing_csv.write_profile(self.out / "profile.csv", [r for rs in gathered for r in rs])
                log.info("profile.csv: %d plan(s) of %d steps each", self.rounds.plan_no + 1, self.rounds.window)
        if not self.csv:
            return
        events = self.rec.events
        n = timing_csv.write_instructions(self.out / f"instructions-{self.rank}.csv", events, self.clock.to_ref)
        timing_csv.write_time_energy(self.out / f"time-energy-{self.rank}.csv", self.energy, self.energy_reason,
                                     self.clock.to_ref)
        log.info("instructions-%d.csv: %d rows over batches %s", self.rank, n, sorted({e.batch for e in events}))
        if not self.prof_steps:
            return
        steps = set(self.prof_steps)
        rows = timing_csv.profile_rows([e for e in events if e.batch in steps], self.energy)
        gathered = self._gather(rows)
        if self.rank == 0:
            timing_csv.write_profile(self.out / "profile.csv", [r for rs in gathered for r in rs])
            log.info("profile.csv: %d profiled steps (%d..%d)", len(steps), min(steps), max(steps))


def make_callback(trainer: Any) -> ProfilingCallback | None:
    prof = trainer.cfg.profile
    if prof.format not in ("chrome", "seed"):
        raise ConfigError(f"profile.format: '{prof.format}' (chrome or seed)")
    if prof.num_prof_steps < 0:
        raise ConfigError(f"profile.num_prof_steps must be >= 0, got {prof.num_prof_steps}")
    timelines = parse_batches(prof.batch)
    perseus = prof.perseus_url is not None
    # Under Perseus num_prof_steps is the window of each plan (perseus_rounds.py), not one average.
    prof_steps = [] if perseus else aggregated_steps(timelines, prof.num_prof_steps)
    if not timelines and not prof_steps and not perseus:
        if prof.export_timing_csv and trainer.env.rank == 0:
            log.warning("profiling: --export_timing_csv with nothing to record (profile.batch %s, num_prof_steps 0): "
                        "no CSV is written; set --num_prof_steps N or --profile_batch K", prof.batch)
        return None
    return ProfilingCallback(trainer, timelines, prof_steps)


def aggregated_steps(timelines: list[int], num_prof_steps: int) -> list[int]:
    """The batches profile.csv averages: num_prof_steps from the first timeline batch, never batch 0.

    Batch 0 is warm-up (allocator growth, first gloo/NCCL connections, pipeline shape inference)
    and would inflate every mean; Perseus likewise drops the first iteration(s) of each profiling
    window. Batch 0 can still get a timeline of its own.
    """
    if num_prof_steps <= 0:
        return []
    first = max(timelines[0] if timelines else 1, WARMUP_STEPS)
    return list(range(first, first + num_prof_steps))
