"""torchrun's agent for tests/unit/test_agent_exit.py: `python tests/support/late_agent.py plain|mended
torchrun-args...`. With LATE_AGENT_S set, this agent waits that long between checking in at the
exit barrier and waiting on it: the moment, otherwise microseconds, in which the master agent of
plain torchrun leaves and takes its store along (pytorch/pytorch#69520), made long enough to
happen every time."""

import os
import sys
import time

from torch.distributed import run
from torch.distributed.elastic.utils import store

from runner.agents import torchrun

delay = float(os.environ.get("LATE_AGENT_S") or 0)
checked_in = store._barrier_nonblocking


def late_check_in(*args, **kwargs):
    key = checked_in(*args, **kwargs)
    time.sleep(delay)
    return key


if delay:
    store._barrier_nonblocking = late_check_in
way, argv = sys.argv[1], sys.argv[2:]
sys.argv = ["torchrun", *argv]
raise SystemExit(torchrun.main(argv) if way == "mended" else run.main(argv))
