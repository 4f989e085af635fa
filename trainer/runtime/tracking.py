"""Experiment tracking beside metrics.jsonl, which stays the source of truth: the records written to
it (logging rank only, at log steps) go, unchanged, to TensorBoard and/or Weights & Biases.

- `logging.tensorboard: true`: event files under OUTPUT_DIR/tensorboard/ (torch.utils.tensorboard's
  SummaryWriter; needs the `tensorboard` package, the project's `tracking` extra). A resumed run
  starts its first logged step with `purge_step`, so TensorBoard drops what an earlier attempt
  logged past the checkpoint instead of drawing it twice.
- `logging.wandb: PROJECT`: a W&B run in `logging.wandb_mode` (offline by default: nodes often have
  no internet) under OUTPUT_DIR/wandb/offline-run-*/, collected with the run for `wandb sync`;
  named after RUN_ID when the runner started it. Needs the `wandb` package.

Either without its package is one line at start (check()), before anything is built. Writers are
made at the first record, so a run that never logs leaves no files; a writer that fails mid-run
is dropped with one warning (the run and metrics.jsonl go on).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from pathlib import Path
from typing import Any

from trainer.config import Config, ConfigError

log = logging.getLogger("trainer")

# metrics.jsonl key -> TensorBoard tag / W&B key (grouped as both UIs show them)
SCALARS = {
    "loss": "train/loss", "eval_loss": "train/eval_loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "tokens": "train/tokens", "tokens_per_s": "perf/tokens_per_s", "tokens_per_s_per_device": "perf/tokens_per_s_per_device",
    "samples_per_s": "perf/samples_per_s", "mfu": "perf/mfu", "step_time_s": "perf/step_time_s",
    "memory_gib": "memory/gib", "memory_reserved_gib": "memory/reserved_gib",
}
TB_DIR = "tensorboard"
WANDB_MODES = ("offline", "online")


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check(cfg: Config) -> None:
    """One line naming the key when a tracker is asked for and its package is not here."""
    lg = cfg.logging
    if lg.tensorboard and not installed("tensorboard"):
        raise ConfigError("logging.tensorboard: the tensorboard package is not installed in this environment; "
                          "pip install 'runner-trainer[tracking]' (or tensorboard) in the image/venv, or set it false")
    if lg.wandb and not installed("wandb"):
        raise ConfigError("logging.wandb: the wandb package is not installed in this environment; pip install wandb "
                          "in the image/venv, or drop logging.wandb")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    return {tag: float(v) for key, tag in SCALARS.items()
            if isinstance(v := record.get(key), (int, float)) and not isinstance(v, bool)}


class Trackers:
    """The trackers cfg.logging asks for, fed metrics.jsonl's records (MetricsWriter.write)."""

    def __init__(self, cfg: Config, output_dir: Path):
        self.cfg, self.output_dir = cfg, Path(output_dir)
        self.writers: list[Any] | None = None  # made at the first record

    @property
    def wanted(self) -> bool:
        return bool(self.cfg.logging.tensorboard or self.cfg.logging.wandb)

    def _open(self, first_step: int) -> list[Any]:
        lg, out = self.cfg.logging, self.output_dir
        resumed = bool(self.cfg.checkpoint.resume)
        writers: list[Any] = []
        if lg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            writers.append(_TensorBoard(SummaryWriter(log_dir=str(out / TB_DIR),
                                                      purge_step=first_step if resumed else None)))
        if lg.wandb:
            writers.append(_Wandb(lg.wandb, lg.wandb_mode, out, self.cfg.to_dict()))
        return writers

    def write(self, record: dict[str, Any]) -> None:
        if self.writers is None:
            self.writers = self._open(int(record["step"]))
        for w in list(self.writers):
            try:
                w.write(record)
            except Exception as exc:  # noqa: BLE001 - a tracker never stops training
                log.warning("%s: %s; no more records go to it (metrics.jsonl has them all)", w.name, exc)
                self.writers.remove(w)

    def close(self) -> None:
        for w in self.writers or []:
            try:
                w.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("%s: closing: %s", w.name, exc)
        self.writers = []


class _TensorBoard:
    name = "logging.tensorboard"

    def __init__(self, writer):
        self.w = writer

    def write(self, record: dict[str, Any]) -> None:
        step, t = int(record["step"]), record.get("time")
        for tag, v in scalars(record).items():
            self.w.add_scalar(tag, v, step, walltime=t)
        self.w.flush()  # a run killed later keeps what it logged (once per log step: cheap)

    def close(self) -> None:
        self.w.close()


class _Wandb:
    name = "logging.wandb"

    def __init__(self, project: str, mode: str, out: Path, config: dict):
        import wandb

        run_id = os.environ.get("RUN_ID")
        # One W&B run per runner run: a resumed run continues it (its id from RUN_ID).
        wid = re.sub(r"[^A-Za-z0-9_-]", "-", run_id)[:64] if run_id else None
        self.run = wandb.init(project=project, mode=mode, dir=str(out), name=run_id, id=wid, resume="allow" if wid else None,
                              config=config)

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()
