"""`python -m bench [NAME ...]`: run the side-by-side benchmarks one after another.

Each prints a Markdown table and writes bench/results/<name>.json. Without names, all run.
The sandbox ones (launch, push, collect, fanout, partition) start a sandbox cluster of their own
(127.0.9.x, BENCH_BASE_ADDR) and need the trainer image on this host (scripts/build-image.sh).
gpu_throughput measures on a CUDA GPU and says so and measures nothing elsewhere; on a GPU host it
runs without this project's virtualenv: `PYTHONPATH=. python3 -m bench gpu_throughput` (likewise
gpu_families, the Perseus families' time and memory against the dry run's estimate).
"""

from __future__ import annotations

import subprocess
import sys

BENCHES = ["trainer_throughput", "lm_loss", "pipeline_schedules", "launch", "push", "collect", "fanout", "gpu_throughput",
           "partition", "links", "push_relay", "push_compress", "gpu_families", "elastic", "optimizer_step", "startup",
           "heartbeat"]


def main(argv: list[str]) -> int:
    names = argv or BENCHES
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"bench: unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    failed = []
    for name in names:
        print(f"\n## {name}\n", flush=True)
        # One process per bench: each sets its own thread counts and process groups.
        if subprocess.run([sys.executable, "-m", f"bench.{name}"]).returncode != 0:
            failed.append(name)
    if failed:
        print(f"bench: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
