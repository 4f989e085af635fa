"""Peak memory of real training runs on this CPU, for tests/test_sizing.py (run as a script in its
own process): for each model, 2 steps of the trainer's own loop (one process, fp32), the peak RSS
(VmHWM, reset through /proc/self/clear_refs) over the RSS before the run, after a warm-up run of
the same model at a tiny batch has imported and initialised everything. Run with
MALLOC_MMAP_THRESHOLD_ small, so that glibc returns freed tensors and RSS follows the tensors.

usage: python tests/sizing_peak.py '{"name": [trainer args...]}' WORKDIR   -> one JSON line:
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


def main(models: dict[str, list[str]], work: Path) -> dict:
    from trainer.cli import parse_train_args
    from trainer.config import resolve
    from trainer.dry_run import make_plan
    from trainer.train import main as train

    libc = ctypes.CDLL("libc.so.6")
    common = ["--train.steps", "2", "--checkpoint.enabled", "false", "--train.dtype", "fp32",
              "--parallel.device", "cpu", "--logging.peak_flops", "1e12"]  # no CPU FLOP/s probe
    out = {}
    for name, args in models.items():
        train([*args, *common, "--output_dir", str(work / f"{name}-warm"), "--train.batch_size", "2",
               "--data.seq_len", "16"])
        libc.malloc_trim(0)
        base, _ = rss_and_peak()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        train([*args, *common, "--output_dir", str(work / name)])
        _, peak = rss_and_peak()
        libc.malloc_trim(0)
        plan = make_plan(resolve(*parse_train_args([*args, *common]), environ={}))
        mem = plan["stages"][0]["memory"]
        out[name] = {"measured": peak - base, "estimate": mem["total"], "parts": mem}
    return out


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]), Path(sys.argv[2]))
    sys.stdout.flush()
    print(json.dumps(result))
