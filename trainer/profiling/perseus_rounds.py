"""The Perseus frequency-plan loop of one rank (Merak's train loop with `--perseus_url`).

    start:       rank 0 registers the job, every rank registers itself (its pp/dp/tp coordinates
                 and the GPU's supported clocks, or [] without one)
    step 0:      warm-up, recorded: the order of this rank's forward/backward instructions
    per round:   fetch the plan (the server answers once every rank asks) -> check it against that
                 order -> run num_prof_steps steps under it -> post one result: per step its time
                 and energy, per instruction kind the time and energy of each instance -> fetch again
    end:         the server's `[profiling-done]` error, or train.steps leaving less than a window;
                 a server error that is not that ends the run with one line.

Every rank sees the same answers at the same step, and every outcome is agreed on over the gloo
group, so one rank's failure stops all of them instead of leaving the others waiting on the
server. Files: plans-{rank}.csv (each round's plan, one row per instruction, applied or not) and,
through the callback, profile.csv rows labelled with plan and frequency.
"""

from __future__ import annotations

import csv
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from contract import hang as rule
from trainer.profiling.gpu_clocks import GpuClocks
from trainer.profiling.perseus_client import PerseusClient, PerseusError, ProfilingDone
from trainer.profiling.recorder import Event
from trainer.profiling.timing_csv import profile_rows

log = logging.getLogger("trainer")

PLAN_KINDS = ("forward", "backward")    # the instruction names of Perseus plans
Key = tuple[str, int, int]              # (instruction, stage, microbatch)


def instruction_order(events: list[Event]) -> list[Key]:
    """This rank's compute instructions of one step, in the order they ran (its own track)."""
    compute = [e for e in events if e.tid == 0 and e.action in ("forward", "backward", "backward_input",
                                                                    "backward_weight")]
    return [(e.action, e.stage, e.mb) for e in sorted(compute, key=lambda e: e.start_ns)]


def plan_mismatch(plan: list[tuple[str, int]], order: list[Key]) -> str | None:
    """Why a plan does not fit this rank's instruction order, or None."""
    names = [a for a, _, _ in order]
    if len(plan) != len(order):
        counts = {k: names.count(k) for k in PLAN_KINDS}
        got = {k: sum(1 for n, _ in plan if n == k) for k in PLAN_KINDS}
        return (f"it lists {len(plan)} instructions ({got['forward']} forward, {got['backward']} backward) but this "
                f"rank runs {len(order)} per step ({counts['forward']} forward, {counts['backward']} backward)")
    for i, ((name, mhz), want) in enumerate(zip(plan, names, strict=True)):
        if name != want:
            return f"instruction {i} is {name!r} where this rank runs {want!r}"
        if mhz <= 0:
            return f"instruction {i} ({name}) has frequency {mhz}"
    return None


def _metadata(environ: dict[str, str] | os._Environ) -> str | None:
    """Appended to the server's job id, which names its dump dir: plain characters only."""
    meta = re.sub(r"[^A-Za-z0-9._-]", "-", environ.get("RUN_ID", ""))[:64].strip(".-")
    return meta or None


def schedule_timeout(cfg: Any) -> float:
    """How long a rank waits for the server's plan, which comes once every rank has asked: a
    collective in all but name, so the collectives' timeout (`parallel.timeout_s`); with `auto`,
    the one contract/hang.py sizes for the first steps (rounds start there), not a fixed 30 min."""
    t = cfg.parallel.timeout_s
    if t != "auto":
        return float(t)
    w = cfg.watch
    return rule.collective_timeout(rule.startup_budget(
        None, None if w.hang_timeout_s == "auto" else float(w.hang_timeout_s),
        None if w.startup_timeout_s == "auto" else float(w.startup_timeout_s)))


