"""A rank's side of "every rank's stacks, before anything is stopped" (contract/stacks.py).

- `install`: faulthandler's C-level handler on SIGUSR2, writing every thread's Python stack into
  OUTPUT_DIR/heartbeat/stacks-rank<R>.txt. It runs inside any C call (a gloo wait, a blocked read,
  a CUDA sync) since it needs neither the GIL nor the main thread; `python -m trainer.tools.stacks`
  sends the signal and copies what it wrote into hang-rank<R>.txt. A SIGSTOPped rank runs no
  handler: the helper reads that one with py-spy.
- `nccl_flight_recorder`: on NCCL, the flight recorder's env before the process group exists (a ring
  of the last 2000 collectives per group, dumped to OUTPUT_DIR/nccl-trace-rank<R> on a watchdog
  timeout and whenever the helper writes to the rank's dump pipe). Not exercised by the CPU tests.
- `write_own`: on a collective timeout the rank writes its own hang-rank<R>.txt (the traceback
  that timed out, every thread's stack, its heartbeat), so a job no runner watches leaves them too.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import tempfile
import time
import traceback
from pathlib import Path
from typing import IO

from contract import heartbeat as fmt
from contract import stacks as names

_FILE: IO | None = None  # kept open for the handler (faulthandler writes to its descriptor)


def install(output_dir: str | Path, rank: int) -> Path | None:
    """Register the stacks handler; returns the file it writes to (None where signals cannot be
    handled: not the main thread, no SIGUSR2 on this platform)."""
    global _FILE
    sig = getattr(signal, names.SIGNAL, None)
    if sig is None:
        return None
    path = fmt.stacks_staging(output_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a")  # noqa: SIM115 - open for the process's life
    try:
        faulthandler.register(sig, file=f, all_threads=True, chain=False)
    except (RuntimeError, ValueError):
        f.close()
        return None
    if _FILE is not None:
        _FILE.close()
    _FILE = f
    return path


def uninstall() -> None:
    global _FILE
    sig = getattr(signal, names.SIGNAL, None)
    if sig is not None:
        faulthandler.unregister(sig)
    if _FILE is not None:
        _FILE.close()
        _FILE = None


def nccl_flight_recorder(output_dir: str | Path, environ: dict | None = None) -> dict[str, str]:
    """Set the flight recorder's env (contract.stacks.nccl_env) where the user has not; returns what
    it set. Must run before the NCCL process group is created."""
    env = os.environ if environ is None else environ
    wanted = names.nccl_env(output_dir, os.getpid(), tempfile.gettempdir())
    done = {k: v for k, v in wanted.items() if not env.get(k)}
    env.update(done)
    return done


def write_own(output_dir: str | Path, rank: int, error: BaseException, where: str) -> Path | None:
    """hang-rank<R>.txt from this rank itself: what timed out and every thread's stack now."""
    path = names.hang_file(output_dir, rank)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(f"# stacks of rank {rank} (pid {os.getpid()}), written by the rank itself at "
                    f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} after a collective timed out\n# heartbeat: {where}\n"
                    f"# error: {' '.join(str(error).split())[:500]}\n\n")
            f.write("".join(traceback.format_exception(type(error), error, error.__traceback__)))
            f.write("\n# every thread now:\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        os.replace(tmp, path)
        return path
    except OSError:
        return None
