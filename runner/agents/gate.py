"""Inside a worker's container: import torchrun while the master comes up, then start it the moment
the runner says the master's rendezvous port listens.

    python -m runner.agents.gate GO_FILE TIMEOUT_S -- torchrun-args...

`runner up` starts the master's container, then at once the workers' containers with this gate
in front of torchrun. Each gate pays the slow part (importing torch, seconds on a Raspberry Pi)
while the master does the same, then waits for GO_FILE in its run dir. The runner writes that
file on every worker node only after it has seen the master's port listening, so no worker's
torchrun runs before the master's store is up (the master-first contract) but none of the
workers' start-up is left on the launch's critical path. If the file does not come within
TIMEOUT_S (the runner died, or gave up on the master), the gate exits 3 with one line.

Standard library only until torchrun starts: this runs in the trainer image, which carries none
of the runner's host-side dependencies.
"""

from __future__ import annotations

import os
import sys
import time

EXIT_NO_GO = 3
POLL_S = 0.02


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[2] != "--":
        sys.stderr.write("usage: python -m runner.agents.gate GO_FILE TIMEOUT_S -- torchrun-args...\n")
        return 2
    go_file, timeout, torchrun_args = argv[0], float(argv[1]), argv[3:]
    from torch.distributed import run  # noqa: F401 - the slow import, overlapped with the master's

    from . import torchrun  # its sibling in the image (runner/agents/torchrun.py)

    deadline = time.monotonic() + timeout
    while not os.path.exists(go_file):
        if time.monotonic() > deadline:
            sys.stderr.write(f"runner gate: no go from the runner within {timeout:.0f}s (the master's port never "
                             "listened, or the runner stopped); not starting torchrun\n")
            return EXIT_NO_GO
        time.sleep(POLL_S)
    return torchrun.main(torchrun_args)  # torchrun, its exit barrier mended (runner/agents/torchrun.py)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
