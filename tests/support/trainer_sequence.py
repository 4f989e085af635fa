"""`python -m tests.support.trainer_sequence RUNS.json` (under torchrun or alone): run each trainer command
of RUNS.json (a list of argv lists) in turn through the trainer's entry point, in this process.

The process group is started here once and kept for every run (trainer.train.run ends only a
group it started itself): env:// cannot start a second default group on torchrun's store, and a
tiny run spends most of its CPU importing torch and transformers. So a test that needs many
small runs of one world size launches once (tests/support/trainer_run.py:run_trainers). Stops at the
first command that does not exit 0, with its exit status.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(path: str) -> int:
    from trainer.cli import main as trainer_main
    from trainer.runtime import dist_env

    argvs = json.loads(Path(path).read_text())
    dist_env.init_process_group(dist_env.from_environ(), "cpu")
    try:
        for argv in argvs:
            rc = trainer_main(list(argv))
            if rc != 0:
                print(f"trainer_sequence: exit {rc}: trainer {' '.join(argv)}", file=sys.stderr, flush=True)
                return rc
    finally:
        dist_env.destroy_process_group()
    return 0


def main_argv(argv: list[str]) -> int:
    """main() for tests/support/trainer_zygote.py, which calls entry points with their argv."""
    return main(argv[0])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
