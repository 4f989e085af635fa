"""Peak memory of real training runs on this CPU, for tests/unit/test_sizing.py (run as a script in its
own process): for each model, 2 steps of the trainer's own loop (one process, fp32), the peak RSS
(VmHWM, reset through /proc/self/clear_refs) over the RSS before the run, its model's transformers
module imported first. Run with
MALLOC_MMAP_THRESHOLD_ small, so that glibc returns freed tensors and RSS follows the tensors.

usage: python tests/support/sizing_peak.py '{"name": [trainer args...]}' WORKDIR   -> one JSON line:
{name: {"measured": bytes, "estimate": `trainer --dry-run`'s total, "parts": {...}}}
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path


def rss_and_peak() -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def warm_up(cfg) -> None:
    """What the run would load on its first use, loaded before the baseline: the model's
    transformers module and torch's CPU thread pool."""
    import torch

    from trainer.models.build import FAMILIES, _family_of, _transformers_attr

    _transformers_attr(FAMILIES[_family_of(cfg.model)].model_cls)
    torch.ones(64, 64) @ torch.ones(64, 64)


def main(models: dict[str, list[str]], work: Path) -> dict:
    from trainer.cli import train_main as train
    from trainer.config import resolve
    from trainer.config.argv import parse_train_args
    from trainer.tools.dry_run import make_plan

    libc = ctypes.CDLL("libc.so.6")
    common = ["--train.steps", "2", "--checkpoint.enabled", "false", "--train.dtype", "fp32",
              "--parallel.device", "cpu", "--logging.peak_flops", "1e12"]  # no CPU FLOP/s probe
    out = {}
    for name, args in models.items():
        cfg = resolve(*parse_train_args([*args, *common]), environ={})
        warm_up(cfg)
        libc.malloc_trim(0)
        base, _ = rss_and_peak()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        train([*args, *common, "--output_dir", str(work / name)])
        _, peak = rss_and_peak()
        libc.malloc_trim(0)
        plan = make_plan(cfg)
        mem = plan["stages"][0]["memory"]
        out[name] = {"measured": peak - base, "estimate": mem["total"], "parts": mem}
    return out


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]), Path(sys.argv[2]))
    sys.stdout.flush()
    print(json.dumps(result))
