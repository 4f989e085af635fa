"""What tests/test_fuzz_*.py share: the hypothesis profiles, the bounds every example runs under, and
the count of examples tried per target that scripts/fuzz.sh records in bench/results/fuzz.json.

Profiles (HYPOTHESIS_PROFILE, default `ci`):
- ci: derandomized (the same examples every run, so CI is reproducible), a fixed number of
  examples per target (`examples(n)`: n in ci), no example database;
- long: new random examples each run, FUZZ_LONG_EXAMPLES (default 2000) per target and round;
  scripts/fuzz.sh runs rounds until its duration is spent.

Bounds: `bounded()` runs one example under a hang guard (SIGALRM after HANG_S: a hang, not a
performance figure; pytest-timeout's timer is given back after) and tracemalloc, and fails the example if Python allocated more than
MEMORY_BOUND at its peak: a hostile input must be refused before it costs memory.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import signal
import time
import tracemalloc
from collections.abc import Iterator

from hypothesis import HealthCheck, settings

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
LONG_EXAMPLES = int(os.environ.get("FUZZ_LONG_EXAMPLES", "2000"))
HANG_S = 60                 # one example: far above any input's cost; only a hang reaches it
MEMORY_BOUND = 256 << 20    # Python allocations at one example's peak
_SUPPRESS = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large,
             HealthCheck.filter_too_much]

settings.register_profile("ci", derandomize=True, deadline=None, database=None, print_blob=True,
                          suppress_health_check=_SUPPRESS)
settings.register_profile("long", derandomize=False, deadline=None, database=None, print_blob=True,
                          suppress_health_check=_SUPPRESS)
settings.load_profile(PROFILE)

COUNTS: collections.Counter = collections.Counter()


def examples(ci: int) -> settings:
    """The settings of one target: `ci` examples in CI, LONG_EXAMPLES in a long run."""
    return settings(max_examples=ci if PROFILE != "long" else LONG_EXAMPLES)


def left_of(timer: tuple[float, float]) -> float:
    """The seconds an armed timer has left, else HANG_S."""
    return timer[0] if timer[0] > 0 else HANG_S


class Hang(Exception):
    """An example ran past HANG_S."""


@contextlib.contextmanager
def bounded(target: str) -> Iterator[None]:
    """One example of `target`: counted, under the hang guard and the memory bound."""
    COUNTS[target] += 1

    def alarm(signum, frame):
        raise Hang(f"{target}: one example ran past {HANG_S}s")

    # pytest-timeout's own timer (its signal method) is the same ITIMER_REAL: taken over for the
    # example, then given back with what is left of it.
    previous = signal.signal(signal.SIGALRM, alarm)
    left, interval = signal.setitimer(signal.ITIMER_REAL, min(HANG_S, left_of(signal.getitimer(signal.ITIMER_REAL))))
    started = time.monotonic()
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if left:
            signal.setitimer(signal.ITIMER_REAL, max(left - (time.monotonic() - started), 0.001), interval)
    assert peak <= MEMORY_BOUND, f"{target}: one example allocated {peak >> 20} MiB (bound {MEMORY_BOUND >> 20} MiB)"


@atexit.register
def _write_counts() -> None:
    """One JSON line per test process: {target: examples tried}, for scripts/fuzz.sh."""
    path = os.environ.get("FUZZ_STATS")
    if path and COUNTS:
        with open(path, "a") as f:
            f.write(json.dumps(dict(COUNTS)) + "\n")
