"""`trainer plot OUTPUT_DIR`: pipeline Gantt charts from the timelines, loss and tokens/s from metrics.jsonl.

Writes next to its inputs: `timeline_batch{k}_gantt.png` per timeline (Chrome trace, or the seed
flat format) and `metrics.png`. The drawing is the contract's (contract/plots.py), shared with
`runner collect`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from contract import metrics as metrics_file
from contract.plots import gantt, gantt_title, metrics_plot
from contract.timeline import load_trace, timeline_files
from trainer.config import ConfigError

__all__ = ["gantt", "metrics_plot", "plot_dir", "timeline_files", "main"]


def plot_dir(out_dir: Path) -> list[Path]:
    if not out_dir.is_dir():
        raise ConfigError(f"plot: '{out_dir}' is not a directory (give the run's OUTPUT_DIR)")
    made = []
    for f in timeline_files(out_dir):
        k = int(re.match(r"timeline_batch(\d+)", f.name).group(1))
        try:  # the job's file: over the bounds or malformed is one warning, the other plots are made
            trace = load_trace(f)
            made.append(gantt(trace, out_dir / f"timeline_batch{k}_gantt.png",
                              gantt_title(trace, k, out_dir / f"timeline_batch{k}_summary.json")))
        except ValueError as exc:
            print(f"trainer: warning: {f.name} not plotted: {exc}", file=sys.stderr)
    mpath = out_dir / metrics_file.FILE
    if mpath.is_file():
        records = metrics_file.loss_records(metrics_file.read(mpath))
        if records:
            made.append(metrics_plot(records, out_dir / "metrics.png"))
    if not made:
        raise ConfigError(f"plot: nothing to plot in '{out_dir}' (no timeline_batch*_all.json, no metrics.jsonl)")
    return made


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: trainer plot OUTPUT_DIR", file=sys.stderr)
        return 2
    for p in plot_dir(Path(argv[0])):
        print(p)
    return 0