class PerseusRounds:
    def __init__(self, trainer: Any, rank: int, world: int, group: Any, rec: Any, energy: Any,
                 sync: Callable[[], None] | None, cuda_index: int | None, csv_on: bool):
        prof = trainer.cfg.profile
        self.client = PerseusClient(prof.perseus_url, schedule_timeout=schedule_timeout(trainer.cfg))
        self.window, self.rank, self.world, self.group = prof.num_prof_steps, rank, world, group
        self.rec, self.energy, self.sync, self.csv_on = rec, energy, sync, csv_on
        self.dims = trainer.dims
        self.clocks = GpuClocks(prof.gpu_clocks, cuda_index)
        self.plans_csv = trainer.output_dir / f"plans-{rank}.csv"
        self.job_id = ""
        self.active = True                      # steps are recorded while rounds go on
        self.order: list[Key] | None = None
        self.plan_no = -1
        self.plan: list[tuple[str, int]] = []
        self.freq: dict[Key, int] = {}
        self.window_steps: range = range(0)
        self.spans: dict[int, tuple[int, int]] = {}
        self.profile: list[dict] = []           # profile.csv rows of every finished round
        self.done_reason = ""
        if energy is None:
            log.warning("Perseus: no energy sensor on rank %d: its results report 0 J", rank)

    # ------------------------------------------------------------ agreement over the gloo group

    def _agree(self, err: str | None) -> None:
        """Raise the first rank's error on every rank (None everywhere: go on)."""
        errs = [err]
        if self.world > 1:
            errs = [None] * self.world
            dist.all_gather_object(errs, err, group=self.group)
        first = next(((r, e) for r, e in enumerate(errs) if e), None)
        if first:
            r, e = first
            raise PerseusError(e if r == self.rank else f"rank {r}: {e}")

    def start(self, trainer: Any) -> None:
        """Register the job (rank 0) and every rank, before step 0."""
        d = self.dims
        job, err = None, None
        if self.rank == 0:
            try:
                job = self.client.register_job(d.pp, d.dp, d.tp, d.world_size, _metadata(os.environ))
            except PerseusError as e:
                err = str(e)
        box = [job, err]
        if self.world > 1:
            dist.broadcast_object_list(box, src=0, group=self.group)
        job, err = box
        if err:
            raise PerseusError(err if self.rank == 0 else f"rank 0: {err}")
        self.job_id = job
        try:
            self.client.register_rank(job, self.rank, d.dp_rank, d.coord("pp"), d.coord("tp"), self.clocks.supported)
            err = None
        except PerseusError as e:
            err = str(e)
        self._agree(err)
        with self.plans_csv.open("w", newline="") as f:
            csv.writer(f).writerow(["plan", "window", "position", "instruction", "stage", "microbatch",
                                    "frequency", "applied"])
        log.info("Perseus server %s: job %s, rank %d registered (%d supported clocks; gpu_clocks %s%s)",
                 self.client.url, job, self.rank, len(self.clocks.supported), self.clocks.mode,
                 "" if self.clocks.active else f": {self.clocks.why}")

    # ------------------------------------------------------------ steps

    def records(self, step: int) -> bool:
        return self.active

    def step_started(self, step: int, t0: int) -> None:
        self.spans[step] = (t0, t0)
        if step in self.window_steps and self.clocks.active:
            self.rec.on_instruction = self._instruction

    def step_ended(self, trainer: Any, step: int, t1: int) -> None:
        self.spans[step] = (self.spans[step][0], t1)
        self.rec.on_instruction = None
        if self.order is None:  # the warm-up step: learn the order, then the first plan
            self.order = instruction_order(self.rec.batch_events(step))
            split = sorted({a for a, _, _ in self.order} - set(PLAN_KINDS))
            self._agree(f"this rank's schedule runs {', '.join(split)} instructions; Perseus plans name forward "
                        f"and backward only (use 1f1b, gpipe or interleaved1f1b)" if split else None)
            self._next_plan(trainer)
        elif step == self.window_steps[-1]:
            self._report(step)
            self._next_plan(trainer)

    def _instruction(self, action: str, stage: int, mb: int) -> None:
        mhz = self.freq.get((action, stage, mb))
        if mhz is not None:
            self.clocks.apply(mhz)

    # ------------------------------------------------------------ plans and results

    def _stop(self, why: str) -> None:
        self.active = False
        self.window_steps = range(0)
        self.clocks.reset()
        self.done_reason = why

    def _next_plan(self, trainer: Any) -> None:
        left = trainer.total_steps - trainer.step
        if trainer.stop_requested or left < self.window:
            self._stop(f"{left} step(s) left, fewer than a window of {self.window}" if not trainer.stop_requested
                       else "the run is stopping")
            if self.rank == 0:
                log.info("Perseus: no further plan fetched: %s", self.done_reason)
            return
        done, err, plan = None, None, []
        try:
            plan = self.client.schedule(self.job_id, self.rank)
        except ProfilingDone as e:
            done = str(e)
        except PerseusError as e:
            err = str(e)
        outcomes = [(done is not None, err)]
        if self.world > 1:
            outcomes = [None] * self.world
            dist.all_gather_object(outcomes, (done is not None, err), group=self.group)
        if all(d for d, _ in outcomes):
            self._stop(f"the server ended profiling ({done})")
            trainer.stop_requested = True
            log.info("Perseus: profiling done after %d plan(s), training ends at step %d: %s", self.plan_no + 1,
                     trainer.step, done)
            return
        if any(d for d, _ in outcomes):
            err = err or "the server ended profiling for some ranks only"
        if not err and (why := plan_mismatch(plan, self.order or [])):
            err = f"Perseus server {self.client.url}: plan {self.plan_no + 1} for rank {self.rank} does not match " \
                  f"this rank's instructions: {why}"
        self._agree(err)
        self.plan_no += 1
        self.plan = plan
        self.freq = {k: mhz for k, (_, mhz) in zip(self.order or [], plan, strict=True)}
        self.window_steps = range(trainer.step, trainer.step + self.window)
        self._write_plan()

    def _write_plan(self) -> None:
        w = self.window_steps
        window = f"{w[0]}-{w[-1]}"
        applied = "true" if self.clocks.active else "false"
        with self.plans_csv.open("a", newline="") as f:
            out = csv.writer(f)
            for i, ((name, mhz), (_, stage, mb)) in enumerate(zip(self.plan, self.order or [], strict=True)):
                out.writerow([self.plan_no, window, i, name, stage, mb, mhz, applied])
        mhz = sorted({m for _, m in self.plan})
        shown = f"{mhz[0]}" if len(mhz) == 1 else f"{mhz[0]}..{mhz[-1]} ({len(mhz)} distinct)"
        if self.clocks.active:
            log.info("Perseus plan %d, steps %s: %d instructions at %s MHz, applied", self.plan_no, window,
                     len(self.plan), shown)
        else:
            log.info("Perseus plan %d, steps %s: %d instructions at %s MHz, NOT applied (%s)", self.plan_no,
                     window, len(self.plan), shown, self.clocks.why)

    def _energy(self, t0: int, t1: int) -> float:
        if self.energy is None:
            return 0.0
        e0, e1 = self.energy.energy_at(t0), self.energy.energy_at(t1)
        return 0.0 if e0 is None or e1 is None else e1 - e0

    def result(self) -> dict:
        """Zeus's ProfilingResult for the window just run."""
        times: dict[str, list[list[float]]] = {k: [] for k in PLAN_KINDS}
        energies: dict[str, list[list[float]]] = {k: [] for k in PLAN_KINDS}
        iter_time, iter_energy = [], []
        if self.energy is not None:  # the window's last instruction ended after the sampler's last row
            self.energy.cover(self.spans[self.window_steps[-1]][1])
        for step in self.window_steps:
            t0, t1 = self.spans[step]
            iter_time.append((t1 - t0) / 1e9)
            iter_energy.append(self._energy(t0, t1))
            events = sorted((e for e in self.rec.batch_events(step) if e.tid == 0 and e.action in PLAN_KINDS),
                            key=lambda e: e.start_ns)
            for k in PLAN_KINDS:
                times[k].append([(e.end_ns - e.start_ns) / 1e9 for e in events if e.action == k])
                energies[k].append([self._energy(e.start_ns, e.end_ns) for e in events if e.action == k])
        return {"rank": self.rank, "iter_time": iter_time, "iter_energy": iter_energy,
                "time_breakdown": times, "energy_breakdown": energies}

    def _report(self, step: int) -> None:
        err = None
        try:
            self.client.report(self.job_id, self.result())
        except PerseusError as e:
            err = str(e)
        self._agree(err)
        steps = set(self.window_steps)
        events = [e for e in self.rec.events if e.batch in steps]
        plan_no = self.plan_no

        def label(e: Event) -> dict:
            return {"plan": plan_no, "frequency": self.freq.get((e.action, e.stage, e.mb))}

        self.profile += profile_rows(events, self.energy, label)
        for s in steps:
            self.spans.pop(s, None)
        if not self.csv_on:  # nothing else needs this window's events or samples: memory stays flat
            self.rec.events = [e for e in self.rec.events if e.batch not in steps]
            if self.energy is not None:
                self.energy.rows = self.energy.rows[-1:]
