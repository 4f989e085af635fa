"""Every rank's stacks on demand, before anything is stopped: the names both wings use.

In a rank (trainer/runtime/stacks.py): at start, `faulthandler.register(SIGNAL, all_threads=True)`
into OUTPUT_DIR/heartbeat/stacks-rank<R>.txt (the C-level handler answers inside a collective, a
blocked read, any C call, without the GIL); on NCCL, the flight recorder's env (NCCL_ENV) with its
dump pipe, and its dump on a collective timeout, to OUTPUT_DIR/nccl-trace-rank<R>.

Taking them (trainer/tools/stacks.py, torch-free, in the rank's container, same pid namespace):

    docker exec --user 0:0 <container> python -m trainer.tools.stacks

signals each live rank of the container and copies what its handler wrote; a stopped rank (state T:
SIGSTOP, a debugger) cannot run a handler, so py-spy reads it (`py-spy dump --nonblocking`: py-spy's
default, which suspends the process, fails on a stopped one); on NCCL it also writes to each rank's
flight-recorder pipe. It writes OUTPUT_DIR/hang-rank<R>.txt per rank (owned by OUTPUT_DIR's owner)
and prints one line per rank. py-spy needs ptrace rights over the rank: the container started with
CONTAINER_RUN_FLAGS (docker SDK: cap_add=["SYS_PTRACE"]) and the helper run as root in it
(EXEC_FLAGS). Without them (a node with kernel.yama.ptrace_scope >= 1 refuses a non-root py-spy)
the live ranks' stacks still come from their handlers. Torch-free.
"""

from __future__ import annotations

from pathlib import Path

SIGNAL = "SIGUSR2"                  # SIGUSR1 is the preemption signal (trainer/checkpoint/preempt.py)
HANG_FILE = "hang-rank{rank}.txt"   # in OUTPUT_DIR: what `runner collect` brings back
NCCL_TRACE = "nccl-trace-rank"      # + rank: the flight recorder's dump (pickle), in OUTPUT_DIR
NCCL_PIPE = "trainer-nccl-{pid}-rank"  # + rank + ".pipe", in the rank's temporary directory (a FIFO)
NCCL_TRACE_ENTRIES = 2000           # TORCH_NCCL_TRACE_BUFFER_SIZE: torch's recommended size
HELPER = ("python", "-m", "trainer.tools.stacks")
CONTAINER_RUN_FLAGS = ("--cap-add", "SYS_PTRACE")
EXEC_FLAGS = ("--user", "0:0")
EXIT_PARTIAL = 3                    # the helper's exit code when some rank's stacks could not be taken


def hang_file(output_dir: str | Path, rank: int) -> Path:
    return Path(output_dir) / HANG_FILE.format(rank=rank)


def nccl_env(output_dir: str | Path, pid: int, tmp: str = "/tmp") -> dict[str, str]:
    """The flight recorder's env for a rank (set before its process group exists; a value the user
    set wins): a ring of NCCL_TRACE_ENTRIES collectives, dumped on a timeout and when its pipe is
    written to (torch appends the rank to both names)."""
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(NCCL_TRACE_ENTRIES),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(output_dir) / NCCL_TRACE),
            "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(Path(tmp) / NCCL_PIPE.format(pid=pid))}


def nccl_pipe(tmp: str | Path, pid: int, rank: int) -> Path:
    return Path(tmp) / f"{NCCL_PIPE.format(pid=pid)}{rank}.pipe"
